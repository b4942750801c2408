"""A replay's scheduler limits and clock (``ReplayConfig``), shared by both replay engines."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv.lab.cost_model import CostModel


@dataclass(frozen=True)
class ReplayConfig:
    """The scheduler's limits and the clock."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 131072
    time_scale: float = 1.0
    cost_model: CostModel = field(default_factory=CostModel)
    attention_mix: tuple[tuple[float, int | None], ...] = ((1.0, None),)
    """``(share of the KV bytes per token, window)`` per attention kind, for the context a step
    attends: a full-attention share reads the whole context, a windowed one at most its window."""
    full_prompt_admission: bool = False
    """Admit a waiting request only when its whole sequence fits (vLLM 0.33's engine admits so:
    ``allocate_slots(..., full_sequence_must_fit=True)``); off, only its first chunk must fit."""

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale!r}")

    def attended(self, context: int) -> float:
        """Context tokens a step reads for a request of ``context`` tokens, weighted by kind."""
        return sum(
            share * (context if window is None else min(context, window))
            for share, window in self.attention_mix
        )
