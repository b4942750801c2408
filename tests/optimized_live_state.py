"""A small live optimized manager for the invariant-checker tests (``test_optimized_*invariants``).

Its state: requests "b" (row 1) and "c" (row 0) hold blocks, "c" shares a cached prefix with the
freed "a" and holds leading nulls in its sliding-window table. The tests corrupt one piece of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from hybridkv.optimized import TorchKVCacheManager
from hybridkv.optimized.block_pool import TorchBlockPool
from hybridkv.optimized.state import ManagerState
from hybridkv.reference import Request
from hybridkv.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    SlidingWindowSpec,
)
from hybridkv.spec.errors import InvariantError

KV = {"block_size": 4, "num_kv_heads": 1, "head_size": 8, "dtype_bytes": 2}
FULL, WINDOW = 0, 1


@dataclass
class Live:
    """A manager after a few requests: "b" (row 1) and "c" (row 0) hold blocks, "c" shares a
    cached prefix with the freed "a" and holds leading nulls in its sliding-window table."""

    manager: TorchKVCacheManager
    state: ManagerState
    pool: TorchBlockPool

    def row(self, request_id: str) -> int:
        row = self.state.rows.row_of(request_id)
        assert row is not None
        return row

    def at(self, request_id: str, group: int, pos: int) -> int:
        """The flat host-table index of a table position."""
        return self.state.tables.base(group, self.row(request_id)) + pos

    def counter(self, request_id: str, group: int) -> int:
        """The index of a (row, group) in the row counters."""
        return self.state.rows.index(self.row(request_id), group)

    def check(self, match: str) -> None:
        with pytest.raises(InvariantError, match=match):
            self.manager.check_invariants()


def run_request(manager: TorchKVCacheManager, request_id: str, tokens: list[int]) -> Request:
    request = Request(request_id, tokens, hash_block_size=4, block_hasher=manager.block_hasher)
    blocks, hit, _ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, len(tokens) - hit, hit, blocks) is not None
    request.num_computed_tokens = len(tokens)
    return request


@pytest.fixture(name="live")
def live_state() -> Live:
    """The fixture ``live`` (import ``live_state`` into a test module to use it)."""
    window = SlidingWindowSpec(**KV, sliding_window=8)
    config = KVCacheConfig(
        40,
        (KVCacheGroup(("full",), FullAttentionSpec(**KV)), KVCacheGroup(("sw",), window)),
    )
    manager = TorchKVCacheManager(config, max_model_len=128, max_num_reqs=8)
    first = run_request(manager, "a", list(range(24)))
    run_request(manager, "b", list(range(100, 120)))
    manager.free(first)
    run_request(manager, "c", list(range(16)) + [7] * 8)
    manager.check_invariants()
    state = manager.state
    assert state.table(WINDOW, state.rows.row_of("c") or 0)[:2] == [0, 0]
    return Live(manager, state, state.pool)
