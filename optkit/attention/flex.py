"""Paged decode attention that reads the block table in place: no gather copy of the context.

The default decode path of :func:`optkit.attention.paged.paged_attention` ("gather-sdpa") copies
each request's blocks out of the cache into a padded ``(B, H_kv, L, D)`` tensor and runs SDPA with
a padding mask. The backends here read the cache where it lies:

- ``"flex"``: ``torch.nn.attention.flex_attention`` over the whole cache seen as one KV sequence of
  ``num_blocks * block_size`` slots. A :class:`BlockMask` whose sparse KV block is the cache block
  lists, per request, the physical blocks of its context in logical order (so the kernel touches
  only those), and a ``mask_mod`` maps a physical slot back to its logical position through a
  physical-to-logical table to cut the last block at the context length and apply the sliding
  window. This is the construction of ``torch.nn.attention.experimental._paged_attention``
  (``PagedAttention.convert_logical_block_mask`` / ``get_mask_mod``) and of vLLM's FlexAttention
  backend, built directly from our block table instead of through that class's own allocator.
  GQA: the ``G = H_q / H_kv`` query heads of a KV head are folded into the query-length axis
  (``(B, H_kv, G, D)``), as the gather path does, instead of ``enable_gqa=True``: inductor's
  decode kernel (``flex_decoding``) only takes power-of-two GQA ratios (SmolLM-135M has 9/3) and
  a block mask with one head, and the general kernel needs ``BLOCK_N`` to divide the page.
- ``"flash-attn"``: ``flash_attn.flash_attn_with_kvcache(..., block_table=...)`` (flash-attn 2,
  CUDA, fp16/bf16, pages a multiple of 256 tokens).

Neither backend is used for prefill chunks; :func:`select_decode_backend` says which one fits a
device, with the reason.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from optkit.attention.paged import AttentionMetadata

DECODE_BACKENDS = ("flash-attn", "flex", "gather-sdpa")

# One sparse Q tile holds all G folded query rows of a KV head; inductor's CUDA decode kernel
# uses BLOCK_M = max(next_pow2(G), 16), which must divide it, and takes only q_len < 128.
_Q_TILE = 128
# Batch sizes are padded to a power of two >= 8 so the compiled kernel (static shapes; the CUDA
# decode kernel needs a static batch) is reused: 8 buckets (8..1024) fit dynamo's default
# recompile limit of 8 per function.
_MIN_BATCH_BUCKET = 8
_FLASH_PAGE_MULTIPLE = 256  # flash-attn 2 fwd_kvcache: "Paged KV cache block size must be divisible by 256"


def check_decode_backend(name: str) -> str:
    if name not in DECODE_BACKENDS:
        raise ValueError(f"decode_backend={name!r} is not one of {DECODE_BACKENDS}")
    return name


# ---------------------------------------------------------------------------------------------
# Backend selection
# ---------------------------------------------------------------------------------------------


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _flash_attn_refusal(device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int) -> str | None:
    """Why flash-attn's paged decode cannot run here, or None when it can."""
    if not _importable("flash_attn"):
        return "flash_attn is not installed"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn takes float16/bfloat16, not {dtype}"
    if block_size % _FLASH_PAGE_MULTIPLE:
        return f"flash-attn 2 paged KV needs block_size % {_FLASH_PAGE_MULTIPLE} == 0, got {block_size}"
    if head_dim > 256 or head_dim % 8:
        return f"flash-attn needs head_dim <= 256 and a multiple of 8, got {head_dim}"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"flash-attn 2 needs compute capability >= 8.0 (Ampere), got {major}.x"
    return None


def _flex_cuda_refusal(block_size: int) -> str | None:
    """Why flex cannot run on this CUDA device, or None when it can."""
    if not _importable("triton"):
        return "triton is not installed (inductor generates the CUDA flex kernel with it)"
    if block_size < 16 or block_size & (block_size - 1):
        # The kernel's KV tile BLOCK_N is capped at the sparse block (the page) and must divide
        # it; Triton's tl.dot needs tiles >= 16 and power-of-two aranges.
        return f"flex on CUDA needs block_size a power of two >= 16, got {block_size}"
    return None


