"""The sign-off run: every variant of a recipe built and measured on the same tokens, on the
same machine, in one process, then judged against the recipe's gates.

Per variant: build (``run_recipe`` with the checkpoint loaded and the calibration tokens built
once, the model deep-copied), quality against the baseline's stored log-probabilities
(perplexity, KL divergence, top-1 agreement), task accuracy by log-likelihood, greedy samples,
per-layer weight SQNR, the runner's speed per phase (a short ``optkit bench``), memory. A variant
that fails to build or measure is reported as failed with its error; the others still are.
"""

from __future__ import annotations

import gc
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch

from optkit import __version__
from optkit.calibration import build_calibration
from optkit.checkpoint import load_checkpoint
from optkit.errors import UserError
from optkit.evaluate.quality import ReferenceLogits, evaluate, load_text_tokens, make_windows
from optkit.hardware import measure_peak_bandwidth, measure_peak_matmul
from optkit.pipeline import run_recipe, source_name
from optkit.progress import Reporter
from optkit.recipe import Recipe, VariantConfig

PERCENT = "%"


def _metric(value: Any, unit: str, method: str, spread: dict | None = None) -> dict:
    return {"value": value, "unit": unit, "method": method, "spread": spread}


def _spread(s: dict) -> dict:
    return {"min": s["min"], "max": s["max"], "n": s["n"]}


def report_dir(recipe: Recipe) -> Path:
    return Path(recipe.report.out) if recipe.report.out else Path("reports") / f"{recipe.name or source_name(recipe.model.source)}-signoff"


def _variant_recipe(recipe: Recipe, v: VariantConfig, work: Path) -> Recipe:
    export = recipe.export.model_copy(update={"out": str(work / v.name), "overwrite": True})
    return recipe.model_copy(update={"quantization": v.quantization, "export": export, "variants": [], "report": None})


def _speed(engine: Any, rc: Any) -> tuple[dict, list]:
    from optkit.serve.bench import BenchSettings, roofline_points, run_bench

    sp = rc.speed
    settings = BenchSettings(
        prompt_lens=tuple(sp.prompt_lens), batch_sizes=tuple(sp.batch_sizes), decode_tokens=sp.decode_tokens,
        offline_requests=0, repeats=sp.repeats, warmup=1, probe_bandwidth=False,
    )
    bench = run_bench(engine, settings)
    points = roofline_points(bench, engine, settings) if engine.native else []
    method = f"optkit runner, median of {sp.repeats} after 1 warm-up, random prompt ids"
    speed = {
        "prefill": [
            {"prompt_tokens": p["prompt_tokens"],
             "ttft_ms": _metric(p["ttft_s"]["median"] * 1e3, "ms", method,
                                {"min": p["ttft_s"]["min"] * 1e3, "max": p["ttft_s"]["max"] * 1e3, "n": p["ttft_s"]["n"]}),
             "tok_s": _metric(p["prefill_tok_s"]["median"], "tokens/s", method, _spread(p["prefill_tok_s"]))}
            for p in bench["prefill"]
        ],
        "decode": [
            {"batch": d["batch"],
             "tok_s": _metric(d["tok_s"]["median"], "tokens/s", method + f", {sp.decode_tokens} tokens per request",
                              _spread(d["tok_s"])),
             "itl_ms_p50": _metric(d["itl_ms"]["median"], "ms", "inter-token latency, median over steps"),
             "itl_ms_p99": _metric(d["itl_ms"]["p99"], "ms", "inter-token latency, 99th percentile over steps")}
            for d in bench["decode"]
        ],
    }
    return speed, points


