"""KV-cache metadata: exact block ids, LRU eviction order, chained hashes, ref counts."""

from __future__ import annotations

import pytest

from optkit.errors import UserError
from optkit.serve.kv_cache import BlockPool, KVCacheBudgetError, KVCacheManager, hash_block, num_blocks_for_budget
from optkit.serve.request import Request, SamplingParams


def make_req(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def computed(kv: KVCacheManager, req: Request, n: int, hits=()) -> list[int] | None:
    """Allocate like the scheduler does and mark the tokens computed."""
    ids = kv.allocate_slots(req, n, hits)
    if ids is not None:
        req.num_computed_tokens += len(hits) * kv.block_size + n
    return ids


# ----------------------------------------------------------------------------- hashing


def test_hash_block_is_chained_and_deterministic():
    root = hash_block(None, [1, 2, 3, 4])
    assert root == hash_block(None, [1, 2, 3, 4])
    assert len(root) == 32
    assert hash_block(None, [1, 2, 3, 5]) != root
    # same tokens, different parent: a different prefix, so a different hash
    a = hash_block(root, [9, 9, 9, 9])
    b = hash_block(hash_block(None, [7, 7, 7, 7]), [9, 9, 9, 9])
    assert a != b
    assert hash_block(None, [9, 9, 9, 9]) not in (a, b)
    # token ids are 64-bit: ids that agree in their low 32 bits stay distinct
    assert hash_block(None, [1]) != hash_block(None, [1 + 2**32])


def test_request_block_hashes_follow_the_chain():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_req("a", list(range(10)))
    kv.get_computed_blocks(req)
    h0 = hash_block(None, [0, 1, 2, 3])
    assert req.block_hashes == [h0, hash_block(h0, [4, 5, 6, 7])]  # only full blocks
    req.output_token_ids += [10, 11]  # the third block fills up: hashed incrementally
    kv.get_computed_blocks(req)
    assert req.block_hashes[2] == hash_block(req.block_hashes[1], [8, 9, 10, 11])


# ----------------------------------------------------------------------------- block pool


def test_pool_allocates_in_id_order_and_frees_to_the_tail():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 3
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    assert [b.block_id for b in pool.get_new_blocks(4)] == [3, 4, 5, 2]  # LRU head first
    assert pool.free_block_ids() == [1, 0]
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.get_new_blocks(3)


def test_pool_touch_removes_a_free_cached_block_from_the_queue():
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    assert pool.cache_full_block(blk, b"h" * 32)
    pool.free_blocks([blk])
    assert pool.free_block_ids() == [1, 2, 3, 0]
    assert pool.get_cached_block(b"h" * 32) is blk  # freed but still findable
    pool.touch([blk])
    assert blk.ref_cnt == 1 and pool.free_block_ids() == [1, 2, 3]
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]  # the hit block is not handed out
    assert pool.get_cached_block(b"h" * 32) is blk


def test_pool_keeps_the_first_block_for_a_duplicate_hash():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_block(a, b"x" * 32)
    assert not pool.cache_full_block(b, b"x" * 32)
    assert b.block_hash is None and pool.get_cached_block(b"x" * 32) is a


# ----------------------------------------------------------------------------- manager


def test_allocate_registers_full_blocks_as_chunks_fill_them():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_req("a", list(range(10)))
    assert computed(kv, req, 6) == [0, 1]  # a 6-token chunk: block 0 full, block 1 half
    assert sorted(b.block_id for b in kv.pool.cached.values()) == [0]
    assert computed(kv, req, 4) == [0, 1, 2]
    assert sorted(b.block_id for b in kv.pool.cached.values()) == [0, 1]
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 5 and kv.usage == pytest.approx(3 / 8)


def test_two_requests_share_a_prefix_and_reference_count_it():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", list(range(10)))
    assert computed(kv, a, 10) == [0, 1, 2]
    b = make_req("b", list(range(8)) + [50, 51, 52])  # shares a's first 2 blocks
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    assert computed(kv, b, 3, hits) == [0, 1, 3]
    assert b.num_computed_tokens == 11
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert kv.prefix_cache_stats.queries == 11 and kv.prefix_cache_stats.hits == 8
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 2]  # the shared blocks stay in use
    kv.free(b)
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 2, 3, 1, 0]  # reversed: tail before prefix
    kv.free(b)  # idempotent
    assert kv.num_free_blocks == 8 and kv.block_ids("b") == []


