"""Cache-hit lookup for the optimized backend: memoised, batched probes with verification.

The rules are the reference's (``hybridkv.reference.coordinator`` and the ``longest_hit`` hooks of
``hybridkv.reference.single_type_managers``, each a function of ``hybridkv.spec.rules``); the
lookup only changes how the per-position question "is block ``i`` of this request cached in
every group of this type?" is answered.

Data layout
-----------
One ``Lookup`` lives for one ``get_computed_blocks`` call. Per attention type it keeps one memo
(``TypeProbe``): a numpy int32 array ``found[groups, positions]`` (the block of each group,
valid only where the position is a hit; allocated empty, so that the positions a lookup never
reaches cost nothing) and a ``bytearray`` of per-position flags (``HIT`` when every group of
the type has the block, ``MISSED`` when one does not, ``UNKNOWN`` not probed yet), read by the
scans with ``find``/``rfind`` and written a window at a time through a numpy view. All vector
work runs on the numpy views of the pool's buffers (``.n``): a numpy call on a few thousand
elements costs a fraction of a torch call.

Runs: a source (the request that cached a block) records, per position and group, the block it
cached there, and evicting a block clears its entry (``hybridkv.optimized.block_pool``), so
the source's record read as an array is the list of its blocks still cached: a run of
positions is its record's rows (a numpy view), less the unrecorded and duplicate entries
(``dups``), verified once for all of them (``source_run``). A lookup of several types first
reads one such run from position 0 for all their groups at once (``lead_run``: a prompt cached
by one request holds its blocks in every group), while it is at most ``LEAD_RUN_MAX`` (position,
group) pairs; longer prompts read a run per type, the later ones from the last run's source
first (``hint``) and from the source of the block a chain walk finds otherwise.

Positions are filled in windows. A window of ``vector_min`` (position, group) pairs or more is
first read from runs, as far as they reach; the rest of the window goes through the hash table
for all groups of the type at once (``probe_vector``: one gather per chain step, lanes dropped
as their chains end, the last ``TAIL_MAX`` chains walked on the array views); a smaller window
goes through the array views (the sizes are in ``hybridkv.optimized.thresholds``).

The scans: full attention reads runs from its known leading hits as far as they reach, then
probes the one position where they stop (most often the end of the cached prefix), then goes
on window by window; a sliding window runs ``rules.sliding_window_hit_blocks_skip`` (proved
equal to ``rules.sliding_window_hit_blocks``) with each candidate window filled at once and
searched with ``rfind``; the other rules read the memo through ``WindowedFlags``.

The hit: per group a ``GroupHit`` (a count of leading nulls and an int32 array of block ids,
copied out of the memo), returned as a ``HitBlocks``, a ``KVCacheBlocks`` that builds its
tuples of Python ints on the first read of ``block_ids``.

Verification (collision safety): token comparisons use the packed token arrays when both the
request and the source keep one (``Request.packed_token_ids``: one comparison of their memory,
and numpy views of it to find the first difference in one pass), else the token lists. A
candidate block is accepted only if its source (see ``hybridkv.optimized.block_pool``) has the
request's hash at that position, the request's cache salt, and the request's tokens up to the
end of that block (with lookahead hashes, also the ``num_hash_lookahead_tokens`` tokens after
it, which its hash covers too). Positions are blocks of the type's block size, keyed by the
hash at the block's last hash boundary. Token agreement is memoised per source as a prefix
length, extended by galloping comparisons (after one whole comparison when the two token lists
are as long and so are the hash lists, which are equal), so a lookup compares each token a few
times at most whatever the number of blocks. Hash lists are compared whole once per source in
the same way before window slices. A candidate that fails is skipped and the next block cached
under the same key (insertion order) is tried.

Modules
-------
This module is the lookup's front: every name importable from it, defined in one module per
part (each layer of ``Lookup`` extends the one before):

- ``hit_blocks``: the hit (``GroupHit``, ``HitBlocks``, ``NO_HIT``);
- ``verification``: ``Verification``, a candidate checked against the request's tokens, hashes
  and salt (``first_difference``, ``same_items``);
- ``probes``: ``Probes``, the hash-table probes of one position or a window;
- ``source_runs``: ``Lookup``, the runs over sources (``source_run``, ``probe_window``);
- ``type_probe``: ``TypeProbe`` (the memo of one type), ``WindowedFlags`` and ``lead_run``.
"""

from hybridkv.optimized.hit_blocks import NO_HIT, NO_IDS, GroupHit, HitBlocks, Ints
from hybridkv.optimized.probes import MISS, Probes
from hybridkv.optimized.source_runs import Lookup
from hybridkv.optimized.type_probe import (
    HIT,
    MISSED,
    UNKNOWN,
    TypeProbe,
    WindowedFlags,
    lead_run,
)
from hybridkv.optimized.verification import Verification, first_difference, same_items

__all__ = [
    "HIT",
    "MISS",
    "MISSED",
    "NO_HIT",
    "NO_IDS",
    "UNKNOWN",
    "GroupHit",
    "HitBlocks",
    "Ints",
    "Lookup",
    "Probes",
    "TypeProbe",
    "Verification",
    "WindowedFlags",
    "first_difference",
    "lead_run",
    "same_items",
]
