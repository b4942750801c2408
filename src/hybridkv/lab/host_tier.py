"""A host (CPU memory) tier under the GPU pool: evicted cached blocks move there, LRU.

What moves: every cached key ``(block, KV cache group)`` the GPU pool evicts (its
``BlockRemoved`` events), never a block still cached on the GPU. A key is named by the trace
itself, not by the manager's hash: ``(last token id of the block, group)``. The replay's token
``hash_id × block_tokens + offset`` names the whole prefix up to and including that token (a
trace id names its whole prefix), so two blocks with the same last token and group hold the
same KV. ``BlockStored`` events carry each block's tokens; the tier keeps the hash → key map
of blocks cached on the GPU and forgets an entry when the block is evicted.

What a key costs, the two accountings of issue 24 item 7:

* ``vllm`` (vLLM 0.33's OffloadingConnector): each ``OffloadKey = hash‖group`` takes a chunk
  sized for *every* group's page, so a model of ``n`` groups fits ``n`` times fewer keys than
  its bytes suggest (``vllm/v1/kv_offload/cpu/spec.py``, vllm#56871);
* ``hybrid`` (hybrid-aware): each key takes its own group's pages only.

What the hybrid-aware tier also writes: a windowed or Mamba group's blocks the GPU pool never
caches. Under the engine's sparse retention (``prefix_cache_retention_interval=0``) the pool
caches a request's sliding-window blocks only at its end, so nothing it evicts holds the window
a mid-prompt hit needs. The hybrid-aware tier stores, as the step computes them, the last
window (a Mamba group: the state) at each boundary of the trace's own blocks, the only places a
hit on a block-hash trace can end (two prompts share whole trace blocks). vLLM's accounting
does not: its connector's store mask is the pool's own retention rule (``reachable_block_mask``,
``../shared/notes``), which is what the pool caches and later evicts.

A host hit continues a GPU hit. Ending at block ``k`` (``(k + 1) × block_size`` tokens) needs
on the host, for the blocks past the GPU hit: a full-attention group every block up to ``k``,
a windowed group (sliding window or attention chunk) the blocks of its last window, a Mamba
group the state of block ``k``. A block still cached on the GPU counts as held (a
full-attention chain the GPU keeps while its window went to the host): vLLM's connector stores
every block it computes, so its host holds those blocks too, here without their bytes.
Loading takes ``bytes / bandwidth``: the replay adds it to the step that computes those tokens
instead of prefilling them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hybridkv.block_trace import BlockTraceRequest
from hybridkv.reference.events import BlockRemoved, BlockStored

ACCOUNTINGS = ("vllm", "hybrid")

HostKey = tuple[int, int]
"""``(last token id of the block, KV cache group)``."""

FULL = -1
"""``GroupNeed.window_blocks`` of a full-attention group: every block of the prefix."""
STATE = -2
"""``GroupNeed.window_blocks`` of a Mamba group: the state at the hit's end only."""


@dataclass(frozen=True)
class GroupNeed:
    """What one group's hit needs, and the bytes of one of its blocks (all its layers)."""

    window_blocks: int
    """``FULL``, ``STATE``, or the most trailing blocks a windowed group reads: a sliding
    window's ``cdiv(window − 1, block_size)`` (the hit rule), a chunk's blocks."""
    block_bytes: int
    chunk_tokens: int = 0
    """A chunked local group's attention chunk: a hit ending at block ``k`` reads the blocks
    from its chunk's start to ``k`` (none when ``k`` ends a chunk)."""

    def first_block(self, k: int, block_size: int) -> int:
        """The first block a hit ending at block ``k`` reads (``k + 1``: none)."""
        if self.window_blocks == STATE:
            return k
        if self.chunk_tokens:
            return (k + 1) * block_size // self.chunk_tokens * self.chunk_tokens // block_size
        return k + 1 - self.window_blocks


def key_bytes(accounting: str, needs: Sequence[GroupNeed]) -> tuple[int, ...]:
    """Host bytes one key of each group takes under ``accounting``."""
    if accounting not in ACCOUNTINGS:
        raise ValueError(f"host accounting must be one of {ACCOUNTINGS}, got {accounting!r}")
    if accounting == "vllm":
        chunk = sum(need.block_bytes for need in needs)
        return tuple(chunk for _ in needs)
    return tuple(need.block_bytes for need in needs)


