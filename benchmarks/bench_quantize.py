"""Round-to-nearest quantization on the embedded SmolLM2-135M-Instruct: time per stage,
artifact size and weight SQNR for each scheme, medians over repeats.

    .venv/bin/python benchmarks/bench_quantize.py [--repeats 3]

Every repeat reloads the cached float checkpoint (not timed), quantizes every Linear but the
lm_head, and writes the artifact to a temporary directory. Ratios are against w8a16 measured
in the same run (this machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from optkit.checkpoint import load_checkpoint
from optkit.export import write_artifact
from optkit.quantize.modules import QuantizedLinear
from optkit.quantize.plan import apply_plan, plan_layers
from optkit.quantize.primitives import sqnr_db
from optkit.recipe import ModelConfig, QuantizationConfig

SCHEMES = {
    "w8a16": QuantizationConfig(scheme="w8a16"),
    "w4a16-g64": QuantizationConfig(scheme="w4a16", group_size=64),
    "w4a16-g32": QuantizationConfig(scheme="w4a16", group_size=32),
    "w4a16-g64-asym": QuantizationConfig(scheme="w4a16", group_size=64, symmetric=False),
}


def one_run(cfg: QuantizationConfig, out: Path) -> dict:
    ck = load_checkpoint(ModelConfig())
    model = ck.model
    floats = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    plan = plan_layers(model, cfg, tied=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        apply_plan(model, plan, torch.bfloat16)
    t1 = time.perf_counter()
    info = write_artifact(model, ck.tokenizer, plan, out, dtype=torch.bfloat16, manifest={})
    t2 = time.perf_counter()
    sqnrs = [
        sqnr_db(floats[n], m.dequantize())
        for n, m in model.named_modules()
        if isinstance(m, QuantizedLinear)
    ]
    bytes_16 = 2 * sum(p.numel() for p in model.parameters() if p.is_floating_point()) + 2 * sum(
        floats[n].numel() for n in plan.linears
    )
    return {
        "quantize_s": t1 - t0,
        "export_s": t2 - t1,
        "weight_mb": info.weight_bytes / 1e6,
        "ratio_16bit": info.weight_bytes / bytes_16,
        "sqnr_db": statistics.median(sqnrs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        one_run(SCHEMES["w8a16"], Path(tmp) / "warmup")
        for name, scheme in SCHEMES.items():
            runs = [one_run(scheme, Path(tmp) / f"{name}-{i}") for i in range(args.repeats)]
            rows[name] = runs
    base_q = statistics.median(r["quantize_s"] for r in rows["w8a16"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} repeats; medians (min-max)")
    hdr = f"{'scheme':<16}{'quantize s':>20}{'vs w8a16':>10}{'export s':>20}{'weights MB':>12}{'x 16-bit':>10}{'SQNR dB':>9}"
    print(hdr)
    print("-" * len(hdr))
    for name, runs in rows.items():
        q = [r["quantize_s"] for r in runs]
        e = [r["export_s"] for r in runs]
        print(
            f"{name:<16}{statistics.median(q):>9.2f} ({min(q):.2f}-{max(q):.2f}){statistics.median(q) / base_q:>10.2f}"
            f"{statistics.median(e):>9.2f} ({min(e):.2f}-{max(e):.2f}){runs[0]['weight_mb']:>12.1f}"
            f"{runs[0]['ratio_16bit']:>10.3f}{runs[0]['sqnr_db']:>9.1f}"
        )


if __name__ == "__main__":
    main()
