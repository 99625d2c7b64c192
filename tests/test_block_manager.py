"""BlockManager: hash chaining, prefix-cache lookups, reference counts, LRU eviction.

Block size 4 throughout, so block i of a request holds tokens [4*i, 4*i + 4).
"""
from __future__ import annotations

import pytest

from kvflow.core.block_manager import BlockManager
from kvflow.core.block_placer import RESERVED
from kvflow.core.request import Request
from kvflow.sampling_params import SamplingParams

BLOCK_SIZE = 4
SALT = b"0123456789abcdef"


def make_bm(num_blocks: int, prefix_caching: bool = True, salt: bytes = SALT) -> BlockManager:
    return BlockManager(num_blocks, BLOCK_SIZE, prefix_caching, salt=salt)


def make_request(token_ids: list[int], request_id: str = "r") -> Request:
    return Request(request_id, token_ids, SamplingParams())


def hashes_of(bm: BlockManager, token_ids: list[int]) -> list[bytes]:
    request = make_request(token_ids)
    bm.hash_full_blocks(request)
    return request.block_hashes


def admit_and_compute(bm: BlockManager, request: Request) -> None:
    """What the scheduler does for a waiting request given its whole prompt in one step:
    take the prefix hits, allocate the rest, mark everything computed, register the blocks."""
    cached = bm.find_cached_blocks(request)
    num_cached = len(cached) * BLOCK_SIZE
    assert bm.allocate(request, request.num_tokens - num_cached, cached)
    request.num_computed_tokens = request.num_tokens
    bm.cache_computed_blocks(request)


def num_hits(bm: BlockManager, token_ids: list[int]) -> int:
    return len(bm.find_cached_blocks(make_request(token_ids)))


def first_blocks(bm: BlockManager, tokens: list[int]) -> list[int]:
    """Block ids registered for each full block of `tokens` (looked up by hash)."""
    return [bm.hash_to_block[h] for h in hashes_of(bm, tokens)]


def assert_all_free(bm: BlockManager) -> None:
    assert bm.total_refs == 0
    assert bm.ref_counts == [0] * bm.num_blocks
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.placer.reservations == {} and bm.placer.empty.count(RESERVED) == 0
    bm.check()


# --- hashing -----------------------------------------------------------------------------

def test_same_tokens_give_same_hashes_and_only_full_blocks_are_hashed() -> None:
    bm = make_bm(8)
    tokens = list(range(10, 20))                       # 2 full blocks + 2 tokens
    first, second = hashes_of(bm, tokens), hashes_of(bm, tokens)
    assert len(first) == 2
    assert first == second
    assert first[0] != first[1]
    # Appending tokens extends the chain without changing the existing hashes.
    assert hashes_of(bm, tokens + [20, 21])[:2] == first
    assert len(hashes_of(bm, tokens + [20, 21])) == 3


def test_changing_an_earlier_block_changes_every_later_hash() -> None:
    bm = make_bm(8)
    tokens = list(range(100, 116))                     # 4 full blocks
    base = hashes_of(bm, tokens)
    changed = list(tokens)
    changed[5] = 999                                   # inside block 1
    other = hashes_of(bm, changed)
    assert other[0] == base[0]
    # Blocks 2 and 3 have identical tokens, but their parent differs: the chain must show it.
    assert all(other[i] != base[i] for i in (1, 2, 3))


def test_salt_changes_every_hash() -> None:
    tokens = list(range(12))
    a = hashes_of(make_bm(8, salt=SALT), tokens)
    b = hashes_of(make_bm(8, salt=b"fedcba9876543210"), tokens)
    assert len(a) == len(b) == 3
    assert all(x != y for x, y in zip(a, b))


# --- lookups -----------------------------------------------------------------------------

def test_lookup_never_covers_the_last_token() -> None:
    bm = make_bm(8)
    tokens = list(range(50, 58))                       # exactly 2 full blocks
    first = make_request(tokens, "a")
    admit_and_compute(bm, first)
    bm.free(first)
    # Same 8 tokens: the second block holds the last token, so only block 0 may be reused.
    assert bm.find_cached_blocks(make_request(tokens)) == first_blocks(bm, tokens)[:1]
    # One more token: now both full blocks precede the last token.
    assert num_hits(bm, tokens + [7]) == 2
    # A prompt shorter than one block plus one token gets nothing.
    assert num_hits(bm, tokens[:4]) == 0
    assert num_hits(bm, tokens[:5]) == 1


def test_lookup_stops_at_the_first_miss() -> None:
    bm = make_bm(8)
    tokens = list(range(12)) + [99]
    admit_and_compute(bm, make_request(tokens, "a"))
    changed = list(tokens)
    changed[2] = 77                                    # block 0 differs
    assert num_hits(bm, changed) == 0
    changed = list(tokens)
    changed[6] = 77                                    # block 1 differs: block 2 can't match
    assert num_hits(bm, changed) == 1