class HostTier:
    """The host tier's keys in LRU order, its byte count, and the GPU's hash → key map."""

    def __init__(
        self,
        capacity_bytes: int,
        needs: Sequence[GroupNeed],
        *,
        accounting: str = "hybrid",
        bandwidth_gbps: float = 25.0,
        block_size: int,
    ) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"host capacity must be an int >= 0, got {capacity_bytes!r}")
        if not bandwidth_gbps > 0:
            raise ValueError(f"host bandwidth must be > 0 GB/s, got {bandwidth_gbps!r}")
        self.capacity_bytes = capacity_bytes
        self.needs = tuple(needs)
        self.accounting = accounting
        self.key_bytes = key_bytes(accounting, self.needs)
        self.bandwidth_gbps = bandwidth_gbps
        self.block_size = block_size
        self.used_bytes = 0
        self.stores = 0
        self.keys: OrderedDict[HostKey, None] = OrderedDict()
        self.on_gpu: dict[tuple[object, int], int] = {}
        self.gpu_keys: set[HostKey] = set()
        """The keys of ``on_gpu``'s blocks: what the GPU pool holds cached now."""
        self.unnamed = 0
        """Stored blocks no position or ``locate`` named (never moved to the host)."""

    # --- What the GPU pool evicts ----------------------------------------------------------

    def observe(
        self, events: Sequence[object], locate: Callable[[], Mapping[object, int]] | None = None
    ) -> None:
        """Learn the keys of blocks the GPU caches; move the ones it evicts to the host.

        A run that stores every position names each block by its position; a sparse one (a
        windowed group under sparse retention stores some positions of its run) by
        ``locate()``: block hash → key token of the blocks the step's requests hold."""
        located: Mapping[object, int] | None = None
        for event in events:
            if isinstance(event, BlockStored):
                group = event.group_idx or 0
                size = event.block_size
                tokens = event.token_ids
                dense = len(event.block_hashes) * size == len(tokens)
                if not dense and located is None:
                    located = {} if locate is None else locate()
                for i, block_hash in enumerate(event.block_hashes):
                    if dense:
                        token = tokens[(i + 1) * size - 1]
                    elif located is not None and (named := located.get(block_hash)) is not None:
                        token = named
                    else:
                        self.unnamed += 1
                        continue
                    self.on_gpu[(block_hash, group)] = token
                    self.gpu_keys.add((token, group))
            elif isinstance(event, BlockRemoved):
                group = event.group_idx or 0
                for block_hash in event.block_hashes:
                    evicted = self.on_gpu.pop((block_hash, group), None)
                    if evicted is not None:
                        self.gpu_keys.discard((evicted, group))
                        self.store((evicted, group))

    def computed(self, trace: BlockTraceRequest, start: int, end: int) -> None:
        """A step computed prompt tokens ``[start, end)`` of ``trace``: the hybrid-aware tier
        stores each windowed group's last window, and each Mamba group's state, at every trace
        block boundary in ``(start, end]`` whose blocks the GPU pool does not hold cached."""
        if self.accounting != "hybrid":
            return
        end = min(end, trace.input_length)
        step = trace.block_tokens
        for boundary in range((start // step + 1) * step, end + 1, step):
            last = boundary // self.block_size - 1
            if last < 0:
                continue
            for g, need in enumerate(self.needs):
                if need.window_blocks == FULL:
                    continue  # cached on the GPU, evicted to the host
                for j in range(max(0, need.first_block(last, self.block_size)), last + 1):
                    if (key := (self.key_token(trace, j), g)) not in self.gpu_keys:
                        self.store(key)

    def store(self, key: HostKey) -> None:
        """Put ``key`` at the LRU tail, evicting the head until it fits."""
        if key in self.keys:
            self.keys.move_to_end(key)
            return
        cost = self.key_bytes[key[1]]
        if cost > self.capacity_bytes:
            return
        while self.used_bytes + cost > self.capacity_bytes:
            old, _ = self.keys.popitem(last=False)
            self.used_bytes -= self.key_bytes[old[1]]
        self.keys[key] = None
        self.used_bytes += cost
        self.stores += 1

    # --- Hits -------------------------------------------------------------------------------

    def hit_tokens(self, trace: BlockTraceRequest, num_gpu_hits: int) -> int:
        """Tokens past the GPU hit the host supplies (a multiple of the block size); the keys
        used move to the LRU tail."""
        size = self.block_size
        first = num_gpu_hits // size
        last = (trace.input_length - 1) // size  # the block of the last prompt token: computed
        best = first
        for k in range(first, last):
            if any(
                need.window_blocks == FULL and not self._held((self.key_token(trace, k), g))
                for g, need in enumerate(self.needs)
            ):
                break  # a full-attention chain ends here
            if all(self._ready(trace, k, first, g, need) for g, need in enumerate(self.needs)):
                best = k + 1
        for k in range(first, best):
            for g in range(len(self.needs)):
                if (key := (self.key_token(trace, k), g)) in self.keys:
                    self.keys.move_to_end(key)
        return (best - first) * size

    def _ready(self, trace: BlockTraceRequest, k: int, first: int, g: int, need: GroupNeed) -> bool:
        if need.window_blocks == FULL:
            return True  # checked block by block
        start = max(first, need.first_block(k, self.block_size))
        return all(self._held((self.key_token(trace, j), g)) for j in range(start, k + 1))

    def _held(self, key: HostKey) -> bool:
        return key in self.keys or key in self.gpu_keys

    def margin_blocks(self) -> int:
        """Blocks before a step's first computed block that a sparse run may store (the
        longest window's)."""
        return max((need.window_blocks for need in self.needs), default=0)

    def key_token(self, trace: BlockTraceRequest, k: int) -> int:
        """The token id at the end of block ``k`` of ``trace``'s prompt."""
        position = (k + 1) * self.block_size - 1
        return trace.hash_ids[position // trace.block_tokens] * trace.block_tokens + (
            position % trace.block_tokens
        )

    def load_ms(self, num_tokens: int) -> float:
        """Milliseconds to load ``num_tokens`` tokens' blocks of every group over the link."""
        per_block = sum(need.block_bytes for need in self.needs)
        return num_tokens / self.block_size * per_block / (self.bandwidth_gbps * 1e6)
