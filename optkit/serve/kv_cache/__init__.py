"""KV-cache metadata: the block pool (LRU free queue, chained prefix hashes) and the
per-request manager the scheduler uses. No tensors: the attention backend owns them."""

from optkit.serve.kv_cache.block_pool import BlockPool, KVBlock, hash_block
from optkit.serve.kv_cache.manager import KVCacheBudgetError, KVCacheManager, PrefixCacheStats, num_blocks_for_budget

__all__ = [
    "BlockPool",
    "KVBlock",
    "KVCacheBudgetError",
    "KVCacheManager",
    "PrefixCacheStats",
    "hash_block",
    "num_blocks_for_budget",
]
