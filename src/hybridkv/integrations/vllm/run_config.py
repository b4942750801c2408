"""What one ``vllm-check`` run is (``RunConfig``: layout or model, scheduling, engine defaults,
seed), the workload it feeds vLLM's scheduler (``Arrival``, ``Workload``) and what it records
(``RunResult``): the values the drivers (``scheduler_drive``, ``offload_drive``,
``mm_workload``) and the comparison (``comparison``) share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridkv.integrations.vllm.model_layout import ModelLayout

LAYOUTS = ("gemma3", "llama4", "jamba")
RUNS = ("sync", "async", "spec")
DEFAULTS = ("engine", "unit")
MANAGERS = ("vllm", "reference", "optimized")
BLOCK_SIZE = 16
VOCAB = 50000
EOS_TOKEN_ID = 50256


@dataclass(frozen=True)
class RunConfig:
    layout: str = "gemma3"
    run: str = "sync"
    defaults: str = "engine"
    seed: int = 0
    num_requests: int = 48
    num_blocks: int = 96
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 128
    max_model_len: int = 1024
    num_speculative_tokens: int = 2
    max_steps: int = 4000
    model: ModelLayout | None = None
    """A real model's groups (``--model``), which replace ``layout``'s."""
    retention: int | str | None = "defaults"
    """``prefix_cache_retention_interval``: ``"defaults"`` (an engine's 0, a unit test's
    dense), ``None`` (dense) or an interval in tokens."""
    full_prompt_admission: bool | None = None
    """``scheduler_reserve_full_isl`` (admit a request only when its whole sequence fits);
    ``None``: the defaults' (the engine's)."""
    prefix_caching: bool = True
    """``enable_prefix_caching``; off, Mamba groups run ``"none"``."""
    workload: str = "tokens"
    """``"tokens"`` (``make_workload``'s) or ``"multimodal"`` (``mm_workload``'s)."""

    @property
    def name(self) -> str:
        layout = self.layout if self.model is None else self.model.name
        suffix = "" if self.workload == "tokens" else f"/{self.workload}"
        return f"{layout}/{self.run}/{self.defaults}{suffix}"

    @property
    def block_size(self) -> int:
        """Tokens per block of every group (and of the scheduler and the block hashes)."""
        return BLOCK_SIZE if self.model is None else self.model.block_size

    @property
    def has_mamba(self) -> bool:
        """Whether a group is Mamba: the engine runs its cache in ``"align"`` mode."""
        return self.layout == "jamba" if self.model is None else self.model.has_mamba

    @property
    def retention_interval(self) -> int | None:
        """The retention interval the run gives vLLM (``None``: dense)."""
        return retention_interval(self.retention, self.defaults)

    @property
    def reserves_full_sequence(self) -> bool:
        """Whether the scheduler admits a request only when its whole sequence fits."""
        return reserves_full_sequence(self.full_prompt_admission, self.defaults)

    def kv_cache_config(self) -> Any:
        """vLLM's ``KVCacheConfig`` of the run: the layout's or the model's groups, the pool,
        and the retention interval (``retention_interval``)."""
        retention = self.retention_interval
        if self.model is not None:
            return self.model.vllm_config(self.num_blocks, retention=retention)
        return kv_cache_config_for(
            self.layout,
            self.num_blocks,
            retention=retention,
            mamba_cache_mode="align" if self.prefix_caching else "none",
        )


def retention_interval(retention: int | str | None, defaults: str) -> int | None:
    """``prefix_cache_retention_interval`` for ``retention`` under ``defaults``: ``"defaults"``
    is an engine's 0 and a unit test's dense (``None``); ``ValueError`` unless it is that,
    ``None`` or tokens ``>= 0``."""
    if retention == "defaults":
        return 0 if defaults == "engine" else None
    if retention is None or (type(retention) is int and retention >= 0):
        return retention
    raise ValueError(
        f"retention must be 'defaults', None (dense) or tokens >= 0, got {retention!r}"
    )


def reserves_full_sequence(full_prompt_admission: bool | None, defaults: str) -> bool:
    """``scheduler_reserve_full_isl``: the setting, or (``None``) the engine defaults' on."""
    return defaults == "engine" if full_prompt_admission is None else full_prompt_admission


def kv_cache_config_for(
    layout: str, num_blocks: int, *, retention: int | None, mamba_cache_mode: str = "align"
) -> Any:
    """vLLM's ``KVCacheConfig`` of a hybrid layout (groups as vLLM's grouping makes them)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    attn = {"block_size": BLOCK_SIZE, "num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
    full = KVCacheGroupSpec(["full.0"], FullAttentionSpec(**attn))
    if layout == "gemma3":
        # Gemma 3: one full-attention layer in six; vLLM groups them 1 full + 5 sliding.
        sliding = SlidingWindowSpec(**attn, sliding_window=64)
        groups = [full] + [KVCacheGroupSpec([f"sliding.{i}"], sliding) for i in range(2)]
    elif layout == "llama4":
        chunked = ChunkedLocalAttentionSpec(**attn, attention_chunk_size=64)
        groups = [full] + [KVCacheGroupSpec([f"chunked.{i}"], chunked) for i in range(3)]
    elif layout == "jamba":
        mamba = MambaSpec(
            block_size=BLOCK_SIZE,
            shapes=((4, 8),),
            dtypes=(torch.float16,),
            mamba_cache_mode=mamba_cache_mode,
        )
        groups = [full, KVCacheGroupSpec(["mamba.0"], mamba)]
    else:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=retention,
    )


@dataclass
class Arrival:
    step: int
    request_id: str
    prompt: list[int]
    max_tokens: int
    priority: int
    cache_salt: str | None
    abort_after: int | None = None
    continues: str | None = None  # a later turn of this request's conversation
    request_kwargs: dict[str, Any] = field(default_factory=dict)  # images, LoRA, embeddings


@dataclass
class Workload:
    arrivals: list[Arrival]
    reset_steps: set[int] = field(default_factory=set)


@dataclass
class RunResult:
    manager: str
    records: list[dict[str, Any]]
    seconds: float
    error: str | None = None
