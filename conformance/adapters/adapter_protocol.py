"""The adapter protocol: what an implementation under test shows the conformance suite.

``ManagerAdapter`` speaks plain values (block ids as tuples of ints, hit lengths, snapshots as
tuples); ``BatchAllocating``, ``BatchFreeing`` and ``Planning`` are the optional extras (found
with ``batch_allocator``, ``batch_freer``, ``planner``); an ``AdapterFactory`` builds an adapter
for a layout and ``EngineOptions``, and a ``Backend`` names one. The package's docstring
(``hybridkv.conformance.adapters``) says how to plug an implementation in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hybridkv.spec import KVCacheConfig, KVCacheSpec

BlockIds = tuple[tuple[int, ...], ...]
"""Block ids per KV cache group, positions in order (null positions hold block 0)."""


NOT_IMPLEMENTED = "does not implement"
"""The words of a ``ValueError`` that refuses a feature an implementation lacks (by name)."""


@dataclass(frozen=True)
class EngineOptions:
    """An engine's keywords of ``KVCacheManager`` (vLLM's names; see its docstring).

    ``max_in_flight_tokens`` sizes a window's reservation in a full-prompt admission;
    ``use_eagle`` drops the last block of a hit; ``num_hash_lookahead_tokens`` hashes each block
    with the tokens after it (requests are built with the same value).
    """

    max_in_flight_tokens: int | None = None
    use_eagle: bool = False
    num_hash_lookahead_tokens: int = 0

    def kwargs(self) -> dict[str, Any]:
        """The keywords that differ from the defaults, for a manager's constructor."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        }


@dataclass(frozen=True)
class Lookup:
    """A lookup's result: what every implementation must agree on, plus the adapter's own
    opaque value to hand back to ``allocate`` (``new_computed_blocks`` of the scheduler API)."""

    block_ids: BlockIds
    num_hit_tokens: int
    handle: Any
    shared_prefix_boundary: int = 0


@dataclass(frozen=True)
class Snapshot:
    """The pool's observable state as plain values (``PoolSnapshot``, whatever its class)."""

    free_block_ids: tuple[int, ...]
    ref_counts: tuple[tuple[int, int], ...]
    cached_block_ids: tuple[tuple[int, ...], ...]
    num_cached_keys: int


class ManagerAdapter(Protocol):
    """What the differential machine needs from an implementation under test.

    Two methods are optional capabilities, not part of this protocol (an adapter may leave
    them out; ``batch_allocator`` and ``batch_freer`` find them): ``allocate_batch`` of
    ``BatchAllocating`` and ``free_batch`` of ``BatchFreeing``, an implementation's whole-step
    calls. When present, the differential machine calls them for a scheduler step of several
    running requests and for a batch of frees, and compares their results with the model's
    (the same calls made one by one, in order).
    """

    name: str

    def new_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        cache_salt: str | None,
        *,
        skip_reading_prefix_cache: bool = False,
    ) -> Any:
        """A request object this implementation accepts (hashed at the pool's block size).

        ``skip_reading_prefix_cache``: the request never reads the prefix cache (its lookups
        hit nothing) but still caches what it computes; some golden traces set it, and pass the
        keyword only then."""
        ...

    def append_tokens(self, request: Any, tokens: Sequence[int]) -> None: ...

    def set_num_computed_tokens(self, request: Any, num_computed_tokens: int) -> None: ...

    def set_shared_prefix_boundary(self, request: Any, boundary: int) -> None:
        """The scheduler stores a lookup's third result on the request."""
        ...

    def lookup(self, request: Any) -> Lookup: ...

    def new_step(self) -> None:
        """``new_step_starts()``: the scheduler begins a step."""
        ...

    def allocate(
        self,
        request: Any,
        num_new_tokens: int,
        hit: Lookup | None,
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
        *,
        full_sequence_must_fit: bool = False,
    ) -> BlockIds | None: ...

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None: ...

    def free(self, request: Any) -> None: ...

    def block_table(self, request_id: str) -> BlockIds: ...

    def reset_prefix_cache(self) -> bool: ...

    def num_free_blocks(self) -> int: ...

    def usage(self) -> float: ...

    def snapshot(self) -> Snapshot | None: ...

    def take_events(self) -> tuple[tuple[object, ...], ...] | None: ...

    def take_stats(self) -> tuple[int, int, int, bool] | None: ...

    def check_invariants(self) -> None: ...


