"""The cached keys of every KV cache group as trees, with the counts ``hybrid`` evicts by.

A key is ``(block hash, group id)``; its parent is the key one block shorter in the same group
(``CachedBlock.parent_hash``), so each group's cached keys form a tree rooted at the prompt
start. A node is *cached* while some block holds its key; a node whose key is gone stays as a
placeholder while a cached descendant hangs below it.

Per node the tree keeps, incrementally:

* ``cached_children``: children whose key is held; a node with none is a branch end, one with
  several a branch point (where requests diverge, the prefix they share ends);
* for sliding-window and chunked-local groups, ``end``: a hit may end here (the node is cached
  and every block the hit reads, ``rules.hit_block_span``, is cached along its path), ``tail``:
  an end at a branch end or branch point (a radix tree's node end), and ``serves`` /
  ``tails``: how many ends (tail ends) read this node. A node no end reads can serve no hit.

A change at a node can move ``end`` only for the nodes whose span reaches back over it: its
descendants within one span (the span's start never falls along a path), its parent (a branch
end no more, or again) and itself. Each of those re-walks its own span and moves the counts on
its span, so one change costs O(span² × branches within a span): bounded by the window or
chunk, never by the pool or the tree. The common change, a block cached below an end,
takes its parent's counted path as a slice instead of re-walking it, and only nodes whose
``serves`` or ``tails`` crosses zero are handed back (only those can change tier): the counting
pass along the new end's path is what remains per block.

Full-attention chains are checked one link at a time: a full-attention node whose parent key
is gone is an orphan (its chain is broken); reusing it makes its children orphans in turn, so
a broken chain is found without walking the subtree.
"""

from __future__ import annotations

from hybridkv.policies.protocol import CachedBlock
from hybridkv.spec import rules

Key = tuple[bytes, int]
WINDOW_KINDS = ("sliding_window", "chunked_local")


def window_of(block: CachedBlock) -> int:
    """The window or chunk size of the block's spec in tokens (1 where the kind has none)."""
    spec = block.spec
    return int(getattr(spec, "sliding_window", getattr(spec, "attention_chunk_size", 1)))


class Node:
    """One key of one group's tree."""

    __slots__ = (
        "blocks",
        "cached_children",
        "children",
        "contrib",
        "end",
        "index",
        "kind",
        "known",
        "parent",
        "serves",
        "span",
        "tail",
        "tails",
    )

    def __init__(self) -> None:
        self.known = False  # a placeholder until a block holds the key
        self.parent: Key | None = None
        self.kind = ""
        self.index = 0  # the block position of the key's last token
        self.span = (0, 0)  # the blocks a hit ending here reads (window kinds)
        self.blocks: dict[int, None] = {}  # holders, first cached first
        self.children: dict[Key, None] = {}
        self.cached_children = 0
        self.end = False
        self.tail = False
        self.serves = 0
        self.tails = 0
        self.contrib: tuple[Key, ...] = ()  # the nodes this end counts in


