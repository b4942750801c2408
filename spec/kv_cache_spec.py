"""Layer specs: what one layer needs from the KV cache.

The design document ("Definitions") calls the bytes that one token of one layer occupies the
*kv hidden size*, and the physical size of one block of one layer ``KVCacheSpec.page_size_bytes``
(block size × kv hidden size). A KV cache group's *page size* is then
(layers per group) × ``page_size_bytes``; see ``KVCacheGroup.page_size_bytes``.

Every spec is a frozen value that validates itself on construction, so an invalid spec can
never reach the planner or the manager.

Each spec class is also the one place where its attention type's behaviour is dispatched: its
``kind``, the leading tokens it no longer needs (``skipped_tokens``), the most blocks one
request holds (``max_blocks_per_request``), its cap in a full-prompt admission
(``admission_cap``), whether it caches sparsely under a retention interval, whether its hit is
a prefix (``hit_is_prefix``), whether it holds a state rather than per-token KV
(``holds_state``), where its table may hold null blocks (``null_positions``,
``max_live_blocks``), and what prefix caching requires of it (``check_prefix_caching``,
``lcm_hashing``, ``needs_shared_block_size``, ``supports_eagle_drop``). Each method calls the
rule in ``hybridkv.spec.rules``; a new attention type is added here, in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridkv.spec import rules
from hybridkv.spec.errors import check_non_negative, check_positive


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """The fields shared by every attention layer: a paged KV cache, one slot per token.

    Not used directly: a layer is full, sliding-window, chunked local or cross-attention.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int
    hit_is_prefix = False
    """Every shorter length of a hit is a hit too (full attention; Prefix caching, Case 2)."""
    holds_state = False
    """A recurrent state per request instead of KV per token (Mamba; Allocation, Case 4)."""
    needs_shared_block_size = False
    """With prefix caching, every group must share this type's block size."""
    supports_eagle_drop = True
    """``use_eagle`` may drop the last block of this type's hit."""

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

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one more token adds to one layer: its KV."""
        return self.kv_hidden_size

    @property
    def null_positions(self) -> Literal["none", "leading", "anywhere"]:
        """Where a request's table may hold the null block: a window or chunk releases from
        the front only; full attention keeps every position."""
        return "leading"

    @property
    def max_live_blocks(self) -> int | None:
        """The most real blocks one request's table holds at once, when the type bounds it."""
        return None

    @property
    def lcm_hashing(self) -> bool:
        """Whether this type forces hashing at the scheduler block (nothing finer is looked up)."""
        return False

    def blocks_without_release(self, max_model_len: int) -> int:
        """Blocks a non-hybrid manager gives one layer of this type for the longest request."""
        return rules.max_blocks_full_attention(max_model_len, self.block_size)

    def check_prefix_caching(self) -> None:
        """Refuse a spec prefix caching cannot serve (``ValueError``)."""

    def check_hash_block_size(self, hash_block_size: int) -> None:
        """Refuse a hash block size this type's hits cannot land on (``ValueError``)."""


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Full (global) attention: every token keeps its KV for the life of the request."""

    kind = "full"
    event_kind = "full_attention"
    """vLLM's ``KVCacheSpecKind`` value of the type (``BlockStored.kv_cache_spec_kind``)."""
    title = "full-attention"
    """The type in words, for messages."""
    sparse_retention = False
    hit_is_prefix = True

    @property
    def null_positions(self) -> Literal["none", "leading", "anywhere"]:
        return "none"

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        return rules.full_attention_skipped_tokens(num_computed_tokens)

    def max_blocks_per_request(
        self, max_model_len: int, max_in_flight_tokens: int, *, enable_prefix_caching: bool
    ) -> int:
        return rules.max_blocks_full_attention(max_model_len, self.block_size)

    def admission_cap(self, max_model_len: int, max_in_flight_tokens: int) -> int | None:
        """Blocks a full-prompt admission reserves at most (``None``: every block it needs)."""
        return None


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention: a token attends to itself and the ``sliding_window − 1`` before."""

    sliding_window: int
    extra_retained_tokens: int = 0
    """Tokens kept below the window, never attended (vLLM 0.33's field, ``num_prefill_lookahead
    − 1``: multi-module MTP prefills those again, so their blocks leave that much later)."""
    kind = "sliding_window"
    event_kind = "sliding_window"
    """vLLM's ``KVCacheSpecKind`` value of the type (``BlockStored.kv_cache_spec_kind``)."""
    title = "sliding-window"
    """The type in words, for messages."""
    sparse_retention = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("sliding_window", self.sliding_window)
        check_non_negative("extra_retained_tokens", self.extra_retained_tokens)

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        return rules.sliding_window_skipped_tokens(
            num_computed_tokens, self.sliding_window, self.extra_retained_tokens
        )

    def max_blocks_per_request(
        self, max_model_len: int, max_in_flight_tokens: int, *, enable_prefix_caching: bool
    ) -> int:
        return rules.max_blocks_sliding_window(
            max_model_len,
            self.block_size,
            self.sliding_window,
            max_in_flight_tokens,
            self.extra_retained_tokens,
        )

    def admission_cap(self, max_model_len: int, max_in_flight_tokens: int) -> int | None:
        """The window behind the in-flight tokens: the most the group ever holds at once."""
        return self.max_blocks_per_request(
            max_model_len, max_in_flight_tokens, enable_prefix_caching=False
        )


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Chunked local attention (Llama 4): a token attends only to tokens of its own chunk."""

    attention_chunk_size: int
    kind = "chunked_local"
    event_kind = "chunked_local_attention"
    """vLLM's ``KVCacheSpecKind`` value of the type (``BlockStored.kv_cache_spec_kind``)."""
    title = "chunked local attention"
    """The type in words, for messages."""
    sparse_retention = False
    needs_shared_block_size = True
    supports_eagle_drop = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("attention_chunk_size", self.attention_chunk_size)

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        return rules.chunked_local_skipped_tokens(num_computed_tokens, self.attention_chunk_size)

    def max_blocks_per_request(
        self, max_model_len: int, max_in_flight_tokens: int, *, enable_prefix_caching: bool
    ) -> int:
        return rules.max_blocks_chunked_local(
            max_model_len, self.block_size, self.attention_chunk_size, max_in_flight_tokens
        )

    def admission_cap(self, max_model_len: int, max_in_flight_tokens: int) -> int | None:
        """The current chunk and the in-flight tokens: the most the group ever holds at once."""
        return self.max_blocks_per_request(
            max_model_len, max_in_flight_tokens, enable_prefix_caching=False
        )