def test_shared_blocks_are_reference_counted() -> None:
    bm = make_bm(8)
    a = make_request(list(range(9)), "a")              # 3 blocks, 2 of them full
    admit_and_compute(bm, a)
    b = make_request(list(range(8)) + [40, 41, 42], "b")
    admit_and_compute(bm, b)
    assert b.block_ids[:2] == a.block_ids[:2]          # both full blocks reused
    assert b.block_ids[2] != a.block_ids[2]
    assert [bm.ref_counts[x] for x in a.block_ids] == [2, 2, 1]
    assert bm.ref_counts[b.block_ids[2]] == 1
    assert bm.total_refs == 6
    assert bm.num_free_blocks == 8 - 4
    bm.free(a)
    # The shared blocks are still held by b: not free, not evictable.
    assert [bm.ref_counts[x] for x in b.block_ids] == [1, 1, 1]
    assert bm.total_refs == 3
    assert bm.num_free_blocks == 8 - 3
    assert all(x not in bm.evictable_blocks for x in b.block_ids)
    bm.free(b)
    assert_all_free(bm)


# --- eviction ----------------------------------------------------------------------------

def test_eviction_is_lru_and_a_sequences_tail_goes_before_its_head() -> None:
    bm = make_bm(6)
    a_tokens, b_tokens = list(range(12)), list(range(200, 212))
    a, b = make_request(a_tokens, "a"), make_request(b_tokens, "b")
    admit_and_compute(bm, a)
    admit_and_compute(bm, b)
    assert bm.num_free_blocks == 0
    bm.free(a)                                         # a freed first: evicted first
    bm.free(b)
    a_blocks = first_blocks(bm, a_tokens)
    b_blocks = first_blocks(bm, b_tokens)
    assert list(bm.evictable_blocks) == a_blocks[::-1] + b_blocks[::-1]

    # Take one block at a time and watch which prefix survives: a's tail goes first.
    c = make_request(list(range(500, 524)), "c")
    lookups = []
    for n in range(1, 7):
        assert bm.allocate(c, BLOCK_SIZE)
        c.num_computed_tokens += BLOCK_SIZE
        lookups.append((num_hits(bm, a_tokens + [1]), num_hits(bm, b_tokens + [1])))
    assert c.block_ids == a_blocks[::-1] + b_blocks[::-1]
    assert lookups == [(2, 3), (1, 3), (0, 3), (0, 2), (0, 1), (0, 0)]


def test_a_reused_prefix_becomes_most_recently_used() -> None:
    bm = make_bm(6)
    a_tokens, b_tokens = list(range(12)), list(range(200, 212))
    a, b = make_request(a_tokens, "a"), make_request(b_tokens, "b")
    admit_and_compute(bm, a)
    admit_and_compute(bm, b)
    bm.free(a)
    bm.free(b)
    a_blocks, b_blocks = first_blocks(bm, a_tokens), first_blocks(bm, b_tokens)
    assert list(bm.evictable_blocks) == a_blocks[::-1] + b_blocks[::-1]
    # d reuses a's first two blocks (its third block evicts a's tail), then is freed:
    # a's head is now the most recently freed, b the least. d's third block held only a
    # partial block, so it comes back empty, not cached.
    d = make_request(a_tokens[:8] + [1], "d")
    admit_and_compute(bm, d)
    assert d.block_ids == a_blocks
    bm.free(d)
    assert list(bm.evictable_blocks) == b_blocks[::-1] + a_blocks[:2][::-1]
    assert bm.placer.empty[a_blocks[2]] and bm.placer.num_empty == 1
    # 3 new blocks: the empty one, then two evictions, both from b although b was freed
    # after a: b's head survives, a's two blocks too.
    e = make_request(list(range(700, 712)), "e")
    assert bm.allocate(e, 12)
    assert e.block_ids == [a_blocks[2], b_blocks[2], b_blocks[1]]
    assert num_hits(bm, a_tokens + [1]) == 2
    assert num_hits(bm, b_tokens + [1]) == 1
    assert bm.allocate(make_request(list(range(800, 804)), "f"), 4)
    assert num_hits(bm, b_tokens + [1]) == 0


# --- allocation --------------------------------------------------------------------------

