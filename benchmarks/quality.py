"""Quality of each quantization method on the embedded SmolLM2-135M-Instruct: bits per weight,
size, WikiText-2 perplexity, KL divergence and top-1 agreement against the unquantized model,
quantization wall time and peak memory. Prints one table.

    .venv/bin/python benchmarks/quality.py [--variants w4-g64-rtn,w4-g64-gptq] [--full]
                                            [--windows N] [--json PATH] [--keep DIR]

Protocol (fixed, so numbers compare across tools; see ../shared/data/README.md):
- calibration: ``wiki.valid.tokens``, 128 samples x 512 tokens, seed 0;
- evaluation: ``wiki.test.raw`` tokenized whole without BOS, non-overlapping 512-token windows,
  every token but the first of each window scored; the first 40 windows (quick, default) or all
  589 (``--full``); float32, 2 torch threads.

Each variant is one ``optkit run RECIPE`` in a child process (first, while this process is still
small: a child's peak RSS counts its parent's memory at the time it was started); its wall time
includes start-up, model loading, calibration, quantization and export. Then the unquantized
model's log-probabilities are computed once (float16 on disk, about 2 GB for the quick protocol,
30 GB with --full) and every artifact, read back with ``load_dequantized_model``, is compared
with them.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

DATA = Path(__file__).resolve().parents[1].parent / "shared/data/wikitext-2"
CALIB_FILE = "wiki.valid.tokens"
EVAL_FILE = "wiki.test.raw"
CALIBRATION = {"num_samples": 128, "seq_len": 512, "seed": 0}
SEQ_LEN = 512
QUICK_WINDOWS = 40
THREADS = 2

# ---- variants: name -> recipe `quantization` section (edit freely) ------------------------------
# GPTQ as the shipped recipes run it: activation order (static groups), importance-weighted MSE
# scales, least-squares scale refit.
GPTQ = {
    "algorithm": "gptq",
    "observer": "mse",
    "importance": True,
    "gptq": {"damp": 0.01, "block_size": 128, "act_order": True, "true_sequential": True, "refine_scales": True},
}
AWQ = {"algorithm": "awq", "awq": {"grid": 20, "clip": True}}
RTN = {"algorithm": "rtn"}
W8 = {"scheme": "w8a16", "group_size": "channel", "symmetric": True}
W8A8 = {"scheme": "w8a8", "group_size": "channel", "symmetric": True, "smoothquant": {"alpha": 0.8}}
W4G64 = {"scheme": "w4a16", "group_size": 64, "symmetric": True}
W4G64_ASYM = {**W4G64, "symmetric": False}
W4G32 = {**W4G64, "group_size": 32}
MIXED_45 = {"mixed_precision": {"bits_per_weight": 4.5, "candidates": ["4bit", "8bit", "16bit"]}}

VARIANTS: dict[str, dict] = {
    "w8a16-rtn": {**W8, **RTN},
    "w8a16-gptq": {**W8, **GPTQ},
    "w8a8-sq-gptq": {**W8A8, **GPTQ},
    "w4-g64-rtn": {**W4G64, **RTN},
    "w4-g64-gptq": {**W4G64, **GPTQ},
    "w4-g64-gptq-ec": {**W4G64, **GPTQ, "gptq": {**GPTQ["gptq"], "error_correction": 0.5}},
    "w4-g64-awq": {**W4G64, **AWQ},
    "w4-g64-asym-gptq": {**W4G64_ASYM, **GPTQ},
    "w4-g32-gptq": {**W4G32, **GPTQ},
    "w4-g32-awq": {**W4G32, **AWQ},
    "w4-g64-mixed-4.5": {**W4G64, **GPTQ, **MIXED_45},
}

err = Console(stderr=True)


# ---- helpers that need no torch (run before the children) ----------------------------------------
def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def scheme_label(q: dict) -> str:
    group = q.get("group_size") or ("channel" if q["scheme"] != "w4a16" else 128)
    group = "ch" if group == "channel" else f"g{group}"
    return f"{q['scheme']} {group} {'sym' if q.get('symmetric', True) else 'asym'}"


def method_label(q: dict) -> str:
    parts = []
    if q.get("smoothquant"):
        parts.append(f"sq{q['smoothquant'].get('alpha', 0.8)}")
    algo = q.get("algorithm", "rtn")
    if algo == "gptq" and q.get("gptq", {}).get("act_order"):
        algo += " act-order"
    parts.append(algo)
    if q.get("observer", "minmax") != "minmax":
        parts.append(q["observer"] + (" imp" if q.get("importance") else ""))
    if q.get("mixed_precision"):
        parts.append(f"mixed {q['mixed_precision'].get('bits_per_weight')} bpw")
    return " + ".join(parts)


def write_recipe(name: str, quant: dict, calib: Path, out: Path, path: Path) -> None:
    recipe = {
        "version": 1,
        "name": name,
        "model": {"source": "default"},
        "calibration": {"source": str(calib), **CALIBRATION},
        "quantization": copy.deepcopy(quant),
        "export": {"out": str(out), "overwrite": True},
    }
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))


def quantize(name: str, recipe: Path, work: Path) -> dict:
    """One ``optkit run`` in a child process: wall time and the child's own peak RSS."""
    log = work / f"{name}.log"
    summary = work / f"{name}.summary.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    cmd = [sys.executable, "-m", "optkit.cli", "--debug", "run", str(recipe), "--summary-json", str(summary)]
    with open(log, "wb") as f:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=work, env=env)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:  # interrupted: do not leave the child running
            proc.kill()
            proc.wait()
            raise
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    row = {"wall_s": wall, "peak_rss_mb": usage.ru_maxrss * 1024 / 1e6, "returncode": proc.returncode}
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        row["error"] = "\n".join(tail)
    elif summary.is_file():
        row["summary"] = json.loads(summary.read_text())
    return row


