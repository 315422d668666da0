"""The runner against transformers on the embedded SmolLM2-135M-Instruct, in one run.

    .venv/bin/python benchmarks/runner.py [--artifact DIR] [--repeats 5] [--json PATH] [--no-compile]

Without ``--artifact`` it quantizes the default model to W4A16 g64 (RTN, 16-bit head) in a
temporary directory first. Then, on 2 torch threads, alternating repeats so drift hits both:
- baseline: transformers ``generate`` (float32 and bfloat16) on the same checkpoint: decode
  tokens/s at batch 1 (64 new tokens after a 32-token prompt; the prefill step is excluded by
  subtracting a 1-token run) and time to first token for a 512-token prompt;
- the runner on the W4 artifact: decode tokens/s at batch 1; TTFT at 512 tokens; aggregate decode
  tokens/s with 32 concurrent requests; TTFT of a 1,000-token prompt cold vs a prefix-cache hit
  (same 1,000 tokens + a new 8-token question); the KV budget against the most blocks it held.
Prints the table with medians, spread (min..max) and ratios; llama.cpp figures quoted in the
issue (same machine, earlier runs, not this one) are shown as references only.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

THREADS = 2
LLAMA_CPP_DECODE = 222.0  # Q4_0, tokens/s at batch 1, quoted in issue 4 (not measured in this run)
LLAMA_CPP_PREFILL_512 = 851.0


def med(xs):
    return statistics.median(xs)


def spread(xs):
    return f"{med(xs):.1f} ({min(xs):.1f}..{max(xs):.1f})"


def build_artifact(out: Path) -> Path:
    from optkit.pipeline import run_recipe
    from optkit.recipe import recipe_from_dict

    run_recipe(recipe_from_dict({"quantization": {"scheme": "w4a16", "group_size": 64}, "export": {"out": str(out)}}))
    return out


def hf_decode(model, prompt, n, repeats_out):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        tn = time.perf_counter() - t
    repeats_out.append((n - 1) / (tn - t1))


def hf_ttft(model, prompt, out):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
        out.append(time.perf_counter() - t)


def engine_run(engine, prompts, params):
    from optkit.serve.request import SamplingParams  # noqa: F401

    for p in prompts:
        engine.add_request(p, params)
    steps = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    return steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-compile", action="store_true", help="measure the eager decode step")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    from transformers import AutoModelForCausalLM

    from optkit.checkpoint.default import ensure_default_checkpoint
    from optkit.serve.engine import EngineConfig, LLMEngine
    from optkit.serve.request import SamplingParams

    console = Console(stderr=True)
    ckpt, _ = ensure_default_checkpoint()
    tmp = tempfile.TemporaryDirectory()
    artifact = args.artifact or build_artifact(Path(tmp.name) / "w4")
    rng = random.Random(0)
    vocab = 49152

    def prompt(n):
        return [rng.randrange(1000, vocab) for _ in range(n)]

    hf32 = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    budget = 256 << 20
    engine = LLMEngine.from_pretrained(str(artifact), EngineConfig(
        device="cpu", kv_cache_memory=budget, max_model_len=2048, max_num_seqs=64, threads=THREADS, compile=not args.no_compile))
    console.print(f"runner kernels: {engine.model.kernel_names()}  dtype {engine.dtype}; compiling the decode step ...")
    console.print(f"warm-up {engine.warmup():.0f} s")
    eager = LLMEngine.from_pretrained(str(artifact), EngineConfig(
        device="cpu", kv_cache_memory=budget, max_model_len=2048, threads=THREADS, compile=False))
    eager.warmup()
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    peak_blocks = [0]
    step = engine.step

    def counting_step():
        r = step()
        peak_blocks[0] = max(peak_blocks[0], engine.kv.num_blocks - engine.kv.num_free_blocks)
        return r

    engine.step = counting_step
    res = {k: [] for k in ("hf32_decode", "hf16_decode", "hf32_ttft512", "hf16_ttft512", "our_decode", "our_ttft512",
                           "our_agg32", "cold1000", "hit1000", "eager_decode")}
    # warm-up (untimed): one of each
    hf_decode(hf32, prompt(32), 8, [])
    hf_decode(hf16, prompt(32), 8, [])
    engine_run(engine, [prompt(32)], greedy(8))
    engine_run(engine, [prompt(512)], greedy(1))
    for r in range(args.repeats):
        console.print(f"repeat {r + 1}/{args.repeats}")
        hf_decode(hf32, prompt(32), 64, res["hf32_decode"])
        hf_decode(hf16, prompt(32), 64, res["hf16_decode"])
        hf_ttft(hf32, prompt(512), res["hf32_ttft512"])
        hf_ttft(hf16, prompt(512), res["hf16_ttft512"])
        steps = engine_run(engine, [prompt(32)], greedy(64))
        res["our_decode"].append(63 / sum(steps[1:]))  # steps[0] is the prefill + first token
        steps = engine_run(eager, [prompt(32)], greedy(64))
        res["eager_decode"].append(63 / sum(steps[1:]))
        t = time.perf_counter()
        engine_run(engine, [prompt(512)], greedy(1))
        res["our_ttft512"].append(time.perf_counter() - t)
        prompts = [prompt(32) for _ in range(32)]
        steps = engine_run(engine, prompts, greedy(64))
        res["our_agg32"].append(32 * 63 / sum(steps[1:]))
        shared = prompt(1000)
        t = time.perf_counter()
        engine_run(engine, [shared + prompt(8)], greedy(1))
        res["cold1000"].append(time.perf_counter() - t)
        t = time.perf_counter()
        engine_run(engine, [shared + prompt(8)], greedy(1))
        res["hit1000"].append(time.perf_counter() - t)
    allocated = engine.cache.nbytes
    peak_bytes = peak_blocks[0] * engine.kv_bytes_per_token * engine.config.block_size
    d32, d16, ours = med(res["hf32_decode"]), med(res["hf16_decode"]), med(res["our_decode"])
    table = Table(show_lines=False, title=f"runner vs transformers on SmolLM2-135M ({THREADS} threads, {args.repeats} repeats; median (min..max))")
    for c in ("measure", "value", "ratio / target"):
        table.add_column(c)
    table.add_row("transformers generate fp32: decode tok/s (b1)", spread(res["hf32_decode"]), "baseline")
    table.add_row("transformers generate bf16: decode tok/s (b1)", spread(res["hf16_decode"]), f"{d16 / d32:.2f}x fp32")
    table.add_row("runner W4: decode tok/s (b1)", spread(res["our_decode"]),
                  f"{ours / d32:.1f}x hf fp32 (target >= 8x); {ours / LLAMA_CPP_DECODE:.2f}x llama.cpp's quoted {LLAMA_CPP_DECODE:.0f}")
    table.add_row("runner W4, eager decode step: decode tok/s (b1)", spread(res["eager_decode"]),
                  f"compiled step is {ours / med(res['eager_decode']):.2f}x faster")
    table.add_row("transformers fp32: TTFT 512 ms", spread([x * 1e3 for x in res["hf32_ttft512"]]), "")
    table.add_row("transformers bf16: TTFT 512 ms", spread([x * 1e3 for x in res["hf16_ttft512"]]), "baseline")
    table.add_row("runner W4: TTFT 512 ms", spread([x * 1e3 for x in res["our_ttft512"]]),
                  f"{med(res['hf16_ttft512']) / med(res['our_ttft512']):.2f}x faster than hf bf16 (target >= 1); "
                  f"{512 / med(res['our_ttft512']):.0f} tok/s vs llama.cpp's quoted {LLAMA_CPP_PREFILL_512:.0f}")
    table.add_row("runner W4: aggregate decode tok/s, 32 concurrent", spread(res["our_agg32"]),
                  f"{med(res['our_agg32']) / ours:.1f}x our b1 (target >= 4x)")
    table.add_row("runner W4: TTFT 1,000-token prompt cold ms", spread([x * 1e3 for x in res["cold1000"]]), "")
    table.add_row("runner W4: TTFT same prefix, cache hit ms", spread([x * 1e3 for x in res["hit1000"]]),
                  f"{med(res['cold1000']) / med(res['hit1000']):.1f}x faster (target >= 5x)")
    kv_row = f"{budget / 2**20:.0f} MiB / {allocated / 2**20:.1f} MiB / {peak_bytes / 2**20:.1f} MiB"
    table.add_row("KV budget / allocated / peak used", kv_row,
                  "within budget" if allocated <= budget and peak_bytes <= allocated else "OVER BUDGET")
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps({"results": res, "kv": {"budget": budget, "allocated": allocated, "peak_used": peak_bytes},
                                         "kernels": engine.model.kernel_names(), "threads": THREADS,
                                         "artifact": str(args.artifact or "w4a16-g64 rtn (temporary)")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
