"""The static KV cache: the running batch's keys and values in buffers allocated once and written in place.

Layout. Each layer holds keys and values of shape (slots + 1, kv_heads, cap, head_dim), allocated
(zeroed) the first time rows arrive and kept until `free`. Row i of the running batch lives in slot i, its
token at position p in column p (left-aligned: a row's KV starts at column 0 whatever its length).
A decode step writes every row's new key and value into column `next_pos[i]` of its slot and reads
columns [0, Lb) of slots [0, Bk), where Lb and Bk are the length and batch buckets of the step
(graphs.py): the tensors a step touches have the same addresses from one step to the next, so the
step can be replayed as a CUDA graph. Columns a row has not written are zeros, never garbage, so a
masked column multiplies a finite value by a zero attention weight.
  * merging: freshly prefilled rows (an HF prefill's right-aligned cache, kv_cache.py) are copied
    into the next free slots, left-aligned, in one gather per layer;
  * compaction: `select` moves the kept rows down to slots [0, n), copying only the moved rows'
    columns, never the whole batch;
  * prefix cache: `row_kv` reads one row's columns out for an insert.
  * chunked prefill: one more slot, `staging`, past the ones batches use, holds a long prompt while it
    is prefilled a chunk per step; `adopt` then moves it into the next free slot.
The same interface as kv_cache.BatchKV (merge, select, reset, row_kv, next_pos, last_tokens), so
the model runner's prefill, retirement and prefix-cache code need not know which one it holds.

Capacity. Every slot holds `cap` columns: the engine's context length, or fewer when the KV budget
cannot give every one of max_batch_size rows the whole context; the runner then serves `cap` as its
context length (requests beyond it are refused by name at the edge, rows reaching it finish with
"length").
Host mirror. `lens` keeps each row's length on the host, so choosing a step's buckets never waits
for the device.

Non-goals: paged blocks (a slot is one dense stretch), sharing KV between rows (prefixes are copied
in from the prefix cache), sliding-window layers (kv_cache.check_layout refuses them).
"""

from __future__ import annotations

import torch


