"""Floors of the scheduler API's per-call work in CPython, measured (README, "What bounds them").

``python scripts/bench_bounds.py`` prints three figures, each the least work an implementation
of the API does in pure Python on this interpreter:

1. a decode ``allocate_slots`` call that validates its arguments, reads the request's counters
   and its row's thresholds, and finds that nothing is to be done;
2. the SHA-256 chain of 8,192 block hashes (the hash function is fixed: vLLM's);
3. the block ids of a fully cached 131,072-token prompt as Python ints (7 groups × 8,192).
"""

from __future__ import annotations

import hashlib
import random
import statistics
import time
from array import array
from collections.abc import Callable

import torch  # noqa: TID251 (the optimized backend's int32 buffers, as it holds them)

from hybridkv.reference import Request


def median_seconds(job: Callable[[], object], repeat: int = 7) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        job()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class FloorManager:
    """Only what a decode call must do when no group crosses a block boundary."""

    def __init__(self, requests: list[Request]) -> None:
        self.rows = {r.request_id: i for i, r in enumerate(requests)}
        never = array("q", [10**9] * len(requests))
        self.capacity, self.release_at, self.cache_at = (memoryview(never) for _ in range(3))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool | None:
        if type(num_new_tokens) is not int or num_new_tokens <= 0:
            raise ValueError(num_new_tokens)
        if len(request.block_hashes) > request.num_tokens // 16:
            raise ValueError(request.request_id)
        row = self.rows[request.request_id]
        computed = request.num_computed_tokens
        processed = computed - getattr(request, "num_in_flight_tokens", 0)
        if (
            processed >= self.release_at[row]
            or computed + num_new_tokens > self.capacity[row]
            or min(computed + num_new_tokens, request.num_tokens) >= self.cache_at[row]
        ):
            return None
        return True


def main() -> None:
    torch.set_num_threads(1)
    requests = [Request(f"r{i}", list(range(100)), hash_block_size=16) for i in range(1024)]
    manager = FloorManager(requests)
    seconds = median_seconds(lambda: [manager.allocate_slots(r, 1) for r in requests])
    print(f"decode call floor (validation + row thresholds): {seconds / 1024 * 1e6:.2f} µs")

    rng = random.Random(0)
    messages = [rng.randbytes(80) for _ in range(8192)]

    def chain() -> None:
        parent = b"\0" * 32
        for message in messages:
            digest = hashlib.sha256(parent)
            digest.update(message)
            parent = digest.digest()

    seconds = median_seconds(chain)
    print(
        f"SHA-256 chain over 8,192 blocks of 80 bytes: {seconds * 1e3:.2f} ms "
        f"({seconds / 8192 * 1e6:.2f} µs per block)"
    )

    ids = torch.arange(8192 * 7, dtype=torch.int32).view(7, 8192)
    seconds = median_seconds(lambda: tuple(tuple(row) for row in ids.tolist()))
    print(f"a 131,072-token hit's block ids as Python ints (7 × 8,192): {seconds * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
