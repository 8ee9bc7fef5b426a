"""Fixed-size KV blocks: allocation with ref counts, block tables, prefix-cache hits and eviction.

A sequence's block table maps position p to slot `table[p // block_size] * block_size + p % block_size`
of the paged pool. Only full blocks whose tokens are final (their KV written and accepted) are
hashed and shared; a sequence writes only at positions >= its computed length, which always lie in
its own private blocks, so shared blocks are never written (no copy-on-write needed). Drafted tokens
take slots past the computed length; `trim` frees whole blocks that only rejected drafts used.

Free blocks: uncached ones are handed out first; cached ones (ref count 0, hash kept) can still be
hit, and are evicted least-recently-freed first when nothing else is left.
"""
from __future__ import annotations

from dataclasses import dataclass

from specdec.cache.prefix_cache import ROOT, PrefixCache, block_hash


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    parent: bytes = ROOT  # hash of the previous block of the prefix (content check on hits)
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 cache_generated: bool = True):
        """cache_generated: whether blocks holding generated tokens are cached too. Not where a model's prompt
        passes run other kernels than its decode passes (a bf16 prompt on oneDNN, decoding on vdpbf16ps):
        a prompt hitting keys/values a decode pass wrote would differ bitwise from its cold prefill."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("need num_blocks >= 1 and block_size >= 1")
        self.block_size = block_size
        self.cache_generated = cache_generated
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # uncached free blocks (a stack)
        self.prefix = PrefixCache()
        self.enable_prefix_caching = enable_prefix_caching

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_ids) + len(self.prefix.lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_for(self, num_slots: int) -> int:
        return -(-num_slots // self.block_size)

    # --- prefix cache ---------------------------------------------------------------------------
    def match_prefix(self, seq) -> int:
        """Give a sequence with an empty block table the cached blocks of its longest cached prefix.

        At least one token is left to compute (its logits are needed). Returns the tokens reused."""
        assert not seq.block_table and seq.num_computed == 0
        if not self.enable_prefix_caching or not seq.reads_prefix_cache:
            return 0
        bs, tokens = self.block_size, seq.token_ids
        parent = ROOT
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = block_hash(parent, chunk, seq.cache_salt)
            block_id = self.prefix.lookup(h)
            block = self.blocks[block_id] if block_id is not None else None
            if block is None or block.token_ids != chunk or block.parent != parent:
                break  # a miss, or a hash collision caught by the content check
            if block.ref_count == 0:
                self.prefix.unpark(block_id)
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            parent = h
        seq.num_computed = len(seq.block_table) * bs
        return seq.num_computed

    def count_prefix_lookup(self, seq, cached_tokens: int) -> None:
        """Count an admitted sequence's lookup (match_prefix's result) in the cache's queries and hits."""
        if not self.enable_prefix_caching or not seq.reads_prefix_cache:
            return
        hits, lookable = cached_tokens // self.block_size, (seq.num_tokens - 1) // self.block_size
        self.prefix.hits += hits
        self.prefix.queries += min(hits + 1, lookable)  # the hits, and the miss that ended them if any

    def commit(self, seq) -> None:
        """Hash and register the sequence's newly completed blocks (all their tokens final)."""
        if not self.enable_prefix_caching:
            return
        bs, tokens = self.block_size, None
        final = seq.num_computed if self.cache_generated else min(seq.num_computed, len(seq.prompt_ids))
        for i in range(len(seq.block_hashes), final // bs):
            tokens = tokens if tokens is not None else seq.token_ids
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT
            h = block_hash(parent, chunk, seq.cache_salt)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and self.prefix.insert(h, block.block_id):
                block.hash, block.parent, block.token_ids = h, parent, chunk

    # --- allocation -----------------------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def _take(self) -> int:
        if self.free_ids:
            return self.free_ids.pop()
        block_id = self.prefix.evict()
        block = self.blocks[block_id]
        self.prefix.forget(block.hash, block_id)
        block.hash, block.parent, block.token_ids = None, ROOT, ()
        return block_id

    def ensure(self, seq, num_slots: int) -> bool:
        """Grow the block table to hold positions [0, num_slots); all or nothing."""
        need = self.blocks_for(num_slots) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        for _ in range(need):
            block_id = self._take()
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)
        return True

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count < 0:  # (not an assert: under python -O a double free would hand a block out twice)
            raise RuntimeError(f"block {block_id} freed twice")
        if block.ref_count == 0:
            if block.hash is not None:
                self.prefix.park(block_id)
            else:
                self.free_ids.append(block_id)

    def trim(self, seq, num_slots: int) -> None:
        """Free the blocks past those holding positions [0, num_slots) (rejected drafts' slots)."""
        keep = self.blocks_for(num_slots)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free(self, seq) -> None:
        """Release every block of the sequence (last block first: a prefix outlives its tail)."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed = 0

    def reset_prefix_cache(self) -> bool:
        """Drop every cached, unused block from the cache (False if some blocks are in use)."""
        if self.num_used:
            return False
        for block_id in list(self.prefix.lru):
            block = self.blocks[block_id]
            block.hash, block.parent, block.token_ids = None, ROOT, ()
            self.free_ids.append(block_id)
        self.prefix.clear()
        return True