def _measure_variant(
    v: VariantConfig, recipe: Recipe, ck: Any, calib: Any, windows: torch.Tensor, ref: ReferenceLogits,
    work: Path, reporter: Reporter, tasks: dict, budget: int,
) -> dict:
    from optkit.evaluate.layers import per_layer_sqnr
    from optkit.evaluate.samples import greedy_samples
    from optkit.evaluate.tasks import evaluate_tasks
    from optkit.export.reader import load_dequantized_model
    from optkit.serve.engine import EngineConfig, LLMEngine
    from optkit.serve.loader import load_source, source_from_model

    rc = recipe.report
    out: dict = {"name": v.name, "description": v.description, "status": "ok", "error": None}
    art = None
    if v.quantization is None:
        model = ck.model
        params = sum(p.numel() for p in model.parameters())
        weight_bytes = 2 * params  # served at 16 bits
        out |= {"scheme": None, "algorithm": None}
        memory = {"artifact_bytes": _metric(None, "B", "the baseline has no artifact (checkpoint served as is)"),
                  "bits_per_weight": _metric(16.0, "bits", "16-bit weights")}
        peak_rss = None
    else:
        with reporter.stage(f"build-{v.name}", f"Building variant {v.name}"):
            res = run_recipe(_variant_recipe(recipe, v, work), reporter, preloaded=(ck, calib))
        art = res.artifact.path
        j = res.to_json()
        model = load_dequantized_model(art, torch.float32)
        weight_bytes = res.artifact.weight_bytes
        peak_rss = res.peak_rss_bytes
        out |= {"scheme": j["scheme"], "algorithm": j["algorithm"],
                "artifact_hashes": {n: f["sha256"] for n, f in res.artifact.files.items()}}
        memory = {"artifact_bytes": _metric(res.artifact.total_bytes, "B", "sum of the artifact's files"),
                  "bits_per_weight": _metric(j["bits_per_weight"], "bits", "8 x weight bytes / parameters (whole model)")}
        if res.sensitivity is not None:
            out["_sensitivity"] = res.sensitivity.to_json()
        if res.mixed is not None:
            out["_mixed"] = {"bits_per_weight": res.mixed.bits_per_weight, "predicted_kl": res.mixed.predicted_kl,
                             "choice": res.mixed.choice}
    with reporter.stage(f"quality-{v.name}", f"Quality of {v.name}"):
        q = evaluate(model, windows, ref, stride=rc.eval.stride)
        task_results = evaluate_tasks(model, ck.tokenizer, tasks, max_items=rc.max_task_items) if tasks else {}
        samples = greedy_samples(model, ck.tokenizer, rc.samples)
        sqnr = per_layer_sqnr(ck.model.state_dict(), art) if art is not None else None
    if model is not ck.model:
        del model
        gc.collect()
    with reporter.stage(f"speed-{v.name}", f"Speed of {v.name}"):
        source = load_source(str(art)) if art is not None else source_from_model(ck.model, ck.tokenizer, "baseline")
        longest = max(max(rc.speed.prompt_lens) + 1, 32 + rc.speed.decode_tokens) + 16
        engine = LLMEngine(source, EngineConfig(kv_cache_memory="512MiB", compile=rc.speed.compile,
                                                threads=rc.speed.threads, max_model_len=longest))
        speed, points = _speed(engine, rc)
        kv_per_token = engine.kv_bytes_per_token
        del engine, source
        gc.collect()
    eval_method = (f"{q.tokens_scored} tokens scored in {q.windows} windows x {q.seq_len}"
                   + (f" (stride {rc.eval.stride})" if rc.eval.stride else "") + f" of {rc.eval.source}")
    out["quality"] = {
        "perplexity": _metric(q.perplexity, "", "exp(mean NLL), " + eval_method),
        "nll": _metric(q.nll, "nats/token", "mean NLL, " + eval_method),
        "kl_divergence": _metric(q.kl_divergence, "nats/token", "mean KL(P_baseline || P_variant), " + eval_method),
        "top1_agreement": _metric(q.top1_agreement, "fraction", "argmax equal to the baseline's, " + eval_method),
        "tasks": {name: {"accuracy": _metric(r.accuracy, "fraction", "log-likelihood multiple choice (acc)"),
                         "n": r.n} for name, r in task_results.items()},
        "per_layer_sqnr_db": sqnr,
        "samples": samples,
    }
    memory |= {
        "weight_bytes": _metric(weight_bytes, "B", "bytes of weights as served (packed codes + scales + 16-bit rest)"),
        "kv_bytes_per_token": _metric(kv_per_token, "B", "K and V of one token over all layers, compute dtype"),
        "peak_rss_bytes": _metric(peak_rss, "B", "peak resident memory of the build (process-wide)"),
        "max_context_tokens": _metric(max(0, (budget - weight_bytes) // kv_per_token), "tokens",
                                      f"(budget {rc.memory_budget} - weight bytes) / KV bytes per token"),
    }
    out["memory"] = memory
    out["speed"] = speed
    out["roofline"] = {"points": points}
    return out


def eval_tokens(cfg: Any, tokenizer: Any) -> torch.Tensor:
    """The evaluation token stream: a text file read whole, or the documents of a .jsonl,
    .parquet or hf: source joined by blank lines (plain text only: perplexity of a chat
    transcript depends on a template)."""
    from optkit.calibration.data import read_documents
    from optkit.recipe import CalibrationConfig

    if Path(cfg.source).suffix in (".txt", ".raw") or not (cfg.source.startswith("hf:") or Path(cfg.source).is_file()):
        return load_text_tokens(cfg.source, tokenizer)  # also names a missing file
    docs, _ = read_documents(CalibrationConfig(source=cfg.source, split=cfg.split, text_field=cfg.text_field))
    if any(not isinstance(d, str) for d in docs):
        raise UserError(f"evaluation source {cfg.source} holds conversations; perplexity needs plain text",
                        hint="point report.eval.text_field at a plain-text column")
    text = "\n\n".join(docs)
    return torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=torch.long)