def test_empty_blocks_are_used_before_any_cached_block_is_evicted() -> None:
    bm = make_bm(6)
    a = make_request(list(range(9)), "a")              # 2 full blocks + 1 partial
    admit_and_compute(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 6 and len(bm.evictable_blocks) == 2 and bm.placer.num_empty == 4
    b = make_request(list(range(100, 116)), "b")       # 4 blocks: exactly the empty ones
    assert bm.allocate(b, 16)
    assert not set(b.block_ids) & set(a.block_ids[:2]) and num_hits(bm, list(range(9))) == 2
    assert bm.allocate(make_request([7] * 4, "c"), 4)  # now the LRU cached block goes
    assert num_hits(bm, list(range(9))) == 1


def grow(bm: BlockManager, request: Request, num_tokens: int) -> None:
    """Decode steps: one token at a time, as the scheduler allocates them."""
    for _ in range(num_tokens):
        request.token_ids.append(1)
        assert bm.allocate(request, 1)
        request.num_computed_tokens += 1


def runs(block_ids: list[int]) -> int:
    return 1 + sum(b != a + 1 for a, b in zip(block_ids, block_ids[1:]))


def test_interleaved_growing_requests_keep_their_blocks_consecutive() -> None:
    # Four requests admitted together, then decoding in lockstep: each reserved room for its
    # prompt + max_tokens when it started, so each stays one run of consecutive blocks.
    bm = make_bm(64)
    requests = [Request(f"r{i}", list(range(10 * i, 10 * i + 6)),
                        SamplingParams(max_tokens=30)) for i in range(4)]
    for r in requests:
        admit_and_compute(bm, r)
    for _ in range(30 - 1):
        for r in requests:
            grow(bm, r, 1)
    for r in requests:
        assert len(r.block_ids) == 9 and runs(r.block_ids) == 1, r.block_ids
    assert bm.num_free_blocks == 64 - 36
    bm.check()
    for r in requests:
        bm.free(r)
    assert bm.placer.reservations == {} and bm.placer.empty.count(RESERVED) == 0
    assert_all_free(bm)


def test_reservations_never_make_an_allocation_fail() -> None:
    # a reserves room for 8 blocks; b then needs everything else, reserved room included.
    bm = make_bm(8)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=29))
    admit_and_compute(bm, a)
    assert len(a.block_ids) == 1 and bm.placer.empty.count(RESERVED) == 7
    b = make_request(list(range(100, 128)), "b")       # 7 blocks
    assert bm.allocate(b, 28)
    assert bm.num_free_blocks == 0 and not set(a.block_ids) & set(b.block_ids)
    assert not bm.allocate(make_request([5], "c"), 1)
    bm.check()
    bm.free(a)
    bm.free(b)
    assert_all_free(bm)


def test_prefix_caching_disabled_still_places_runs() -> None:
    bm = make_bm(32, prefix_caching=False)
    a = Request("a", list(range(6)), SamplingParams(max_tokens=20))
    b = Request("b", list(range(50, 56)), SamplingParams(max_tokens=20))
    admit_and_compute(bm, a)
    admit_and_compute(bm, b)
    for _ in range(19):
        grow(bm, a, 1)
        grow(bm, b, 1)
    assert runs(a.block_ids) == runs(b.block_ids) == 1
    bm.free(a)
    bm.free(b)
    assert_all_free(bm)


def test_allocate_counts_exact_blocks_for_a_growing_request() -> None:
    bm = make_bm(8)
    r = make_request(list(range(5)))
    assert bm.allocate(r, 5)
    assert len(r.block_ids) == 2
    r.num_computed_tokens = 5
    assert bm.allocate(r, 3)                           # 8 tokens: still 2 blocks
    assert len(r.block_ids) == 2
    r.num_computed_tokens = 8
    assert bm.allocate(r, 1)                           # token 9 needs block 3
    assert len(r.block_ids) == 3
    assert bm.num_free_blocks == 5
    assert bm.total_refs == 3


def snapshot(bm: BlockManager) -> tuple:
    return (list(bm.ref_counts), list(bm.evictable_blocks), bm.total_refs, dict(bm.hash_to_block),
            list(bm.block_hashes))


def test_allocate_fails_without_side_effects() -> None:
    bm = make_bm(4)
    a = make_request(list(range(12)), "a")
    assert bm.allocate(a, 12)                          # 3 of 4 blocks
    b = make_request(list(range(100, 105)), "b")
    before = snapshot(bm)
    assert not bm.allocate(b, 5)                       # needs 2, 1 free
    assert snapshot(bm) == before
    assert b.block_ids == []
    assert bm.allocate(b, 4)                           # 1 block fits exactly
    assert bm.num_free_blocks == 0


