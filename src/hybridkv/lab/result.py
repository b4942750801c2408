"""What a replay measured: hits at first admission beside the bound, latency, throughput."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridkv.block_trace import BlockTraceRequest, prefix_hit_tokens


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0–100) by linear interpolation between order statistics (numpy's
    default); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class ReplayResult:
    """Counts and per-request times of one replay (times in simulated milliseconds)."""

    requests: int = 0
    skipped: int = 0
    refused: int = 0
    finished: int = 0
    steps: int = 0
    preemptions: int = 0
    evictions: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    host_hit_tokens: int = 0
    """Prompt tokens (of first admissions) past the GPU hit that the host tier supplied."""
    bound_hit_tokens: int = 0
    in_flight_bound_tokens: int = 0
    """Bound tokens that no cache could have hit: at the request's first admission the earlier
    prompt holding them had not been scheduled that far yet (it arrived in the same step, or
    its chunked prefill was still running). A replay that evicts nothing hits the bound less
    exactly these (with dense retention; sparse retention keeps less)."""
    arrived_prompt_tokens: int = 0
    """Prompt tokens of every arrived request (admitted or refused): the bound's denominator."""
    readmissions: int = 0
    readmission_hit_tokens: int = 0
    readmission_prompt_tokens: int = 0
    computed_tokens: int = 0
    output_tokens: int = 0
    simulated_ms: float = 0.0
    wall_seconds: float = 0.0
    manager_seconds: float = 0.0
    ttft_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    queue_ms: list[float] = field(default_factory=list)
    group_hit_tokens: list[int] = field(default_factory=list)
    """Per KV cache group, prompt tokens (of first admissions) whose blocks that group found
    cached: the hit's non-null block ids of the group × its block size."""
    group_reached_again: list[int] = field(default_factory=list)
    """Per KV cache group, cached keys evicted that a later first admission reached again (its
    prompt walked from the start past cached and evicted keys, ``hit_profile.EvictionLedger``):
    the hits eviction cost. Empty without the manager's events."""

    def count_arrival(
        self,
        trace: BlockTraceRequest,
        covered: dict[int, int],
        block_size: int,
        max_model_len: int,
    ) -> int | None:
        """Count an arrived request: skipped (``None``) when its prompt and output exceed
        ``max_model_len``, else its share of the bound (returned), its prompt tokens and one
        request. Both replay engines count arrivals so."""
        if trace.input_length + trace.output_length > max_model_len:
            self.skipped += 1
            return None
        bound = prefix_hit_tokens(trace, covered, block_size)
        self.bound_hit_tokens += bound
        self.requests += 1
        self.arrived_prompt_tokens += trace.input_length
        return bound

    @property
    def group_hit_rates(self) -> list[float]:
        """``group_hit_tokens`` over ``prompt_tokens``, one per group."""
        total = self.prompt_tokens
        return [tokens / total if total else 0.0 for tokens in self.group_hit_tokens]

    @property
    def hit_rate(self) -> float:
        """Prompt tokens hit at first admission / prompt tokens of admitted requests."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def host_hit_rate(self) -> float:
        """Host-tier hits at first admission / prompt tokens of admitted requests."""
        return self.host_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def bound_hit_rate(self) -> float:
        """The infinite-cache bound of the same requests (arrived ones), same block size.

        Its denominator is the prompt tokens of every arrived request (``arrived_prompt_tokens``);
        it equals ``prompt_tokens`` when no request was refused."""
        total = self.arrived_prompt_tokens
        return self.bound_hit_tokens / total if total else 0.0

    @property
    def reachable_bound_hit_rate(self) -> float:
        """The bound less its in-flight tokens, over the same denominator."""
        total = self.arrived_prompt_tokens
        reachable = self.bound_hit_tokens - self.in_flight_bound_tokens
        return reachable / total if total else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Prompt and output tokens computed per second of simulated time."""
        seconds = self.simulated_ms / 1e3
        return (self.computed_tokens) / seconds if seconds else 0.0

    def summary(self) -> dict[str, Any]:
        """The figures as a flat dict with stable keys."""

        def spread(values: Sequence[float]) -> dict[str, float]:
            return {f"p{q}": round(percentile(values, q), 3) for q in (50, 90, 99)}

        return {
            "requests": self.requests,
            "skipped": self.skipped,
            "refused": self.refused,
            "finished": self.finished,
            "steps": self.steps,
            "preemptions": self.preemptions,
            "evictions": self.evictions,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": round(self.hit_rate, 6),
            "host_hit_tokens": self.host_hit_tokens,
            "group_hit_rates": [round(rate, 6) for rate in self.group_hit_rates],
            "group_reached_again": list(self.group_reached_again),
            "bound_hit_tokens": self.bound_hit_tokens,
            "arrived_prompt_tokens": self.arrived_prompt_tokens,
            "bound_hit_rate": round(self.bound_hit_rate, 6),
            "in_flight_bound_tokens": self.in_flight_bound_tokens,
            "reachable_bound_hit_rate": round(self.reachable_bound_hit_rate, 6),
            "readmissions": self.readmissions,
            "readmission_hit_tokens": self.readmission_hit_tokens,
            "readmission_prompt_tokens": self.readmission_prompt_tokens,
            "computed_tokens": self.computed_tokens,
            "output_tokens": self.output_tokens,
            "simulated_seconds": round(self.simulated_ms / 1e3, 3),
            "tokens_per_second": round(self.tokens_per_second, 1),
            "ttft_ms": spread(self.ttft_ms),
            "e2e_ms": spread(self.e2e_ms),
            "queue_ms": spread(self.queue_ms),
            "wall_seconds": round(self.wall_seconds, 3),
            "manager_seconds": round(self.manager_seconds, 3),
        }
