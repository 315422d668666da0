"""``optkit bench`` end to end on a tiny checkpoint, its errors, and synthetic shapes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from optkit.errors import UserError
from optkit.serve.engine import EngineConfig, LLMEngine
from optkit.serve.request import SamplingParams
from optkit.serve.synthetic import SHAPES, synthetic_source


def _optkit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "optkit.cli", *args], capture_output=True, text=True)


def test_bench_writes_every_section(tiny_ckpt, tmp_path):
    out = tmp_path / "bench.json"
    res = _optkit("bench", str(tiny_ckpt), "--prompt-lens", "8,20", "--batch-sizes", "1,3", "--decode-tokens", "5",
                  "--offline-requests", "4", "--repeats", "2", "--warmup", "1", "--no-compile", "--threads", "1",
                  "--json", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["engine"] == "native" and r["synthetic_weights"] is False
    assert [p["prompt_tokens"] for p in r["prefill"]] == [8, 20]
    assert all(p["ttft_s"]["n"] == 2 and p["ttft_s"]["median"] > 0 for p in r["prefill"])
    assert [d["batch"] for d in r["decode"]] == [1, 3]
    b1, b3 = r["decode"]
    assert b1["tok_s"]["median"] > 0 and b3["tok_s"]["min"] <= b3["tok_s"]["median"] <= b3["tok_s"]["max"]
    assert r["offline"]["requests"] == 4 and r["offline"]["output_tok_s"]["median"] > 0
    assert r["machine"]["read_gb_s"] > 0 and 0 < r["decode_bandwidth"]["fraction_of_peak"]
    assert r["kv"]["peak_bytes_used"] <= r["kv"]["allocated_bytes"] <= r["kv"]["budget_bytes"]
    assert r["kv"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 2  # K+V x layers x kv heads x head dim x bf16
    assert r["memory"]["peak_rss_bytes"] > 0 and r["machine"]["matmul"]["tflops"] > 0
    points = {p["label"]: p for p in r["roofline"]}
    assert set(points) == {"prefill 8", "prefill 20", "decode b1", "decode b3"}
    # more tokens per weight read: intensity grows with prompt length and with batch
    assert points["prefill 20"]["intensity_flop_per_byte"] > points["prefill 8"]["intensity_flop_per_byte"]
    assert points["decode b3"]["intensity_flop_per_byte"] > points["decode b1"]["intensity_flop_per_byte"]
    assert "decode" in res.stdout and "prefill" in res.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        ((), "either MODEL or --synthetic"),
        (("default", "--synthetic", "llama-3-8b"), "either MODEL or --synthetic"),
        (("--synthetic", "gpt-5"), "unknown synthetic model"),
        (("--synthetic", "smollm2-135m", "--weights", "w3a16"), "unknown synthetic weight format"),
        (("--synthetic", "smollm2-135m", "--batch-sizes", "1,x"), "positive integers"),
        (("--synthetic", "smollm2-135m", "--kv-cache-memory", "lots"), "not understood"),
    ],
)
def test_bench_bad_input_exits_2(args, message):
    res = _optkit("bench", *args)
    assert res.returncode == 2, res.stderr[-2000:]
    assert message in res.stderr and "Traceback" not in res.stderr


def test_synthetic_shapes_match_their_published_configs():
    s = synthetic_source("llama-3-8b", "w4a16")
    names = s.weights.shapes
    n_params = sum(torch.Size(shape).numel() for shape, _ in names.values())
    assert 8.0e9 < n_params < 8.1e9  # Llama-3-8B: 8.03 B parameters
    q = s.weights.pop("model.layers.0.self_attn.k_proj.weight")
    assert q.q.shape == (1024, 4096) and q.scheme.bits == 4 and q.scheme.group_size == 128
    assert q.scale.shape == (1024, 32) and q.q.dtype == torch.int8
    qwen = synthetic_source("qwen2.5-7b", "bf16").weights.shapes
    assert "model.layers.0.self_attn.q_proj.bias" in qwen and qwen["lm_head.weight"][0] == (152064, 3584)
    assert set(SHAPES) == {"smollm2-135m", "llama-3.2-1b", "llama-3-8b", "qwen2.5-7b"}


def test_synthetic_model_runs_and_says_so():
    src = synthetic_source("smollm2-135m", "w4a16-g64")
    assert src.synthetic and src.tokenizer is None
    eng = LLMEngine(src, EngineConfig(device="cpu", kv_cache_memory="32MiB", max_model_len=256))
    assert eng.model.kernel_names()["cpu-int4pack"] == 30 * 4  # fused qkv, o, fused gate_up, down
    out = eng.generate([[1000, 2000, 3000]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.text == ""
    with pytest.raises(UserError, match="no tokenizer"):
        eng.add_request("text needs a tokenizer", SamplingParams())
