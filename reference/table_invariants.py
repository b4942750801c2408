"""The block tables against the block pool: the part of ``KVCacheManager.check_invariants``
that reads every request's table.

Tests call the checker after every step of the golden replays and the state machines, so each
check gathers its offenders with a comprehension, a count or a set or dict comparison, and
formats its message (naming the first offender) only when it fails.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from itertools import chain

from hybridkv.reference.kv_cache_block import KVCacheBlock
from hybridkv.reference.single_type_base import SingleTypeKVCacheManager
from hybridkv.spec import KVCacheSpec, rules
from hybridkv.spec.errors import InvariantError


def cached_tokens_by_scan(tables: Sequence[Sequence[KVCacheBlock]]) -> int:
    """``estimate_cached_tokens`` as vLLM 0.33 computes it, over every block of every table of
    one request (``KVCacheManager.check_invariants`` compares the two)."""
    cached: int | None = None
    for table in tables:
        longest = max([block.block_hash_num_tokens or 0 for block in table], default=0)
        cached = longest if cached is None else min(cached, longest)
    return cached or 0


def check_tables(
    managers: Sequence[SingleTypeKVCacheManager], in_flight: Mapping[str, int]
) -> Counter[int]:
    """Nulls only where each group's type puts them and no block in two groups; return the
    holders of every real block (one per table position holding it).

    ``in_flight``: the tokens each request has in flight, whose blocks an ``"align"`` Mamba
    table may still hold.
    """
    holders: Counter[int] = Counter()
    owner: dict[int, int] = {}
    for manager in managers:
        tables = {
            request_id: [block.block_id for block in table]
            for request_id, table in manager.req_to_blocks.items()
        }
        check_null_positions(manager.spec, manager.block_size, tables, in_flight)
        ids = list(chain.from_iterable(tables.values()))
        holders.update(ids)
        held = set(ids)
        held.discard(0)
        _check_one_group(owner, held, manager.group_id)
    del holders[0]
    return holders


def _check_one_group(owner: dict[int, int], held: set[int], group_id: int) -> None:
    """No block of group ``group_id`` (``held``) belongs to an earlier group (``owner``: block
    → its group); then record them as this group's."""
    shared = held.intersection(owner)
    if shared:
        block_id = min(shared)
        raise InvariantError(f"block {block_id} is in groups {owner[block_id]} and {group_id}")
    owner.update(dict.fromkeys(held, group_id))


def check_ref_counts(blocks: Sequence[KVCacheBlock], holders: Counter[int]) -> None:
    """Every block's reference count (but the null block's) equals its holders.

    The nonzero counts are compared with the holders as one mapping; the blocks are walked
    one by one only when the two differ, to name the first block whose count is wrong.
    """
    counts = {block.block_id: block.ref_cnt for block in blocks[1:] if block.ref_cnt}
    if counts == dict(holders):
        return
    wrong = [block for block in blocks[1:] if block.ref_cnt != holders[block.block_id]]
    if wrong:
        block = wrong[0]
        raise InvariantError(
            f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
            f"{holders[block.block_id]} holders"
        )


def check_null_positions(
    spec: KVCacheSpec,
    block_size: int,
    tables: Mapping[str, list[int]],
    in_flight: Mapping[str, int],
) -> None:
    """Nulls only where the type puts them: a window or chunk (or a Mamba state in ``"none"``
    mode) releases from the front only; full attention keeps every position; an ``"align"``
    Mamba table holds nulls anywhere but at most a few real blocks.

    ``tables``: each request's block ids in one group (0: the null block) of ``spec`` and
    ``block_size``. The nulls are counted, and listed only for the message of a failed check.
    """
    limit = spec.max_live_blocks
    if limit is not None:
        _check_live_blocks(spec, limit, block_size, tables, in_flight)
    where = spec.null_positions
    if where == "leading":
        # Past the leading nulls, no null.
        wrong = [request_id for request_id, ids in tables.items() if 0 in ids[ids.count(0) :]]
        if wrong:
            nulls = [i for i, block_id in enumerate(tables[wrong[0]]) if block_id == 0]
            raise InvariantError(
                f"request {wrong[0]!r} has null positions {nulls} after a real block"
            )
    elif where == "none":
        wrong = [request_id for request_id, ids in tables.items() if 0 in ids]
        if wrong:
            raise InvariantError(f"request {wrong[0]!r} of a {spec.title} group holds null blocks")


def _check_live_blocks(
    spec: KVCacheSpec,
    limit: int,
    block_size: int,
    tables: Mapping[str, list[int]],
    in_flight: Mapping[str, int],
) -> None:
    """At most ``limit`` real blocks per table (the state, the previous one, a prefill
    checkpoint and the speculative blocks), plus the blocks of the request's tokens still in
    flight: states released only once their step is processed."""
    for request_id, ids in tables.items():
        allowed = limit + rules.cdiv(in_flight.get(request_id, 0), block_size)
        real = len(ids) - ids.count(0)
        if real > allowed:
            raise InvariantError(
                f"request {request_id!r} holds {real} {spec.title} blocks (> {allowed})"
            )
