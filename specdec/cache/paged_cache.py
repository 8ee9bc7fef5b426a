"""A paged KV pool and the per-forward view a batch of ragged sequences reads it through.

Pool layout per layer: k, v of shape [num_slots, n_kv_heads, head_dim], num_slots = num_blocks *
block_size; slot = block * block_size + offset (the block manager's tables say which).

`BatchKV` implements what the model asks of a cache (`attention_mask`, `write`, `advance`) for B
rows that are LEFT-padded to a common T, so every row's last new token sits at column T - 1 and
`num_logits=1` gives each row's next-token logits. Row b has past_b cached tokens and n_b new ones.
E.g. past = [5, 2], n = [1, 3], T = 3: row 0 is [pad pad x], row 1 is [y0 y1 y2].
`write` stores the valid new k/v at their slots, then gathers each row's past_b + n_b slots into a
padded [B, n_kv, Lmax, D] view; the [B, 1, T, Lmax] mask hides padding (a pad query sees key 0 only,
so softmax never meets an all-masked row).
"""
from __future__ import annotations

import torch


class PagedKVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks

    @classmethod
    def for_model(cls, config, num_blocks: int, block_size: int, dtype: torch.dtype, device="cpu") -> "PagedKVPool":
        return cls(config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads,
                   config.head_dim, dtype, device)

    @staticmethod
    def bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * elem

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Slot indices of positions [start, end) of a sequence. [end - start]"""
        return self.slots_of(block_table, torch.arange(start, end))

    def slots_of(self, block_table: list[int], positions: torch.Tensor) -> torch.Tensor:
        """Slot indices of a sequence's positions [n] (any order)."""
        table = torch.as_tensor(block_table, dtype=torch.long)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def keep(self, block_table: list[int], positions: list[int], start: int) -> None:
        """A sequence's k/v at `positions` (ascending, all >= start) packed from `start` on, as KVCache.keep:
        a verified tree's accepted path. Nothing moves where they are packed already (a chain-shaped path)."""
        packed = list(range(start, start + len(positions)))
        if positions != packed:
            self.move(block_table, positions, packed)

    def move(self, block_table: list[int], src: list[int], dst: list[int]) -> None:
        """Every layer's k/v of a sequence's positions src to its positions dst (the sources are read before
        any is overwritten)."""
        s, d = self.slots_of(block_table, torch.tensor(src)), self.slots_of(block_table, torch.tensor(dst))
        self.k[:, d] = self.k[:, s]
        self.v[:, d] = self.v[:, s]