def select_decode_backend(
    device: torch.device | str, dtype: torch.dtype, head_dim: int, block_size: int
) -> tuple[str, str]:
    """(name, reason): the fastest decode backend that can run on ``device``.

    CUDA: "flash-attn" when it is importable and its constraints hold, else "flex" (Triton via
    inductor), else "gather-sdpa". Elsewhere "gather-sdpa": on CPU compiled flex only ties or
    loses at the sizes the CPU engine runs. One layer's decode (cache write + attention), H_q=9,
    H_kv=3, D=64, block 16, contexts 512, 505, ...; medians of 30 in ms, 2 threads, quiet machine
    (``.venv/bin/python -m optkit.attention.flex 2``; ``... 1`` for one thread)::

        B   dtype     cache slots  gather-sdpa  flex (compiled)  flex/gather  (1 thread)
        8   float32         4,352        0.914            0.839        0.92x       0.77x
        8   float32        65,536        0.872            0.932        1.07x       0.87x
        8   bfloat16        4,352        0.748            1.082        1.45x       1.35x
        8   bfloat16       65,536        0.769            1.127        1.47x       1.31x
        1   float32        65,536        0.218            0.450        2.06x       1.83x
        32  float32        65,536        3.456            2.489        0.72x       0.52x

    Flex's per-step plan (block lists and the physical-to-logical map, shared by all layers) adds
    0.24-0.57 ms per step, not per layer. Flex pays off on CPU only from ~32 concurrent decodes in
    float32; and inside the engine's compiled decode step it costs a graph break per layer (the
    inductor CPU flex template fails to build under dynamic shapes: ``cur_kvSplitSize6`` not
    declared, torch 2.13), so the CPU default stays the gather.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return "gather-sdpa", (
            f"{device.type}: gather + SDPA (compiled flex measured slower on CPU, see select_decode_backend)"
        )
    if not torch.cuda.is_available():
        return "gather-sdpa", "CUDA requested but torch.cuda.is_available() is False"
    flash_why = _flash_attn_refusal(device, dtype, head_dim, block_size)
    if flash_why is None:
        return "flash-attn", "flash_attn importable; fp16/bf16, page a multiple of 256, head_dim <= 256, sm >= 80"
    flex_why = _flex_cuda_refusal(block_size)
    if flex_why is None:
        return "flex", f"FlexAttention paged decode (flash-attn refused: {flash_why})"
    return "gather-sdpa", f"flash-attn refused: {flash_why}; flex refused: {flex_why}"


# ---------------------------------------------------------------------------------------------
# Per-step plans (built once per step in build_metadata, read by every layer)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlexDecodePlan:
    """The block-mask tensors of one decode step, padded to a batch bucket of ``B_p`` rows.

    ``kv_num_blocks``: (B_p, 1, 1) int32, visible blocks per row.
    ``kv_indices``: (B_p, 1, 1, num_blocks) int32, physical ids of the visible blocks in logical
    order (first ``kv_num_blocks`` entries; the width is the whole cache so one compiled kernel
    serves every context length, and the CPU kernel asserts ``width * block_size >= kv_len``).
    ``phys_to_logical``: (B_p, num_blocks) int32, the logical block index of each physical block
    in row b's context, -1 elsewhere.
    ``context_lens``: (B_p,) int64 (padding rows: 1, reading slot 0).
    """

    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    phys_to_logical: torch.Tensor
    context_lens: torch.Tensor
    batch: int
    block_size: int
    sliding_window: int | None


@dataclass(frozen=True)
class FlashDecodePlan:
    """flash-attn wants int32: ``block_table`` (B, max_blocks), ``cache_seqlens`` (B,)."""

    block_table: torch.Tensor
    cache_seqlens: torch.Tensor


def _bucket(b: int) -> int:
    return max(_MIN_BATCH_BUCKET, 1 << (b - 1).bit_length())


def plan_flex_decode(
    block_table: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int,
    sliding_window: int | None = None,
) -> FlexDecodePlan:
    """block_table: (B, M) int64 (padded with any id), context_lens: (B,) int64 (>= 1)."""
    B, M = block_table.shape
    Bp = _bucket(B)
    dev = block_table.device
    table = torch.zeros(Bp, M, dtype=torch.int64, device=dev)
    table[:B] = block_table
    lens = torch.ones(Bp, dtype=torch.int64, device=dev)
    lens[:B] = context_lens
    n_blocks = (lens + block_size - 1) // block_size  # (B_p,) blocks holding the context
    if sliding_window is None:
        first = torch.zeros_like(lens)
    else:  # the new token at ctx-1 sees positions >= ctx - window
        first = (lens - sliding_window).clamp(min=0) // block_size
    j = torch.arange(M, device=dev)  # (M,) logical block index
    visible = table.gather(1, (first[:, None] + j[None, :]).clamp(max=M - 1))  # (B_p, M)
    kv_indices = torch.zeros(Bp, 1, 1, num_blocks, dtype=torch.int32, device=dev)
    kv_indices[:, 0, 0, :M] = visible.to(torch.int32)
    # Inverse map; entries past a row's context (padding ids) go to a spare column and are dropped.
    in_ctx = j[None, :] < n_blocks[:, None]  # (B_p, M)
    p2l = torch.full((Bp, num_blocks + 1), -1, dtype=torch.int32, device=dev)
    p2l.scatter_(1, torch.where(in_ctx, table, num_blocks), j.to(torch.int32).expand(Bp, M).contiguous())
    return FlexDecodePlan(
        (n_blocks - first).to(torch.int32).view(Bp, 1, 1), kv_indices, p2l[:, :num_blocks].contiguous(), lens,
        B, block_size, sliding_window,
    )


def plan_decode(
    backend: str, block_table: torch.Tensor, context_lens: torch.Tensor, block_size: int,
    sliding_window: int | None, num_blocks: int | None,
) -> FlexDecodePlan | FlashDecodePlan:
    """The per-step plan of ``backend`` ("flex" or "flash-attn"); called by ``build_metadata``."""
    if backend == "flex":
        if num_blocks is None:
            raise ValueError(
                "decode_backend='flex' needs num_blocks (the cache's block count: the block mask spans the "
                "whole cache); pass build_metadata(..., num_blocks=cache.num_blocks)"
            )
        return plan_flex_decode(block_table, context_lens, num_blocks, block_size, sliding_window)
    if backend == "flash-attn":
        return FlashDecodePlan(block_table.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous())
    raise ValueError(f"no decode plan for backend {backend!r}; planned backends: 'flex', 'flash-attn'")


# ---------------------------------------------------------------------------------------------
# FlexAttention
# ---------------------------------------------------------------------------------------------


@cache
def _compiled_flex():
    """flex_attention is only fused under torch.compile (eager runs a reference that materialises
    scores over the whole cache). Static shapes: the batch is bucketed by the plan."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


