"""Paged attention against dense attention, and the in-place decode backends against the gather path.

Each case builds a cache whose blocks are handed out in a random order (so a sequence's blocks
are not contiguous and sequences interleave), writes each sequence's past K/V through its slots,
and compares the paged result for the new tokens with SDPA over the unpaged K/V.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools

import pytest
import torch
import torch.nn.functional as F

from optkit.attention import flex
from optkit.attention.flex import flex_paged_decode, plan_flex_decode, select_decode_backend
from optkit.attention.paged import build_metadata, paged_attention

H_KV, D = 2, 16
NUM_BLOCKS = 160  # fixed, so compiled flex sees one cache shape per (block size, heads, dtype)
LENGTHS = (1, 5, 37, 100)
WINDOW = 8


class Seqs:
    """Sequences with dense K/V (L, H_kv, D) each and random block ids in one shared cache."""

    def __init__(self, lengths, block_size, group, dtype=torch.float32, seed=0, num_blocks=NUM_BLOCKS):
        g = torch.Generator().manual_seed(seed)
        self.bs, self.hq, self.dtype = block_size, H_KV * group, dtype
        self.k = [torch.randn(n, H_KV, D, generator=g).to(dtype) for n in lengths]
        self.v = [torch.randn(n, H_KV, D, generator=g).to(dtype) for n in lengths]
        self.q = [torch.randn(n, self.hq, D, generator=g).to(dtype) for n in lengths]  # a query per position
        need = [-(-n // block_size) for n in lengths]
        ids = torch.randperm(num_blocks, generator=g).tolist()
        assert sum(need) <= num_blocks
        self.blocks, at = [], 0
        for n in need:
            self.blocks.append(ids[at : at + n])
            at += n
        self.k_cache = torch.zeros(num_blocks, block_size, H_KV, D, dtype=dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.k_cache.normal_(generator=g)  # garbage in unused slots: masking must hide it
        self.v_cache.normal_(generator=g)

    def write(self, i: int, upto: int) -> None:
        """Positions [0, upto) of sequence i into its slots (what earlier steps left in the cache)."""
        for p in range(upto):
            b, o = self.blocks[i][p // self.bs], p % self.bs
            self.k_cache[b, o] = self.k[i][p]
            self.v_cache[b, o] = self.v[i][p]

    def dense(self, i: int, start: int, end: int, window: int | None) -> torch.Tensor:
        """Rows [start, end) of causal attention over sequence i's dense K/V: (n, H_q, D) float32."""
        n_k = end
        qpos = torch.arange(start, end)[:, None]
        kpos = torch.arange(n_k)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        q = self.q[i][start:end].float().transpose(0, 1)[None]  # (1, H_q, n, D)
        k = self.k[i][:n_k].float().transpose(0, 1)[None]
        v = self.v[i][:n_k].float().transpose(0, 1)[None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5, enable_gqa=True)[0].transpose(0, 1)


def _decode_step(s: Seqs, rows: list[int], window, backend="gather-sdpa"):
    """Every sequence in ``rows`` decodes its last position; returns (out (B, H_q, D), reference)."""
    for i in rows:
        s.write(i, len(s.k[i]) - 1)
    meta = build_metadata(
        [(len(s.k[i]), s.blocks[i]) for i in rows], [], s.bs, torch.device("cpu"), window,
        decode_backend=backend, num_blocks=s.k_cache.shape[0],
    )
    q = torch.stack([s.q[i][-1] for i in rows])
    k = torch.stack([s.k[i][-1] for i in rows])
    v = torch.stack([s.v[i][-1] for i in rows])
    out = paged_attention(q, k, v, s.k_cache, s.v_cache, meta, D**-0.5, window).view(len(rows), s.hq, D)
    ref = torch.stack([s.dense(i, len(s.k[i]) - 1, len(s.k[i]), window)[0] for i in rows])
    return out, ref


