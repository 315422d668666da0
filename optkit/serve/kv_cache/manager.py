"""Per-request block tables on top of the :class:`BlockPool`, with prefix caching.

The scheduler talks only to :class:`KVCacheManager`: it asks which prefix of a request is
already cached (:meth:`~KVCacheManager.get_computed_blocks`), asks for room for the tokens it
is about to schedule (:meth:`~KVCacheManager.allocate_slots`, ``None`` when the pool is short,
so the scheduler can preempt) and releases a request's blocks when it leaves or is preempted
(:meth:`~KVCacheManager.free`). (vLLM v1 ``core/kv_cache_manager.py``.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from optkit.errors import UserError
from optkit.serve.kv_cache.block_pool import BlockPool, KVBlock, hash_block
from optkit.serve.request import Request


class KVCacheBudgetError(UserError, ValueError):
    """The memory budget cannot hold even one KV block (a ``UserError`` for the CLI, and a
    ``ValueError`` for callers that treat it as a bad argument)."""


def num_blocks_for_budget(budget_bytes: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """How many KV blocks fit in ``budget_bytes``.

    One block holds K and V for ``block_size`` tokens in every layer:
    ``2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes`` bytes.
    """
    for name, value in (
        ("block_size", block_size),
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("dtype_bytes", dtype_bytes),
    ):
        if not isinstance(value, int) or value < 1:
            raise KVCacheBudgetError(f"{name}={value!r} is invalid; allowed: an integer >= 1")
    per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes  # K and V
    n = int(budget_bytes) // per_block
    if n < 1:
        raise KVCacheBudgetError(
            f"KV-cache budget of {int(budget_bytes)} bytes holds no block: one block of {block_size} tokens needs "
            f"{per_block} bytes (2 x {num_layers} layers x {block_size} tokens x {num_kv_heads} KV heads x "
            f"{head_dim} head_dim x {dtype_bytes} bytes)",
            hint="raise the KV-cache memory budget or lower block_size",
        )
    return n


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache lookups, counted in tokens, once per successful admission of a request
    (a request that waits several steps for room is not counted once per attempt)."""

    requests: int = 0
    queries: int = 0  # tokens looked up (the request's length at lookup)
    hits: int = 0  # of those, tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Block tables of running requests, prefix-cache lookups and the pool's accounting."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} is invalid; allowed: an integer >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        # How many of a request's leading blocks are already registered in the prefix cache, so
        # each allocation only hashes and registers the blocks it newly fills.
        self._num_cached_blocks: dict[str, int] = {}
        # The last lookup's (queries, hits) per request, committed to the stats when that
        # request's allocation succeeds (see PrefixCacheStats).
        self._pending_lookup: dict[str, tuple[int, int]] = {}
        self._stats = PrefixCacheStats()

    # ----------------------------------------------------------------- queries

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests (free cached blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self._stats

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (block ids in token order); empty when it holds none."""
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ----------------------------------------------------------------- prefix cache

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of the request's full blocks, and its length in tokens.

        Capped so at least one token is left to compute: the last token's forward pass is what
        produces the logits to sample from, so a fully cached prompt still recomputes its last
        block. Blocks are returned untouched; :meth:`allocate_slots` takes the reference.
        """
        if not self.enable_prefix_caching:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break  # the chain is broken: later blocks cannot match a different prefix
            hits.append(block)
        num_computed = len(hits) * self.block_size
        self._pending_lookup[request.request_id] = (request.num_tokens, num_computed)
        return hits, num_computed

    def _update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to cover every full block of its known tokens.

        Tokens are only ever appended, so earlier hashes stay valid (also across preemptions)
        and each block is hashed once in the request's life.
        """
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        if len(hashes) >= num_full:
            return
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(len(hashes), num_full):
            hashes.append(hash_block(hashes[i - 1] if i else None, tokens[i * bs : (i + 1) * bs]))

    # ----------------------------------------------------------------- allocation

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock] = ()) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after the request's computed ones.

        ``new_computed_blocks``: a prefix-cache hit from :meth:`get_computed_blocks`, only for a
        request that holds no blocks yet. The request then needs slots for
        ``num_computed_tokens + len(hit) * block_size + num_new_tokens`` tokens. Returns the
        request's whole block table (ids), or ``None`` with nothing changed when the free queue
        cannot supply the missing blocks; free cached blocks count as available (they are
        evicted), except those the hit itself revives.

        Blocks that the scheduled tokens fill are registered in the prefix cache here, before
        the runner computes them (as vLLM does): a hit later in the same step points at KV the
        same forward pass writes, so the runner must write each layer's KV for all scheduled
        tokens before that layer's attention reads it.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens={num_new_tokens} is invalid; allowed: >= 0")
        rid = request.request_id
        blocks = self._req_blocks.get(rid)
        if new_computed_blocks:
            assert not blocks, f"request {rid} already holds blocks; a prefix hit only applies at admission"
        num_held = len(blocks) if blocks else 0
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        num_new_blocks = self.num_blocks_for_tokens(total) - num_held - len(new_computed_blocks)
        # Free cached blocks that this hit revives leave the free queue: they are not spare.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_revived:
            return None

        if blocks is None:
            blocks = self._req_blocks[rid] = []
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        if num_new_blocks > 0:
            blocks.extend(self.pool.get_new_blocks(num_new_blocks))
        if rid in self._pending_lookup:
            queries, hits = self._pending_lookup.pop(rid)
            s = self._stats
            self._stats = PrefixCacheStats(s.requests + 1, s.queries + queries, s.hits + hits)

        if self.enable_prefix_caching:
            self._cache_full_blocks(request, blocks, min(total, request.num_tokens) // self.block_size)
        return [b.block_id for b in blocks]

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_full: int) -> None:
        rid = request.request_id
        start = self._num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        for i in range(start, num_full):
            self.pool.cache_full_block(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, see :meth:`BlockPool.free_blocks`) and
        forget its block table. Idempotent: a second call, or one for a request holding no
        blocks, does nothing."""
        rid = request.request_id
        self._pending_lookup.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        blocks = self._req_blocks.pop(rid, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> int:
        """Forget all cached prefixes (see :meth:`BlockPool.reset_prefix_cache`). Running
        requests' already-registered blocks are not registered again: they simply stop being
        findable. Returns the number of hashes dropped."""
        return self.pool.reset_prefix_cache()

    def reset_stats(self) -> None:
        self._stats = PrefixCacheStats()