@dataclass(frozen=True, kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Cross-attention of an encoder-decoder model (Whisper): the decoder reads the KV of the
    encoder's output, one slot per encoder token, written once when the encoder runs.

    vLLM 0.33's ``CrossAttentionSpec`` and ``CrossAttentionManager``: a request's table is
    sized by its encoder tokens (``num_encoder_tokens`` of ``allocate_slots``), in one static
    allocation, not by its decoder tokens; nothing is skipped, looked up or cached (encoder
    states are unique per request, so vLLM disables prefix caching for encoder-decoder models).
    """

    kind = "cross_attention"
    event_kind = "cross_attention"
    """vLLM's ``KVCacheSpecKind`` value of the type (``BlockStored.kv_cache_spec_kind``)."""
    title = "cross-attention"
    """The type in words, for messages."""
    sparse_retention = False

    @property
    def null_positions(self) -> Literal["none", "leading", "anywhere"]:
        return "none"

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        """The encoder's KV is read by every decoder token: nothing is skipped."""
        return rules.full_attention_skipped_tokens(num_computed_tokens)

    def max_blocks_per_request(
        self, max_model_len: int, max_in_flight_tokens: int, *, enable_prefix_caching: bool
    ) -> int:
        """The blocks of the longest encoder input, scheduled in one step: vLLM's
        ``max_memory_usage_bytes`` reads ``max_num_encoder_input_tokens``, the engine's
        ``max_num_batched_tokens`` (``max_in_flight_tokens`` here), not the decoder's length."""
        return rules.attention_blocks_for_tokens(max_in_flight_tokens, self.block_size)

    def max_memory_usage_bytes(self, max_num_encoder_input_tokens: int) -> int:
        """vLLM's rule for one layer: ``cdiv(max_encoder_len, block_size) × page_size_bytes``."""
        blocks = rules.attention_blocks_for_tokens(max_num_encoder_input_tokens, self.block_size)
        return blocks * self.page_size_bytes

    def admission_cap(self, max_model_len: int, max_in_flight_tokens: int) -> int | None:
        """A full-prompt admission reserves every encoder block (vLLM caps only windows)."""
        return None

    def check_prefix_caching(self) -> None:
        """vLLM disables prefix caching for encoder-decoder models, and its cross-attention
        manager can neither look a hit up nor cache a block: refused, not guessed at."""
        raise ValueError(
            "enable_caching must be False with a cross-attention group: vLLM disables prefix "
            "caching for encoder-decoder models, got enable_caching=True"
        )


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
    kind = "mamba"
    event_kind = "mamba"
    """vLLM's ``KVCacheSpecKind`` value of the type (``BlockStored.kv_cache_spec_kind``)."""
    title = "Mamba"
    """The type in words, for messages."""
    sparse_retention = True
    hit_is_prefix = False
    holds_state = True
    needs_shared_block_size = False
    supports_eagle_drop = True

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

    kv_bytes_per_token = 0
    """A state does not grow with the request."""

    @property
    def null_positions(self) -> Literal["none", "leading", "anywhere"]:
        """``"align"`` keeps a few state blocks anywhere in the table; ``"none"`` releases the
        states before the running one, from the front."""
        return "anywhere" if self.mamba_cache_mode == "align" else "leading"

    @property
    def max_live_blocks(self) -> int | None:
        """``"align"``: the state, the previous one, a prefill checkpoint and the speculative
        blocks."""
        return 3 + self.num_speculative_blocks if self.mamba_cache_mode == "align" else None

    @property
    def lcm_hashing(self) -> bool:
        """``"none"`` mode looks nothing up: hashes need only the scheduler block."""
        return self.mamba_cache_mode == "none"

    def blocks_without_release(self, max_model_len: int) -> int:
        return rules.max_blocks_mamba(max_model_len)

    def check_prefix_caching(self) -> None:
        """Prefix caching keeps states only in ``"align"`` mode."""
        if self.mamba_cache_mode != "align":
            raise ValueError(
                "mamba_cache_mode must be 'align' for a Mamba group when prefix caching is "
                f"on (enable_caching=True), got {self.mamba_cache_mode!r}: plan with "
                "plan_kv_cache(..., enable_caching=True), or convert a plan with "
                "hybridkv.reference.planner.with_mamba_cache_mode(config, True)"
            )

    def check_hash_block_size(self, hash_block_size: int) -> None:
        """Hits land on Mamba block boundaries only."""
        if self.block_size > hash_block_size:
            raise ValueError(
                f"a Mamba 'align' group's block_size ({self.block_size}) must equal the hash "
                f"block size ({hash_block_size}): hits inside a Mamba block are not "
                "supported; give every group the Mamba block size"
            )

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        return rules.mamba_skipped_tokens(num_computed_tokens)

    def max_blocks_per_request(
        self, max_model_len: int, max_in_flight_tokens: int, *, enable_prefix_caching: bool
    ) -> int:
        """One state block (Case 4); two with prefix caching (the state and the previous one)."""
        return rules.max_blocks_mamba(max_model_len) * rules.mamba_state_blocks(
            enable_prefix_caching
        )

    def admission_cap(self, max_model_len: int, max_in_flight_tokens: int) -> int | None:
        return None


KVCacheSpec = (
    FullAttentionSpec
    | SlidingWindowSpec
    | ChunkedLocalAttentionSpec
    | CrossAttentionSpec
    | MambaSpec
)
"""Any layer spec the planner and the manager understand."""
