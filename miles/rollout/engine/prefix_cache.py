"""Prefix cache: a radix tree over token ids whose nodes each hold the KV of one block of tokens.

A block's keys and values depend on every token before it (causal attention, absolute RoPE
positions), so a node is keyed by its own `block_size` token ids under its parent: the path from the
root spells the exact prefix the KV was computed for. Only full blocks are cached; a request reuses
the longest chain of cached blocks that its prompt starts with and computes the rest.

Entries are copied in and out (`insert` clones, `gather` concatenates), so nothing in the running
batch ever points into the tree and eviction needs no reference counts: least recently used leaves
go first once the cache holds more than `max_tokens`.
Non-goals: paged attention (the running batch keeps its own dense KV), sharing across processes.
"""

from __future__ import annotations

import itertools

import torch


class _Node:
    __slots__ = ("children", "keys", "values", "parent", "edge", "last_used")

    def __init__(self, parent: "_Node | None", edge: tuple[int, ...], keys=None, values=None):
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent = parent
        self.edge = edge
        self.keys = keys  # (layers, kv_heads, block, head_dim)
        self.values = values
        self.last_used = 0


class PrefixCache:
    def __init__(self, block_size: int, max_tokens: int):
        if block_size < 1:
            raise ValueError("prefix cache block_size must be >= 1")
        self.block_size = block_size
        self.max_tokens = max_tokens
        self._root = _Node(None, ())
        self._clock = itertools.count(1)
        self.num_blocks = 0

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def match(self, ids, limit: int | None = None) -> list[_Node]:
        """The cached blocks `ids` starts with, at most `limit` tokens' worth, root first."""
        B = self.block_size
        n = len(ids) if limit is None else min(limit, len(ids))
        node, out, now = self._root, [], next(self._clock)
        for start in range(0, n - n % B, B):
            node = node.children.get(tuple(ids[start:start + B]))
            if node is None:
                break
            node.last_used = now
            out.append(node)
        return out

    @staticmethod
    def gather(nodes: list[_Node]) -> tuple[torch.Tensor, torch.Tensor]:
        """Concatenated KV of a chain of blocks: keys, values each (layers, kv_heads, tokens, head_dim)."""
        return torch.cat([n.keys for n in nodes], dim=2), torch.cat([n.values for n in nodes], dim=2)

    def insert(self, ids, kv_fn, start_blocks: int = 0) -> int:
        """Add the full blocks of `ids` that are missing; returns how many blocks were added.

        kv_fn(a, b) returns (keys, values) for token positions [a, b), each (layers, kv_heads, b - a,
        head_dim); it is called once, for the span that is not cached yet, so a caller holding a big
        batch tensor only copies what is new.
        """
        if self.max_tokens < self.block_size:
            return 0
        B = self.block_size
        nfull = len(ids) // B
        node, now, i = self._root, next(self._clock), 0
        while i < nfull:
            child = node.children.get(tuple(ids[i * B:(i + 1) * B]))
            if child is None:
                break
            child.last_used = now
            node, i = child, i + 1
        if i == nfull:
            return 0
        keys, values = kv_fn(i * B, nfull * B)
        for j in range(i, nfull):
            a = (j - i) * B
            edge = tuple(ids[j * B:(j + 1) * B])
            child = _Node(node, edge, keys[:, :, a:a + B].clone(), values[:, :, a:a + B].clone())
            child.last_used = now
            node.children[edge] = child
            node = child
        self.num_blocks += nfull - i
        self._evict()
        return nfull - i

    def clear(self) -> None:
        self._root = _Node(None, ())
        self.num_blocks = 0

    def _evict(self) -> None:
        if self.num_tokens <= self.max_tokens:
            return
        # Evict down to 90% so a full cache does not pay a tree walk on every insert.
        target = int(self.max_tokens * 0.9) // self.block_size
        leaves = [n for n in self._walk() if not n.children]
        leaves.sort(key=lambda n: n.last_used)
        while self.num_blocks > target and leaves:
            leaf = leaves.pop(0)
            parent = leaf.parent
            del parent.children[leaf.edge]
            self.num_blocks -= 1
            if parent is not self._root and not parent.children:
                # The parent became a leaf: keep the list ordered by recency.
                k = next((i for i, n in enumerate(leaves) if n.last_used > parent.last_used), len(leaves))
                leaves.insert(k, parent)

    def _walk(self):
        stack = list(self._root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())