class BatchKV:
    """The cache one batched forward sees. past[b], num_new[b]: cached and new tokens of row b."""

    def __init__(self, pool: PagedKVPool, block_tables: list[list[int]], past: list[int], num_new: list[int],
                 row_masks: list[torch.Tensor | None] | None = None):
        B, T = len(past), max(num_new)
        self.pool = pool
        lengths = [p + n for p, n in zip(past, num_new)]
        self.Lmax = max(lengths)
        # slots of the new tokens (valid entries only) and where they sit in the padded [B, T] input
        new_slots, rows, cols, key_cols = [], [], [], []
        gather = torch.zeros(B, self.Lmax, dtype=torch.long)  # padding reads slot 0, masked out
        for b, (table, p, n, L) in enumerate(zip(block_tables, past, num_new, lengths)):
            all_slots = pool.slots(table, 0, L)
            gather[b, :L] = all_slots
            new_slots.append(all_slots[p:])
            rows.extend([b] * n)
            cols.extend(range(T - n, T))
            key_cols.extend(range(p, p + n))
        self.gather = gather
        self.new_slots = torch.cat(new_slots)  # [N] N = sum(num_new)
        self.rows, self.cols, self.key_cols = torch.tensor(rows), torch.tensor(cols), torch.tensor(key_cols)
        self.mask = self._mask(past, num_new, T, row_masks)
        self.tails = self._tails(past, num_new, T, row_masks)

    def _mask(self, past, num_new, T, row_masks) -> torch.Tensor:
        # query column t of row b is new token j = t - (T - n_b); a chain sees keys < past_b + j + 1
        t = torch.arange(T)[None, :]  # [1, T]
        past_t, n_t = torch.tensor(past)[:, None], torch.tensor(num_new)[:, None]  # [B, 1]
        j = t - (T - n_t)  # [B, T]
        limit = torch.where(j >= 0, past_t + j + 1, torch.ones_like(j))  # pad rows: key 0 only
        mask = torch.arange(self.Lmax)[None, None, :] < limit[:, :, None]  # [B, T, Lmax]
        for b, tree in enumerate(row_masks or ()):
            if tree is not None:  # a token tree: its own ancestor mask among the new tokens
                p, n = past[b], num_new[b]
                mask[b, T - n:, p:p + n] = tree
        return mask[:, None]  # [B, 1, T, Lmax]

    def _tails(self, past, num_new, T, row_masks) -> tuple | None:
        """For the attention kernel, when a row is a tree: (mask [B, T, Lmax] with each tree row's root path
        laid out by depth, tail_start [B, T], tail_path [B, T, T]), as FusedAttention's (attention.c)."""
        from specdec.spec.tree import root_path_columns
        trees = [(b, root_path_columns(m)) for b, m in enumerate(row_masks or ()) if m is not None]
        trees = [(b, paths) for b, paths in trees if paths is not None]
        if not trees:
            return None
        B = len(past)
        mask = self.mask[:, 0].clone()  # each tree row's block replaced below
        start = torch.full((B, T), self.Lmax, dtype=torch.long)  # Lmax: read the columns as they are
        path = torch.zeros(B, T, T, dtype=torch.long)
        for b, (vis, p_b) in trees:
            p, n = past[b], num_new[b]
            mask[b, T - n:, p:p + n] = vis
            start[b, T - n:] = p
            path[b, T - n:] = p  # past the tree's columns (never seen): its root's
            path[b, T - n:, :n] = p + p_b
        return mask, start, path

    def attention_mask(self, block_mask, num_new: int) -> torch.Tensor:
        return self.mask

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Sequence position of each gathered key, [B, Lmax] (sliding-window attention): column i < past_b
        holds position i, the new tokens' columns their `positions` (a tree's are not contiguous)."""
        kp = torch.arange(self.Lmax, device=positions.device).expand(positions.shape[0], -1).clone()
        kp[self.rows, self.key_cols] = positions[self.rows, self.cols]
        return kp

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v: [B, n_kv, T, D] -> store valid entries, return [B, n_kv, Lmax, D] views
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]
        k_pool.index_copy_(0, self.new_slots, k[self.rows, :, self.cols].to(k_pool.dtype))  # [N, n_kv, D]
        v_pool.index_copy_(0, self.new_slots, v[self.rows, :, self.cols].to(v_pool.dtype))
        return k_pool[self.gather].transpose(1, 2).to(k.dtype), v_pool[self.gather].transpose(1, 2).to(v.dtype)

    def advance(self, n: int) -> None:
        """Lengths live in the sequences, which the engine advances after verification."""


class SeqKV:
    """One sequence's blocks seen as a single-request KVCache (length, max_len, write, rollback).

    Lent to proposers that draft into the target's own cache (layerskip) as state.draft["target_cache"];
    max_len is what the sequence's allocated blocks hold."""

    def __init__(self, pool: PagedKVPool, block_table: list[int], length: int):
        self.pool, self.block_table, self.length = pool, block_table, length

    @property
    def max_len(self) -> int:
        return len(self.block_table) * self.pool.block_size

    def attention_mask(self, block_mask, num_new: int):
        from specdec.model.layers import build_attention_mask
        return build_attention_mask(self.length, block_mask, num_new, self.pool.k.device)

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        past = torch.arange(self.length, device=positions.device).expand(positions.shape[0], -1)
        return torch.cat((past, positions), dim=1)  # [1, length + T], as KVCache.key_positions

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v: [1, n_kv, T, D] at positions [length, length + T) -> [1, n_kv, length + T, D]
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} > {self.max_len} positions")
        slots = self.pool.slots(self.block_table, 0, end)
        self.pool.k[layer].index_copy_(0, slots[self.length:], k[0].transpose(0, 1).to(self.pool.k.dtype))
        self.pool.v[layer].index_copy_(0, slots[self.length:], v[0].transpose(0, 1).to(self.pool.v.dtype))
        return (self.pool.k[layer][slots].transpose(0, 1)[None].to(k.dtype),
                self.pool.v[layer][slots].transpose(0, 1)[None].to(v.dtype))

    def advance(self, n: int) -> None:
        self.length += n

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length} (cache holds {self.length})")
        self.length = length