# ---------------------------------------------------------------------------------------------
# The existing gather path against dense attention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_gather_decode_matches_dense(block_size, group, window):
    s = Seqs(LENGTHS, block_size, group, seed=block_size * 10 + group)
    out, ref = _decode_step(s, list(range(len(LENGTHS))), window)  # one batch, padded mask
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for i in range(len(LENGTHS)):  # each alone: the single-decode fast path when unwindowed
        out, ref = _decode_step(s, [i], window)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefill_chunks_match_dense(block_size, group, window):
    """Chunks with nothing cached before them (causal fast path) and after a cached prefix
    (start > 0), in one flat batch behind two decodes."""
    s = Seqs((37, 100, 23, 5, 64), block_size, group, seed=7 + block_size, num_blocks=256)
    chunks = [(0, 0, 37), (1, 40, 100), (2, 0, 23), (3, 4, 5)]  # (seq, start, end)
    decodes = [4]
    for i, start, _ in chunks:
        s.write(i, start)
    for i in decodes:
        s.write(i, len(s.k[i]) - 1)
    meta = build_metadata(
        [(len(s.k[i]), s.blocks[i]) for i in decodes],
        [(start, end - start, s.blocks[i]) for i, start, end in chunks],
        block_size, torch.device("cpu"), window,
    )
    q = torch.cat([s.q[i][-1:] for i in decodes] + [s.q[i][a:b] for i, a, b in chunks])
    k = torch.cat([s.k[i][-1:] for i in decodes] + [s.k[i][a:b] for i, a, b in chunks])
    v = torch.cat([s.v[i][-1:] for i in decodes] + [s.v[i][a:b] for i, a, b in chunks])
    out = paged_attention(q, k, v, s.k_cache, s.v_cache, meta, D**-0.5, window).view(-1, s.hq, D)
    ref = torch.cat([s.dense(i, len(s.k[i]) - 1, len(s.k[i]), window) for i in decodes]
                    + [s.dense(i, a, b, window) for i, a, b in chunks])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for i, start, end in chunks:  # the chunk's K/V landed in its slots
        for p in range(start, end):
            torch.testing.assert_close(s.k_cache[s.blocks[i][p // block_size], p % block_size], s.k[i][p])


# ---------------------------------------------------------------------------------------------
# FlexAttention paged decode
# ---------------------------------------------------------------------------------------------


def _flex_inputs(s: Seqs, rows: list[int]):
    for i in rows:
        s.write(i, len(s.k[i]))  # the new token's K/V is already in the cache
    width = max(-(-len(s.k[i]) // s.bs) for i in rows)
    table = torch.tensor([s.blocks[i] + [0] * (width - len(s.blocks[i])) for i in rows])
    lens = torch.tensor([len(s.k[i]) for i in rows])
    q = torch.stack([s.q[i][-1] for i in rows])
    return q, table, lens


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_flex_eager_matches_dense(block_size, group, window):
    """Flex's eager reference evaluates the mask_mod on every cache slot: this checks the
    physical-to-logical map, the length cut and the window. (Not the block list: eager ignores
    block sparsity; the compiled tests below check that.)"""
    s = Seqs(LENGTHS, block_size, group, seed=block_size + group)
    rows = [0, 1, 2, 3]
    q, table, lens = _flex_inputs(s, rows)
    out = flex_paged_decode(q, s.k_cache, s.v_cache, table, lens, D**-0.5, window, compiled=False)
    ref = torch.stack([s.dense(i, len(s.k[i]) - 1, len(s.k[i]), window)[0] for i in rows])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_flex_plan_lists_only_the_visible_blocks():
    s = Seqs((37, 5), 4, 1, seed=3)
    _, table, lens = _flex_inputs(s, [0, 1])
    plan = plan_flex_decode(table, lens, NUM_BLOCKS, 4, sliding_window=WINDOW)
    assert plan.kv_num_blocks.shape == (8, 1, 1)  # batch 2 padded to the bucket of 8
    # 37 tokens, window 8: positions 29..36 live in logical blocks 7, 8, 9 (of 0..9)
    assert plan.kv_num_blocks[:2, 0, 0].tolist() == [3, 2]
    assert plan.kv_indices[0, 0, 0, :3].tolist() == s.blocks[0][7:10]
    assert plan.kv_indices[1, 0, 0, :2].tolist() == s.blocks[1][0:2]
    p2l = plan.phys_to_logical
    assert [p2l[0, b].item() for b in s.blocks[0]] == list(range(10))
    assert (p2l[0] >= 0).sum() == 10 and (p2l[1] >= 0).sum() == 2
    assert plan.context_lens.tolist() == [37, 5] + [1] * 6


_COMPILED_CASES = [  # few shapes: each is one inductor compile (seconds on 2 cores)
    pytest.param(16, 3, None, torch.float32, id="bs16-gqa3-fp32"),
    pytest.param(4, 1, WINDOW, torch.float32, id="bs4-mha-window-fp32"),
    pytest.param(16, 4, WINDOW, torch.bfloat16, id="bs16-gqa4-window-bf16"),
]


@pytest.mark.parametrize(("block_size", "group", "window", "dtype"), _COMPILED_CASES)
def test_flex_compiled_matches_gather(block_size, group, window, dtype):
    """The compiled (fused, block-sparse) CPU kernel through paged_attention's hook equals the
    gather path, batched and per sequence."""
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    for rows in ([0, 1, 2, 3], [3, 0], [2]):
        s = Seqs(LENGTHS, block_size, group, dtype=dtype, seed=11)
        got, ref = _decode_step(s, rows, window, backend="flex")
        s = Seqs(LENGTHS, block_size, group, dtype=dtype, seed=11)
        want, _ = _decode_step(s, rows, window, backend="gather-sdpa")
        torch.testing.assert_close(got, want, **tol)
        torch.testing.assert_close(got.float(), ref, **tol)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_compiled_reads_only_the_listed_blocks():
    """Cutting a row's block list to its first block changes the compiled result (the fused
    kernel skips unlisted blocks) but not eager's (which masks every slot): so the compiled tests
    above exercise the block list, and the compiled kernel really ran."""
    s = Seqs(LENGTHS, 16, 3, seed=11)
    q, table, lens = _flex_inputs(s, [0, 1, 2, 3])
    plan = plan_flex_decode(table, lens, NUM_BLOCKS, 16)
    cut = dataclasses.replace(plan, kv_num_blocks=torch.ones_like(plan.kv_num_blocks))
    args = (q, s.k_cache, s.v_cache, table, lens, D**-0.5)
    full = flex_paged_decode(*args, plan=plan)
    short = flex_paged_decode(*args, plan=cut)
    torch.testing.assert_close(short[:2], full[:2])  # contexts 1 and 5: one block anyway
    for row in (2, 3):  # contexts 37 and 100: 3 and 7 blocks
        assert not torch.allclose(short[row], full[row])
    torch.testing.assert_close(flex_paged_decode(*args, plan=cut, compiled=False), full, atol=1e-5, rtol=1e-5)


def test_flex_hook_with_prefill_in_the_same_step():
    """Decodes through flex and a prefill chunk through SDPA in one flat batch."""
    s = Seqs((100, 37, 23), 16, 3, seed=5)
    s.write(0, 99)
    s.write(1, 36)
    s.write(2, 10)
    meta = build_metadata(
        [(100, s.blocks[0]), (37, s.blocks[1])], [(10, 13, s.blocks[2])], 16, torch.device("cpu"),
        decode_backend="flex", num_blocks=NUM_BLOCKS,
    )
    q = torch.cat([s.q[0][-1:], s.q[1][-1:], s.q[2][10:]])
    k = torch.cat([s.k[0][-1:], s.k[1][-1:], s.k[2][10:]])
    v = torch.cat([s.v[0][-1:], s.v[1][-1:], s.v[2][10:]])
    out = paged_attention(q, k, v, s.k_cache, s.v_cache, meta, D**-0.5).view(-1, s.hq, D)
    ref = torch.cat([s.dense(0, 99, 100, None), s.dense(1, 36, 37, None), s.dense(2, 10, 23, None)])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_flex_hook_inside_a_compiled_dynamic_step():
    """The engine compiles its decode step with dynamic shapes; the flex hook is a compile
    boundary there and still matches the (eager) gather path for several batch sizes."""

    def step(q, k, v, k_cache, v_cache, meta):
        return paged_attention(q, k, v, k_cache, v_cache, meta, D**-0.5) * 1.0

    compiled = torch.compile(step, dynamic=True)
    for rows in ([0, 1, 2], [0, 1, 2, 3], [1, 3], [0, 1, 2, 3] * 2):  # the last fills its bucket of 8
        outs = {}
        for backend in ("gather-sdpa", "flex"):
            s = Seqs(LENGTHS, 16, 3, seed=13)
            for i in rows:
                s.write(i, len(s.k[i]) - 1)
            meta = build_metadata(
                [(len(s.k[i]), s.blocks[i]) for i in rows], [], 16, torch.device("cpu"), static_decode=True,
                decode_backend=backend, num_blocks=NUM_BLOCKS,
            )
            q = torch.stack([s.q[i][-1] for i in rows])
            k = torch.stack([s.k[i][-1] for i in rows])
            v = torch.stack([s.v[i][-1] for i in rows])
            outs[backend] = (compiled if backend == "flex" else step)(q, k, v, s.k_cache, s.v_cache, meta)
        torch.testing.assert_close(outs["flex"], outs["gather-sdpa"], atol=1e-5, rtol=1e-5)


def test_build_metadata_rejects_unknown_backend_and_missing_num_blocks():
    with pytest.raises(ValueError, match="not one of"):
        build_metadata([(3, [0])], [], 4, torch.device("cpu"), decode_backend="paged-triton")
    with pytest.raises(ValueError, match="num_blocks"):
        build_metadata([(3, [0])], [], 4, torch.device("cpu"), decode_backend="flex")
    meta = build_metadata([], [(0, 3, [0])], 4, torch.device("cpu"), decode_backend="flex")  # no decodes: no plan
    assert meta.decode_plan is None


# ---------------------------------------------------------------------------------------------
# flash-attn (CUDA only)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None,
    reason="needs CUDA and the flash_attn package",
)
@pytest.mark.parametrize("window", [None, 300])
def test_flash_attn_matches_gather(window):
    dev = torch.device("cuda")
    s = Seqs((1, 37, 300, 700), 256, 3, dtype=torch.bfloat16, seed=1, num_blocks=16)
    rows = [0, 1, 2, 3]
    q, table, lens = _flex_inputs(s, rows)
    kc, vc = s.k_cache.to(dev), s.v_cache.to(dev)
    got = flex.flash_attn_paged_decode(q.to(dev), kc, vc, table.to(dev), lens.to(dev), D**-0.5, window)
    ref = torch.stack([s.dense(i, len(s.k[i]) - 1, len(s.k[i]), window)[0] for i in rows])
    torch.testing.assert_close(got.float().cpu(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, WINDOW])
def test_flex_cuda_matches_dense(window):
    dev = torch.device("cuda")
    s = Seqs(LENGTHS, 16, 3, dtype=torch.bfloat16, seed=2)
    rows = [0, 1, 2, 3]
    q, table, lens = _flex_inputs(s, rows)
    got = flex_paged_decode(q.to(dev), s.k_cache.to(dev), s.v_cache.to(dev), table.to(dev), lens.to(dev), D**-0.5, window)
    ref = torch.stack([s.dense(i, len(s.k[i]) - 1, len(s.k[i]), window)[0] for i in rows])
    torch.testing.assert_close(got.float().cpu(), ref, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------------
# Backend selection
# ---------------------------------------------------------------------------------------------


def _fake_env(monkeypatch, *, cuda: bool, flash: bool, triton: bool, capability=(9, 0)):
    real = importlib.util.find_spec
    present = {"flash_attn": flash, "triton": triton}

    def find_spec(name, *a, **kw):
        if name in present:
            return object() if present[name] else None
        return real(name, *a, **kw)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


@pytest.mark.parametrize(
    ("env", "dtype", "block_size", "want", "why"),
    [
        ({"cuda": True, "flash": True, "triton": True}, torch.bfloat16, 256, "flash-attn", "flash_attn importable"),
        ({"cuda": True, "flash": True, "triton": True}, torch.bfloat16, 16, "flex", "divisible by 256|% 256"),
        ({"cuda": True, "flash": True, "triton": True}, torch.float32, 256, "flex", "float16/bfloat16"),
        ({"cuda": True, "flash": True, "triton": True, "capability": (7, 5)}, torch.float16, 512, "flex", "8.0"),
        ({"cuda": True, "flash": False, "triton": True}, torch.bfloat16, 16, "flex", "not installed"),
        ({"cuda": True, "flash": False, "triton": True}, torch.bfloat16, 8, "gather-sdpa", "power of two >= 16"),
        ({"cuda": True, "flash": False, "triton": False}, torch.bfloat16, 16, "gather-sdpa", "triton"),
        ({"cuda": False, "flash": True, "triton": True}, torch.bfloat16, 256, "gather-sdpa", "is_available"),
    ],
)
def test_select_decode_backend_cuda(monkeypatch, env, dtype, block_size, want, why):
    _fake_env(monkeypatch, **env)
    name, reason = select_decode_backend("cuda", dtype, 64, block_size)
    assert name == want
    assert any(w in reason for w in why.split("|")), reason


def test_select_decode_backend_cpu_is_gather_even_with_everything_installed(monkeypatch):
    _fake_env(monkeypatch, cuda=True, flash=True, triton=True)
    assert select_decode_backend(torch.device("cpu"), torch.bfloat16, 64, 256)[0] == "gather-sdpa"


def test_select_never_picks_an_unavailable_backend(monkeypatch):
    for cuda, fl, tr, dtype, bs, hd, cap in itertools.product(
        (False, True), (False, True), (False, True), (torch.float32, torch.bfloat16), (1, 16, 48, 256), (64, 80, 512),
        ((7, 5), (8, 0)),
    ):
        _fake_env(monkeypatch, cuda=cuda, flash=fl, triton=tr, capability=cap)
        for device in ("cpu", "cuda"):
            name, reason = select_decode_backend(device, dtype, hd, bs)
            assert name in flex.DECODE_BACKENDS and reason
            if name == "flash-attn":
                assert device == "cuda" and cuda and fl and dtype == torch.bfloat16 and bs % 256 == 0
                assert hd <= 256 and cap >= (8, 0)
            if name == "flex":
                assert device == "cuda" and cuda and tr and bs in (16, 256)
