"""KV-cache blocks as metadata: ids, reference counts, prefix hashes and the LRU free queue.

No tensors live here. The attention backend owns one ``(num_blocks, block_size, ...)`` K and V
tensor per layer and indexes it by ``block_id``; this module only decides which ids a request
may write to and which ids already hold a given prefix.

Two rules carry the design (vLLM v1 ``core/block_pool.py``):

* **The free queue is the LRU order.** Fresh blocks start in id order; allocation pops the head;
  a block whose last user lets go is appended at the tail. A freed block keeps its KV and its
  hash, so it stays findable by prefix lookups until allocation pops it for reuse: the least
  recently freed cached block is therefore the first one evicted.
* **Block hashes are chained.** ``hash_block(parent, tokens)`` covers the whole prefix, so equal
  hashes mean equal prefixes (up to a cryptographic collision), never just equal block contents.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Parent of a sequence's first block. A fixed 32-byte value (the digest size below) keeps the
# hashed message unambiguous: every message is exactly 32 parent bytes + 8 bytes per token.
_ROOT_HASH = hashlib.sha256(b"optkit-kv-prefix-root").digest()


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """SHA-256 over the parent's hash and the block's token ids (little-endian int64).

    A cryptographic digest, not Python's ``hash()``: a collision would make a request reuse
    another prefix's KV and silently produce wrong tokens. ``parent_hash=None`` marks the first
    block of a sequence.
    """
    toks = array("q", token_ids)  # int64: any vocabulary fits; the byte layout is fixed below
    if sys.byteorder != "little":
        toks.byteswap()
    h = hashlib.sha256(_ROOT_HASH if parent_hash is None else parent_hash)
    h.update(toks.tobytes())
    return h.digest()


@dataclass(eq=False)
class KVBlock:
    """One block of ``block_size`` token slots in every layer's KV tensor.

    ``ref_cnt``: running requests whose block table holds this block (0: in the free queue).
    ``block_hash``: the chained hash of the prefix whose last full block this is, while the
    block is registered in the prefix cache; ``None`` otherwise.
    Identity equality (``eq=False``): two blocks are the same only if they are the same object.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """All ``num_blocks`` blocks, the LRU free queue and the prefix-cache index.

    The free queue is an ``OrderedDict[block_id, KVBlock]``: ``popitem(last=False)`` pops the
    head, assignment appends at the tail and ``pop(block_id)`` removes a cached block from the
    middle in O(1) when a prefix lookup revives it (vLLM uses a hand-written doubly linked list;
    in Python the C-implemented OrderedDict is both simpler and faster).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r} is invalid; allowed: an integer >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        # hash -> the block holding that prefix (in use or free). One block per hash: a second
        # block computed with the same hash (two requests filled it before either could hit)
        # stays unregistered and is recycled like any uncached block.
        self.cached: dict[bytes, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ``ref_cnt == 0``, cached or not: all can be handed out (cached ones are evicted)."""
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        """The free queue head to tail (the order the next allocations take); for tests and debugging."""
        return list(self._free)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Pop ``n`` blocks from the LRU head, evicting their cached hashes; each gets ``ref_cnt=1``."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self._free)} are free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            assert block.ref_cnt == 0, f"block {block.block_id} in the free queue with ref_cnt={block.ref_cnt}"
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """A prefix-cache hit: one more user for each block; free ones leave the free queue so
        they cannot be reallocated (and overwritten) while the new user reads them."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """One user fewer for each block; blocks nobody uses join the free queue's tail in the
        order given. Callers pass a request's blocks in reverse, so its tail blocks (the least
        shareable) are evicted before its prefix blocks (vLLM does the same)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than allocated"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_full_block(self, block: KVBlock, block_hash: bytes) -> bool:
        """Register a full block under its chained hash; False when caching is off or another
        block already holds that hash (this one then stays an ordinary block)."""
        if not self.enable_caching:
            return False
        if block.block_hash is not None:
            assert block.block_hash == block_hash, f"block {block.block_id} re-registered under a different hash"
            return True
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        """The block holding the prefix with this hash, in use or free-but-not-yet-evicted."""
        return self.cached.get(block_hash) if self.enable_caching else None

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (e.g. between benchmark runs, or after new weights); returns
        how many were dropped. Blocks in use keep their KV and their owners; they are only no
        longer findable, which is always safe because hits are an optimisation."""
        n = len(self.cached)
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return n

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
