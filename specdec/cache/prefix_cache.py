"""Prefix caching: chained SHA-256 block hashes and the table of cached blocks.

A full block of token ids is named by

    hash_i = SHA-256(hash_{i-1} || salt (first block only) || token ids of block i)

so a block's name covers the whole prefix before it. `cache_salt` (a per-tenant secret) is mixed
into the first block: tenants with different salts never share blocks, so one cannot learn by
timing whether another's prompt is cached (vLLM CVE-2025-46570). A hit is also checked by
content (the block's own token ids and its parent's hash), as nano-vllm does, so even a hash
collision cannot hand one prompt another prompt's KV.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

ROOT = b""  # the parent hash of a sequence's first block


def block_hash(parent: bytes, token_ids: tuple[int, ...] | list[int], salt: str | None = None) -> bytes:
    h = hashlib.sha256()
    h.update(parent)
    if not parent and salt:
        h.update(b"salt:" + salt.encode())
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


class PrefixCache:
    """hash -> block id for blocks that hold a full, final block of some prefix.

    Free blocks that are still cached stay hittable; `lru` keeps them in the order they were
    freed, and the block manager evicts from its head when it runs out of uncached blocks."""

    def __init__(self):
        self.by_hash: dict[bytes, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # free (ref count 0) cached block ids
        self.queries = 0  # blocks looked up
        self.hits = 0

    def lookup(self, h: bytes) -> int | None:
        return self.by_hash.get(h)

    def insert(self, h: bytes, block_id: int) -> bool:
        """Register a block; a hash already present keeps its first block (returns False)."""
        if h in self.by_hash:
            return False
        self.by_hash[h] = block_id
        return True

    def forget(self, h: bytes, block_id: int) -> None:
        if self.by_hash.get(h) == block_id:
            del self.by_hash[h]

    def park(self, block_id: int) -> None:
        """A cached block's last user left: it can be hit again or evicted (least recent first)."""
        self.lru[block_id] = None

    def unpark(self, block_id: int) -> None:
        self.lru.pop(block_id, None)

    def evict(self) -> int | None:
        """The least recently freed cached block, now out of the cache; None when there is none."""
        if not self.lru:
            return None
        block_id, _ = self.lru.popitem(last=False)
        return block_id

    def clear(self) -> None:
        self.by_hash.clear()
        self.lru.clear()
