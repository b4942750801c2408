"""The size thresholds of the optimized backend, in one place.

Most paths of the backend exist twice: one element at a time on the memoryviews of its
buffers (cheap per element, nothing to set up) and in numpy calls (a fixed cost per call, then
cheap per element). Each constant below says where one such switch flips, or how
large a window of work is; none changes a result, only the time it takes (the differential
tests run both sides of every switch).

Layout
------
Plain module constants, never reassigned. The seven that tests and the conformance adapter set
smaller, to drive the vectorised paths with a few requests, are copied onto each
``TorchKVCacheManager`` when it is built and changed there: ``vector_min``, ``batch_min``,
``free_batch_min``, ``busy_batch_min``, ``insert_min``, ``pending_min`` (the pool's copies
of ``INSERT_MIN`` and ``PENDING_MIN``) and ``memcmp_min`` (the hash memo's). ``VECTOR_MIN_TOKENS``
is read by a free function (the hasher), so a test patches it where that function reads it, on
``hybridkv.optimized.hashing``.
"""

from __future__ import annotations

# --- Whole-step calls (``hybridkv.optimized.batch``) ------------------------------------------

BATCH_MIN = 640
"""An ``allocate_slots_batch`` of fewer requests makes the single-request calls (the small
batch's loop, ``batch_small``): below this, their cost is less than the vectorised step's
fixed cost in numpy calls (reading and comparing every request's counts, cold after the
scheduler's own work). The two meet between 640 and 768 requests of a decode step of ~100-token
prompts on a 10⁶-block pool, each step after vLLM's and the reference's
(``docs/optimized-history.md``, the round after commit 7f098e3)."""

FREE_BATCH_MIN = 16
"""A ``free_batch`` of fewer requests frees them one by one; from it, in numpy calls (whose
fixed cost a few requests' blocks already repay)."""

BUSY_BATCH_MIN = 64
"""Fewer requests than this with work to do in a step (in a decode step most have none) are
served one by one; from it, by the vectorised step, whose numpy calls then pay off."""

INSERT_MIN = 32
"""Fewer blocks than this are cached, touched or linked into the free queue one by one on the
array views; from it, in vectorised calls (``insert_array``, ``touch_array``, ``link_after_array``,
``release_cached``)."""

PENDING_MIN = 256
"""Running steps' deferred releases and inserts (``hybridkv.optimized.pending``) are made in
numpy calls from this many entries (releases and inserts together), else one by one. They are
made at the start of the next step, after the scheduler's own work has left the caches cold,
where each numpy call costs several times what it does warm: a decode step of 256 requests
inside vLLM's scheduler (some 180 entries) is made faster one by one, one of 1,024 (some 900)
in numpy calls."""

PENDING_MAX = 8192
"""Running steps' deferred releases and inserts (``hybridkv.optimized.pending``) are made once
this many wait, when no other call has made them earlier: a bound on their memory."""

# --- Cache-hit lookups (``hybridkv.optimized.lookup``) ----------------------------------------

VECTOR_MIN = 48
"""A window of at least this many (position, group) pairs is probed through the hash table in
numpy calls (one gather per chain step for all of them), a run read from position 0 for every
attention type at once, and a long prompt's full-attention scan reads runs first; a smaller one
walks the chains on the arrays."""

RUN_MIN = 4
"""A window of at least this many positions is read from sources' runs of cached blocks first
(a few numpy calls for a whole run, however long); a run shorter than this ends that, and the
rest of the window is probed."""

LEAD_RUN_MAX = 4096
"""A lookup of several attention types reads the run from position 0 for all their groups at
once (``lead_run``) when it spans at most this many (position, group) pairs: beyond, the
positions a sliding window does not need cost more than a run of its own."""

RUN_SCALAR_MAX = 16
"""A run of at most this many (position, group) pairs is checked on the array views, one pair
at a time; a longer one in numpy calls."""

TAIL_MAX = 32
"""A vector probe (and the duplicate check) walks its last chains on the array views once at
most this many remain: a call per chain step would cost more than the walk."""

SCAN_FIRST_WINDOW = 512
"""The full-attention scan of a long prompt probes this many positions first, then windows four
times as long as the last: a miss early in the prompt costs one small window."""

FLAG_MIN_WINDOW = 8
"""A rule's scan asking for one position not probed yet gets at least this many probed, in its
direction (it asks for the neighbours next)."""

FLAG_MAX_WINDOW = 4096
"""Each further window of a rule's scan is twice the last, up to this many positions."""

AGREE_MIN_STEP = 16
"""Token agreement with a source is extended by at least this many blocks per slice comparison
(and at least doubled), so that a lookup compares each token a few times at most."""

# --- The hash memo's comparisons (``hybridkv.optimized.same_ids``) ----------------------------

MEMCMP_MIN = 1024
"""From this many ids a range of two prompts' packed ids compares with the C library's
``memcmp``; below, the foreign call and the arrays' exports cost more than memoryview slices'
loop over the items."""

NUMPY_COMPARE_MIN = 8192
"""Without ``memcmp``: from this many ids a comparison takes numpy views (one vector pass,
whose fixed cost a shorter range does not repay); below, the memoryview slices."""

# --- Block hashing (``hybridkv.optimized.hashing``) -------------------------------------------

VECTOR_MIN_TOKENS = 1024
"""Inputs with fewer tokens to encode than this (a decode step's new block) take the reference's
path: setting up the CBOR tensors would cost more than it saves."""

FEW_BLOCKS_MAX = 24
"""Packed ids of at most this many blocks are hashed one ``cbor2`` call per block
(``hash_packed_blocks``): ``encode_bodies``' fixed cost pays off only from about as many."""

# --- The prefix-cache hash table (``hybridkv.optimized.block_pool``) --------------------------

SETTLE_MAX = 1 << 14
"""Blocks cached since the last lookup are checked for duplicate entries by the next lookup
(``settle_duplicates``), or once this many wait (a long run of steps without lookups), so that
the list stays bounded."""

SETTLE_SCALAR_MAX = 256
"""At most this many blocks waiting to be checked for duplicate entries (an admission's) are
walked one by one on the array views; more in numpy calls, a chain step for all at once."""

REACH_SCALAR_MAX = 8
"""The invariant check follows all the prefix-cache chains one step at a time in numpy calls
while more than this many are left, then walks the rest one block at a time on the array
views (a few long chains: one numpy call per step would cost more)."""

MIN_BUCKETS = 16
"""The hash table has at least this many buckets (the smallest power of two at least half the
number of blocks, otherwise), so that a tiny pool still spreads its keys over a few chains."""