def test_allocate_counts_free_cached_blocks_as_taken() -> None:
    # Prefix hits that sit in the free list use up free blocks too: the fit is exact.
    bm = make_bm(4)
    prefix = list(range(8))
    a = make_request(prefix + [9], "a")
    admit_and_compute(bm, a)
    bm.free(a)                                         # 4 free blocks, 2 of them cached
    too_big = make_request(prefix + list(range(30, 39)), "big")     # 17 tokens = 5 blocks
    cached = bm.find_cached_blocks(too_big)
    assert len(cached) == 2
    before = snapshot(bm)
    assert not bm.allocate(too_big, too_big.num_tokens - 8, cached)
    assert snapshot(bm) == before
    assert too_big.block_ids == []
    fits = make_request(prefix + list(range(30, 35)), "fits")      # 13 tokens = 4 blocks
    cached = bm.find_cached_blocks(fits)
    assert bm.allocate(fits, fits.num_tokens - 8, cached)
    assert fits.block_ids[:2] == cached
    assert len(set(fits.block_ids)) == 4
    assert bm.num_free_blocks == 0
    assert bm.total_refs == 4


def test_reference_counts_return_to_zero() -> None:
    bm = make_bm(16)
    prefix = list(range(8))
    requests = [make_request(prefix + [i] * (i + 1), f"r{i}") for i in range(5)]
    for r in requests:
        admit_and_compute(bm, r)
    # Grow two of them by a decode step each.
    for r in requests[:2]:
        r.token_ids.append(3)
        assert bm.allocate(r, 1)
        r.num_computed_tokens += 1
        bm.cache_computed_blocks(r)
    assert bm.ref_counts[requests[0].block_ids[0]] == 5   # the shared prefix block
    assert bm.total_refs == sum(len(r.block_ids) for r in requests)
    bm.check()
    for r in requests[::2] + requests[1::2]:           # free in a mixed order
        bm.free(r)
    assert_all_free(bm)


def test_prefix_caching_disabled_gives_no_hits() -> None:
    bm = make_bm(8, prefix_caching=False)
    tokens = list(range(13))
    a = make_request(tokens, "a")
    admit_and_compute(bm, a)
    assert bm.hash_to_block == {}
    bm.free(a)
    assert bm.find_cached_blocks(make_request(tokens)) == []
    b = make_request(tokens, "b")
    admit_and_compute(bm, b)
    assert b.num_computed_tokens == 13 and len(b.block_ids) == 4
    bm.free(b)
    assert_all_free(bm)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_random_workload_keeps_every_invariant(prefix_caching: bool) -> None:
    """Random admissions (some sharing prefixes), decode growth, frees and preemptions on a
    tight pool: allocation succeeds exactly when enough blocks are free (reservations never
    refuse one), no block is held by two requests unless it is a shared cached prefix block,
    the counts add up every step, and everything comes back at the end."""
    import random
    rng = random.Random(7)
    bm = make_bm(48, prefix_caching)
    prefixes = [list(range(1000 * i, 1000 * i + 8)) for i in range(3)]
    running: list[Request] = []
    for step in range(600):
        action = rng.random()
        if action < 0.3:                                       # admit
            prompt = rng.choice(prefixes)[:rng.randint(0, 8)] + [rng.randrange(9, 99)
                                                                  for _ in range(rng.randint(1, 9))]
            r = Request(f"q{step}", prompt, SamplingParams(max_tokens=rng.randint(1, 40)))
            cached = bm.find_cached_blocks(r)
            need = bm.blocks_needed(r.num_tokens) - len(cached)
            fits = need <= bm.num_free_blocks - sum(bm.ref_counts[b] == 0 for b in cached)
            assert bm.allocate(r, r.num_tokens - len(cached) * BLOCK_SIZE, cached) == fits
            if fits:
                r.num_computed_tokens = r.num_tokens
                bm.cache_computed_blocks(r)
                running.append(r)
        elif action < 0.85 and running:                        # one decode step each
            for r in list(running):
                if r.num_output_tokens >= r.sampling_params.max_tokens:
                    bm.free(r)
                    running.remove(r)
                    continue
                r.token_ids.append(rng.randrange(9, 99))
                fits = bm.blocks_needed(r.num_tokens) - len(r.block_ids) <= bm.num_free_blocks
                assert bm.allocate(r, 1) == fits
                if not fits:                                   # preempt it
                    bm.free(r)
                    running.remove(r)
                    continue
                r.num_computed_tokens += 1
                bm.cache_computed_blocks(r)
        elif running:                                          # free one early
            bm.free(running.pop(rng.randrange(len(running))))
        bm.check()
        held = [b for r in running for b in r.block_ids]
        assert bm.total_refs == len(held)
        assert all(bm.ref_counts[b] == held.count(b) for b in set(held))
        shared = {b for b in held if held.count(b) > 1}
        assert all(bm.block_hashes[b] is not None for b in shared)
        assert bm.num_free_blocks == bm.num_blocks - len(set(held))
    for r in running:
        bm.free(r)
    assert_all_free(bm)
