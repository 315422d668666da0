"""Paged attention: the KV tensors, the per-step metadata, and the attention forward.

The KV cache manager (``optkit.serve.kv_cache``) hands out block ids; this module owns the
tensors those ids index: per layer ``k, v: (num_blocks, block_size, H_kv, D)``. Token ``p`` of a
sequence whose block table is ``bt`` lives in slot ``bt[p // block_size] * block_size + p % block_size``.

One step computes a flat batch of ``T`` tokens from several requests (DESIGN rule 7): decodes
(one new token after a cached context) and prefill chunks (several new tokens, possibly after a
cached prefix). Decodes are batched into one SDPA call over their gathered context; each prefill
chunk is one SDPA call (the causal fast path when nothing is cached before it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """Tokens ``[q_start, q_end)`` of the flat batch belong to one request whose chunk starts at
    position ``start``; ``block_table``: (n_blocks,) int64 covering positions ``< start + n``."""

    q_start: int
    q_end: int
    start: int
    block_table: torch.Tensor


@dataclass
class AttentionMetadata:
    """Built once per step by the runner, read by every layer.

    ``slot_mapping``: (T,) int64, the cache slot of each new token.
    Decodes occupy the first ``num_decodes`` rows of the flat batch:
    ``decode_block_table`` (B_d, max_blocks) int64 (padded with block 0),
    ``decode_mask`` (B_d, 1, 1, L) bool, True where a key position is visible, or None when a
    single decode covers exactly its context (then no mask is needed).
    ``decode_len``: L, the number of key positions gathered for decodes.
    ``decode_backend``: how decodes read the cache: "gather-sdpa" (above), or "flex" /
    "flash-attn" (``optkit.attention.flex``: the block table read in place, no gather), which use
    ``decode_context_lens`` (B_d,) int64 and ``decode_plan``, the backend's per-step tensors.
    """

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_table: torch.Tensor | None
    decode_mask: torch.Tensor | None
    decode_len: int
    prefills: list[PrefillChunk]
    # --- decode backend hook (optkit.attention.flex) ---
    decode_backend: str = "gather-sdpa"
    decode_context_lens: torch.Tensor | None = None
    decode_plan: Any = None


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that cost no memory until written, on CPU: ``calloc`` (numpy) maps zero pages
    lazily, where ``torch.zeros`` writes every byte up front. So resident memory grows with the
    blocks actually used, and the budget is an upper bound, not an up-front cost. Zeros, not
    ``empty``: masked-out slots are still multiplied by a zero weight, and garbage bits could
    be NaN."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class PagedKVCache:
    """The KV tensors of every layer: ``(num_blocks, block_size, H_kv, D)`` each for K and V."""

    def __init__(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device,
    ):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.k = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one token over all layers."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def build_metadata(
    decodes: list[tuple[int, list[int]]],
    prefills: list[tuple[int, int, list[int]]],
    block_size: int,
    device: torch.device,
    sliding_window: int | None = None,
    static_decode: bool = False,
    decode_backend: str = "gather-sdpa",
    num_blocks: int | None = None,
) -> AttentionMetadata:
    """Metadata for a flat batch: ``decodes`` first, one row each, as ``(context_len, block_ids)``
    where ``context_len`` counts the new token; then ``prefills`` as ``(start, n, block_ids)``.

    ``static_decode``: always describe decodes by tensor shapes (a padded block table and a
    mask, at least 2 blocks wide), never by a Python int, so a compiled decode step sees one
    dynamic shape instead of recompiling for every context length.

    ``decode_backend``: see ``AttentionMetadata``; "flex" also needs ``num_blocks``, the cache's
    block count (its block mask spans the whole cache)."""
    slots: list[int] = []
    for ctx, blocks in decodes:
        p = ctx - 1
        slots.append(blocks[p // block_size] * block_size + p % block_size)
    chunks = []
    row = len(decodes)
    for start, n, blocks in prefills:
        for p in range(start, start + n):
            slots.append(blocks[p // block_size] * block_size + p % block_size)
        n_blocks = -(-(start + n) // block_size)
        chunks.append(PrefillChunk(row, row + n, start, torch.tensor(blocks[:n_blocks], dtype=torch.int64, device=device)))
        row += n
    table = mask = None
    length = 0
    if decodes:
        max_blocks = max(-(-ctx // block_size) for ctx, _ in decodes)
        if static_decode:
            max_blocks = max(max_blocks, 2)  # size-1 dims get specialised by the compiler
        table = torch.tensor(
            [blocks[:max_blocks] + [0] * (max_blocks - len(blocks[:max_blocks])) for _, blocks in decodes],
            dtype=torch.int64, device=device,
        )
        ctx_lens = [ctx for ctx, _ in decodes]
        if len(decodes) == 1 and sliding_window is None and not static_decode:
            length = ctx_lens[0]  # gather exactly the context: no mask needed
        else:
            length = max_blocks * block_size
            pos = torch.arange(length, device=device)  # (L,)
            lens = torch.tensor(ctx_lens, device=device)[:, None]  # (B_d, 1)
            visible = pos[None, :] < lens
            if sliding_window is not None:  # the new token at ctx-1 sees keys > ctx-1-window
                visible &= pos[None, :] >= lens - sliding_window
            mask = visible[:, None, None, :]  # (B_d, 1, 1, L)
    meta = AttentionMetadata(
        torch.tensor(slots, dtype=torch.int64, device=device), len(decodes), table, mask, length, chunks
    )
    if decode_backend != "gather-sdpa":  # --- decode backend hook (optkit.attention.flex) ---
        from optkit.attention.flex import check_decode_backend, plan_decode

        meta.decode_backend = check_decode_backend(decode_backend)
        if decodes:
            meta.decode_context_lens = torch.tensor([ctx for ctx, _ in decodes], dtype=torch.int64, device=device)
            meta.decode_plan = plan_decode(
                decode_backend, table, meta.decode_context_lens, block_size, sliding_window, num_blocks
            )
    return meta


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """(num_blocks, bs, H, D) indexed by (..., n_blocks) -> (..., H, length, D)."""
    g = cache[block_table]  # (..., n_blocks, bs, H, D)
    g = g.flatten(-4, -3)[..., :length, :, :]  # (..., length, H, D)
    return g.transpose(-3, -2)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
) -> torch.Tensor:
    """q: (T, H_q, D); k, v: (T, H_kv, D), already rotated. Writes k, v to the cache, returns (T, H_q * D)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    # Scatter the new tokens into their slots (the cache stays the source of truth for later steps).
    k_cache.view(-1, Hkv, D).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, Hkv, D).index_copy_(0, meta.slot_mapping, v)
    nd = meta.num_decodes
    od_hook = None
    if nd and meta.decode_backend != "gather-sdpa":  # --- decode backend hook (optkit.attention.flex) ---
        from optkit.attention.flex import decode_attention

        od_hook = decode_attention(q[:nd], k_cache, v_cache, meta, scale, sliding_window)  # (B_d, H_q, D)
        if nd == T:
            return od_hook.reshape(T, Hq * D)
    elif nd == T and meta.decode_mask is None:  # one decode, nothing else: no output buffer needed
        kd = _gather(k_cache, meta.decode_block_table, meta.decode_len)  # (1, H_kv, L, D)
        vd = _gather(v_cache, meta.decode_block_table, meta.decode_len)
        od = F.scaled_dot_product_attention(q.view(1, Hkv, group, D), kd, vd, scale=scale)
        return od.reshape(T, Hq * D)
    out = torch.empty_like(q)
    if od_hook is not None:
        out[:nd] = od_hook
    elif nd:
        # GQA without repeating K/V: the G query heads of a KV head become G "query positions".
        qd = q[:nd].view(nd, Hkv, group, D)  # (B_d, H_kv, G, D)
        kd = _gather(k_cache, meta.decode_block_table, meta.decode_len)  # (B_d, H_kv, L, D)
        vd = _gather(v_cache, meta.decode_block_table, meta.decode_len)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[:nd] = od.reshape(nd, Hq, D)
    for c in meta.prefills:
        n = c.q_end - c.q_start
        # SDPA takes its fused (flash) CPU path only for 4-D inputs: keep a batch dim of 1.
        qp = q[c.q_start : c.q_end].transpose(0, 1)[None]  # (1, H_q, n, D)
        total = c.start + n
        windowed = sliding_window is not None and total > sliding_window
        if c.start == 0 and not windowed:
            kp = k[c.q_start : c.q_end].transpose(0, 1)[None]  # (1, H_kv, n, D): nothing cached before the chunk
            vp = v[c.q_start : c.q_end].transpose(0, 1)[None]
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=group > 1)
        else:
            kp = _gather(k_cache, c.block_table[None], total)  # (1, H_kv, total, D)
            vp = _gather(v_cache, c.block_table[None], total)
            qpos = torch.arange(c.start, total, device=q.device)[:, None]  # (n, 1)
            kpos = torch.arange(total, device=q.device)[None, :]  # (1, total)
            mask = kpos <= qpos  # causal with the chunk's offset
            if windowed:
                mask &= kpos > qpos - sliding_window
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=group > 1)
        out[c.q_start : c.q_end] = op[0].transpose(0, 1)
    return out.view(T, Hq * D)