def _block_mask(plan: FlexDecodePlan, q_len: int, kv_len: int):
    from torch.nn.attention.flex_attention import BlockMask

    p2l, lens, bs, window = plan.phys_to_logical, plan.context_lens, plan.block_size, plan.sliding_window

    def mask_mod(b, h, q_idx, kv_idx):  # kv_idx: a physical slot of the cache
        logical_block = p2l[b, kv_idx // bs]
        pos = logical_block * bs + kv_idx % bs  # position in sequence b
        keep = (logical_block >= 0) & (pos < lens[b])
        if window is not None:
            keep = keep & (pos >= lens[b] - window)
        return keep

    return BlockMask.from_kv_blocks(
        plan.kv_num_blocks, plan.kv_indices, BLOCK_SIZE=(_Q_TILE, bs), mask_mod=mask_mod,
        seq_lengths=(q_len, kv_len), compute_q_blocks=False,  # inference only: no backward tables
    )


def flex_paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_table: torch.Tensor, context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
    *, plan: FlexDecodePlan | None = None, compiled: bool = True,
) -> torch.Tensor:
    """One new token per sequence against its paged context, read in place.

    q: (B, H_q, D), already rotated, its K/V already in the cache; k_cache, v_cache:
    (num_blocks, block_size, H_kv, D); block_table: (B, max_blocks) int64, padded;
    context_lens: (B,) int64, counting the new token. Returns (B, H_q, D).
    ``plan``: the step's :class:`FlexDecodePlan` (built from block_table/context_lens when None).
    ``compiled=False`` runs flex's eager reference (scores over every cache slot: tests only).
    """
    B, Hq, D = q.shape
    N, bs, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    if G >= _Q_TILE:
        raise ValueError(f"flex decode folds the H_q/H_kv = {G} query heads of a KV head into rows; needs < {_Q_TILE}")
    if plan is None:
        plan = plan_flex_decode(block_table, context_lens, N, bs, sliding_window)
    if plan.batch != B or plan.phys_to_logical.shape[1] != N or plan.block_size != bs:
        raise ValueError(
            f"plan for batch {plan.batch}, {plan.phys_to_logical.shape[1]} blocks of {plan.block_size} "
            f"does not fit q batch {B} and a cache of {N} blocks of {bs}"
        )
    Bp = plan.context_lens.shape[0]
    qf = q.view(B, Hkv, G, D)  # (B, H_kv, G, D): GQA folded into rows
    if Bp > B:
        qf = torch.cat([qf, qf.new_zeros(Bp - B, Hkv, G, D)])  # (B_p, H_kv, G, D)
    k = k_cache.view(1, N * bs, Hkv, D).transpose(1, 2)  # (1, H_kv, N*bs, D): a view, no copy
    v = v_cache.view(1, N * bs, Hkv, D).transpose(1, 2)
    mask = _block_mask(plan, G, N * bs)
    if compiled:
        # Static batch, one mask head, q_len G < 128 and GQA ratio 1 select inductor's decode
        # kernel, which caps its KV tile at the page. Should the general kernel be taken instead,
        # its tile BLOCK_N must divide the page too (its default configs use 64-128).
        opts = {"BLOCK_N": min(bs, 64)} if q.device.type == "cuda" else None
        out = _compiled_flex()(qf, k, v, block_mask=mask, scale=scale, kernel_options=opts)
    else:
        from torch.nn.attention.flex_attention import flex_attention

        out = flex_attention(qf, k, v, block_mask=mask, scale=scale)
    return out[:B].reshape(B, Hq, D)


