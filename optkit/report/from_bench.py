"""Report sections from ``optkit bench`` JSON (``optkit.serve.bench.run_bench`` output).

The measurement loop runs the bench once per variant; these functions turn its dict into the
report's speed, memory, machine and roofline sections, so the field mapping lives in one place.
Only fields the bench schema version 1 writes are read.
"""

from __future__ import annotations

from optkit.errors import UserError
from optkit.report.derive import roofline_point
from optkit.report.schema import DecodePoint, Machine, MemoryReport, Metric, PrefillPoint, Roofline, SpeedReport

_BENCH_VERSION = 1


def _check(bench: dict) -> None:
    if bench.get("schema_version") != _BENCH_VERSION:
        raise UserError(f"bench result has schema_version {bench.get('schema_version')!r}; the report reads version {_BENCH_VERSION}")


def _method(bench: dict, what: str) -> str:
    s = bench["settings"]
    engine = bench["engine"] if bench.get("engine") == "native" else f"transformers fallback ({bench.get('fallback_reason')})"
    return f"optkit bench: {what}; median of {s['repeats']} after {s['warmup']} warm-up, {engine}"


def speed_from_bench(bench: dict) -> SpeedReport:
    """Prefill (TTFT, tok/s per prompt length) and decode (tok/s, ITL per batch). Speedups are
    left for :func:`optkit.report.derive.fill_derived` (they need the baseline)."""
    _check(bench)
    prefill = [
        PrefillPoint(
            prompt_tokens=p["prompt_tokens"],
            ttft_ms=Metric.from_summary(p["ttft_s"], "ms", _method(bench, f"time to first token, {p['prompt_tokens']}-token prompt"), 1e3),
            tok_s=Metric.from_summary(p["prefill_tok_s"], "tok/s", _method(bench, "prompt tokens / TTFT")),
        )
        for p in bench.get("prefill", [])
    ]
    decode = []
    for d in bench.get("decode", []):
        itl = d["itl_ms"]
        steps = f"over {itl['n']} steps"
        decode.append(DecodePoint(
            batch=d["batch"],
            tok_s=Metric.from_summary(d["tok_s"], "tok/s", _method(bench, f"decoded tokens/s summed over batch {d['batch']}")),
            itl_ms_p50=Metric(value=itl["median"], unit="ms", method=f"optkit bench: inter-token latency p50 {steps}"),
            itl_ms_p99=Metric(value=itl["p99"], unit="ms", method=f"optkit bench: inter-token latency p99 {steps}"),
        ))
    return SpeedReport(prefill=prefill, decode=decode)


def memory_from_bench(bench: dict, base: MemoryReport | None = None) -> MemoryReport:
    """KV bytes per token and peak memory from the bench, merged into ``base`` (which holds the
    artifact's byte counts); ``max_context_tokens`` is the KV budget the bench ran with."""
    _check(bench)
    m = (base or MemoryReport()).model_copy(deep=True)
    kv = bench["kv"]
    m.kv_bytes_per_token = Metric(value=kv["bytes_per_token"], unit="bytes", method="optkit bench: KV bytes per token, all layers")
    if kv.get("budget_bytes") and kv["bytes_per_token"]:
        m.max_context_tokens = Metric(
            value=kv["budget_bytes"] // kv["bytes_per_token"], unit="tokens",
            method=f"KV budget of {kv['budget_bytes'] / 2**30:.2f} GiB / KV bytes per token (the bench's budget)",
        )
    mem = bench.get("memory", {})
    if "peak_rss_bytes" in mem:
        m.peak_rss_bytes = Metric(value=mem["peak_rss_bytes"], unit="bytes", method="optkit bench: peak RSS of the bench process")
    if "peak_cuda_bytes" in mem:
        m.peak_cuda_bytes = Metric(value=mem["peak_cuda_bytes"], unit="bytes", method="optkit bench: torch.cuda.max_memory_allocated")
    return m


def machine_from_bench(bench: dict, peak_matmul: dict[str, Metric] | None = None) -> Machine:
    """The bandwidth probe of the bench; matmul peaks come from the caller (the bench has none)."""
    _check(bench)
    probe = bench.get("machine")
    bw = (Metric(value=probe["read_gb_s"], unit="GB/s", method=probe["method"]) if probe
          else Metric(unit="GB/s", method="not measured (bench ran without the bandwidth probe)"))
    return Machine(peak_read_bandwidth=bw, peak_matmul=peak_matmul or {})


def roofline_from_bench(bench: dict, matmul_params: int, dtype: str | None = None) -> Roofline:
    """Decode points per batch and prefill points per prompt length.

    ``matmul_params``: parameters of the Linear layers run per token (head included, embedding
    lookup not). Bytes per step are the bench's ``weight_bytes_per_step`` (native runner only;
    the transformers fallback gives no points). See :func:`roofline_point` for what is left out.
    """
    _check(bench)
    wb = bench.get("weight_bytes_per_step")
    if not wb:
        return Roofline()
    pts = []
    for d in bench.get("decode", []):
        b, rate = d["batch"], d["tok_s"]["median"]  # rate = tokens/s over the batch -> steps/s = rate / b
        pts.append(roofline_point("decode", f"decode b{b}", 2.0 * matmul_params * b, wb, b / rate, dtype))
    for p in bench.get("prefill", []):
        t = p["prompt_tokens"]
        pts.append(roofline_point("prefill", f"prefill {t}", 2.0 * matmul_params * t, wb, p["ttft_s"]["median"], dtype))
    return Roofline(points=pts)


__all__ = ["machine_from_bench", "memory_from_bench", "roofline_from_bench", "speed_from_bench"]
