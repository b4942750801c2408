"""The manager's calls about the requests it serves, beside the scheduler API.

``make_request`` builds a ``Request`` on the manager's fast path (hashed by its memo at its hash
block size and lookahead). ``trust_hash_counts`` names a request type whose owner hashes it at
the manager's hash block size (vLLM's scheduler its ``Request``): a running request of that type
then takes the quiet exit of ``allocate_slots`` without counting its hashes against its full
blocks, as a ``Request`` hashed at that size does. ``quiet_thresholds`` hands a caller that
makes that exit itself for such requests (the vLLM integration's running calls) what it reads.

Data layout: ``trusted`` (a frozenset of exact types), read by the quiet exit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hybridkv.optimized.hash_memo import HashMemo
from hybridkv.reference.request import Request


class RequestCalls:
    """Building and trusting requests (mixed into ``TorchKVCacheManager``)."""

    # The manager's own, which these read.
    hash_block_size: int
    lookahead: int
    block_hasher: HashMemo
    enable_caching: bool
    _row_of: Callable[[str], int | None]
    _quiet_below: memoryview
    _has_align: bool
    trusted: frozenset[type] = frozenset()
    """Request types whose hash counts their owner guarantees (``trust_hash_counts``)."""

    def make_request(
        self, request_id: str, prompt_token_ids: Sequence[int], **options: Any
    ) -> Request:
        """A ``Request`` on this manager's fast path: hashed at its hash block size and
        lookahead by ``block_hasher``; ``options`` are ``Request``'s other keywords."""
        return Request(
            request_id,
            prompt_token_ids,
            hash_block_size=self.hash_block_size,
            num_hash_lookahead_tokens=self.lookahead,
            block_hasher=self.block_hasher,
            **options,
        )

    def trust_hash_counts(self, request_type: type) -> None:
        """Requests of exactly ``request_type`` are hashed at this manager's hash block size by
        their owner (vLLM's scheduler hashes its ``Request`` so): a running one's step does not
        count its hashes against its full blocks (``check_block_hashes``), as for a ``Request``."""
        if not isinstance(request_type, type):
            raise TypeError(f"request_type must be a class, got {request_type!r}")
        self.trusted = self.trusted | {request_type}

    def quiet_thresholds(
        self, request_type: type
    ) -> tuple[Callable[[str], int | None], memoryview] | None:
        """What the quiet exit of ``allocate_slots`` reads, for a caller that makes that exit
        itself for requests of exactly ``request_type``: the row of a request id (``None``: it
        holds none) and each row's ``quiet_below``; ``None`` where the exit does not apply to
        that type (caching on and its hash counts not trusted; a Mamba ``"align"`` group).

        A call for such a request that holds a row, with no hit, external or encoder tokens,
        lookahead, reserve or watermark and ``num_new_tokens`` a positive int, whose
        ``num_computed_tokens + num_new_tokens`` stays below its row's ``quiet_below``, takes
        no block, releases and caches nothing and counts nothing: ``allocate_slots`` returns
        ``no_blocks``. The vLLM integration answers such a call without calling the manager:
        most of a decode step's calls are such."""
        if self._has_align or (self.enable_caching and request_type not in self.trusted):
            return None
        return self._row_of, self._quiet_below