# ---------------------------------------------------------------------------------------------
# flash-attn
# ---------------------------------------------------------------------------------------------


def flash_attn_paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_table: torch.Tensor, context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
    *, plan: FlashDecodePlan | None = None,
) -> torch.Tensor:
    """Same contract as :func:`flex_paged_decode`, through ``flash_attn.flash_attn_with_kvcache``
    (q (B, 1, H_q, D), paged caches (num_blocks, page, H_kv, D), int32 ``block_table`` and
    ``cache_seqlens``; GQA native). The window: flash-attn's query i sees keys
    ``[i + L_k - L_q - left, i + L_k - L_q + right]``; with L_q = 1 the new token at ctx-1 sees
    ``>= ctx - 1 - left``, and ours sees ``>= ctx - window``, so ``left = window - 1``."""
    from flash_attn import flash_attn_with_kvcache

    if plan is None:
        plan = FlashDecodePlan(block_table.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous())
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
    out = flash_attn_with_kvcache(
        q.unsqueeze(1), k_cache, v_cache, cache_seqlens=plan.cache_seqlens, block_table=plan.block_table,
        softmax_scale=scale, causal=True, window_size=window,
    )  # (B, 1, H_q, D)
    return out.squeeze(1)


# ---------------------------------------------------------------------------------------------
# The hook called by paged_attention
# ---------------------------------------------------------------------------------------------


