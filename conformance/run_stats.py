"""What a differential run covered: ``RunStats``, the counts the machine keeps while it runs
and the report's lines (rules taken, lookups and hits, allocations and failures, batched
calls, layouts drawn, backends skipped)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar

from hybridkv.conformance.strategies import Layout


@dataclass
class RunStats:
    """Counts for the report: what the machine did and checked."""

    examples: int = 0
    steps: int = 0
    rules: Counter[str] = field(default_factory=Counter)
    invariant_checks: int = 0
    comparisons: int = 0
    type_mixes: Counter[str] = field(default_factory=Counter)
    group_counts: Counter[int] = field(default_factory=Counter)
    allocations: int = 0
    failed_allocations: int = 0
    hits: int = 0
    lookups: int = 0
    cached_lookups: int = 0
    """Lookups with prefix caching on (the others cannot hit)."""
    evictions: int = 0
    caching_off: int = 0
    backends: tuple[str, ...] = ()
    features: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    stand_ins: int = 0
    shared_prefix_boundaries: int = 0
    full_prompt_admissions: int = 0
    full_prompt_refusals: int = 0
    speculative_steps: int = 0
    accepted_drafts: int = 0
    batch_steps: int = 0
    """Scheduler steps of several running requests (``allocate_batch`` where offered)."""
    batch_requests: int = 0
    batch_frees: int = 0
    last_run: tuple[Layout, list[str], list[str]] | None = None
    """The layout, the calls (``Lockstep.script``) and the backends' names of the latest
    example: after a failure, the shortest failing one."""
    plans: int = 0
    """Models planned by every implementation that plans (``Planning``) and compared."""
    plans_refused: int = 0
    batched_calls: Counter[str] = field(default_factory=Counter)
    """Per backend: the batched calls it served through its own ``allocate_batch`` or
    ``free_batch`` (a backend without them is driven one request at a time)."""
    fast_paths: dict[str, Counter[str]] = field(default_factory=dict)
    """Per backend that counts its paths (``fast_paths``): how often each ran, the quiet exit
    of single ``allocate`` calls included (``hybridkv.conformance.path_tally``)."""

    WORK_RULES: ClassVar[tuple[str, ...]] = (
        "warm_up",
        "admit",
        "admit_whole_prompt",
        "prefill",
        "decode",
        "speculative_decode",
        "step_batch",
        "step_all",
    )
    """The rules that schedule tokens: an admission's first prefill chunk (the set-up's warm-up
    admits a whole prompt), later chunks, decode steps (one request, several, or every running
    one)."""

    @staticmethod
    def _percent(part: int, whole: int) -> str:
        return f"{100 * part / whole:.0f}%" if whole else "n/a"

    def shares(self) -> dict[str, float]:
        """The traffic's shares, in percent: lookups with a hit, steps that prefill or decode,
        allocations that returned ``None``."""

        def share(part: int, whole: int) -> float:
            return 100 * part / whole if whole else 0.0

        work = sum(self.rules[name] for name in self.WORK_RULES)
        return {
            "hits": share(self.hits, self.cached_lookups),
            "prefill_decode": share(work, self.steps),
            "failed_allocations": share(self.failed_allocations, self.allocations),
        }

    def lines(self) -> list[str]:
        mixes = ", ".join(f"{mix} ×{n}" for mix, n in sorted(self.type_mixes.items()))
        groups = ", ".join(f"{k} groups ×{n}" for k, n in sorted(self.group_counts.items()))
        rule_counts = ", ".join(f"{name} {n}" for name, n in sorted(self.rules.items()))
        features = ", ".join(f"{name} ×{n}" for name, n in sorted(self.features.items()))
        skipped = ", ".join(f"{name} {self.skipped[name]}" for name in self.backends) or "none"
        work = sum(self.rules[name] for name in self.WORK_RULES)
        batched = ", ".join(f"{n} {self.batched_calls[n]}" for n in self.backends) or "none"
        return [
            f"  backends: {' vs '.join(self.backends)}",
            f"  examples {self.examples}, steps {self.steps} "
            f"(operations on each backend: {sum(self.rules.values())})",
            f"  rules: {rule_counts}",
            f"  lookups {self.lookups} ({self.hits} with a hit), allocations {self.allocations} "
            f"({self.failed_allocations} returned None), cache evictions {self.evictions}",
            f"  shares: {self._percent(self.hits, self.cached_lookups)} of lookups with caching "
            f"on hit ({self.cached_lookups}), "
            f"{self._percent(work, self.steps)} of steps prefill or decode, "
            f"{self._percent(self.failed_allocations, self.allocations)} of allocations fail",
            f"  batched: {self.batch_steps} steps of several requests ({self.batch_requests} "
            f"requests), {self.batch_frees} batches of frees; served by the backends' own "
            f"batched calls: {batched}",
            f"  observables compared {self.comparisons}, invariant checks {self.invariant_checks}",
            f"  models planned and compared {self.plans} ({self.plans_refused} refused by "
            "every planner)",
            f"  layouts: {groups}; caching off in {self.caching_off}",
            f"  type mixes: {mixes}",
            f"  engine features (layouts): {features or 'none'}",
            f"  shared-prefix boundaries stored {self.shared_prefix_boundaries}, full-prompt "
            f"admissions {self.full_prompt_admissions} ({self.full_prompt_refusals} returned "
            f"None), speculative decode steps {self.speculative_steps} "
            f"({self.accepted_drafts} accepted drafts)",
            f"  skipped examples (layout not implemented): {skipped}"
            + (f"; reference-again stood in {self.stand_ins}×" if self.stand_ins else ""),
            *self.path_lines(),
        ]

    def path_lines(self) -> list[str]:
        """One line per backend that counts its fast paths: each path and its count, in the
        backend's order (a path at 0 is one this run never reached)."""
        return [
            f"  fast paths ({name}): " + ", ".join(f"{path} {n}" for path, n in counts.items())
            for name, counts in self.fast_paths.items()
        ]
