"""vLLM 0.33's own KV event structs, built by the core as events happen: the event builder the
integration hands its core, and the ``extra_keys`` of LoRA, multimodal and prompt-embedding
requests as vLLM's block pool publishes them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridkv.reference.events import EventBuilder
from hybridkv.reference.request import Request
from hybridkv.spec import KVCacheConfig

_LOW_64 = (1 << 64) - 1


def vllm_event_builder_class(
    groups: Sequence[tuple[str, int | None]] | None = None,
) -> type[EventBuilder]:
    """An ``EventBuilder`` whose events are vLLM 0.33's own msgspec structs (``BlockStored``,
    ``BlockRemoved``, ``AllBlocksCleared``): lists for list fields, and hashes as vLLM's
    ``maybe_convert_block_hash`` gives them (their low 64 bits as an int under
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, a switch read here, once per manager; vLLM reads
    it per event). The core builds each event once, in the engine's type, as vLLM's manager
    does, instead of its own dataclass converted at every step. ``groups``: each group's
    ``(kv_cache_spec_kind, kv_cache_spec_sliding_window)`` as vLLM's manager publishes them
    (``get_kv_cache_spec_kind``: ``mla_attention`` for an MLA group, which hybridkv runs as
    full attention); ``None``: hybridkv's spec's own."""
    from vllm import envs
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    def to_int(block_hash: bytes) -> int:
        return int.from_bytes(block_hash, "big") & _LOW_64

    class VllmEventBuilder(EventBuilder):
        stored_type = BlockStored
        removed_type = BlockRemoved
        cleared_type = AllBlocksCleared
        sequence = list
        convert_hash = staticmethod(to_int) if envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES else None

        @classmethod
        def of(cls, config: KVCacheConfig, num_hash_lookahead_tokens: int = 0) -> EventBuilder:
            if groups is None:
                return super().of(config, num_hash_lookahead_tokens)
            return cls(groups, num_hash_lookahead_tokens)

        def extra_keys(
            self, request: Any, positions: Sequence[int], block_size: int
        ) -> Sequence[tuple[Any, ...] | None] | None:
            if isinstance(request, Request) or (  # the core's own: its keys as it hashes them
                request.lora_request is None
                and not request.mm_features
                and request.prompt_embeds is None
            ):
                return super().extra_keys(request, positions, block_size)
            return event_extra_keys(request, positions, block_size, self.num_hash_lookahead_tokens)

        def lora(self, request: Any) -> tuple[int | None, str | None]:
            if isinstance(request, Request):
                return super().lora(request)
            lora = request.lora_request
            return (None, None) if lora is None else (lora.adapter_id, lora.name)

    return VllmEventBuilder


def event_extra_keys(
    request: Any, positions: Sequence[int], block_size: int, num_lookahead_tokens: int
) -> list[tuple[Any, ...] | None] | None:
    """The ``extra_keys`` of a ``BlockStored`` of ``request``'s blocks at ``positions``, as
    vLLM 0.33's block pool publishes them (``_generate_event_extra_keys``, then
    ``to_event_extra_keys``): LoRA names, multimodal ``(identifier, offset)`` pairs, the salt
    and prompt-embedding digests, untagged; the same window as the block hash."""
    from vllm.v1.core.kv_cache_utils import (
        generate_block_hash_extra_keys,
        generate_lookahead_block_hash_extra_keys,
        to_event_extra_keys,
    )

    keys: list[tuple[Any, ...] | None] = []
    mm_index = 0
    for position in positions:
        start, end = position * block_size, (position + 1) * block_size
        if num_lookahead_tokens:
            extra, mm_index = generate_lookahead_block_hash_extra_keys(
                request, start, end, end + num_lookahead_tokens, mm_index
            )
        else:
            extra, mm_index = generate_block_hash_extra_keys(request, start, end, mm_index)
        keys.append(extra)
    published: list[tuple[Any, ...] | None] | None = to_event_extra_keys(keys)
    return published
