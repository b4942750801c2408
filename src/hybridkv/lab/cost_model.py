"""How long a scheduler step takes: a documented cost model, every coefficient overridable.

A replay of real traffic needs time: arrivals are milliseconds, and whether a request waits
depends on how long the steps before it took. A step's duration here is linear in what it
computes::

    step_ms = fixed_ms
            + prefill_token_ms × (prompt tokens computed this step)
            + decode_seq_ms    × (requests decoding this step)
            + context_token_ms × (tokens attended this step: each scheduled request's context,
                                  a sliding window's or chunk's part only)

``for_gpu`` derives the coefficients from a model's active parameters and its KV bytes per
attended token on a named GPU preset, the usual roofline reading of a transformer step:

* ``fixed_ms``: reading the weights once (``2 × active parameters`` bytes at bf16 over the
  GPU's memory bandwidth) plus a launch overhead (``launch_ms``);
* ``prefill_token_ms``: ``2 × active parameters`` FLOPs per token at ``mfu`` of the GPU's
  dense bf16 peak;
* ``decode_seq_ms``: the sampler's and scheduler's per-sequence work (a constant);
* ``context_token_ms``: reading one token's KV bytes (all layers) over the bandwidth.

The presets are the vendors' published dense bf16 peaks and HBM bandwidths. The model is a
reading aid, not a simulator of kernels: it orders policies by the time their misses cost,
and every coefficient can be set from a measured engine instead.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPUPreset:
    """A GPU's dense bf16 peak (TFLOP/s) and memory bandwidth (TB/s), from its data sheet."""

    name: str
    bf16_tflops: float
    hbm_tbps: float


GPU_PRESETS: dict[str, GPUPreset] = {
    preset.name: preset
    for preset in (
        GPUPreset("A100", 312.0, 2.039),  # A100 SXM 80 GB data sheet
        GPUPreset("H100", 989.0, 3.35),  # H100 SXM data sheet (dense, without sparsity)
        GPUPreset("H200", 989.0, 4.8),  # H200 SXM data sheet
    )
}


@dataclass(frozen=True)
class CostModel:
    """A step's duration in milliseconds, linear in what the step computes."""

    fixed_ms: float = 5.0
    prefill_token_ms: float = 0.0002
    decode_seq_ms: float = 0.01
    context_token_ms: float = 0.00002

    def __post_init__(self) -> None:
        for name in ("fixed_ms", "prefill_token_ms", "decode_seq_ms", "context_token_ms"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ValueError(f"cost model {name} must be a number >= 0, got {value!r}")

    def step_ms(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        """The duration of one step that computes these."""
        return (
            self.fixed_ms
            + self.prefill_token_ms * prefill_tokens
            + self.decode_seq_ms * decode_seqs
            + self.context_token_ms * context_tokens
        )

    @classmethod
    def for_gpu(
        cls,
        active_parameters: float,
        kv_bytes_per_token: float,
        gpu: str = "H100",
        *,
        mfu: float = 0.5,
        launch_ms: float = 1.0,
        decode_seq_ms: float = 0.01,
    ) -> CostModel:
        """The roofline coefficients of a model on ``gpu`` (a ``GPU_PRESETS`` name)."""
        if gpu not in GPU_PRESETS:
            raise ValueError(f"gpu must be one of {sorted(GPU_PRESETS)}, got {gpu!r}")
        if not active_parameters > 0:
            raise ValueError(f"active_parameters must be > 0, got {active_parameters!r}")
        if not kv_bytes_per_token >= 0:
            raise ValueError(f"kv_bytes_per_token must be >= 0, got {kv_bytes_per_token!r}")
        if not 0 < mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")
        preset = GPU_PRESETS[gpu]
        bandwidth = preset.hbm_tbps * 1e12 / 1e3  # bytes per ms
        flops = preset.bf16_tflops * 1e12 / 1e3 * mfu  # FLOPs per ms
        return cls(
            fixed_ms=launch_ms + 2 * active_parameters / bandwidth,
            prefill_token_ms=2 * active_parameters / flops,
            decode_seq_ms=decode_seq_ms,
            context_token_ms=kv_bytes_per_token / bandwidth,
        )
