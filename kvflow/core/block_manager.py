"""KV block manager: fixed-size blocks, reference counts, hash-chained prefix cache, LRU eviction.

A full block's hash chains its parent's hash with its token ids, keyed by a per-engine salt
so hashes cannot be guessed from outside. Freed blocks keep their hash and stay reusable until
a new allocation evicts them: least recently freed first, and since a request frees its blocks
tail first, a sequence's tail is evicted before its head.

Free blocks come in two kinds: cached ones (holding a hashed block, in LRU order) and empty
ones (holding nothing worth keeping). New blocks come from the empty ones first, so nothing
cached is evicted while an empty block is left, and they are placed in runs: a request grows
into the block right after its last one, and a request that starts a run reserves room after
it for the tokens it may still produce (prompt + max_tokens, at most MAX_RESERVED_BLOCKS). A
reservation is only a placement hint: reserved blocks count as free, and when no unreserved
empty block is left they are handed out like any other. Consecutive blocks are what the CPU
attention kernel reads fastest (the hardware prefetcher streams through a run; a jump to a block
elsewhere costs a memory latency).
"""
from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict

from kvflow.core.request import Request


EMPTY, RESERVED = 1, 2           # values of BlockManager.empty
MAX_RESERVED_BLOCKS = 64         # the most blocks a new run reserves ahead of it
RUN_OF_EMPTY = bytes([EMPTY]) * MAX_RESERVED_BLOCKS
RUN_OF_RESERVED = bytes([RESERVED]) * MAX_RESERVED_BLOCKS


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
        self.free_blocks: OrderedDict[int, None] = OrderedDict()
        # Free blocks holding nothing: EMPTY, or RESERVED for a request's growth; 0 otherwise.
        self.empty = bytearray([EMPTY]) * num_blocks
        self.num_empty = num_blocks
        self.reservations: dict[str, tuple[int, int]] = {}   # request id -> [start, end)
        # No run of EMPTY blocks is longer than this (reset when blocks become empty), so a
        # fragmented pool costs one failed search per length, not one per new run.
        self.longest_empty_run = num_blocks
        self.total_refs = 0
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + self.num_empty

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- hashing ---------------------------------------------------------------------------

    def hash_full_blocks(self, request: Request) -> None:
        """Extend request.block_hashes to cover every full block of its tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        for i in range(len(hashes), request.num_tokens // bs):
            parent = hashes[-1] if hashes else b""
            tokens = array("q", request.token_ids[i * bs:(i + 1) * bs]).tobytes()
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
                    self.empty[block_id] = EMPTY
                    self.num_empty += 1
                    self.longest_empty_run = self.num_blocks
                else:
                    self.free_blocks[block_id] = None
        request.block_ids = []
        self._release(request.request_id)

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
        for block_id in self.free_blocks:
            self._forget_hash(block_id)
            self.empty[block_id] = EMPTY
        self.num_empty += len(self.free_blocks)
        self.free_blocks.clear()
        self.longest_empty_run = self.num_blocks

    # --- internals -------------------------------------------------------------------------

    def _ref(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free_blocks[block_id]
        self.ref_counts[block_id] += 1
        self.total_refs += 1

    def _new_block(self, request: Request) -> int:
        """A free block for the request's next block: the one right after its last block when
        that is empty, else the start of a new run, else (nothing empty) the LRU cached one."""
        ids = request.block_ids
        block_id = ids[-1] + 1 if ids else self.num_blocks
        if block_id >= self.num_blocks or not self.empty[block_id]:
            block_id = self._start_run(request)
        if block_id >= 0 and self.empty[block_id] == RESERVED:
            self._unreserve(block_id, request.request_id)
        if block_id < 0:
            block_id, _ = self.free_blocks.popitem(last=False)
            self._forget_hash(block_id)
        else:
            self.empty[block_id] = 0
            self.num_empty -= 1
        self.ref_counts[block_id] = 1
        self.total_refs += 1
        return block_id

    def _start_run(self, request: Request) -> int:
        """The first block of the first run of unreserved empty blocks as long as what the
        request may still need (halving that while no run is), the rest of the run reserved
        for it; else any unreserved empty block, else a reserved one; -1 when none is empty."""
        self._release(request.request_id)
        max_tokens = request.num_prompt_tokens + request.sampling_params.max_tokens
        want = min(self.blocks_needed(max_tokens) - len(request.block_ids), MAX_RESERVED_BLOCKS,
                   self.longest_empty_run)
        while want > 1:
            start = self.empty.find(RUN_OF_EMPTY[:want])
            if start >= 0:
                self.empty[start + 1:start + want] = RUN_OF_RESERVED[:want - 1]
                self.reservations[request.request_id] = (start + 1, start + want)
                return start
            self.longest_empty_run = want - 1
            want //= 2
        start = self.empty.find(EMPTY)
        return start if start >= 0 else self.empty.find(RESERVED)

    def _release(self, request_id: str) -> None:
        """Give back what is left of the request's reservation."""
        start, end = self.reservations.pop(request_id, (0, 0))
        if start < end:
            self.empty[start:end] = RUN_OF_EMPTY[:end - start]
            self.longest_empty_run = self.num_blocks

    def _unreserve(self, block_id: int, taker: str) -> None:
        """A reserved block is being taken: by its owner growing into it (the reservation
        shrinks from the front), or by another request when nothing unreserved is left (the
        owner's run cannot continue past it: the rest of its reservation is given back)."""
        for owner, (start, end) in self.reservations.items():
            if start <= block_id < end:
                break
        else:
            raise AssertionError(f"block {block_id} is RESERVED but in no reservation")
        if owner == taker and block_id == start:
            self.reservations[owner] = (start + 1, end)
            if start + 1 == end:
                del self.reservations[owner]
            return
        if block_id + 1 < end:
            self.empty[block_id + 1:end] = RUN_OF_EMPTY[:end - block_id - 1]
            self.longest_empty_run = self.num_blocks
        if start < block_id:
            self.reservations[owner] = (start, block_id)
        else:
            del self.reservations[owner]

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
        assert self.num_empty == self.num_blocks - self.empty.count(0), self.num_empty
        if self.longest_empty_run < MAX_RESERVED_BLOCKS:
            assert RUN_OF_EMPTY[:self.longest_empty_run + 1] not in self.empty
        # Reservations: disjoint, nonempty, every block in them RESERVED and no other.
        num_reserved = 0
        for start, end in self.reservations.values():
            assert start < end and self.empty[start:end] == RUN_OF_RESERVED[:end - start]
            num_reserved += end - start
        assert num_reserved == self.empty.count(RESERVED), num_reserved