class StaticKV:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, slots: int, cap: int,
                 dtype: torch.dtype, device: torch.device):
        self.shape = (slots + 1, kv_heads, cap, head_dim)  # the last slot: staging (never in a batch bucket)
        self.num_layers, self.slots, self.cap = num_layers, slots, cap
        self.staging = slots
        self.dtype, self.device = dtype, device
        self.k: list[torch.Tensor] = []  # per layer (slots + 1, kv_heads, cap, head_dim); empty until allocated
        self.v: list[torch.Tensor] = []
        self._tokens: torch.Tensor | None = None  # (slots,) next input token of each slot
        self._pos: torch.Tensor | None = None  # (slots,) next position (= columns written) of each slot
        self.lens: list[int] = []  # host mirror of next_pos for the rows in use
        self.generation = 0  # bumped whenever the buffers are (re)allocated: captured graphs read them

    # ---- the BatchKV interface --------------------------------------------------------------

    @property
    def n(self) -> int:
        return len(self.lens)

    @property
    def next_pos(self) -> torch.Tensor | None:
        return None if not self.lens else self._pos[:self.n]

    @property
    def last_tokens(self) -> torch.Tensor | None:
        return None if not self.lens else self._tokens[:self.n]

    @property
    def allocated(self) -> bool:
        return bool(self.k)

    def reset(self) -> None:
        """Forget every row; the buffers stay allocated (a step never reads a slot's stale columns
        beyond the positions its own row writes, and padding slots' outputs are discarded)."""
        self.lens = []
        if self._pos is not None:
            self._pos.zero_()
            self._tokens.zero_()

    def merge(self, cache, mask: torch.Tensor, lens: torch.Tensor, tokens: torch.Tensor) -> None:
        """Copy rows of a prefill (its HF cache with right-aligned rows, mask (R, L'), prompt lengths
        (R,), first tokens (R,)) into the next free slots."""
        R = mask.shape[0]
        if self.n + R > self.slots:
            raise RuntimeError(f"static KV: {self.n} + {R} rows exceed its {self.slots} slots (max_batch_size)")
        new_lens = lens.tolist()
        if max(new_lens) > self.cap:
            raise RuntimeError(f"static KV: a prompt of {max(new_lens)} tokens exceeds the {self.cap} columns "
                               "of a slot")
        self.allocate()
        row, col = mask.nonzero(as_tuple=True)  # real tokens, row-major: each row's in position order
        pos = (mask.cumsum(dim=1) - 1)[row, col]  # their positions
        slot = row + self.n
        for layer, k, v in zip(cache.layers, self.k, self.v):
            k[slot, :, pos] = layer.keys[row, :, col]  # (N, H, D)
            v[slot, :, pos] = layer.values[row, :, col]
        self._pos[self.n:self.n + R] = lens
        self._tokens[self.n:self.n + R] = tokens
        self.lens = self.lens + new_lens

    def select(self, keep: list[int]) -> None:
        """Keep only rows `keep` (non-empty, increasing), moved down to slots [0, len(keep))."""
        moved = [(j, i) for j, i in enumerate(keep) if i != j]
        if moved:
            dst = torch.tensor([j for j, _ in moved], device=self.device)
            src = torch.tensor([i for _, i in moved], device=self.device)
            L = max(self.lens[i] for _, i in moved)
            for k, v in zip(self.k, self.v):
                # The right side is gathered into a new tensor first, so overlapping slots are safe.
                k[dst, :, :L] = k[src, :, :L]
                v[dst, :, :L] = v[src, :, :L]
            self._pos[dst] = self._pos[src]
            self._tokens[dst] = self._tokens[src]
        n = len(keep)
        self._pos[n:].zero_()  # padding slots of a bucket decode at position 0
        self._tokens[n:].zero_()
        self.lens = [self.lens[i] for i in keep]

    def row_kv(self, i: int, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of row i's tokens [a, b) (of the staging slot for i = staging), each
        (layers, H, b - a, D)."""
        return (torch.stack([k[i, :, a:b] for k in self.k]), torch.stack([v[i, :, a:b] for v in self.v]))

    # ---- chunked prefill ----------------------------------------------------------------------

    def load_staging(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write a cached prefix, keys and values (layers, H, c, D), into the staging slot's first c columns."""
        self.allocate()
        c = keys.shape[2]
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            k[self.staging, :, :c] = keys[layer]
            v[self.staging, :, :c] = values[layer]

    def adopt(self, length: int, token: torch.Tensor) -> None:
        """Move the staging slot's prompt (`length` columns) into the next free slot, its next input
        `token` (a (1,) tensor): the row joins the batch."""
        if self.n >= self.slots:
            raise RuntimeError(f"static KV: no free slot among {self.slots} for a prefilled row")
        n = self.n
        for k, v in zip(self.k, self.v):
            k[n, :, :length] = k[self.staging, :, :length]
            v[n, :, :length] = v[self.staging, :, :length]
        self._pos[n] = length
        self._tokens[n:n + 1] = token
        self.lens = self.lens + [length]

    # ---- the decode step --------------------------------------------------------------------

    def advance(self, tokens: torch.Tensor) -> None:
        """After a decode step of the first len(tokens) slots: their sampled tokens are the next inputs."""
        n = tokens.shape[0]
        self._tokens[:n] = tokens
        self._pos[:n] += 1
        self.lens = [min(x + 1, self.cap) for x in self.lens]

    def inputs(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, positions) of slots [0, rows). A finished row waiting for compaction keeps stepping,
        its outputs ignored; the forward clamps its position to the last column."""
        return self._tokens[:rows], self._pos[:rows]

    def free(self) -> None:
        """Give the buffers back (memory release); the next merge allocates them again."""
        self.k, self.v = [], []
        self._tokens = self._pos = None
        self.lens = []

    def allocate(self) -> None:
        """Allocate the buffers (zeroed), unless they are. Never as inference tensors, whatever the caller's
        mode: merges, compaction and resets write into them outside inference mode."""
        if self.k:
            return
        with torch.inference_mode(False):
            self.k = [torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
            self.v = [torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
            self._tokens = torch.zeros(self.slots, dtype=torch.long, device=self.device)
            self._pos = torch.zeros(self.slots, dtype=torch.long, device=self.device)
        self.generation += 1

    def nbytes(self) -> int:
        """Bytes the buffers take once allocated."""
        s = self.shape
        return 2 * self.num_layers * s[0] * s[1] * s[2] * s[3] * torch.empty((), dtype=self.dtype).element_size()