def run_signoff(recipe: Recipe, reporter: Reporter | None = None) -> tuple[dict, Path]:
    """Build and measure every variant; returns the report (a dict in the report schema) and
    the directory it was written to. Gates are evaluated by :mod:`optkit.report`."""
    from optkit.evaluate.tasks import resolve_tasks
    from optkit.report.gates import validate_gates

    reporter = reporter or Reporter()
    rc = recipe.report
    if rc is None:
        raise UserError("this recipe has no 'report' section", hint="add variants and a report section to sign off")
    validate_gates(rc.gates)  # an unknown metric fails before minutes of work
    tasks = resolve_tasks(rc.tasks)
    out_dir = report_dir(recipe)
    from optkit.serve.engine import parse_memory

    budget = parse_memory(rc.memory_budget, 0)
    work = Path(recipe.export.out) if recipe.export.out else Path("artifacts") / out_dir.name
    started = time.time()
    with reporter.stage("load", "Loading checkpoint"):
        ck = load_checkpoint(recipe.model)
    with reporter.stage("calibration", "Building calibration tokens"):
        calib = build_calibration(recipe.calibration, ck.tokenizer)
    ids = eval_tokens(rc.eval, ck.tokenizer)
    if ids.numel() < rc.eval.seq_len:
        raise UserError(
            f"evaluation text {rc.eval.source} has {ids.numel()} tokens, fewer than one window of {rc.eval.seq_len}",
            hint="give a longer text or a smaller report.eval.seq_len",
        )
    windows = make_windows(ids, rc.eval.seq_len, rc.eval.max_windows, rc.eval.stride)
    dev = torch.device("cpu")
    machine = {
        "peak_read_bandwidth": _metric(None, "GB/s", ""),
        "peak_matmul": {},
    }
    bw = measure_peak_bandwidth(dev)
    machine["peak_read_bandwidth"] = _metric(bw["read_gb_s"], "GB/s", bw["method"])
    for dt in (torch.bfloat16, torch.float32):
        mm = measure_peak_matmul(dev, dt)
        machine["peak_matmul"][mm["dtype"]] = _metric(mm["tflops"], "TFLOP/s", mm["method"])
    variants = []
    with ReferenceLogits.compute(ck.model, windows, None) as ref:
        for v in recipe.variants:
            try:
                variants.append(_measure_variant(v, recipe, ck, calib, windows, ref, work, reporter, tasks, budget))
            except (UserError, RuntimeError, ValueError, OSError) as err:  # reported, the others still run
                variants.append({"name": v.name, "description": v.description, "status": "failed",
                                 "error": f"{type(err).__name__}: {err}"})
    report = _assemble(recipe, ck, calib, machine, variants, started)
    return report, out_dir


def _assemble(recipe: Recipe, ck: Any, calib: Any, machine: dict, variants: list[dict], started: float) -> dict:
    from optkit.export.writer import package_versions
    from optkit.serve.bench import hardware

    base_name = next(v.name for v in recipe.variants if v.quantization is None)
    base = next((v for v in variants if v["name"] == base_name and v["status"] == "ok"), None)
    for v in variants:
        if v["status"] != "ok":
            continue
        q = v["quality"]
        if base is not None:
            bppl = base["quality"]["perplexity"]["value"]
            q["ppl_increase_pct"] = _metric(100 * (q["perplexity"]["value"] / bppl - 1), PERCENT, "vs the baseline, same windows")
            drops = [100 * (base["quality"]["tasks"][t]["accuracy"]["value"] - r["accuracy"]["value"])
                     for t, r in q["tasks"].items() if t in base["quality"]["tasks"]]
            q["task_accuracy_drop"] = _metric(
                max(drops) if drops else None, "points", "largest accuracy drop over the tasks vs the baseline")
            b1 = {d["batch"]: d["tok_s"]["value"] for d in v["speed"]["decode"]}.get(1)
            bb1 = {d["batch"]: d["tok_s"]["value"] for d in base["speed"]["decode"]}.get(1)
            v["speed"]["decode_speedup"] = _metric(
                b1 / bb1 if b1 and bb1 else None, "x", "decode tok/s at batch 1 vs the baseline, same run")
            longest = max(p["prompt_tokens"] for p in v["speed"]["prefill"])
            t = {p["prompt_tokens"]: p["ttft_ms"]["value"] for p in v["speed"]["prefill"]}
            tb = {p["prompt_tokens"]: p["ttft_ms"]["value"] for p in base["speed"]["prefill"]}
            v["speed"]["prefill_speedup"] = _metric(tb[longest] / t[longest] if longest in tb else None, "x",
                                                    f"TTFT at {longest} tokens, baseline / variant, same run")
        v["quality"]["sensitivity"] = v.pop("_sensitivity", None)
        v["quality"]["mixed_plan"] = v.pop("_mixed", None)
    recipe_json = recipe.model_dump(mode="json")
    return {
        "schema_version": 1,
        "title": recipe.name or f"{source_name(recipe.model.source)} sign-off",
        "provenance": {
            "recipe": recipe_json,
            "recipe_sha256": hashlib.sha256(json.dumps(recipe_json, sort_keys=True).encode()).hexdigest(),
            "checkpoint_fingerprint": ck.fingerprint,
            "calibration_fingerprint": calib.fingerprint,
            "artifact_hashes": {v["name"]: v.pop("artifact_hashes") for v in variants if "artifact_hashes" in v},
            "packages": package_versions(),
            "hardware": hardware(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "wall_s": time.time() - started,
            "engine": "optkit-runner",
            "optkit_version": __version__,
        },
        "machine": machine,
        "baseline": base_name,
        "variants": variants,
        "gates": list(recipe.report.gates),
    }