class KeyTree:
    """Every group's cached keys; ``add`` and ``remove`` return the nodes whose class moved."""

    def __init__(self) -> None:
        self.nodes: dict[Key, Node] = {}
        self.full_groups: dict[int, None] = {}
        self.mamba_groups: dict[int, None] = {}
        self.full_holders: dict[bytes, int] = {}  # full-attention groups caching a hash

    def add(self, block: CachedBlock) -> set[Key]:
        key = (block.block_hash, block.group_id)
        node = self.nodes.get(key)
        if node is None:
            node = self.nodes[key] = Node()
        dirty = {key}
        if not node.known:
            self._learn(node, key, block, dirty)
        was_cached = bool(node.blocks)
        node.blocks[block.block_id] = None
        if not was_cached:
            self._flip(key, node, +1, dirty)
        return dirty

    def remove(self, block_id: int, key: Key) -> set[Key]:
        node = self.nodes.get(key)
        dirty = {key}
        if node is None or block_id not in node.blocks:
            return dirty
        del node.blocks[block_id]
        if not node.blocks:
            self._flip(key, node, -1, dirty)
            self._prune(key)
        return dirty

    def _learn(self, node: Node, key: Key, block: CachedBlock, dirty: set[Key]) -> None:
        node.known = True
        node.kind = block.spec.kind
        size = block.spec.block_size
        node.index = max(block.prefix_tokens - 1, 0) // size
        node.span = rules.hit_block_span(node.kind, window_of(block), size, block.prefix_tokens)
        if block.parent_hash is not None:
            node.parent = (block.parent_hash, key[1])
            parent = self.nodes.get(node.parent)
            if parent is None:
                parent = self.nodes[node.parent] = Node()
            parent.children[key] = None
        group = key[1]
        if node.kind == "full" and group not in self.full_groups:
            self.full_groups[group] = None
            dirty.update(k for k, n in self.nodes.items() if n.kind == "mamba")  # once
        if node.kind == "mamba":
            self.mamba_groups[group] = None

    def _flip(self, key: Key, node: Node, delta: int, dirty: set[Key]) -> None:
        """``node`` became cached (+1) or lost its last holder (−1)."""
        parent = self.nodes.get(node.parent) if node.parent is not None else None
        if parent is not None and node.parent is not None:
            parent.cached_children += delta
            dirty.add(node.parent)
        if node.kind == "full":
            dirty.update(node.children)
            held = self.full_holders.get(key[0], 0) + delta
            if held:
                self.full_holders[key[0]] = held
            else:
                self.full_holders.pop(key[0], None)
            if held in (0, 1):
                dirty.update((key[0], g) for g in self.mamba_groups)
        elif node.kind in WINDOW_KINDS:
            for reached in self._reaching(key, node):
                self._refresh(reached, dirty)
            if node.parent is not None and parent is not None:
                self._retail(parent, dirty)

    def _reaching(self, key: Key, node: Node) -> list[Key]:
        """``key`` and its descendants whose span may reach back over it."""
        found = [key]
        stack = [key]
        while stack:
            for child_key in self.nodes[stack.pop()].children:
                child = self.nodes[child_key]
                if child.blocks and child.span[0] <= node.index:
                    found.append(child_key)
                    stack.append(child_key)
        return found

    def _refresh(self, key: Key, dirty: set[Key]) -> None:
        node = self.nodes[key]
        path = self.end_path(key)
        end = path is not None
        if end == node.end:
            self._retail(node, dirty)  # the path is the one counted: only the tail moves
            return
        self._count(node, -1, dirty)
        node.end = end
        node.tail = end and node.cached_children != 1
        node.contrib = path or ()
        self._count(node, +1, dirty)

    def _retail(self, node: Node, dirty: set[Key]) -> None:
        """``node``'s end stands (a child changed, or a change above left it): it may become
        a tail end or stop being one. The path it counts in (``contrib``) stands with its end,
        so only ``tails`` moves, in one pass over that path.
        """
        tail = node.end and node.cached_children != 1
        if tail == node.tail:
            return
        node.tail = tail
        delta = 1 if tail else -1
        for k in node.contrib:
            counted = self.nodes[k]
            counted.tails += delta
            if counted.tails == (delta > 0):  # 0 -> 1 or 1 -> 0: the node's class may move
                dirty.add(k)

    def _count(self, node: Node, sign: int, dirty: set[Key]) -> None:
        """Add (+1) or take back (−1) ``node``'s end and tail on every node its path reads."""
        if not node.end:
            return
        tail = sign if node.tail else 0
        first = sign > 0  # a count that reaches 1 going up, or 0 going down, crossed zero
        for k in node.contrib:
            counted = self.nodes[k]
            counted.serves += sign
            counted.tails += tail
            if counted.serves == first or (tail and counted.tails == first):
                dirty.add(k)  # only a count crossing zero can move the node's class

    def end_path(self, key: Key) -> tuple[Key, ...] | None:
        """The nodes a hit ending at ``key`` reads, when all are cached (else ``None``)."""
        node = self.nodes[key]
        lo, hi = node.span
        if node.kind not in WINDOW_KINDS or lo >= hi:
            return None
        parent = self.nodes.get(node.parent) if node.parent is not None else None
        if node.blocks and parent is not None and parent.end and parent.span[0] <= lo < node.index:
            # The parent's counted path runs one block per step back to its own span start,
            # at or before ours: ours is that path cut at our start, with us in front.
            return (key, *parent.contrib[: parent.index - lo + 1])
        path: list[Key] = []
        current_key, current = key, node
        while True:
            if not current.blocks:
                return None
            path.append(current_key)
            if current.index <= lo or current.parent is None:
                return tuple(path)
            parent = self.nodes.get(current.parent)
            if parent is None:
                return None
            current_key, current = current.parent, parent

    def _prune(self, key: Key) -> None:
        """Drop placeholders that hold nothing and have nothing below them."""
        while True:
            node = self.nodes.get(key)
            if node is None or node.blocks or node.children or node.serves:
                return
            del self.nodes[key]
            if node.parent is None:
                return
            parent = self.nodes.get(node.parent)
            if parent is None:
                return
            parent.children.pop(key, None)
            key = node.parent

    def orphan(self, key: Key) -> bool:
        """A full-attention node whose parent key is held by no block: its chain is broken."""
        node = self.nodes[key]
        if node.parent is None:
            return False
        parent = self.nodes.get(node.parent)
        return parent is None or not parent.blocks
