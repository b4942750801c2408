"""What a scheduler loop asks of a manager, and the one chunking rule both loops share.

``hybridkv.simulate`` (steps, synthetic workloads) and ``hybridkv.lab`` (a clock, block-hash
traces) each drive a manager as vLLM v1's scheduler does; they call the same five methods and
cut a Mamba "align" model's prefill the same way, so both live here once.
"""

from __future__ import annotations

from typing import Protocol

from hybridkv.reference import KVCacheBlocks, Request


class Manager(Protocol):
    """The scheduler-facing calls a loop makes (``KVCacheManager`` and the torch backend)."""

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]: ...

    def new_step_starts(self) -> None: ...

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        *,
        full_sequence_must_fit: bool = False,
    ) -> KVCacheBlocks | None: ...

    def free(self, request: Request) -> None: ...

    @property
    def usage(self) -> float: ...


def mamba_aligned_chunk(
    request: Request, start: int, num_new: int, mamba_block_size: int | None
) -> int:
    """How many of ``num_new`` tokens from ``start`` a step computes.

    A Mamba "align" model's prefill chunk ends on a Mamba block boundary, and the prompt's last
    chunk stops at the last boundary before the prompt's end, so that the states there are
    cached (as vLLM's scheduler cuts them, ``_mamba_block_aligned_split``); other models, and
    decode, take ``num_new`` as it is.
    """
    block = mamba_block_size
    if block is None or start >= request.num_prompt_tokens:
        return num_new
    end = start + num_new
    last_boundary = (request.num_prompt_tokens - 1) // block * block
    if start < last_boundary < end:
        return last_boundary - start
    if end < request.num_tokens and end // block * block > start:
        return end // block * block - start
    return num_new
