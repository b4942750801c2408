"""``ProtocolAdapter``: the example adapter, over any manager with the scheduler API of
``KVCacheManagerLike`` (the reference's and the optimized backend's); ``PlanningAdapter`` adds
the reference planner. Also the hash block size a manager resolves by default
(``hash_block_size_of``), at which requests are hashed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hybridkv.conformance.adapters.adapter_protocol import (
    BlockIds,
    Lookup,
    PlanFacts,
    Snapshot,
)
from hybridkv.conformance.protocol import KVCacheManagerLike
from hybridkv.reference.request import Request
from hybridkv.spec import KVCacheConfig, KVCacheSpec, rules


def _as_ids(blocks: Any) -> BlockIds:
    return tuple(tuple(ids) for ids in blocks.get_block_ids())


def _plain_event(event: object) -> tuple[object, ...]:
    """A core event as the protocol's tuple (the README's "Events"), the shape every adapter
    gives (the vLLM adapter's too): ``("BlockStored", block_hashes, parent_block_hash,
    token_ids, block_size, group_idx)``, ``("BlockRemoved", block_hashes, group_idx)``,
    ``("AllBlocksCleared",)``. The core's other fields (vLLM's schema: medium, extra keys, spec
    kind, session, lookahead tokens) are left out, so adapters of managers without them compare
    equal; the backends' tests compare them whole. Anything else: (class name, fields…).

    Events are told apart by class name, so a patched copy of the reference (its own event
    classes) projects the same way."""
    kind = type(event).__name__
    if kind == "BlockStored":
        stored: Any = event
        return (
            kind,
            stored.block_hashes,
            stored.parent_block_hash,
            stored.token_ids,
            stored.block_size,
            stored.group_idx,
        )
    if kind == "BlockRemoved":
        removed: Any = event
        return (kind, removed.block_hashes, removed.group_idx)
    if dataclasses.is_dataclass(event) and not isinstance(event, type):
        return (type(event).__name__, *dataclasses.astuple(event))
    return (type(event).__name__, repr(event))


RequestMaker = Callable[..., Request]
"""Makes a request as ``Request(request_id, prompt, **keywords)`` does."""


class ProtocolAdapter:
    """The example adapter: any manager with the scheduler API of ``KVCacheManagerLike``.

    Requests are ``hybridkv.reference.Request`` objects, one per implementation, so nothing is
    shared between the implementations under test by accident; ``make``, when given, makes
    them instead (called as ``Request`` is: the optimized backend's ``StepColumns.request``).
    """

    def __init__(
        self,
        name: str,
        manager: KVCacheManagerLike,
        block_size: int,
        num_hash_lookahead_tokens: int = 0,
        make: RequestMaker | None = None,
    ) -> None:
        self.name = name
        self.manager = manager
        self.block_size = block_size
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.make: RequestMaker = Request if make is None else make

    def new_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        cache_salt: str | None,
        *,
        skip_reading_prefix_cache: bool = False,
        **keys: Any,
    ) -> Request:
        """A ``Request``; ``keys``: its ``lora``, ``mm_features`` and ``prompt_embeds``, which
        the extra-key traces pass when set (``hybridkv.conformance.golden_keyed``)."""
        return self.make(
            request_id,
            prompt,
            hash_block_size=self.block_size,
            cache_salt=cache_salt,
            skip_reading_prefix_cache=skip_reading_prefix_cache,
            num_hash_lookahead_tokens=self.num_hash_lookahead_tokens,
            **keys,
        )

    def append_tokens(self, request: Request, tokens: Sequence[int]) -> None:
        request.append_output_token_ids(tokens)

    def set_num_computed_tokens(self, request: Request, num_computed_tokens: int) -> None:
        request.num_computed_tokens = num_computed_tokens

    def set_shared_prefix_boundary(self, request: Request, boundary: int) -> None:
        request.shared_prefix_boundary = boundary

    def lookup(self, request: Request) -> Lookup:
        blocks, num_hit_tokens, boundary = self.manager.get_computed_blocks(request)
        # Each lookup counts as an admission (as the vLLM adapter counts it): the statistics
        # then compare every lookup the machine makes.
        self.manager.record_prefix_cache_stats(request, num_hit_tokens)
        return Lookup(_as_ids(blocks), num_hit_tokens, blocks, boundary)

    def new_step(self) -> None:
        self.manager.new_step_starts()

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        hit: Lookup | None,
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
        *,
        full_sequence_must_fit: bool = False,
    ) -> BlockIds | None:
        new = self.manager.allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens=0 if hit is None else hit.num_hit_tokens,
            new_computed_blocks=None if hit is None else hit.handle,
            num_lookahead_tokens=num_lookahead_tokens,
            delay_cache_blocks=delay_cache_blocks,
            full_sequence_must_fit=full_sequence_must_fit,
        )
        return None if new is None else _as_ids(new)

    def allocate_batch(
        self,
        requests: Sequence[Request],
        num_new_tokens: Sequence[int],
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
    ) -> list[BlockIds | None]:
        """The manager's ``allocate_slots_batch`` when it has one, else ``allocate_slots`` per
        request in order."""
        batched = getattr(self.manager, "allocate_slots_batch", None)
        results: Sequence[Any]
        if batched is not None:
            results = batched(
                list(requests), list(num_new_tokens), num_lookahead_tokens, delay_cache_blocks
            )
        else:
            results = [
                self.manager.allocate_slots(
                    request,
                    count,
                    num_lookahead_tokens=num_lookahead_tokens,
                    delay_cache_blocks=delay_cache_blocks,
                )
                for request, count in zip(requests, num_new_tokens, strict=True)
            ]
        return [None if new is None else _as_ids(new) for new in results]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self.manager.cache_blocks(request, num_computed_tokens)

    def free(self, request: Request) -> None:
        self.manager.free(request)

    def free_batch(self, requests: Sequence[Request]) -> None:
        """The manager's ``free_batch`` when it has one, else ``free`` per request in order."""
        batched = getattr(self.manager, "free_batch", None)
        if batched is not None:
            batched(list(requests))
            return
        for request in requests:
            self.manager.free(request)

    def fast_paths(self) -> Mapping[str, int] | None:
        """The manager's own path counts (``TorchKVCacheManager.fast_paths``), ``None`` for a
        manager that keeps none."""
        counts: Mapping[str, int] | None = getattr(self.manager, "fast_paths", None)
        return counts

    def block_table(self, request_id: str) -> BlockIds:
        return tuple(tuple(ids) for ids in self.manager.get_block_ids(request_id))

    def reset_prefix_cache(self) -> bool:
        return self.manager.reset_prefix_cache()

    def num_free_blocks(self) -> int:
        return self.manager.num_free_blocks

    def usage(self) -> float:
        return self.manager.usage

    def snapshot(self) -> Snapshot:
        snap = self.manager.snapshot()
        return Snapshot(
            tuple(snap.free_block_ids),
            tuple(sorted(snap.ref_counts.items())),
            tuple(tuple(ids) for ids in snap.cached_block_ids),
            snap.num_cached_keys,
        )

    def take_events(self) -> tuple[tuple[object, ...], ...]:
        return tuple(_plain_event(event) for event in self.manager.take_events())

    def take_stats(self) -> tuple[int, int, int, bool] | None:
        stats = self.manager.make_prefix_cache_stats()
        if stats is None:
            return None
        return (stats.requests, stats.queries, stats.hits, stats.reset)

    def check_invariants(self) -> None:
        self.manager.check_invariants()


class PlanningAdapter(ProtocolAdapter):
    """``ProtocolAdapter`` with a planner: ``plan_report`` of ``hybridkv.reference`` (or of a
    patched copy), stated as ``PlanFacts``."""

    def __init__(
        self,
        name: str,
        manager: KVCacheManagerLike,
        block_size: int,
        num_hash_lookahead_tokens: int,
        plan_report: Callable[..., Any],
    ) -> None:
        super().__init__(name, manager, block_size, num_hash_lookahead_tokens)
        self.plan_report = plan_report

    def plan_model(
        self,
        layers: Mapping[str, KVCacheSpec],
        available_memory: int,
        max_model_len: int,
        kv_sharing: Mapping[str, str],
    ) -> PlanFacts:
        report = self.plan_report(
            dict(layers),
            available_memory,
            max_model_len=max_model_len,
            max_num_batched_tokens=512,
            kv_sharing=dict(kv_sharing),
        )
        shared = set(kv_sharing)
        return PlanFacts(
            num_blocks=report.num_blocks,
            block_size=report.block_size,
            page_size_bytes=report.page_size_bytes,
            groups=tuple(
                (group.spec, tuple(n for n in group.layer_names if n not in shared))
                for group in report.config.groups
            ),
            num_padding_slots=report.num_padding_slots,
        )


def block_size_of(config: KVCacheConfig) -> int:
    """The first group's block size (every group's, when they share one)."""
    return config.groups[0].spec.block_size


def hash_block_size_of(config: KVCacheConfig, enable_caching: bool = True) -> int:
    """The hash block size a manager resolves by default (requests are hashed at it): one
    group's block size; else the gcd of the block sizes, or their lcm with caching off or a
    Mamba group in ``"none"`` mode."""
    sizes = [group.spec.block_size for group in config.groups]
    if len(sizes) == 1:
        return sizes[0]
    lcm_hashing = not enable_caching or any(g.spec.lcm_hashing for g in config.groups)
    return rules.hash_block_size(sizes, lcm_hashing=lcm_hashing)
