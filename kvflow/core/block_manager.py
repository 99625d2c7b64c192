"""KV block manager: fixed-size blocks, reference counts, hash-chained prefix cache, LRU eviction.

A full block's hash chains its parent's hash with its token ids, keyed by a per-engine salt
so hashes cannot be guessed from outside. Freed blocks keep their hash and stay reusable until
a new allocation evicts them: least recently freed first, and since a request frees its blocks
tail first, a sequence's tail is evicted before its head.

Free blocks come in two kinds: cached ones (holding a hashed block, in LRU order, the only
ones ever evicted) and empty ones (holding nothing worth keeping). New blocks come from the
empty ones first, so nothing cached is evicted while an empty block is left; which empty block
is the BlockPlacer's choice (block_placer.py: runs of consecutive blocks, for the CPU kernel).
"""
from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict

from kvflow.core.block_placer import BlockPlacer
from kvflow.core.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 salt: bytes | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = os.urandom(16) if salt is None else salt
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        # Free blocks holding a cached block, least recently freed first: evicted from the front.
        self.evictable_blocks: OrderedDict[int, None] = OrderedDict()
        self.placer = BlockPlacer(num_blocks)     # the free blocks holding nothing
        self.total_refs = 0
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Every block no request holds: the evictable cached ones and the empty ones."""
        return len(self.evictable_blocks) + self.placer.num_empty

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- hashing ---------------------------------------------------------------------------

    def hash_full_blocks(self, request: Request) -> None:
        """Extend request.block_hashes to cover every full block of its tokens."""
        hashes = request.block_hashes
        block_size = self.block_size
        for i in range(len(hashes), request.num_tokens // block_size):
            parent = hashes[-1] if hashes else b""
            tokens = array("q", request.token_ids[i * block_size:(i + 1) * block_size]).tobytes()
            hashes.append(hashlib.blake2b(parent + tokens, key=self.salt,
                                          digest_size=16).digest())

    # --- allocation ------------------------------------------------------------------------

    def find_cached_blocks(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of the request's tokens.

        Never covers the last token, so at least one token is computed and yields logits.
        """
        if not self.enable_prefix_caching:
            return []
        self.hash_full_blocks(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids = []
        for h in request.block_hashes[:max_blocks]:
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def allocate(self, request: Request, num_new_tokens: int,
                 cached_block_ids: list[int] | None = None) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens; False if they don't fit.

        `cached_block_ids` (prefix hits, for a request not yet running) are taken first.
        """
        cached = cached_block_ids or []
        num_tokens = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(num_tokens) - len(request.block_ids) - len(cached)
        # Cached blocks nobody references sit in the free list: taking them shrinks it.
        num_cached_free = sum(1 for b in cached if self.ref_counts[b] == 0)
        if num_new_blocks > self.num_free_blocks - num_cached_free:
            return False
        for block_id in cached:
            self._ref(block_id)
        request.block_ids.extend(cached)
        for _ in range(max(0, num_new_blocks)):
            request.block_ids.append(self._new_block(request))
        return True

    def free(self, request: Request) -> None:
        """Drop the request's references, tail first (so its tail is evicted first)."""
        for block_id in reversed(request.block_ids):
            self.ref_counts[block_id] -= 1
            self.total_refs -= 1
            if self.ref_counts[block_id] == 0:
                if self.block_hashes[block_id] is None:
                    self.placer.put(block_id)
                else:
                    self.evictable_blocks[block_id] = None
        request.block_ids = []
        self.placer.release(request.request_id)

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the hashes of the request's full blocks whose KV is now computed."""
        if not self.enable_prefix_caching:
            return
        self.hash_full_blocks(request)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for i in range(request.num_registered_blocks, num_full):
            block_id, h = request.block_ids[i], request.block_hashes[i]
            if h not in self.hash_to_block:
                self.hash_to_block[h] = block_id
                self.block_hashes[block_id] = h
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        self.num_queried_tokens += num_queried
        self.num_hit_tokens += num_hit

    def reset_prefix_cache(self) -> None:
        """Forget every hash of a free block (running requests keep theirs)."""
        for block_id in self.evictable_blocks:
            self._forget_hash(block_id)
            self.placer.put(block_id)
        self.evictable_blocks.clear()

    # --- internals -------------------------------------------------------------------------

    def _ref(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.evictable_blocks[block_id]
        self.ref_counts[block_id] += 1
        self.total_refs += 1

    def _new_block(self, request: Request) -> int:
        """An empty block where the placer puts it, else (nothing empty) the LRU cached one."""
        ids = request.block_ids
        num_wanted = (self.blocks_needed(request.num_prompt_tokens
                                         + request.sampling_params.max_tokens) - len(ids))
        block_id = self.placer.take(request.request_id, ids[-1] if ids else None, num_wanted)
        if block_id < 0:
            block_id, _ = self.evictable_blocks.popitem(last=False)
            self._forget_hash(block_id)
        self.ref_counts[block_id] = 1
        self.total_refs += 1
        return block_id

    def _forget_hash(self, block_id: int) -> None:
        h = self.block_hashes[block_id]
        if h is not None:
            self.block_hashes[block_id] = None
            if self.hash_to_block.get(h) == block_id:
                del self.hash_to_block[h]

    def check(self) -> None:
        """Internal invariants; cheap enough to run every step."""
        num_used = self.num_blocks - self.num_free_blocks
        assert num_used <= self.total_refs, (num_used, self.total_refs)
        assert (self.total_refs == 0) == (num_used == 0), (self.total_refs, num_used)
        self.placer.check()
