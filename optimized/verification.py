"""Verification of a lookup's candidate blocks against the request (collision safety).

A cache hit is never trusted on the hash alone (see ``hybridkv.optimized.block_pool``): a
candidate block is accepted only if its source has the request's hash at that position, the
request's cache salt, and the request's tokens up to the end of that block (with lookahead
hashes, also the ``num_hash_lookahead_tokens`` tokens after it, which its hash covers too).

Data layout: one ``Verification`` per lookup keeps, per source index, the number of leading
blocks whose tokens are known to agree with the request's (``_agree``, extended by galloping
comparisons), the first block known to differ (``_limit``), whether the whole hash lists are
equal (``_hashes_equal``) and the source's hashes at the lookup's block size (``_views``), so
that a lookup compares each token a few times at most whatever the number of blocks. Token
comparisons use the packed token arrays when both the request and the source keep one
(``Request.packed_token_ids``: one comparison of their memory, and numpy views of it to find
the first difference in one pass), else the token lists.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from hybridkv.optimized.block_pool import TorchBlockPool
from hybridkv.optimized.sources import Source
from hybridkv.optimized.thresholds import AGREE_MIN_STEP
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.request import Request, RequestLike


def hashes_view(hashes: Sequence[BlockHash], scale: int) -> Sequence[BlockHash]:
    """The hashes at ``scale`` hash blocks per block (``hashes_at_block_size``)."""
    return hashes if scale == 1 else hashes[scale - 1 :: scale]


def same_items(a: Sequence[object], b: Sequence[object]) -> bool:
    """Element-wise equality of two sequences of any types (list == tuple is False in Python)."""
    if type(a) is type(b):
        return a == b
    return list(a) == list(b)


def _packed(tokens: Sequence[int]) -> bool:
    """Whether ``tokens`` is a packed token array (``Request.packed_token_ids``)."""
    return isinstance(tokens, array) and tokens.typecode == "Q"


def first_difference(ours: Sequence[int], theirs: Sequence[int], lo: int, hi: int) -> int:
    """The first index in ``lo … hi − 1`` where the token sequences differ, ``hi`` if none
    (both hold at least ``hi`` tokens).

    Packed arrays are compared as numpy views of their memory (no copy, one pass); lists by one
    slice comparison, then a binary search of slices for the first difference."""
    if hi <= lo:
        return hi
    if _packed(ours) and _packed(theirs):
        # Views for this call only: the arrays grow as tokens are appended.
        a = np.frombuffer(ours, np.uint64, hi - lo, lo * 8)  # type: ignore[call-overload]
        b = np.frombuffer(theirs, np.uint64, hi - lo, lo * 8)  # type: ignore[call-overload]
        differs = a != b
        at = int(differs.argmax())
        return lo + at if differs[at] else hi
    whole = lo == 0 and hi == len(ours) == len(theirs)
    if same_items(ours, theirs) if whole else same_items(ours[lo:hi], theirs[lo:hi]):
        return hi
    # [start, lo) agree, [lo, hi) does not.
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if same_items(ours[lo:mid], theirs[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo


class Verification:
    """The request's tokens, hashes and salt, and what is known of each source against them."""

    def __init__(
        self,
        pool: TorchBlockPool,
        request: RequestLike,
        block_size: int,
        lookahead: int = 0,
        scale: int = 1,
    ) -> None:
        self.pool = pool
        # Positions are blocks of ``block_size`` = ``scale`` hash blocks; a block's key is the
        # hash at its last hash boundary (``hashes_at_block_size``).
        self.scale = scale
        self.request_hashes: Sequence[BlockHash] = request.block_hashes
        self.hashes: Sequence[BlockHash] = hashes_view(request.block_hashes, scale)
        self.tokens: Sequence[int] = request.all_token_ids
        # Only hybridkv's own ``Request`` keeps a packed copy (vLLM's does not).
        self.packed: Sequence[int] | None = (
            request.packed_token_ids if isinstance(request, Request) else None
        )
        self.salt: object = request.cache_salt
        self.memo = pool.memo
        self.block_size = block_size
        self.lookahead = lookahead
        self._views: dict[int, Sequence[BlockHash]] = {}
        self._agree: dict[int, int] = {}
        self._limit: dict[int, int] = {}
        self._hashes_equal: dict[int, bool] = {}

    def content_agrees(self, src: int, pos: int) -> bool:
        """Whether source ``src`` holds the request's salt and tokens up to block ``pos``."""
        agree = self._agree.get(src)
        source = self.pool.source(src)
        if agree is None:
            agree = 0
            if source.salt != self.salt:
                self._limit[src] = 0
            elif source.tokens is self.tokens:
                agree = len(self.tokens) // self.block_size
            elif self.memo is not None and self.packed is not None:
                # Ids the memo compared when it hashed this prompt (``HashMemo.agreed_blocks``).
                agreed = self.memo.agreed_blocks(self.packed, source)
                agree = agreed * self.memo.block_size // self.block_size
            self._agree[src] = agree
        if pos < agree:
            return True
        limit = self._limit.get(src)
        if limit is not None and pos >= limit:
            return False
        b = self.block_size
        ours, theirs = self._token_pair(source)
        cap = min(len(theirs), len(ours)) // b
        if (
            agree == 0
            and len(ours) == len(theirs)
            and self.all_hashes_equal(src)
            and same_items(ours, theirs)
        ):
            # Equal token lists (a repeated prompt, whose hash lists are equal too): one
            # comparison, which stops at the first difference otherwise (then the search below
            # finds it).
            self._agree[src] = cap
            return pos < cap
        target = min(max(pos + 1, 2 * agree, agree + AGREE_MIN_STEP), cap)
        hi = target * b
        first = first_difference(ours, theirs, agree * b, hi)
        if first == hi:
            self._agree[src] = target
            return pos < target
        self._agree[src] = self._limit[src] = first // b
        return pos < first // b

    def _token_pair(self, source: Source) -> tuple[Sequence[int], Sequence[int]]:
        """The request's and the source's tokens, packed when both keep them packed (a
        comparison is then one pass over memory)."""
        if self.packed is not None and source.packed is not None:
            return self.packed, source.packed
        return self.tokens, source.tokens

    def their_hashes(self, src: int) -> Sequence[BlockHash]:
        """Source ``src``'s hashes at this lookup's block size."""
        hashes = self.pool.source(src).hashes
        if self.scale == 1:
            return hashes
        view = self._views.get(src)
        if view is None or len(view) != len(hashes) // self.scale:
            view = self._views[src] = hashes_view(hashes, self.scale)
        return view

    def hashes_agree(self, src: int, lo: int, hi: int) -> bool:
        """Whether source ``src`` has the request's block hashes at positions ``lo … hi − 1``."""
        if self.all_hashes_equal(src):
            return True
        return same_items(self.their_hashes(src)[lo:hi], self.hashes[lo:hi])

    def all_hashes_equal(self, src: int) -> bool:
        """Whether source ``src`` has exactly the request's hashes at this lookup's block size
        (one comparison without slicing, remembered)."""
        equal = self._hashes_equal.get(src)
        if equal is None:
            theirs, ours = self.their_hashes(src), self.hashes
            equal = self._hashes_equal[src] = len(theirs) == len(ours) and same_items(theirs, ours)
        return equal

    def lookahead_agrees(self, src: int, pos: int) -> bool:
        """With lookahead hashes, whether source ``src`` has the request's tokens after block
        ``pos`` that its hash also covers (trivially true without lookahead)."""
        if not self.lookahead:
            return True
        lo = (pos + 1) * self.block_size
        hi = lo + self.lookahead
        ours, theirs = self._token_pair(self.pool.source(src))
        return len(theirs) >= hi and same_items(ours[lo:hi], theirs[lo:hi])

    def accepts(self, block: int, pos: int, src: int = -1) -> bool:
        """Whether cached ``block`` (its primary entry, or the extra one from source ``src``)
        really holds this request's block ``pos`` (and, with lookahead hashes, is keyed by the
        same following tokens)."""
        if src < 0:
            src = self.pool.src.a[block]
        if not self.content_agrees(src, pos) or not self.lookahead_agrees(src, pos):
            return False
        hidx = (pos + 1) * self.scale - 1
        return bool(self.pool.source(src).hashes[hidx] == self.hashes[pos])

    def agreed(self, src: int) -> int:
        """The leading blocks of source ``src`` known to hold the request's tokens."""
        return self._agree.get(src, 0)
