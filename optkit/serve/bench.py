"""``optkit bench``: per-phase speed and memory of the runner on an artifact or synthetic shape.

Every figure is a median over repeats after warm-up, with its spread (min..max), measured on
random token ids (speed does not depend on the text; fresh ids per repeat keep the prefix
cache out of prefill timings):
- prefill: time to first token (TTFT) and prefill tokens/s for each prompt length;
- decode: tokens/s summed over a batch, and inter-token latency, per batch size;
- offline: N requests of mixed prompt/output lengths submitted at once (continuous batching);
- roofline position of decode: weight bytes read per step x steps/s, next to this machine's
  measured read bandwidth;
- host overhead per decode step (everything that is not the model's forward);
- KV bytes per token, KV budget and the most it held, peak memory.
"""

from __future__ import annotations

import platform
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from optkit.hardware import measure_peak_bandwidth, measure_peak_matmul
from optkit.serve.engine import LLMEngine
from optkit.serve.request import SamplingParams

BENCH_SCHEMA_VERSION = 1


@dataclass
class BenchSettings:
    prompt_lens: tuple[int, ...] = (128, 512, 2048)
    batch_sizes: tuple[int, ...] = (1, 4, 16, 64)
    decode_tokens: int = 64
    decode_prompt_len: int = 32
    offline_requests: int = 64
    offline_prompt_range: tuple[int, int] = (32, 512)
    offline_output_range: tuple[int, int] = (16, 128)
    repeats: int = 3
    warmup: int = 1
    seed: int = 0
    probe_bandwidth: bool = True


def summarize(values: list[float]) -> dict:
    """Median and spread of repeated measurements."""
    med = statistics.median(values)
    return {
        "median": med, "min": min(values), "max": max(values), "n": len(values),
        "spread_pct": 100.0 * (max(values) - min(values)) / med if med else 0.0,
    }


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    lo = min(1000, vocab // 2)  # stay clear of special tokens at the start of most vocabularies
    return [rng.randrange(lo, vocab) for _ in range(n)]


def _run_until_done(engine: LLMEngine) -> list[float]:
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times


def bench_ttft(engine: LLMEngine, length: int, s: BenchSettings, rng: random.Random) -> dict:
    vocab = engine.source.config.vocab_size
    times = []
    for i in range(s.warmup + s.repeats):
        engine.add_request(_prompt(rng, length, vocab), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        t = time.perf_counter()
        _run_until_done(engine)
        if i >= s.warmup:
            times.append(time.perf_counter() - t)
    ttft = summarize(times)
    return {"prompt_tokens": length, "ttft_s": ttft, "prefill_tok_s": summarize([length / x for x in times])}


def bench_decode(engine: LLMEngine, batch: int, s: BenchSettings, rng: random.Random) -> dict:
    vocab = engine.source.config.vocab_size
    rates, itls, overheads, forwards = [], [], [], []
    preempt0 = engine.scheduler.num_preemptions
    for i in range(s.warmup + s.repeats):
        for _ in range(batch):
            engine.add_request(
                _prompt(rng, s.decode_prompt_len, vocab),
                SamplingParams(max_tokens=s.decode_tokens, temperature=0.0, ignore_eos=True),
            )
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running + list(engine.scheduler.waiting)):
            engine.step()  # prefill (and the first token) are not decode
        mark = len(engine.runner.timing.history)
        steps = _run_until_done(engine)
        if i >= s.warmup and steps:
            decoded = len(steps) * batch
            rates.append(decoded / sum(steps))
            itls.extend(steps)
            hist = engine.runner.timing.history[mark:]
            forwards.extend(h[1] for h in hist)
            overheads.extend(st - h[1] for st, h in zip(steps, hist, strict=True))
    return {
        "batch": batch,
        "tok_s": summarize(rates),
        "itl_ms": {k: v * 1e3 if k in ("median", "min", "max") else v for k, v in summarize(itls).items()}
        | {"p90": _pct(itls, 90) * 1e3, "p99": _pct(itls, 99) * 1e3},
        "forward_ms": statistics.median(forwards) * 1e3,
        "host_overhead_ms": statistics.median(overheads) * 1e3,
        "preemptions": engine.scheduler.num_preemptions - preempt0,
    }


def _pct(values: list[float], p: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]


def bench_offline(engine: LLMEngine, s: BenchSettings, rng: random.Random) -> dict:
    vocab = engine.source.config.vocab_size
    results = []
    for i in range(s.warmup + s.repeats):
        n_prompt = n_out = 0
        for _ in range(s.offline_requests):
            p = rng.randint(*s.offline_prompt_range)
            o = rng.randint(*s.offline_output_range)
            p = min(p, engine.max_model_len - o)  # a short-context model: clip the prompt, keep the output
            n_prompt, n_out = n_prompt + p, n_out + o
            engine.add_request(_prompt(rng, p, vocab), SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True))
        t = time.perf_counter()
        _run_until_done(engine)
        dt = time.perf_counter() - t
        if i >= s.warmup:
            results.append((dt, n_prompt, n_out))
    return {
        "requests": s.offline_requests,
        "prompt_range": list(s.offline_prompt_range),
        "output_range": list(s.offline_output_range),
        "output_tok_s": summarize([o / dt for dt, _, o in results]),
        "total_tok_s": summarize([(p + o) / dt for dt, p, o in results]),
        "wall_s": summarize([dt for dt, _, _ in results]),
    }


