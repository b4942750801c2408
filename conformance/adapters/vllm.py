"""vLLM 0.33's own ``vllm.v1.core.kv_cache_manager.KVCacheManager`` behind the adapter protocol.

``python -m hybridkv.conformance --adapter hybridkv.conformance.adapters.vllm:make_adapter``
runs the suite on vLLM itself: the golden traces were recorded from this manager, so it must
replay them all, and the differential machine compares it with the reference under traffic the
traces never saw. vLLM is imported when a factory builds an adapter, not with this module.

The translations between the suite's values and vLLM's:

* **Config.** Each hybridkv group becomes a ``KVCacheGroupSpec`` of the same layers and the
  vLLM spec of the same kind and fields (``hybridkv.integrations.vllm.to_vllm_config``).
  Layer sizes do not matter to the manager: ``dtype_bytes`` picks a torch dtype of that size
  (1, 2 or 4 bytes).
* **Mamba block size.** hybridkv's ``MambaSpec.block_size`` is vLLM's, unchanged: the tokens
  one Mamba block spans (the attention block size with prefix caching, ``max_model_len``
  without). A state of ``state_bytes`` is one uint8 tensor of that many elements; ``"align"``
  / ``"none"``, speculative and checkpoint blocks and ``page_size_padded`` pass through.
* **Scheduler and hash block sizes.** vLLM takes them as arguments; they are what the suite's
  requests assume: the scheduler block is the lcm of the groups' block sizes
  (``rules.scheduler_block_size``), the hash block ``adapters.hash_block_size_of``.
  Requests get vLLM's block hasher at that size (``sha256_cbor``, the scheme of the golden
  traces; ``init_none_hash(sha256_cbor)`` sets vLLM's first parent hash, a process global).
* **Statistics.** vLLM's manager does not count lookups itself; its scheduler calls
  ``record_prefix_cache_stats(request, num_hits)`` after ``get_computed_blocks``. The adapter
  does the same in ``lookup`` (with ``log_stats=True``), so each lookup counts once, as in
  the reference; ``take_stats`` reads ``(requests, queries, hits, reset)`` from vLLM's
  ``PrefixCacheStats`` (requests are never preempted here, so the preempted counters stay 0).
* **Events.** vLLM reports block hashes as 64-bit ints by default
  (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``); the adapter maps each back to the 32-byte hash
  of a block of one of its requests, so events compare with the reference's
  ``(name, block_hashes, parent_block_hash, token_ids, block_size, group_idx)`` tuples.
  vLLM's extra event fields (medium, LoRA, spec kind, ...) are not part of the protocol.
* **Snapshot.** Read from vLLM's block pool: the free queue, reference counts above 0, the
  blocks under each group's cached keys, and the number of keys.
* **Invariants.** vLLM has no checker; ``check_invariants`` checks what the snapshot shows
  (the free queue holds every block of count 0 once and never the null block; the free count
  is its length).

**Known bug.** ``known_bug`` names a failure that is vLLM's own, reproduced through vLLM's
``Scheduler`` (``tests/test_vllm_mamba_draft_checkpoint.py``), so that the suite's verdict says
whose fault it is: in Mamba ``"align"`` mode with prefill checkpoint blocks, a decode step whose
drafts span a Mamba block makes vLLM key a checkpoint past the request's known tokens, and
``allocate_slots`` fails an assertion (the reference drops that checkpoint as transient).
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from typing import Any

from hybridkv.conformance.adapters import (
    BlockIds,
    EngineOptions,
    Lookup,
    Snapshot,
    hash_block_size_of,
)
from hybridkv.spec import (
    KVCacheConfig,
    rules,
)


def vllm_config(config: KVCacheConfig) -> Any:
    """vLLM's ``KVCacheConfig`` of hybridkv's: the integration's ``to_vllm_config`` (the same
    groups, specs, EAGLE flags, blocks and retention interval; a Mamba state as one flat byte
    tensor of ``state_bytes``)."""
    from hybridkv.integrations.vllm.convert import to_vllm_config

    return to_vllm_config(config)


def _ids(per_group: Sequence[Sequence[int]]) -> BlockIds:
    return tuple(tuple(ids) for ids in per_group)


class VllmAdapter:
    """vLLM's ``KVCacheManager`` as a ``ManagerAdapter`` (see the module's translations)."""

    name = "vllm"

    def __init__(
        self,
        manager: Any,
        hash_block_size: int,
        num_hash_lookahead_tokens: int,
        max_model_len: int,
    ) -> None:
        from vllm.utils.hashing import sha256_cbor
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher

        self.manager = manager
        self.max_model_len = max_model_len
        self.block_hasher = get_request_block_hasher(
            hash_block_size, sha256_cbor, num_hash_lookahead_tokens
        )
        self.requests: list[Any] = []
        self._hash_bytes: dict[object, bytes] = {}

    def new_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        cache_salt: str | None,
        *,
        skip_reading_prefix_cache: bool = False,
    ) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(
            max_tokens=self.max_model_len,
            skip_reading_prefix_cache=skip_reading_prefix_cache or None,
        )
        request = Request(
            request_id,
            list(prompt),
            params,
            None,
            cache_salt=cache_salt,
            block_hasher=self.block_hasher,
        )
        self.requests.append(request)
        return request

    def append_tokens(self, request: Any, tokens: Sequence[int]) -> None:
        request.append_output_token_ids(list(tokens))

    def set_num_computed_tokens(self, request: Any, num_computed_tokens: int) -> None:
        request.num_computed_tokens = num_computed_tokens

    def set_shared_prefix_boundary(self, request: Any, boundary: int) -> None:
        request.shared_prefix_boundary = boundary

    def lookup(self, request: Any) -> Lookup:
        blocks, num_hit_tokens, boundary = self.manager.get_computed_blocks(request)
        # vLLM's scheduler counts the lookup; the reference counts it in the lookup itself.
        self.manager.record_prefix_cache_stats(request, num_hit_tokens)
        return Lookup(_ids(blocks.get_block_ids()), num_hit_tokens, blocks, boundary)

    def new_step(self) -> None:
        self.manager.new_step_starts()

    def allocate(
        self,
        request: Any,
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
        return None if new is None else _ids(new.get_block_ids())

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        self.manager.cache_blocks(request, num_computed_tokens)

    def free(self, request: Any) -> None:
        self.manager.free(request)

    def block_table(self, request_id: str) -> BlockIds:
        return _ids(self.manager.get_block_ids(request_id))

    def reset_prefix_cache(self) -> bool:
        return bool(self.manager.reset_prefix_cache())

    def num_free_blocks(self) -> int:
        return int(self.manager.block_pool.get_num_free_blocks())

    def usage(self) -> float:
        return float(self.manager.usage)

    def snapshot(self) -> Snapshot:
        from vllm.v1.core.kv_cache_utils import get_group_id

        pool = self.manager.block_pool
        cache = pool.cached_block_hash_to_block._cache
        cached: list[set[int]] = [set() for _ in self.manager.kv_cache_config.kv_cache_groups]
        for key, blocks in cache.items():
            held = blocks.values() if isinstance(blocks, dict) else [blocks]
            cached[get_group_id(key)].update(block.block_id for block in held)
        return Snapshot(
            free_block_ids=tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks()),
            ref_counts=tuple((b.block_id, b.ref_cnt) for b in pool.blocks[1:] if b.ref_cnt > 0),
            cached_block_ids=tuple(tuple(sorted(ids)) for ids in cached),
            num_cached_keys=len(cache),
        )

    def _bytes_of(self, block_hash: object) -> object:
        """The 32-byte hash behind an event's (int) hash, from the requests' hashes."""
        if isinstance(block_hash, bytes):
            return block_hash
        if block_hash not in self._hash_bytes:
            from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

            for request in self.requests:
                for full in request.block_hashes:
                    self._hash_bytes[maybe_convert_block_hash(full)] = bytes(full)
        return self._hash_bytes.get(block_hash, block_hash)

    def take_events(self) -> tuple[tuple[object, ...], ...]:
        out: list[tuple[object, ...]] = []
        for event in self.manager.take_events():
            kind = type(event).__name__
            if kind == "BlockStored":
                parent = event.parent_block_hash
                out.append(
                    (
                        kind,
                        tuple(self._bytes_of(h) for h in event.block_hashes),
                        None if parent is None else self._bytes_of(parent),
                        tuple(event.token_ids),
                        event.block_size,
                        event.group_idx,
                    )
                )
            elif kind == "BlockRemoved":
                hashes = tuple(self._bytes_of(h) for h in event.block_hashes)
                out.append((kind, hashes, event.group_idx))
            else:
                out.append((kind,))
        return tuple(out)

    def take_stats(self) -> tuple[int, int, int, bool]:
        stats = self.manager.make_prefix_cache_stats()
        return (stats.requests, stats.queries, stats.hits, bool(stats.reset))

    def check_invariants(self) -> None:
        snap = self.snapshot()
        free = snap.free_block_ids
        if len(set(free)) != len(free) or 0 in free:
            raise AssertionError(f"vllm: free queue {free} repeats a block or holds block 0")
        held = dict(snap.ref_counts)
        if set(free) & set(held):
            raise AssertionError(f"vllm: blocks {sorted(set(free) & set(held))} free but held")
        num_blocks = self.manager.kv_cache_config.num_blocks
        missing = set(range(1, num_blocks)) - set(free) - set(held)
        if missing:
            raise AssertionError(f"vllm: blocks {sorted(missing)} neither free nor held")
        if self.num_free_blocks() != len(free):
            raise AssertionError(
                f"vllm: num_free_blocks {self.num_free_blocks()} != free queue length {len(free)}"
            )


DRAFT_CHECKPOINT_BUG = (
    'a vLLM 0.33 bug, not a false alarm: in Mamba "align" mode with prefill checkpoint '
    "blocks, a decode step whose draft tokens span a Mamba block puts MambaManager's checkpoint "
    "past the request's known tokens; under dense or positive retention "
    "_cache_partial_tail_block keys it and BlockPool._get_partial_block_hash fails "
    "'assert 0 < num_hash_blocks <= len(request.block_hashes)'. vLLM's own Scheduler reaches "
    "it (tests/test_vllm_mamba_draft_checkpoint.py); the reference drops that checkpoint as "
    "transient"
)


def known_bug(error: BaseException) -> str | None:
    """What vLLM bug ``error`` is, when it is one reproduced through vLLM's own ``Scheduler``
    (else ``None``): the differential machine then reports vLLM at fault, not its traffic."""
    names = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
    if (
        isinstance(error, AssertionError)
        and names[-1:] == ["_get_partial_block_hash"]
        and "_cache_partial_tail_block" in names
    ):
        return DRAFT_CHECKPOINT_BUG
    return None


def make_adapter(
    config: KVCacheConfig,
    max_model_len: int,
    enable_caching: bool,
    enable_kv_cache_events: bool,
    engine: EngineOptions,
) -> VllmAdapter:
    """An ``AdapterFactory``: vLLM 0.33's ``KVCacheManager`` for this layout and engine."""
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256_cbor)
    hash_block_size = hash_block_size_of(config, enable_caching)
    manager = KVCacheManager(
        vllm_config(config),
        max_model_len,
        scheduler_block_size=rules.scheduler_block_size([g.spec.block_size for g in config.groups]),
        hash_block_size=hash_block_size,
        max_in_flight_tokens=engine.max_in_flight_tokens,
        enable_caching=enable_caching,
        use_eagle=engine.use_eagle,
        num_hash_lookahead_tokens=engine.num_hash_lookahead_tokens,
        log_stats=True,
        enable_kv_cache_events=enable_kv_cache_events,
    )
    return VllmAdapter(manager, hash_block_size, engine.num_hash_lookahead_tokens, max_model_len)
