"""How ``VllmReplay`` builds vLLM 0.33's scheduler: the manager, the defaults, the single settings.

``"engine"`` defaults are a vLLM 0.33 engine's (``prefix_cache_retention_interval=0``,
``scheduler_reserve_full_isl``, ``AsyncScheduler``: two steps in flight), ``"unit"`` vLLM's unit
tests' (dense retention, first-chunk admission, ``Scheduler``: one step in flight). Each single
setting (``hybridkv replay --retention-interval``, ``--admission``, ``--async-scheduling``,
``--no-prefix-caching``) replaces the defaults' value of that setting alone, as it does for the
built-in loop (``hybridkv.cli.replay_setup.EngineSettings``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.integrations.vllm.check import reserves_full_sequence, retention_interval
from hybridkv.integrations.vllm.model_layout import ModelLayout

MANAGERS = ("vllm", "reference", "optimized")


@dataclass(frozen=True)
class VllmEngine:
    """vLLM's scheduler as the replay builds it: the groups, the pool, the manager, the
    defaults (``"engine"``: retention interval 0, full-sequence admission, async scheduling;
    ``"unit"``: dense retention, first-chunk admission, one step in flight) and the single
    settings given beside them (``None``, or ``"defaults"`` for the retention: the defaults')."""

    layout: ModelLayout
    num_blocks: int
    manager: str = "vllm"
    defaults: str = "engine"
    eviction_policy: str = "lru"
    device: str | None = None
    retention: int | str | None = "defaults"
    """``prefix_cache_retention_interval`` (``None``: dense; ``"defaults"``: the defaults')."""
    full_prompt_admission: bool | None = None
    async_scheduling: bool | None = None
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.manager not in MANAGERS:
            raise ValueError(f"manager must be one of {MANAGERS}, got {self.manager!r}")
        if self.defaults not in ("engine", "unit"):
            raise ValueError(f"defaults must be 'engine' or 'unit', got {self.defaults!r}")
        if self.manager == "vllm" and self.eviction_policy != "lru":
            raise ValueError(f"vLLM's own manager evicts lru only, not {self.eviction_policy!r}")
        retention_interval(self.retention, self.defaults)  # ValueError naming a bad one

    @property
    def is_async(self) -> bool:
        """Async scheduling (the engine defaults'), unless set apart."""
        if self.async_scheduling is None:
            return self.defaults == "engine"
        return self.async_scheduling

    @property
    def reserves_full_sequence(self) -> bool:
        """Full-sequence admission (the engine defaults'), unless set apart."""
        return reserves_full_sequence(self.full_prompt_admission, self.defaults)

    @property
    def depth(self) -> int:
        """Steps in flight: two under async scheduling (the engine's), else one."""
        return 2 if self.is_async else 1
