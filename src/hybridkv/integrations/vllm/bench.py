"""``hybridkv bench --vllm-scheduler``: the manager's cost inside vLLM 0.33's real scheduler.

B running decode requests on a Gemma-3-like layout (one full-attention group and five
sliding-window groups, window 512, block size 16; ~1,000-token prompts, staggered over one block
so that every step sees 1/16 of the requests enter a new block). After the prefill, each step
is ``schedule()`` + ``update_from_output()`` with a fake model that samples one token per
request; the median over the steps is reported, with vLLM's own manager, the reference and the
optimized backend in one process, and the ratio vLLM ÷ backend (above 1: hybridkv is faster).

What bounds the ratio: after the timed steps, as many more run with every method of the
scheduler's manager timed (``ManagerClock``), which splits a step into the manager's time and
the scheduler's own (the step less the manager). The scheduler's own work is the same whichever
manager runs, so vLLM's step divided by it is the most any manager could gain ("bound": a
manager that took no time at all).
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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


def measure(manager: str, batch: int, steps: int) -> StepTimes:
    """Median µs of ``schedule()`` + ``update_from_output()`` per decode step, then the split
    of as many clocked steps into the manager's time and the scheduler's own."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    per_request = (PROMPT + steps) // BLOCK_SIZE + 2 + 5 * (LAYOUT_WINDOW // BLOCK_SIZE + 3)
    cfg = RunConfig(
        max_num_seqs=batch,
        max_num_batched_tokens=16384,
        max_model_len=4096,
        defaults="unit",
    )
    scheduler = build_scheduler(cfg, manager, _kv_cache_config(batch * per_request + 64))
    for i in range(batch):
        params = SamplingParams(max_tokens=10_000, ignore_eos=True)
        params.update_from_generation_config({}, 50256)
        prompt = [(i * 7919 + t * 31) % 50000 for t in range(PROMPT - i % BLOCK_SIZE)]
        scheduler.add_request(
            Request(
                request_id=f"r{i}",
                prompt_token_ids=prompt,
                sampling_params=params,
                pooling_params=None,
                block_hasher=hasher,
            )
        )

    def step() -> tuple[int, float]:
        start = time.perf_counter()
        output = scheduler.schedule()
        req_ids = list(output.num_scheduled_tokens)
        sampled = [
            [] if scheduler.requests[r].is_prefill_chunk else [(len(r) * 13) % 50000]
            for r in req_ids
        ]
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )
        scheduler.update_from_output(output, runner)
        return len(req_ids), time.perf_counter() - start

    # Prefill until every request decodes.
    while any(
        r.is_prefill_chunk or r.num_computed_tokens == 0 for r in scheduler.requests.values()
    ):
        step()
    times = []
    for _ in range(steps):
        scheduled, seconds = step()
        if scheduled != batch:
            raise RuntimeError(f"{manager}: {scheduled} of {batch} requests scheduled")
        times.append(seconds)
    clock = ManagerClock(scheduler.kv_cache_manager)
    own, spent = [], []
    for _ in range(steps):
        before = clock.seconds
        _, seconds = step()
        spent.append(clock.seconds - before)
        own.append(seconds - spent[-1])
    return StepTimes(
        statistics.median(times) * 1e6,
        statistics.median(spent) * 1e6,
        statistics.median(own) * 1e6,
    )


def main(argv: Sequence[str] | None = None, *, quick: bool = False) -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    batches = [16, 32] if quick else [256, 1024]
    steps = 4 if quick else 32
    managers = ("vllm", "reference", "optimized")
    print(
        "vLLM 0.33 scheduler, Gemma-3-like layout (1 full + 5 sliding groups, window "
        f"{LAYOUT_WINDOW}), ~{PROMPT}-token prompts: median µs per schedule() + "
        "update_from_output() step"
    )
    print(f"{'B':>6} " + " ".join(f"{m:>12}" for m in managers) + "   vLLM÷ref  vLLM÷opt")
    splits: list[str] = []
    for batch in batches:
        timings = {m: measure(m, batch, steps) for m in managers}
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
        splits.append(
            f"{batch:>6} bound: vLLM's step ÷ the scheduler's own work with the optimized "
            f"backend = {timings['vllm'].step / own:.2f}× (a manager that took no time)"
        )
    print("\nWhere a clocked step goes (median µs per step; every manager method timed):")
    print(f"{'B':>6} {'manager':>10} {'in manager':>12} {'scheduler own':>16}")
    print("\n".join(splits))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], quick="--quick" in sys.argv))