def roofline_points(result: dict, engine: LLMEngine, s: BenchSettings) -> list[dict]:
    """Where each measured phase sits on the roofline: arithmetic intensity (FLOPs per byte of
    compulsory memory traffic) and achieved FLOP/s and bytes/s.

    FLOPs: 2 per weight per token through the layers' linears (the head only for sampled rows),
    plus attention, 4 * layers * H_q * head_dim per (query, key) pair (QK^T and AV; causal
    prefill has T^2/2 pairs). Bytes: the packed weights once per forward, plus the KV cache
    read (decode) or written (prefill)."""
    spec = engine.model.spec
    p_layers, p_head = engine.model.matmul_params()
    attn = 4 * spec.num_layers * spec.num_heads * spec.head_dim
    wbytes = result["weight_bytes_per_step"]
    kv = engine.kv_bytes_per_token
    points = []
    for p in result["prefill"]:
        t = p["prompt_tokens"]
        flops = 2 * p_layers * t + 2 * p_head + attn * t * t / 2
        nbytes = wbytes + kv * t
        sec = p["ttft_s"]["median"]
        points.append({"phase": "prefill", "label": f"prefill {t}", "intensity_flop_per_byte": flops / nbytes,
                       "achieved_tflops": flops / sec / 1e12, "achieved_gb_s": nbytes / sec / 1e9})
    ctx = s.decode_prompt_len + s.decode_tokens / 2  # mean context over the decode run
    for d in result["decode"]:
        b = d["batch"]
        flops = b * (2 * (p_layers + p_head) + attn * ctx)
        nbytes = wbytes + b * ctx * kv
        sec = b / d["tok_s"]["median"]  # one step makes one token per request
        points.append({"phase": "decode", "label": f"decode b{b}", "intensity_flop_per_byte": flops / nbytes,
                       "achieved_tflops": flops / sec / 1e12, "achieved_gb_s": nbytes / sec / 1e9})
    return points


