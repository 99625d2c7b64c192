"""Where a request's next KV block goes: empty blocks handed out in runs.

A request grows into the block right after its last one, and a request that starts a run
reserves room after it for the tokens it may still produce (prompt + max_tokens, at most
MAX_RESERVED_BLOCKS). A reservation is only a placement hint: reserved blocks count as free,
and when no unreserved empty block is left they are handed out like any other (taking one cuts
its owner's reservation there). Consecutive blocks are what the CPU attention kernel reads
fastest (the hardware prefetcher streams through a run; a jump to a block elsewhere costs a
memory latency). The block manager asks for a block with `take` and hands back emptied ones
with `put`; everything else here is private.
"""
from __future__ import annotations

EMPTY, RESERVED = 1, 2           # values of BlockPlacer.empty (0: not empty)
MAX_RESERVED_BLOCKS = 64         # the most blocks a new run reserves ahead of it
RUN_OF_EMPTY = bytes([EMPTY]) * MAX_RESERVED_BLOCKS
RUN_OF_RESERVED = bytes([RESERVED]) * MAX_RESERVED_BLOCKS


class BlockPlacer:
    """The empty blocks (free, holding nothing worth keeping) and who may grow into which."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.empty = bytearray([EMPTY]) * num_blocks
        self.num_empty = num_blocks
        self.reservations: dict[str, tuple[int, int]] = {}   # request id -> [start, end)
        # No run of EMPTY blocks is longer than this (reset when blocks become empty), so a
        # fragmented pool costs one failed search per length, not one per new run.
        self.longest_empty_run = num_blocks

    def take(self, request_id: str, last_block: int | None, num_wanted: int) -> int:
        """An empty block for the request's next block, -1 when none is: the one right after
        `last_block` when that is empty, else the start of a new run with room for
        `num_wanted` blocks (the rest reserved for it)."""
        block_id = self.num_blocks if last_block is None else last_block + 1
        if block_id >= self.num_blocks or not self.empty[block_id]:
            block_id = self._start_run(request_id, num_wanted)
        if block_id < 0:
            return -1
        if self.empty[block_id] == RESERVED:
            self._unreserve(block_id, request_id)
        self.empty[block_id] = 0
        self.num_empty -= 1
        return block_id

    def put(self, block_id: int) -> None:
        """The block holds nothing any more."""
        self.empty[block_id] = EMPTY
        self.num_empty += 1
        self.longest_empty_run = self.num_blocks

    def release(self, request_id: str) -> None:
        """Give back what is left of the request's reservation."""
        start, end = self.reservations.pop(request_id, (0, 0))
        if start < end:
            self.empty[start:end] = RUN_OF_EMPTY[:end - start]
            self.longest_empty_run = self.num_blocks

    def _start_run(self, request_id: str, num_wanted: int) -> int:
        """The first block of the first run of unreserved empty blocks as long as wanted
        (halving that while no run is), the rest of the run reserved; else any unreserved
        empty block, else a reserved one; -1 when none is empty."""
        self.release(request_id)
        want = min(num_wanted, MAX_RESERVED_BLOCKS, self.longest_empty_run)
        while want > 1:
            start = self.empty.find(RUN_OF_EMPTY[:want])
            if start >= 0:
                self.empty[start + 1:start + want] = RUN_OF_RESERVED[:want - 1]
                self.reservations[request_id] = (start + 1, start + want)
                return start
            self.longest_empty_run = want - 1
            want //= 2
        start = self.empty.find(EMPTY)
        return start if start >= 0 else self.empty.find(RESERVED)

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

    def check(self) -> None:
        assert self.num_empty == self.num_blocks - self.empty.count(0), self.num_empty
        if self.longest_empty_run < MAX_RESERVED_BLOCKS:
            assert RUN_OF_EMPTY[:self.longest_empty_run + 1] not in self.empty
        # Reservations: disjoint, nonempty, every block in them RESERVED and no other.
        num_reserved = 0
        for start, end in self.reservations.values():
            assert start < end and self.empty[start:end] == RUN_OF_RESERVED[:end - start]
            num_reserved += end - start
        assert num_reserved == self.empty.count(RESERVED), num_reserved
