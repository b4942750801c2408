"""``hybridkv bench --vllm-scheduler``: the manager's cost inside vLLM 0.33's real scheduler.

B running decode requests on a Gemma-3-like layout (one full-attention group and five
sliding-window groups, window 512, block size 16; ~1,000-token prompts, staggered over one block
so that every step sees 1/16 of the requests enter a new block). After the prefill, each step
is ``schedule()`` + ``update_from_output()`` with a fake model that samples one token per
request; the median over the steps is reported, with vLLM's own manager, the reference and the
optimized backend in one process, their schedulers stepped in turn, and the ratio vLLM ÷
backend (above 1: hybridkv is faster).

What bounds the ratio: after the timed steps, as many more run with every method of the
scheduler's manager timed (``ManagerClock``), which splits a step into the manager's time and
the scheduler's own (the step less the manager). The scheduler's own work is the same whichever
manager runs, so vLLM's step divided by it is the most any manager could gain ("bound": a
manager that took no time at all). The share of it reached is the timed step's ratio ÷ the
bound, which takes its two medians from different steps; it is printed beside the median over
the clocked steps of each step's own work ÷ that whole step, which one disturbed stretch of
steps moves less (and which counts the clocks' own cost against the manager).
"""

from __future__ import annotations

import functools
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.extras import exit_if_missing
from hybridkv.integrations.vllm.check import BLOCK_SIZE, RunConfig, build_scheduler

LAYOUT_WINDOW = 512
PROMPT = 1000


def _kv_cache_config(num_blocks: int) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    attn = {"block_size": BLOCK_SIZE, "num_kv_heads": 8, "head_size": 128, "dtype": torch.bfloat16}
    sliding = SlidingWindowSpec(**attn, sliding_window=LAYOUT_WINDOW)
    groups = [KVCacheGroupSpec(["full.0"], FullAttentionSpec(**attn))] + [
        KVCacheGroupSpec([f"sliding.{i}"], sliding) for i in range(5)
    ]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


class ManagerClock:
    """Times every method call on one manager object (calls made from inside a timed call
    count once, in the outer call)."""

    def __init__(self, manager: Any) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._inside = False
        for name in dir(type(manager)):
            if name.startswith("_"):
                continue
            attribute = getattr(manager, name, None)
            if callable(attribute) and not isinstance(attribute, type):
                setattr(manager, name, self._timed(attribute))

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._inside:
                return method(*args, **kwargs)
            self._inside = True
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
                self._inside = False

        return timed


@dataclass(frozen=True)
class StepTimes:
    """Median µs per decode step: the whole step, and (from the clocked steps) the manager's
    share and the scheduler's own work."""

    step: float
    manager: float
    scheduler: float
    own_share: float
    """The median over the clocked steps of each step's own work ÷ that step (its own work and
    its manager's, clocks included): the share of a manager that took no time reached, from
    one set of steps (the clocks' cost counts against the manager)."""


class DecodeRun:
    """One vLLM scheduler on one manager: B requests admitted and prefilled, then decode steps
    (``step``) with a fake model that samples one token per request."""

    def __init__(self, manager: str, batch: int, steps: int, kv_events: bool = False) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request

        self._output_class = ModelRunnerOutput
        init_none_hash(sha256)
        hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        per_request = (PROMPT + 2 * steps) // BLOCK_SIZE + 2 + 5 * (LAYOUT_WINDOW // BLOCK_SIZE + 3)
        cfg = RunConfig(
            max_num_seqs=batch,
            max_num_batched_tokens=16384,
            max_model_len=4096,
            defaults="unit",
        )
        self.manager, self.batch = manager, batch
        config = _kv_cache_config(batch * per_request + 64)
        self.scheduler = build_scheduler(cfg, manager, config, kv_events=kv_events)
        for i in range(batch):
            params = SamplingParams(max_tokens=10_000, ignore_eos=True)
            params.update_from_generation_config({}, 50256)
            prompt = [(i * 7919 + t * 31) % 50000 for t in range(PROMPT - i % BLOCK_SIZE)]
            self.scheduler.add_request(
                Request(
                    request_id=f"r{i}",
                    prompt_token_ids=prompt,
                    sampling_params=params,
                    pooling_params=None,
                    block_hasher=hasher,
                )
            )
        # Prefill until every request decodes.
        while any(
            r.is_prefill_chunk or r.num_computed_tokens == 0
            for r in self.scheduler.requests.values()
        ):
            self.step(check=False)

    def step(self, check: bool = True) -> float:
        """One ``schedule()`` + ``update_from_output()``; its seconds."""
        scheduler = self.scheduler
        start = time.perf_counter()
        output = scheduler.schedule()
        req_ids = list(output.num_scheduled_tokens)
        sampled = [
            [] if scheduler.requests[r].is_prefill_chunk else [(len(r) * 13) % 50000]
            for r in req_ids
        ]
        runner = self._output_class(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )
        scheduler.update_from_output(output, runner)
        seconds = time.perf_counter() - start
        if check and len(req_ids) != self.batch:
            raise RuntimeError(f"{self.manager}: {len(req_ids)} of {self.batch} scheduled")
        return seconds