def hardware() -> dict:
    info = {"platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
            "threads": torch.get_num_threads()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def run_bench(engine: LLMEngine, s: BenchSettings, progress: Callable[[str], None] = lambda _: None) -> dict:
    rng = random.Random(s.seed)
    dev = engine.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    out: dict = {
        "schema_version": BENCH_SCHEMA_VERSION,
        "model": engine.source.path,
        "synthetic_weights": engine.source.synthetic,
        "weights": engine.source.schemes or {"float": 1},
        "engine": "native" if engine.native else "transformers-fallback",
        "fallback_reason": engine.fallback_reason,
        "config": asdict(engine.config) | {"dtype_resolved": str(engine.dtype).removeprefix("torch."),
                                           "max_model_len": engine.max_model_len},
        "settings": asdict(s),
        "hardware": hardware(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out["decode_attention"] = {"backend": engine.decode_attention, "reason": engine.decode_attention_reason}
    if engine.native:
        out["kernels"] = engine.model.kernel_names()
        out["slow_paths"] = engine.model.slow_paths()
        out["weight_bytes_per_step"] = engine.model.weight_bytes_per_step()
    out["kv"] = {"bytes_per_token": engine.kv_bytes_per_token, "budget_bytes": engine.kv_budget_bytes,
                 "block_size": engine.config.block_size, "num_blocks": engine.kv.num_blocks}
    out["compile"] = {"enabled": bool(engine.native and engine.model.compiled)}
    progress("warm-up" + (" (compiling the decode step)" if out["compile"]["enabled"] else ""))
    out["compile"]["warmup_s"] = engine.warmup()
    peak_used = [0]
    step = engine.step

    def counting_step():  # tracks the most KV blocks ever in use (checked against the budget)
        r = step()
        peak_used[0] = max(peak_used[0], engine.kv.num_blocks - engine.kv.num_free_blocks)
        return r

    engine.step = counting_step  # type: ignore[method-assign]
    try:
        out["prefill"] = []
        for n in s.prompt_lens:
            if n + 1 > engine.max_model_len:
                continue
            progress(f"prefill {n} tokens")
            out["prefill"].append(bench_ttft(engine, n, s, rng))
        out["decode"] = []
        for b in s.batch_sizes:
            progress(f"decode batch {b}")
            out["decode"].append(bench_decode(engine, b, s, rng))
        if s.offline_requests:
            progress(f"offline {s.offline_requests} requests")
            out["offline"] = bench_offline(engine, s, rng)
    finally:
        del engine.step
    kv_bytes_block = engine.kv_bytes_per_token * engine.config.block_size
    out["kv"]["peak_blocks_used"] = peak_used[0]
    out["kv"]["peak_bytes_used"] = peak_used[0] * kv_bytes_block
    out["kv"]["allocated_bytes"] = engine.cache.nbytes if engine.cache is not None else None
    if s.probe_bandwidth:
        progress("peak bandwidth and matmul probes")
        out["machine"] = measure_peak_bandwidth(dev) | {"matmul": measure_peak_matmul(dev, engine.dtype)}
    b1 = next((d for d in out["decode"] if d["batch"] == 1), None)
    if b1 and engine.native:
        achieved = out["weight_bytes_per_step"] * b1["tok_s"]["median"] / 1e9
        out["decode_bandwidth"] = {
            "achieved_gb_s": achieved,
            "method": "weight bytes read per decode step x steps/s at batch 1",
            "fraction_of_peak": achieved / out["machine"]["read_gb_s"] if "machine" in out else None,
        }
    if engine.native and "machine" in out:
        out["roofline"] = roofline_points(out, engine, s)
    out["memory"] = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if dev.type == "cuda":
        out["memory"]["peak_cuda_bytes"] = torch.cuda.max_memory_allocated(dev)
    return out


def render(result: dict) -> list:
    """Rich tables for the terminal."""
    from rich.table import Table

    def f(d: dict, scale: float = 1.0, digits: int = 1) -> str:
        return f"{d['median'] * scale:.{digits}f} ({d['min'] * scale:.{digits}f}..{d['max'] * scale:.{digits}f})"

    title = result["model"] + ("  [SYNTHETIC WEIGHTS]" if result["synthetic_weights"] else "")
    if result["engine"] != "native":
        title += f"  [transformers fallback: {result['fallback_reason']}]"
    tables = []
    t = Table(title=f"prefill - {title}")
    for c in ("prompt tokens", "TTFT ms", "prefill tok/s"):
        t.add_column(c, justify="right")
    for p in result["prefill"]:
        t.add_row(str(p["prompt_tokens"]), f(p["ttft_s"], 1e3), f(p["prefill_tok_s"], 1.0, 0))
    tables.append(t)
    t = Table(title="decode")
    for c in ("batch", "tok/s", "ITL p50 ms", "ITL p99 ms", "forward ms", "host ms/step", "preempt"):
        t.add_column(c, justify="right")
    for d in result["decode"]:
        t.add_row(str(d["batch"]), f(d["tok_s"]), f"{d['itl_ms']['median']:.2f}", f"{d['itl_ms']['p99']:.2f}",
                  f"{d['forward_ms']:.2f}", f"{d['host_overhead_ms']:.2f}", str(d["preemptions"]))
    tables.append(t)
    t = Table(title="offline, memory, roofline")
    t.add_column("metric")
    t.add_column("value", justify="right")
    if "offline" in result:
        o = result["offline"]
        t.add_row(f"offline {o['requests']} req: output tok/s", f(o["output_tok_s"]))
        t.add_row("offline: total tok/s", f(o["total_tok_s"]))
    if "decode_bandwidth" in result:
        db = result["decode_bandwidth"]
        t.add_row("decode b1 weight bandwidth GB/s", f"{db['achieved_gb_s']:.1f}")
        if db["fraction_of_peak"] is not None:
            t.add_row("machine read bandwidth GB/s (probe)", f"{result['machine']['read_gb_s']:.1f}")
            t.add_row("fraction of peak", f"{100 * db['fraction_of_peak']:.0f} %")
    if "weight_bytes_per_step" in result:
        t.add_row("weight bytes / decode step", f"{result['weight_bytes_per_step'] / 1e6:.1f} MB")
    if "machine" in result and "matmul" in result["machine"]:
        mm = result["machine"]["matmul"]
        t.add_row(f"machine matmul TFLOP/s ({mm['dtype']}, probe)", f"{mm['tflops']:.2f}")
    for pt in result.get("roofline", []):
        t.add_row(f"roofline {pt['label']}", f"{pt['intensity_flop_per_byte']:.1f} FLOP/B, {pt['achieved_tflops']:.3f} TFLOP/s")
    kv = result["kv"]
    t.add_row("KV bytes / token", f"{kv['bytes_per_token']}")
    t.add_row("KV budget / peak used", f"{kv['budget_bytes'] / 1e6:.0f} MB / {kv['peak_bytes_used'] / 1e6:.1f} MB")
    t.add_row("peak RSS", f"{result['memory']['peak_rss_bytes'] / 1e6:.0f} MB")
    if "peak_cuda_bytes" in result["memory"]:
        t.add_row("peak CUDA memory", f"{result['memory']['peak_cuda_bytes'] / 1e6:.0f} MB")
    t.add_row("decode step compiled", f"{'yes' if result['compile']['enabled'] else 'no'} (warm-up {result['compile']['warmup_s']:.0f} s)")
    t.add_row("decode attention", result["decode_attention"]["backend"])
    if result.get("kernels"):
        t.add_row("kernels", ", ".join(f"{k} x{v}" for k, v in result["kernels"].items()))
    tables.append(t)
    return tables


__all__ = ["BenchSettings", "run_bench", "render", "roofline_points", "summarize"]
