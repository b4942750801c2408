"""The longest-hit oracle on an implementation under test: a cache state built inside it through
its adapter's own scheduler calls (so it needs no access to the implementation's pool), the
content of every block read back from its block tables (``_KeyTracker``), and a few probes'
hits compared with brute force (``oracle_longest_hit``) on the cached flags its snapshot shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybridkv.conformance.oracle_longest_hit import (
    GroupCacheState,
    Kind,
    brute_force_hit_blocks,
    first_needed_block,
)
from hybridkv.conformance.oracle_reference_hit import spec_of
from hybridkv.spec import KVCacheConfig, KVCacheGroup

if TYPE_CHECKING:
    from hybridkv.conformance.adapters import AdapterFactory, Lookup, ManagerAdapter


@dataclass
class AdapterOracleStats:
    """What the longest-hit oracle checked on one implementation through its adapter."""

    name: str
    states: int = 0
    probes: int = 0
    hits: int = 0
    three_types: int = 0
    refused: int = 0
    not_shown: int = 0
    failures: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [
            f"  longest hit of {self.name} (states built through its adapter): "
            f"{self.probes - len(self.failures)} of {self.probes} lookups equal to brute force "
            f"over {self.states} cache states ({self.three_types} with ≥ 3 types, {self.hits} "
            f"lookups with a hit; {self.refused} layouts refused by name, {self.not_shown} states "
            "not checked: no snapshot)"
        ]


class _KeyTracker:
    """Which content each block of each group holds, read from the adapter's own block tables.

    After every successful allocation, a block at position ``j`` of group ``g`` whose tokens
    are all computed holds the request's first ``(j + 1)·B`` tokens (it was cached by that
    allocation); a block still partly empty holds nothing cacheable yet (a reused block lost its
    old content when it was evicted). ``cached`` then answers, with the adapter's snapshot of
    cached blocks, which of a probe's blocks each group has cached, and where.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.content: dict[tuple[int, int], tuple[int, ...]] = {}

    def record(self, tables: Sequence[Sequence[int]], tokens: Sequence[int], computed: int) -> None:
        size = self.block_size
        for gid, table in enumerate(tables):
            for position, block_id in enumerate(table):
                if block_id == 0:
                    continue
                if (position + 1) * size <= computed:
                    self.content[(gid, block_id)] = tuple(tokens[: (position + 1) * size])
                else:
                    self.content.pop((gid, block_id), None)

    def cached(
        self, cached_block_ids: Sequence[Sequence[int]], prompt: Sequence[int]
    ) -> list[list[set[int]]]:
        """Per group, per full block of ``prompt``: the cached blocks that hold it."""
        size = self.block_size
        where: list[list[set[int]]] = []
        for gid, ids in enumerate(cached_block_ids):
            holders: dict[tuple[int, ...], set[int]] = {}
            for block_id in ids:
                content = self.content.get((gid, block_id))
                if content is not None:
                    holders.setdefault(content, set()).add(block_id)
            where.append(
                [
                    holders.get(tuple(prompt[: (i + 1) * size]), set())
                    for i in range(len(prompt) // size)
                ]
            )
        return where


def _random_adapter_layout(rng: Any) -> tuple[list[GroupCacheState], int]:
    """1–4 attention groups of one block size (chunks a multiple of it: there the coordinator
    returns the longest hit whatever the types), with empty cached flags."""
    block_size = rng.choice([1, 2, 3, 4])
    groups = []
    for _ in range(rng.choice([1, 2, 3, 3, 4])):
        kind: Kind = rng.choice(["full", "sliding_window", "chunked_local"])
        param = (
            block_size * rng.choice([1, 2, 3]) if kind == "chunked_local" else rng.randint(2, 12)
        )
        groups.append(GroupCacheState(kind, param, ()))
    return groups, block_size


def adapter_hit_state(
    factory: AdapterFactory, rng: Any, stats: AdapterOracleStats, probes_per_state: int = 3
) -> None:
    """Build one cache state inside an implementation through its adapter's scheduler calls
    (requests sharing prefixes admitted in chunks and freed in a small pool, so that sliding
    windows release blocks and evictions leave holes), then look up a few probes and compare
    each hit with brute force on the cached flags read from the adapter's own tables and
    snapshot. Failures are appended to ``stats.failures``."""
    from hybridkv.conformance.adapters import NOT_IMPLEMENTED, EngineOptions

    layout, size = _random_adapter_layout(rng)
    max_len = size * rng.randint(3, 10)
    per_request = -(-max_len // size) * len(layout)
    config = KVCacheConfig(
        num_blocks=1 + per_request + rng.randint(0, per_request),
        groups=tuple(
            KVCacheGroup((f"layer{gid}",), spec_of(g, size)) for gid, g in enumerate(layout)
        ),
    )
    try:
        adapter = factory(config, max_len + 1, True, False, EngineOptions())
    except ValueError as error:
        if NOT_IMPLEMENTED not in str(error):
            raise
        stats.refused += 1
        return
    stats.states += 1
    stats.three_types += len({g.type_key for g in layout}) >= 3
    tracker = _KeyTracker(size)
    bases = [[rng.randint(0, 40) for _ in range(max_len)] for _ in range(2)]
    prompts: list[list[int]] = []
    for turn in range(rng.randint(2, 6)):
        cut = rng.randint(0, max_len)
        prompt = rng.choice(bases)[:cut]
        prompt += [rng.randint(0, 40) for _ in range(rng.randint(1, max_len - cut + 1))]
        prompt = prompt[:max_len]
        prompts.append(prompt)
        handle = _admit_in_chunks(adapter, tracker, f"state{turn}", prompt, size, rng)
        if turn == 0 or rng.random() < 0.8:
            adapter.free(handle)
            adapter.check_invariants()
    for index in range(probes_per_state):
        source = rng.choice(prompts)
        probe = source[: rng.randint(1, len(source))] + [
            rng.randint(0, 40) for _ in range(rng.randint(0, 3))
        ]
        _check_probe(adapter, tracker, layout, size, probe, f"probe{index}", stats)


def _admit_in_chunks(
    adapter: ManagerAdapter, tracker: _KeyTracker, rid: str, prompt: list[int], size: int, rng: Any
) -> Any:
    """Admit ``prompt`` as request ``rid`` with its cache hit, then prefill it in chunks of one
    to four blocks until it is computed or an allocation fails, recording each step's cached
    keys and checking the invariants; the request's handle."""
    handle = adapter.new_request(rid, prompt, None)
    adapter.new_step()
    computed = 0
    use: Lookup | None = adapter.lookup(handle)
    while computed < len(prompt):
        n = len(prompt) - computed - (use.num_hit_tokens if use is not None else 0)
        n = min(n, size * rng.randint(1, 4))
        if n <= 0:
            break
        if adapter.allocate(handle, n, use, 0, False) is None:
            break
        computed += n + (use.num_hit_tokens if use is not None else 0)
        use = None
        adapter.set_num_computed_tokens(handle, computed)
        tracker.record(adapter.block_table(rid), prompt, computed)
        adapter.check_invariants()
    return handle


def _check_probe(
    adapter: ManagerAdapter,
    tracker: _KeyTracker,
    layout: Sequence[GroupCacheState],
    size: int,
    probe: Sequence[int],
    rid: str,
    stats: AdapterOracleStats,
) -> None:
    snapshot = adapter.snapshot()
    if snapshot is None:
        stats.not_shown += 1
        return
    holders = tracker.cached(snapshot.cached_block_ids, probe)
    groups = [
        GroupCacheState(g.kind, g.param, tuple(bool(h) for h in holders[gid]))
        for gid, g in enumerate(layout)
    ]
    handle = adapter.new_request(rid, probe, None)
    found = adapter.lookup(handle)
    adapter.free(handle)
    best = brute_force_hit_blocks(groups, len(probe), size)
    stats.probes += 1
    stats.hits += best > 0
    problems = []
    if found.num_hit_tokens != best * size:
        problems.append(f"hit {found.num_hit_tokens} tokens, brute force {best * size}")
    for gid, (group, ids) in enumerate(zip(groups, found.block_ids, strict=True)):
        first = first_needed_block(group, best, size)
        if found.num_hit_tokens == best * size and len(ids) != best:
            problems.append(f"group {gid}: {len(ids)} blocks for a {best}-block hit")
            continue
        for position, block_id in enumerate(ids[:best]):
            if position < first and block_id != 0:
                problems.append(f"group {gid}: block {block_id} at {position}, expected null")
            elif position >= first and block_id not in holders[gid][position]:
                cached = sorted(holders[gid][position])
                problems.append(
                    f"group {gid}: block {block_id} at {position} does not hold the probe's "
                    f"tokens there (cached holders: {cached})"
                )
    if problems:
        stats.failures.append(
            f"{stats.name}: longest hit of a {len(probe)}-token probe, block size {size}, "
            f"groups {[(g.kind, g.param, g.cached) for g in groups]}: {'; '.join(problems)}"
        )


def run_adapter_hit_oracle(
    name: str, factory: AdapterFactory, num_states: int, seed: int = 0
) -> AdapterOracleStats:
    """The longest hit an implementation returns, through its adapter (``factory`` an
    ``AdapterFactory``), against brute force on ``num_states`` random states built through the
    same adapter. An exception is reported as a failure naming the state, not raised."""
    import random

    rng = random.Random(seed)
    stats = AdapterOracleStats(name)
    for index in range(num_states):
        try:
            adapter_hit_state(factory, rng, stats)
        except Exception as error:
            stats.failures.append(
                f"{name}: state {index} (seed {seed}) raised {type(error).__name__}: {error}"
            )
    return stats
