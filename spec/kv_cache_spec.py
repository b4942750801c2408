"""Layer specs: what one layer needs from the KV cache.

The design document ("Definitions") calls the bytes that one token of one layer occupies the
*kv hidden size*, and the physical size of one block of one layer ``KVCacheSpec.page_size_bytes``
(block size × kv hidden size). A KV cache group's *page size* is then
(layers per group) × ``page_size_bytes``; see ``KVCacheGroup.page_size_bytes``.

Every spec is a frozen value that validates itself on construction, so an invalid spec can
never reach the planner or the manager.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.spec.errors import check_non_negative, check_positive


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """The fields shared by every attention layer: a paged KV cache, one slot per token.

    Not used directly: a layer is full attention, sliding window or chunked local attention.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int

    def __post_init__(self) -> None:
        check_positive("block_size", self.block_size)
        check_positive("num_kv_heads", self.num_kv_heads)
        check_positive("head_size", self.head_size)
        check_positive("dtype_bytes", self.dtype_bytes)

    @property
    def kv_hidden_size(self) -> int:
        """Bytes of one token of one layer: K and V, each num_kv_heads × head_size elements."""
        return 2 * self.num_kv_heads * self.head_size * self.dtype_bytes

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer (the code's ``page_size_bytes``, not the group's)."""
        return self.block_size * self.kv_hidden_size


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Full (global) attention: every token keeps its KV for the life of the request."""


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention: a token attends to itself and the ``sliding_window − 1`` before."""

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("sliding_window", self.sliding_window)


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Chunked local attention (Llama 4): a token attends only to tokens of its own chunk."""

    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("attention_chunk_size", self.attention_chunk_size)


MAMBA_CACHE_MODES = ("none", "align")
"""``"none"``: one running state per request, no prefix caching. ``"align"``: the states at block
boundaries are kept as prefix-cache entries (the mode an engine selects with prefix caching)."""


@dataclass(frozen=True, kw_only=True)
class MambaSpec:
    """A Mamba (or other recurrent) layer: a fixed-size state per request, whatever its length.

    ``state_bytes`` is the state of one layer for one request. The planner pads it to the
    attention page (Allocation, Case 4) and records the padded size in ``page_size_padded``.

    ``block_size`` is the Mamba block in tokens: table position ``i`` covers tokens
    ``[i·B, (i+1)·B)`` and holds a state only where one lives. With prefix caching the planner
    gives Mamba the (raised) attention block size; without it, an engine lets one block span
    ``max_model_len`` so that a request holds one state block.

    ``mamba_cache_mode`` is ``"none"`` or ``"align"`` (required when prefix caching is on);
    ``num_speculative_blocks`` extra state blocks serve draft tokens (speculative decoding);
    ``num_prefill_checkpoint_blocks`` (0 or 1) and ``prefill_checkpoint_alignment`` describe
    kernels that can export the block-boundary state from inside one prefill chunk.
    """

    block_size: int
    state_bytes: int
    page_size_padded: int | None = None
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None

    def __post_init__(self) -> None:
        check_positive("block_size", self.block_size)
        check_positive("state_bytes", self.state_bytes)
        if self.page_size_padded is not None and (
            not isinstance(self.page_size_padded, int) or self.page_size_padded < self.state_bytes
        ):
            raise ValueError(
                f"page_size_padded must be at least state_bytes ({self.state_bytes}), "
                f"got {self.page_size_padded!r}"
            )
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(
                f"mamba_cache_mode must be one of {MAMBA_CACHE_MODES}, "
                f"got {self.mamba_cache_mode!r}"
            )
        check_non_negative("num_speculative_blocks", self.num_speculative_blocks)
        if self.num_prefill_checkpoint_blocks not in (0, 1) or isinstance(
            self.num_prefill_checkpoint_blocks, bool
        ):
            raise ValueError(
                "num_prefill_checkpoint_blocks must be 0 or 1, "
                f"got {self.num_prefill_checkpoint_blocks!r}"
            )
        if self.prefill_checkpoint_alignment is not None:
            check_positive("prefill_checkpoint_alignment", self.prefill_checkpoint_alignment)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of the (padded) state of one layer: one block holds one request's state."""
        if self.page_size_padded is None:
            return self.state_bytes
        return self.page_size_padded


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | ChunkedLocalAttentionSpec | MambaSpec
"""Any layer spec the planner and the manager understand."""


def spec_kind(spec: KVCacheSpec) -> str:
    """A short stable name of the attention type, used in reports and error messages."""
    if isinstance(spec, SlidingWindowSpec):
        return "sliding_window"
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return "chunked_local"
    if isinstance(spec, MambaSpec):
        return "mamba"
    return "full"
