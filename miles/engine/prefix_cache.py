"""Prefix cache: a radix tree over token ids whose nodes each hold the KV of one block of tokens.

A node's entry is a tuple of tensors, each (layers, heads, tokens, dim): keys and values (MLA: the
compressed latent and the rotary key), and for a DSA model its indexer keys (kv_cache.row_kv), all
cut, joined and evicted together.

A block's keys and values depend on every token before it (causal attention, absolute RoPE
positions), so a node is keyed by its own token ids under its parent: the path from the root
spells the exact prefix the KV was computed for. Prefixes are stored as chains of `block_size`
blocks ending, where their length is not a multiple of it, in one shorter tail block (always a
leaf). A request reuses the longest chain of blocks, tails included, that its prompt holds whole
within its limit (at least one prompt token is always computed). Tails matter for multi-turn
rollouts, where each turn's prompt is the last turn's prompt plus its output plus a short
observation: whole blocks alone would lose up to `block_size - 1` tokens of history per turn.
A block is used whole or not at all. Reusing the first k tokens of a block would let the copies of
one prompt, or prompts that diverge inside a block, take different paths (cached prefix or a
full prefill) depending on which request came first, and their logprobs would then differ in the
last bits from run to run.

Entries are copied in and out (`insert` clones, `gather` concatenates), so nothing in the running
batch ever points into the tree and eviction needs no reference counts: least recently used leaves
go first once the cache holds more than `max_tokens`.
Non-goals: paged attention (the running batch keeps its own dense KV), sharing across processes.
"""

from __future__ import annotations

import itertools

import torch


class _Node:
    __slots__ = ("children", "entry", "parent", "edge", "last_used")

    def __init__(self, parent: "_Node | None", edge: tuple[int, ...], entry: tuple = ()):
        self.children: dict[tuple[int, ...], _Node] = {}  # by edge: block_size tokens, or fewer for a tail
        self.parent = parent
        self.edge = edge
        self.entry = entry  # each (layers, heads, len(edge), dim): keys, values[, indexer keys]
        self.last_used = 0


class Match:
    """Cached blocks a prompt starts with, root first, holding `tokens` tokens in all."""

    __slots__ = ("nodes", "tokens")

    def __init__(self, nodes: list[_Node], tokens: int):
        self.nodes, self.tokens = nodes, tokens


class PrefixCache:
    def __init__(self, block_size: int, max_tokens: int):
        if block_size < 1:
            raise ValueError("prefix cache block_size must be >= 1")
        self.block_size = block_size
        self.max_tokens = max_tokens
        self._root = _Node(None, ())
        self._clock = itertools.count(1)
        self.num_tokens = 0

    def match(self, ids, limit: int | None = None) -> Match:
        """The cached prefix `ids` starts with, at most `limit` tokens of it."""
        B = self.block_size
        n = len(ids) if limit is None else min(limit, len(ids))
        node, nodes, now, pos = self._root, [], next(self._clock), 0
        while pos + B <= n:
            child = node.children.get(tuple(ids[pos:pos + B]))
            if child is None:
                break
            child.last_used = now
            nodes.append(child)
            node, pos = child, pos + B
        # Then a tail block, if the prompt holds one whole within the limit.
        for e in range(min(B - 1, n - pos), 0, -1):
            child = node.children.get(tuple(ids[pos:pos + e]))
            if child is not None:
                child.last_used = now
                nodes.append(child)
                pos += e
                break
        return Match(nodes, pos)

    @staticmethod
    def gather(match: Match) -> tuple[torch.Tensor, ...]:
        """Concatenated entries of a match: keys, values[, indexer keys], each (layers, heads, match.tokens, dim)."""
        return tuple(torch.cat(parts, dim=2) for parts in zip(*(n.entry for n in match.nodes)))

    def insert(self, ids, kv_fn, whole_blocks: bool = False) -> int:
        """Add what the cache lacks of `ids` (whole blocks, then the tail unless `whole_blocks`); returns
        tokens added.

        kv_fn(a, b) returns the entry for token positions [a, b): keys, values[, indexer keys], each
        (layers, heads, b - a, dim); it is called once, for the span that is not cached yet, so a
        caller holding a big batch tensor only copies what is new.
        """
        if self.max_tokens < self.block_size:
            return 0
        B = self.block_size
        nfull = len(ids) // B
        if whole_blocks:
            ids = ids[:nfull * B]
        node, now, i = self._root, next(self._clock), 0
        while i < nfull:
            child = node.children.get(tuple(ids[i * B:(i + 1) * B]))
            if child is None:
                break
            child.last_used = now
            node, i = child, i + 1
        tail = tuple(ids[nfull * B:])
        if i == nfull and (not tail or tail in node.children):
            return 0
        entry = kv_fn(i * B, len(ids))
        for j in range(i, nfull + (1 if tail else 0)):
            a, b = (j - i) * B, min((j - i + 1) * B, len(ids) - i * B)
            node = self._add(node, tuple(ids[j * B:j * B + b - a]), tuple(t[:, :, a:b].clone() for t in entry), now)
        added = len(ids) - i * B
        self.num_tokens += added
        self._evict()
        return added

    def _add(self, parent: _Node, edge: tuple[int, ...], entry: tuple, now: int) -> _Node:
        for k in range(1, len(edge)):
            old = parent.children.get(edge[:k])
            if old is not None:
                self._remove(old)  # a shorter tail of the same tokens: the new block holds its KV too
        child = _Node(parent, edge, entry)
        child.last_used = now
        parent.children[edge] = child
        return child

    def _remove(self, leaf: _Node) -> None:
        del leaf.parent.children[leaf.edge]
        self.num_tokens -= len(leaf.edge)

    def clear(self) -> None:
        self._root = _Node(None, ())
        self.num_tokens = 0

    def _evict(self) -> None:
        if self.num_tokens <= self.max_tokens:
            return
        # Evict down to 90% so a full cache does not pay a tree walk on every insert.
        target = int(self.max_tokens * 0.9)
        leaves = [n for n in self._walk() if not n.children]
        leaves.sort(key=lambda n: n.last_used)
        while self.num_tokens > target and leaves:
            leaf = leaves.pop(0)
            parent = leaf.parent
            self._remove(leaf)
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