# A compile boundary: when the caller compiles its decode step (``ServeModel.enable_compile``,
# dynamic shapes), the backend still runs its own kernel with its own static, bucketed shapes
# (inlined into the caller's graph, inductor's CPU flex template failed to build, both with a
# dynamic batch and with B equal to its bucket); flash-attn is an opaque extension call anyway.
# The price is one graph break per layer, as vLLM's attention custom op takes.
@torch.compiler.disable
def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """The decode rows of ``paged_attention`` through ``meta.decode_backend``: q (B_d, H_q, D) -> (B_d, H_q, D)."""
    args = (q, k_cache, v_cache, meta.decode_block_table, meta.decode_context_lens, scale, sliding_window)
    if meta.decode_backend == "flex":
        return flex_paged_decode(*args, plan=meta.decode_plan)
    if meta.decode_backend == "flash-attn":
        return flash_attn_paged_decode(*args, plan=meta.decode_plan)
    raise ValueError(f"decode_backend={meta.decode_backend!r} has no in-place kernel; one of {DECODE_BACKENDS}")


# ---------------------------------------------------------------------------------------------
# CPU measurement behind select_decode_backend: .venv/bin/python -m optkit.attention.flex
# ---------------------------------------------------------------------------------------------


def _bench(threads: int, repeats: int = 30, warmup: int = 10) -> None:  # pragma: no cover - a measurement
    import statistics
    import time

    from optkit.attention.paged import build_metadata, paged_attention

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    Hq, Hkv, D, ctx, bs = 9, 3, 64, 512, 16
    print(f"decode attention of one layer (cache write + attention): H_q={Hq} H_kv={Hkv} D={D} context~{ctx} "
          f"block={bs}; median (min..max) ms of {repeats} after {warmup} warm-up, alternating; threads={threads}")
    for B, dtype, N in (
        (8, torch.float32, 8 * ctx // bs + 16), (8, torch.float32, 4096),
        (8, torch.bfloat16, 8 * ctx // bs + 16), (8, torch.bfloat16, 4096),
        (1, torch.float32, 4096), (32, torch.float32, 4096),
    ):
        kc = torch.randn(N, bs, Hkv, D, dtype=dtype)
        vc = torch.randn_like(kc)
        ids = torch.randperm(N)[: B * ctx // bs].view(B, -1).tolist()
        decodes = [(ctx - 7 * i, ids[i]) for i in range(B)]  # contexts 512, 505, ...
        q = torch.randn(B, Hq, D, dtype=dtype)
        k = torch.randn(B, Hkv, D, dtype=dtype)
        v = torch.randn_like(k)
        times: dict[str, list[float]] = {"gather-sdpa": [], "flex": [], "flex plan/step": []}
        outs = {}
        for _ in range(warmup + repeats):  # alternate so drift hits both
            for name in ("gather-sdpa", "flex"):
                t0 = time.perf_counter()
                meta = build_metadata(decodes, [], bs, torch.device("cpu"), decode_backend=name, num_blocks=N)
                t1 = time.perf_counter()
                outs[name] = paged_attention(q, k, v, kc, vc, meta, D**-0.5)
                t2 = time.perf_counter()
                times[name].append((t2 - t1) * 1e3)
                if name == "flex":
                    times["flex plan/step"].append((t1 - t0) * 1e3)
        err = (outs["flex"].float() - outs["gather-sdpa"].float()).abs().max().item()
        med = {n: statistics.median(t[warmup:]) for n, t in times.items()}
        cells = "  ".join(f"{n} {med[n]:.3f} ({min(t[warmup:]):.3f}..{max(t[warmup:]):.3f})" for n, t in times.items())
        print(f"B={B:2d} {str(dtype)[6:]:8s} cache {N * bs:5d} slots: {cells}  "
              f"flex/gather {med['flex'] / med['gather-sdpa']:.2f}x  max|diff| {err:.1e}")


if __name__ == "__main__":
    import sys

    _bench(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