def test_a_fully_cached_prompt_still_computes_at_least_one_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", list(range(9)))
    computed(kv, a, 9)
    kv.free(a)
    b = make_req("b", list(range(9)))  # its 2 full blocks are cached: 1 token left
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    c = make_req("c", list(range(8)))  # exactly 2 full blocks: the last one is recomputed
    hits, n = kv.get_computed_blocks(c)
    assert [h.block_id for h in hits] == [0] and n == 4


def test_eviction_is_least_recently_freed_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_req("a", [1, 2, 3, 4, 5])
    b = make_req("b", [6, 7, 8, 9, 10])
    assert computed(kv, a, 4) == [0, 1]
    assert computed(kv, b, 4) == [2, 3]
    kv.free(a)
    kv.free(b)
    assert kv.pool.free_block_ids() == [1, 0, 3, 2]
    c = make_req("c", [20, 21, 22])
    assert computed(kv, c, 3) == [1, 0]  # evicts a's tail block, then a's first block
    assert kv.get_computed_blocks(make_req("a2", [1, 2, 3, 4, 5])) == ([], 0)  # evicted: not found
    hits, n = kv.get_computed_blocks(make_req("b2", [6, 7, 8, 9, 10]))
    assert [h.block_id for h in hits] == [2, 3] and n == 4  # b's blocks survive


def test_allocate_returns_none_and_changes_nothing_when_full():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_req("a", list(range(8)))
    computed(kv, a, 8)
    kv.free(a)  # blocks 0, 1 free but cached; queue [2, 3, 1, 0]
    big = make_req("big", list(range(100, 120)))
    assert computed(kv, big, 20) is None  # needs 5 > 4
    # a hit on the 2 free cached blocks revives them: they are not spare for its other blocks
    c = make_req("c", list(range(8)) + list(range(50, 58)))
    hits, n = kv.get_computed_blocks(c)
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    before = (kv.pool.free_block_ids(), dict(kv.pool.cached), [b.ref_cnt for b in kv.pool.blocks])
    assert kv.allocate_slots(c, 8 + 1, hits) is None  # needs 5 blocks: 2 hit + 3 new, only 2 spare
    assert (kv.pool.free_block_ids(), dict(kv.pool.cached), [b.ref_cnt for b in kv.pool.blocks]) == before
    assert kv.block_ids("c") == [] and kv.prefix_cache_stats.requests == 0
    assert computed(kv, c, 8, hits) == [0, 1, 2, 3]
    assert kv.prefix_cache_stats.requests == 1 and kv.num_free_blocks == 0


def test_stats_count_one_lookup_per_admission():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", list(range(9)))
    computed(kv, a, 9)
    b = make_req("b", list(range(9)))
    for _ in range(3):  # e.g. the scheduler retried admission for 3 steps
        hits, n = kv.get_computed_blocks(b)
    computed(kv, b, 1, hits)
    s = kv.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (1, 9, 8)  # a was allocated without a lookup
    assert s.hit_rate == pytest.approx(8 / 9)


def test_reset_prefix_cache_and_caching_disabled():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", list(range(9)))
    computed(kv, a, 9)
    kv.free(a)
    assert kv.reset_prefix_cache() == 2
    assert kv.get_computed_blocks(make_req("b", list(range(9)))) == ([], 0)
    off = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_req("a", list(range(9)))
    computed(off, a, 9)
    assert off.pool.cached == {} and a.block_hashes == []
    off.free(a)
    assert off.get_computed_blocks(make_req("b", list(range(9)))) == ([], 0)


def test_num_blocks_for_budget():
    # one block: K and V x 2 layers x 4 tokens x 2 heads x 8 dims x 2 bytes = 512 bytes
    assert num_blocks_for_budget(512 * 10 + 511, 4, 2, 2, 8, 2) == 10
    with pytest.raises(KVCacheBudgetError, match="holds no block.*512 bytes") as e:
        num_blocks_for_budget(511, 4, 2, 2, 8, 2)
    assert isinstance(e.value, UserError) and isinstance(e.value, ValueError)
    with pytest.raises(ValueError, match="head_dim=0"):
        num_blocks_for_budget(10**6, 4, 2, 2, 0, 2)
