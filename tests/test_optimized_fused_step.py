"""A decode step's common crossing call takes the fused step and leaves what ``step`` leaves.

``FusedStep`` (``hybridkv.optimized.fused_step``) makes a running request's crossing call in
one function when each part it makes (a window's release, a new block, a newly full block) is
one block per group, and declines (changing nothing) otherwise. Each test drives the reference,
the optimized backend and the optimized backend with the fused step switched off
(``Tuning(fused_step=False)``) with the same calls, and compares every result and, after each
call, the pool's snapshot, every request's block ids and the invariants.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.optimized import TorchKVCacheManager, path_counts
from hybridkv.optimized.state import Tuning
from hybridkv.policies.lru import LRUPolicy
from hybridkv.reference import KVCacheManager, Request
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec

SIZES = {"num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}
FUSED = path_counts.FUSED_STEP
GENERAL = path_counts.RUNNING_STEP


def config(
    num_blocks: int, block_size: int = 2, window: int = 4, windows: int = 2
) -> KVCacheConfig:
    """One full-attention group and ``windows`` sliding-window groups (the design document's
    Gemma-like hybrid), one block size."""
    full = FullAttentionSpec(block_size=block_size, **SIZES)
    sliding = SlidingWindowSpec(block_size=block_size, sliding_window=window, **SIZES)
    windowed = [KVCacheGroup((f"sw{i}",), sliding) for i in range(windows)]
    return KVCacheConfig(num_blocks, (KVCacheGroup(("full",), full), *windowed))


class Trio:
    """The reference, the optimized backend and the optimized backend without the fused step."""

    def __init__(self, kv_config: KVCacheConfig) -> None:
        self.ref = KVCacheManager(kv_config, 256)
        self.fused = TorchKVCacheManager(kv_config, 256, max_num_reqs=8)
        self.plain = TorchKVCacheManager(
            kv_config, 256, max_num_reqs=8, tuning=Tuning(fused_step=False)
        )
        self.requests: dict[str, tuple[Request, Request, Request]] = {}

    def admit(self, request_id: str, prompt: list[int]) -> KVCacheBlocks | None:
        size = self.ref.hash_block_size
        made = tuple(Request(request_id, list(prompt), hash_block_size=size) for _ in range(3))
        self.requests[request_id] = (made[0], made[1], made[2])
        found = self.ref.get_computed_blocks(made[0])
        assert self.fused.get_computed_blocks(made[1]) == found
        assert self.plain.get_computed_blocks(made[2]) == found
        blocks, hit, _ = found
        out = self.call(request_id, len(prompt) - hit, hit, blocks)
        if out is None:
            del self.requests[request_id]
        return out

    def call(
        self,
        request_id: str,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        *,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
        reserved_blocks: int = 0,
    ) -> KVCacheBlocks | None:
        """The same ``allocate_slots`` on all three (computed counts advanced on success)."""
        ref_request, fused_request, plain_request = self.requests[request_id]
        args = (num_new_tokens, num_new_computed_tokens, new_computed_blocks)
        keywords = {
            "num_lookahead_tokens": num_lookahead_tokens,
            "delay_cache_blocks": delay_cache_blocks,
            "reserved_blocks": reserved_blocks,
        }
        out = self.ref.allocate_slots(ref_request, *args, **keywords)  # type: ignore[arg-type]
        assert self.fused.allocate_slots(fused_request, *args, **keywords) == out  # type: ignore[arg-type]
        assert self.plain.allocate_slots(plain_request, *args, **keywords) == out  # type: ignore[arg-type]
        if out is not None:
            for request in self.requests[request_id]:
                request.num_computed_tokens += num_new_computed_tokens + num_new_tokens
        self.same_state()
        return out

    def decode(
        self,
        request_id: str,
        tokens: list[int],
        *,
        delay_cache_blocks: bool = False,
        num_lookahead_tokens: int = 0,
        reserved_blocks: int = 0,
    ) -> KVCacheBlocks | None:
        for request in self.requests[request_id]:
            request.append_output_token_ids(tokens)
        return self.call(
            request_id,
            len(tokens),
            delay_cache_blocks=delay_cache_blocks,
            num_lookahead_tokens=num_lookahead_tokens,
            reserved_blocks=reserved_blocks,
        )

    def step_starts(self) -> None:
        self.ref.new_step_starts()
        self.fused.new_step_starts()
        self.plain.new_step_starts()

    def free(self, request_id: str) -> None:
        ref_request, fused_request, plain_request = self.requests.pop(request_id)
        self.ref.free(ref_request)
        self.fused.free(fused_request)
        self.plain.free(plain_request)
        self.same_state()

    def same_state(self) -> None:
        snapshot = self.ref.snapshot()
        for manager in (self.fused, self.plain):
            assert manager.snapshot() == snapshot
            assert manager.num_free_blocks == self.ref.num_free_blocks
            for request_id in self.requests:
                assert manager.get_block_ids(request_id) == self.ref.get_block_ids(request_id)
            manager.check_invariants()

    def counts(self, path: str) -> tuple[int, int]:
        """How often ``path`` ran on the fused manager and on the plain one."""
        return self.fused.fast_paths[path], self.plain.fast_paths[path]


def test_every_crossing_of_a_decode_run_takes_the_fused_step() -> None:
    # Block size 2, window 4: a request's decode step enters a new block, lets a window block
    # go or fills a block on alternate tokens; three requests, a step at a time.
    trio = Trio(config(120))
    for i, length in enumerate((7, 8, 10)):
        assert trio.admit(f"r{i}", [100 * i + t for t in range(length)]) is not None
    for i in range(3):  # the first step lets go every block that left the window in the prompt
        trio.decode(f"r{i}", [999])
    before = trio.counts(FUSED), trio.counts(GENERAL)
    for token in range(20):
        trio.step_starts()
        for i in range(3):
            assert trio.decode(f"r{i}", [1000 + token]) is not None
    fused, plain = trio.counts(FUSED)
    assert plain == 0
    assert fused - before[0][0] == 60  # every call crosses a threshold with a window of 4
    assert trio.counts(GENERAL)[0] == before[1][0]  # the general step made none of them
    assert trio.counts(GENERAL)[1] - before[1][1] == 60


def test_the_fused_step_declines_what_is_not_one_block_per_group() -> None:
    trio = Trio(config(120))
    trio.admit("a", list(range(1, 8)))
    general = trio.counts(GENERAL)[0]
    trio.decode("a", [8, 9, 10, 11, 12])  # five tokens: several blocks enter and leave
    assert trio.counts(GENERAL)[0] == general + 1
    trio.decode("a", [13], num_lookahead_tokens=4)  # lookahead: two new blocks per group
    assert trio.counts(GENERAL)[0] == general + 2
    fused = trio.counts(FUSED)[0]
    trio.decode("a", [14], reserved_blocks=1)  # blocks kept free: the general step's check
    assert trio.counts(FUSED)[0] == fused


def test_a_window_block_never_cached_is_left_to_the_general_step() -> None:
    # Caching delayed, the blocks filled from token 8 on are not cached: released, they go to
    # the free queue's head at once, which the fused step (deferring to the tail) does not do.
    # Block size 2, window 4; tokens 8 … 15, one call each:
    #   8: the prompt's blocks 0 and 1 leave the window (two per group): general;
    #   10: block 2 leaves, cached by the admission: fused;
    #   12, 14: blocks 3 and 4 leave, never cached: general;
    #   9, 11, 13, 15: a new block in every group: fused.
    trio = Trio(config(120))
    trio.admit("a", list(range(1, 8)))
    general, fused = trio.counts(GENERAL)[0], trio.counts(FUSED)[0]
    for token in range(8, 16):
        trio.decode("a", [token], delay_cache_blocks=True)
    assert trio.counts(GENERAL)[0] - general == 3
    assert trio.counts(FUSED)[0] - fused == 5


def test_a_step_the_pool_cannot_serve_returns_none_on_every_path() -> None:
    # 12 usable blocks: a's 6 tokens hold 3 blocks per group, b's 2 tokens one per group, so
    # none is free. a's next token enters a fourth block in every group (3 blocks) while one
    # block per window leaves (2 blocks, cached): the step does not fit.
    trio = Trio(config(13))
    trio.admit("a", list(range(1, 7)))
    trio.admit("b", [50, 51])
    assert trio.ref.num_free_blocks == 0
    trio.step_starts()
    general = trio.counts(GENERAL)[0]
    assert trio.decode("a", [7]) is None
    assert trio.counts(GENERAL)[0] == general + 1
    assert trio.ref.num_free_blocks == 2  # the window's blocks stay released


def test_a_policy_manager_has_no_fused_step() -> None:
    manager = TorchKVCacheManager(config(40), 64, eviction_policy=LRUPolicy())
    request = Request("a", list(range(1, 8)), hash_block_size=2)
    manager.allocate_slots(request, 7)
    request.num_computed_tokens = 7
    for token in range(8, 14):
        request.append_output_token_ids(token)
        manager.allocate_slots(request, 1)
        request.num_computed_tokens += 1
    assert manager.fast_paths[FUSED] == 0
    assert manager.fast_paths[GENERAL] > 0


@settings(max_examples=40, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    window=st.sampled_from([1, 3, 4, 8]),
    windows=st.integers(0, 3),
    num_blocks=st.integers(12, 80),
    plan=st.lists(
        st.tuples(
            st.sampled_from(["admit", "decode", "decode", "decode", "step", "free"]),
            st.integers(0, 3),
            st.integers(1, 3),
            st.booleans(),
        ),
        max_size=40,
    ),
)
def test_any_run_leaves_the_same_state_with_and_without_the_fused_step(
    block_size: int,
    window: int,
    windows: int,
    num_blocks: int,
    plan: list[tuple[str, int, int, bool]],
) -> None:
    """Admissions sharing prefixes, decode steps of one to three tokens (some delaying their
    caching), steps starting and frees, in any order."""
    trio = Trio(config(num_blocks, block_size, window, windows))
    for n, (action, who, count, delay) in enumerate(plan):
        request_id = f"r{who}"
        if action == "admit" and request_id not in trio.requests:
            trio.admit(request_id, [1 + (t % 5) for t in range(3 * who + 4)])
        elif action == "decode" and request_id in trio.requests:
            tokens = [7 + n + k for k in range(count)]
            trio.decode(request_id, tokens, delay_cache_blocks=delay and count > 1)
        elif action == "step":
            trio.step_starts()
        elif action == "free" and request_id in trio.requests:
            trio.free(request_id)


@pytest.mark.parametrize("windows", [0, 1, 3])
def test_a_long_decode_run_crosses_only_on_the_fused_step(windows: int) -> None:
    trio = Trio(config(300, block_size=4, window=8, windows=windows))
    trio.admit("a", list(range(1, 31)))
    trio.admit("b", list(range(1, 23)))  # a's first five blocks: a hit
    trio.decode("a", [499])  # the first steps let go every block that left the window
    trio.decode("b", [899])
    general = trio.counts(GENERAL)[0]
    for token in range(40):
        trio.step_starts()
        trio.decode("a", [500 + token])
        trio.decode("b", [900 + token])
    assert trio.counts(GENERAL)[0] == general
    assert trio.counts(FUSED)[0] > 0