def warm_default_model(work: Path) -> bool:
    """Convert the embedded model into the optkit cache (once per machine) in a child process, so
    the first variant's time does not include the conversion and this process stays small."""
    code = "from optkit.checkpoint.default import ensure_default_checkpoint; ensure_default_checkpoint()"
    return subprocess.run([sys.executable, "-c", code], cwd=work).returncode == 0


def rss_floor_mb(work: Path) -> float:
    """Peak RSS of a child that does nothing: the floor under every measured peak."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"], cwd=work)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss * 1024 / 1e6


# ---- artifact accounting -------------------------------------------------------------------------
def safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def artifact_bits(artifact: Path) -> dict:
    """Bits per weight over the quantized Linear layers (codes, scales and zero points as
    stored) and the artifact's weight bytes (its *.safetensors files)."""
    from safetensors import safe_open

    manifest = json.loads((artifact / "optkit.json").read_text())
    st_files = [n for n in manifest["files"] if n.endswith(".safetensors")]
    where = {}
    for n in st_files:
        for key, info in safetensors_header(artifact / n).items():
            where[key] = (n, info)
    stored_bytes = n_weights = 0
    for name, layer in manifest["layers"]["quantized"].items():
        if layer.get("kind") != "linear":
            continue
        for suffix in ("weight_packed", "weight", "weight_scale", "weight_zero_point"):
            if f"{name}.{suffix}" in where:
                start, end = where[f"{name}.{suffix}"][1]["data_offsets"]
                stored_bytes += end - start
        if f"{name}.weight_shape" in where:
            file = where[f"{name}.weight_shape"][0]
            with safe_open(str(artifact / file), framework="pt") as f:
                n_weights += math.prod(f.get_tensor(f"{name}.weight_shape").tolist())
        else:
            n_weights += math.prod(where[f"{name}.weight"][1]["shape"])
    return {
        "bits_per_weight": 8 * stored_bytes / n_weights if n_weights else float("nan"),
        "quantized_linears": sum(1 for v in manifest["layers"]["quantized"].values() if v.get("kind") == "linear"),
        "weight_bytes": sum(manifest["files"][n]["bytes"] for n in st_files),
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---- main ----------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="all", help=f"comma list (default: all): {', '.join(VARIANTS)}")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--full", action="store_true", help="evaluate on all 589 windows (default: the first 40)")
    g.add_argument("--windows", type=int, help="evaluate on the first N windows (smoke runs; not the protocol)")
    ap.add_argument("--batch-size", type=int, default=4, help="evaluation windows per forward pass")
    ap.add_argument("--json", type=Path, help="also write every row and the protocol here")
    ap.add_argument("--keep", type=Path, help="keep recipes, logs and artifacts in this directory")
    args = ap.parse_args()
    names = list(VARIANTS) if args.variants == "all" else [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    if args.windows is not None and args.windows < 1:
        ap.error("--windows must be at least 1")
    args.names = names
    return args


def main() -> int:
    args = parse_args()
    if not (DATA / CALIB_FILE).is_file() or not (DATA / EVAL_FILE).is_file():
        err.print(f"WikiText-2 data not found: expected {DATA}/{CALIB_FILE} and {EVAL_FILE} (see ../shared/data/README.md)")
        return 2
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        work = args.keep.resolve()
    else:
        work = Path(tempfile.mkdtemp(prefix="optkit-quality-"))
    try:
        return run(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> int:
    hashes = {f: sha256(DATA / f) for f in (CALIB_FILE, EVAL_FILE)}
    calib = DATA / CALIB_FILE
    floor = rss_floor_mb(work)
    if not warm_default_model(work):
        err.print("cannot prepare the embedded default model (see the error above)")
        return 2

    # 1. quantize, each in its own process, before this one grows
    runs: dict[str, dict] = {}
    for i, name in enumerate(args.names, 1):
        recipe = work / f"{name}.yaml"
        write_recipe(name, VARIANTS[name], calib, work / name, recipe)
        err.print(f"[{i}/{len(args.names)}] quantizing {name} ...")
        runs[name] = quantize(name, recipe, work)
        r = runs[name]
        if r["returncode"] == 0:
            err.print(f"    done in {r['wall_s']:.1f} s, peak RSS {r['peak_rss_mb']:,.0f} MB")
        else:
            err.print(f"    FAILED (exit {r['returncode']}); log {work / (name + '.log')}:\n{r['error']}", markup=False)

    # 2. the unquantized reference, once
    import torch

    from optkit.checkpoint import load_checkpoint
    from optkit.evaluate import ReferenceLogits, evaluate, load_text_tokens, make_windows
    from optkit.export import load_dequantized_model
    from optkit.recipe import ModelConfig

    torch.set_num_threads(THREADS)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    ck = load_checkpoint(ModelConfig())
    tokens = load_text_tokens(DATA / EVAL_FILE, ck.tokenizer)
    n_windows = None if args.full else (args.windows or QUICK_WINDOWS)
    windows = make_windows(tokens, SEQ_LEN, n_windows)  # (W, L)
    protocol = {
        "model": ck.name,
        "model_fingerprint": ck.fingerprint,
        "calibration": {"file": CALIB_FILE, "sha256": hashes[CALIB_FILE], **CALIBRATION},
        "evaluation": {
            "file": EVAL_FILE,
            "sha256": hashes[EVAL_FILE],
            "tokens": tokens.numel(),
            "seq_len": SEQ_LEN,
            "windows": windows.shape[0],
            "tokens_scored": windows.shape[0] * (SEQ_LEN - 1),
            "figure": "full" if args.full else ("quick" if args.windows is None else f"first {args.windows} windows (smoke)"),
        },
        "dtype": "float32",
        "threads": THREADS,
    }
    machine = {
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "rss_floor_mb": floor,
    }
    print_header(protocol, machine)

    err.print("reference: unquantized model ...")
    rows = []
    with tempfile.TemporaryDirectory(prefix="optkit-quality-ref-") as ref_dir:
        t0 = time.perf_counter()
        with ReferenceLogits.compute(ck.model, windows, directory=ref_dir, batch_size=args.batch_size) as ref:
            ref_s = time.perf_counter() - t0
            n_params = sum(p.numel() for p in ck.model.parameters())  # tied embeddings counted once
            rows.append(  # sized as a 16-bit checkpoint, the baseline a quantized artifact replaces
                {
                    "variant": "unquantized",
                    "scheme": "16-bit (reference)",
                    "method": "-",
                    "checkpoint_dtype": ck.dtype or "float32",
                    "bits_per_weight": 16.0,
                    "weight_bytes": 2 * n_params,
                    **ref.result.to_json(),
                    "kl_divergence": 0.0,
                    "top1_agreement": 1.0,
                    "eval_s": ref_s,
                }
            )
            del ck
            # 3. every artifact against it
            for name in args.names:
                q = VARIANTS[name]
                row = {"variant": name, "scheme": scheme_label(q), "method": method_label(q), "quantization": q, **runs[name]}
                row["stage_s"] = row.pop("summary", {}).get("timings_s")
                if runs[name]["returncode"] == 0:
                    err.print(f"evaluating {name} ...")
                    row.update(artifact_bits(work / name))
                    t0 = time.perf_counter()
                    model = load_dequantized_model(work / name, torch.float32)
                    row.update(evaluate(model, windows, reference=ref, batch_size=args.batch_size).to_json())
                    row["eval_s"] = time.perf_counter() - t0
                    del model
                rows.append(row)

    print_table(rows, protocol)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"protocol": protocol, "machine": machine, "rows": rows}, indent=2) + "\n")
        err.print(f"wrote {args.json}")
    return 1 if any(r.get("returncode", 0) != 0 for r in rows) else 0