class BatchAllocating(Protocol):
    """The optional whole-step allocation of an adapter."""

    def allocate_batch(
        self,
        requests: Sequence[Any],
        num_new_tokens: Sequence[int],
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
    ) -> Sequence[BlockIds | None]:
        """One step of running requests (each listed once, no new cache hits): exactly
        ``[allocate(r, n, None, num_lookahead_tokens, delay_cache_blocks) for r, n in
        zip(requests, num_new_tokens)]``, one result per request (its new blocks, or ``None``
        when the pool could not hold them; later requests still get theirs if they fit)."""
        ...


class BatchFreeing(Protocol):
    """The optional batched free of an adapter."""

    def free_batch(self, requests: Sequence[Any]) -> None:
        """Exactly ``for r in requests: free(r)`` (a request listed twice, or holding
        nothing, is freed once or not at all, as the single calls do)."""
        ...


class PathCounting(Protocol):
    """The optional path counts of an adapter: which of its implementation's fast paths ran."""

    def fast_paths(self) -> Mapping[str, int] | None:
        """Times each path ran since the manager was built (names are the implementation's;
        an ``allocate`` that changes no count was answered by its quiet exit); ``None`` when
        this implementation keeps none."""
        ...


@dataclass(frozen=True)
class PlanFacts:
    """What a planner decided for a model, as plain values every planner can state.

    ``groups``: one entry per KV cache group, in the plan's order: the group's spec (after
    Case 4's page unification) and the names of the layers it allocates memory for (KV-sharing
    layers excluded: they read another layer's memory, Case 5). ``num_padding_slots``: group
    slots, over all groups, that hold no layer (Case 3's padding)."""

    num_blocks: int
    block_size: int
    page_size_bytes: int
    groups: tuple[tuple[KVCacheSpec, tuple[str, ...]], ...]
    num_padding_slots: int


MODEL_REFUSED = "refused"
"""What ``plan_model`` stands for when a planner refuses a model (raises ``ValueError``)."""


class Planning(Protocol):
    """The optional planner of an adapter: layers → KV cache groups → memory → blocks."""

    def plan_model(
        self,
        layers: Mapping[str, KVCacheSpec],
        available_memory: int,
        max_model_len: int,
        kv_sharing: Mapping[str, str],
    ) -> PlanFacts:
        """The plan for ``layers`` (name → spec) in ``available_memory`` bytes per device,
        with ``kv_sharing`` (layer → the layer whose memory it reads); raises ``ValueError`` for
        a model it refuses (the machine then expects every planner to refuse it)."""
        ...


def batch_allocator(adapter: object) -> BatchAllocating | None:
    """The adapter itself if it offers ``allocate_batch``, else ``None``."""
    return adapter if callable(getattr(adapter, "allocate_batch", None)) else None  # type: ignore[return-value]


def batch_freer(adapter: object) -> BatchFreeing | None:
    """The adapter itself if it offers ``free_batch``, else ``None``."""
    return adapter if callable(getattr(adapter, "free_batch", None)) else None  # type: ignore[return-value]


def path_counter(adapter: object) -> PathCounting | None:
    """The adapter itself if it offers ``fast_paths``, else ``None``."""
    return adapter if callable(getattr(adapter, "fast_paths", None)) else None  # type: ignore[return-value]


def planner(adapter: object) -> Planning | None:
    """The adapter itself if it offers ``plan_model``, else ``None``."""
    return adapter if callable(getattr(adapter, "plan_model", None)) else None  # type: ignore[return-value]


AdapterFactory = Callable[[KVCacheConfig, int, bool, bool, EngineOptions], ManagerAdapter]
"""Builds an adapter from (config, max_model_len, enable_caching, enable_kv_cache_events,
engine options)."""


Backend = tuple[str, AdapterFactory]
"""A name for reports, and the factory."""
