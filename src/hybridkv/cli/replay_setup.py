"""A ``hybridkv replay`` cell's plain values: its ``ReplaySetup``, the ``EngineSettings``
resolved from it, and its ``CellResult``.

Frozen dataclasses of plain values only, so a grid's cells cross into worker processes; both
the built-in replay (``hybridkv.cli.replay_run``) and vLLM's scheduler
(``hybridkv.cli.replay_vllm``) read them, neither owning the other's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridkv.cli.options import UserError

TRACE_FORMATS = ("mooncake",)
"""Block-hash trace formats ``--trace-format`` names (others are recognised by their fields)."""

COST_FIELDS = ("fixed_ms", "prefill_token_ms", "decode_seq_ms", "context_token_ms")


@dataclass(frozen=True)
class ReplaySetup:
    """Everything one replay needs, as plain values."""

    trace: str
    model: str | None = None
    memory_bytes: int = 8 << 30
    eviction: str = "lru"
    backend: str = "optimized"
    scheduler: str = "built-in"
    """``built-in`` (``hybridkv.lab.Replay``) or ``vllm`` (vLLM 0.33's own ``Scheduler``)."""
    device: str = "cpu"
    block_tokens: int = 512
    max_requests: int | None = None
    max_model_len: int = 131072
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    block_size: int = 16
    kv_dtype: str = "bf16"
    mamba_ssm_dtype: str = "auto"
    defaults: str = "engine"
    time_scale: float = 1.0
    gpu: str = "H100"
    cost: tuple[tuple[str, float], ...] = ()
    """Cost-model coefficients given on the command line; the others come from the model."""
    host_memory_bytes: int | None = None
    host_bandwidth_gbps: float = 25.0
    host_accounting: str = "hybrid"
    retention: str = "default"
    """``"default"`` (the defaults'), ``"dense"`` or an interval in tokens (``"0"``: sparse)."""
    admission: str = "default"
    """``"default"``, ``"full"`` (the whole sequence must fit) or ``"first-chunk"``."""
    async_scheduling: bool | None = None
    """Async scheduling's tokens in flight; ``None``: the defaults'."""
    prefix_caching: bool = True
    """Off: no prefix caching at all (Mamba groups then run ``"none"``), the baseline a
    policy's hits are read against."""


@dataclass(frozen=True)
class EngineSettings:
    """The manager's and the scheduler's settings one replay runs with, resolved from the
    ``defaults`` and the single settings given beside them."""

    retention_interval: int | None
    """``prefix_cache_retention_interval``: ``None`` dense, ``0`` sparse."""
    full_prompt_admission: bool
    async_scheduling: bool
    prefix_caching: bool
    """On: Mamba groups cache their states in ``"align"`` mode, as an engine with prefix
    caching selects."""

    @classmethod
    def of(cls, setup: ReplaySetup) -> EngineSettings:
        """``UserError`` naming a setting that does not parse."""
        engine = setup.defaults == "engine"
        if setup.admission not in ADMISSIONS:
            raise UserError(f"--admission must be one of {ADMISSIONS}, got {setup.admission!r}")
        admission = setup.admission if setup.admission != "default" else None
        is_async = setup.async_scheduling
        return cls(
            retention_interval=_retention(setup.retention, engine),
            full_prompt_admission=engine if admission is None else admission == "full",
            async_scheduling=engine if is_async is None else is_async,
            prefix_caching=setup.prefix_caching,
        )


ADMISSIONS = ("default", "full", "first-chunk")


def _retention(text: str, engine: bool) -> int | None:
    """``--retention-interval``'s value: ``default``, ``dense`` or tokens ``>= 0``."""
    if text == "default":
        return 0 if engine else None
    if text == "dense":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise UserError(
            f"--retention-interval must be 'default', 'dense' or tokens >= 0 (0: sparse), "
            f"got {text!r}"
        )
    return value


@dataclass(frozen=True)
class CellResult:
    """A cell's JSON object (item 9's keys and more) and its TTFTs for the plot."""

    summary: dict[str, Any]
    ttft_ms: tuple[float, ...] = field(default=())