def stdout_console() -> Console:
    out = Console()
    return out if out.is_terminal else Console(width=200)  # a file or pipe gets the whole table


def print_header(protocol: dict, machine: dict) -> None:
    c, e = protocol["calibration"], protocol["evaluation"]
    out = stdout_console()
    out.print(f"[bold]optkit quality benchmark[/bold]: {protocol['model']} (fingerprint {protocol['model_fingerprint'][:12]})")
    out.print(f"calibration: {c['file']} (sha256 {c['sha256'][:12]}), {c['num_samples']} x {c['seq_len']} tokens, seed {c['seed']}")
    out.print(
        f"evaluation:  {e['file']} (sha256 {e['sha256'][:12]}), {e['tokens']:,} tokens, {e['windows']} windows x "
        f"{e['seq_len']} ({e['figure']}), {e['tokens_scored']:,} tokens scored"
    )
    out.print(
        f"machine:     {machine['cpu']}, {machine['cpu_count']} CPUs, torch {machine['torch']}, {protocol['threads']} threads, "
        f"{protocol['dtype']}; child RSS floor {machine['rss_floor_mb']:,.0f} MB"
    )


def print_table(rows: list[dict], protocol: dict) -> None:
    e = protocol["evaluation"]
    t = Table(title=f"WikiText-2 test, {e['windows']} x {e['seq_len']} windows ({e['tokens_scored']:,} tokens)", title_justify="left")
    for col, justify in [
        ("variant", "left"),
        ("scheme", "left"),
        ("method", "left"),
        ("bits/weight", "right"),
        ("size MB", "right"),
        ("perplexity", "right"),
        ("KL", "right"),
        ("top-1", "right"),
        ("quantize s", "right"),
        ("peak RSS MB", "right"),
    ]:
        t.add_column(col, justify=justify)
    for r in rows:
        if r.get("returncode", 0) != 0:
            t.add_row(r["variant"], r["scheme"], r["method"], *["-"] * 5, f"FAILED ({r['returncode']})", "")
            continue
        t.add_row(
            r["variant"],
            r["scheme"],
            r["method"],
            f"{r['bits_per_weight']:.2f}",
            f"{r['weight_bytes'] / 1e6:,.1f}",
            f"{r['perplexity']:.3f}",
            f"{r['kl_divergence']:.4f}",
            f"{r['top1_agreement']:.3f}",
            f"{r['wall_s']:.1f}" if "wall_s" in r else "-",
            f"{r['peak_rss_mb']:,.0f}" if "peak_rss_mb" in r else "-",
        )
    stdout_console().print(t)


if __name__ == "__main__":
    sys.exit(main())