def measure_all(
    managers: Sequence[str], batch: int, steps: int, kv_events: bool = False
) -> dict[str, StepTimes]:
    """Median µs of ``schedule()`` + ``update_from_output()`` per decode step for each manager,
    the managers' schedulers stepped in turn (so that a change of load hits all alike); then
    as many clocked steps, in turn again, split into the manager's time and the scheduler's.
    ``kv_events``: with vLLM's KV cache events on (a default engine has them off)."""
    runs = [DecodeRun(manager, batch, steps, kv_events) for manager in managers]
    # The prefilled state is long-lived, as a serving engine's is after start-up (vLLM's engine
    # freezes it too): the collector leaves it out of its scans, so that one run's garbage does
    # not bill another's step for scanning the other runs' requests.
    gc.collect()
    gc.freeze()
    try:
        return _interleaved(runs, steps)
    finally:
        gc.unfreeze()


def _interleaved(runs: Sequence[DecodeRun], steps: int) -> dict[str, StepTimes]:
    times: dict[str, list[float]] = {run.manager: [] for run in runs}
    for _ in range(steps):
        for run in runs:
            times[run.manager].append(run.step())
    clocks = {run.manager: ManagerClock(run.scheduler.kv_cache_manager) for run in runs}
    own: dict[str, list[float]] = {run.manager: [] for run in runs}
    spent: dict[str, list[float]] = {run.manager: [] for run in runs}
    for _ in range(steps):
        for run in runs:
            clock = clocks[run.manager]
            before = clock.seconds
            seconds = run.step()
            spent[run.manager].append(clock.seconds - before)
            own[run.manager].append(seconds - spent[run.manager][-1])
    return {
        m: StepTimes(
            statistics.median(times[m]) * 1e6,
            statistics.median(spent[m]) * 1e6,
            statistics.median(own[m]) * 1e6,
            statistics.median(o / (o + t) for o, t in zip(own[m], spent[m], strict=True)),
        )
        for m in times
    }


def measure(manager: str, batch: int, steps: int) -> StepTimes:
    """``measure_all`` of one manager."""
    return measure_all([manager], batch, steps)[manager]


def main(argv: Sequence[str] | None = None, *, quick: bool = False) -> int:
    exit_if_missing("python -m hybridkv.integrations.vllm.bench", ["vllm", "torch"])
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    batches = [16, 32] if quick else [256, 1024]
    steps = 4 if quick else 32
    print(
        "vLLM 0.33 scheduler, Gemma-3-like layout (1 full + 5 sliding groups, window "
        f"{LAYOUT_WINDOW}), ~{PROMPT}-token prompts: median µs per schedule() + "
        "update_from_output() step"
    )
    for kv_events in (False, True):
        title = "on (a null publisher)" if kv_events else "off (a default engine's setting)"
        print(f"\nKV cache events {title}:")
        _report(batches, steps, kv_events)
    return 0


def _report(batches: Sequence[int], steps: int, kv_events: bool) -> None:
    """One table of step times per B and its split into manager and scheduler time."""
    managers = ("vllm", "reference", "optimized")
    print(f"{'B':>6} " + " ".join(f"{m:>12}" for m in managers) + "   vLLM÷ref  vLLM÷opt")
    splits: list[str] = []
    for batch in batches:
        timings = measure_all(managers, batch, steps, kv_events)
        print(
            f"{batch:>6} "
            + " ".join(f"{timings[m].step:>12,.0f}" for m in managers)
            + f"   {timings['vllm'].step / timings['reference'].step:>7.2f}×"
            + f"  {timings['vllm'].step / timings['optimized'].step:>7.2f}×"
        )
        sys.stdout.flush()
        splits.extend(
            f"{batch:>6} {m:>10} {t.manager:>12,.0f} {t.scheduler:>16,.0f}"
            for m, t in timings.items()
        )
        own = timings["optimized"].scheduler
        bound = timings["vllm"].step / own
        reached = timings["vllm"].step / timings["optimized"].step / bound
        splits.append(
            f"{batch:>6} bound: vLLM's step ÷ the scheduler's own work with the optimized "
            f"backend = {bound:.2f}× (a manager that took no time); the optimized backend "
            f"reaches {reached:.0%} of it ({timings['optimized'].own_share:.0%} within the "
            "clocked steps, their clocks counted against it)"
        )
    print("Where a clocked step goes (median µs per step; every manager method timed):")
    print(f"{'B':>6} {'manager':>10} {'in manager':>12} {'scheduler own':>16}")
    print("\n".join(splits))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], quick="--quick" in sys.argv))
