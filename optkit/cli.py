"""Command line: flags -> recipe -> one API call. No pipeline logic lives here.

User errors (:class:`optkit.errors.UserError`) print one message and exit with code 2;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import json
import os
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from optkit import __version__
from optkit.errors import RecipeError, UserError

app = typer.Typer(
    name="optkit",
    help="Quantize an LLM checkpoint into a verified artifact that standard runtimes load.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
out_console = Console()
err_console = Console(stderr=True)


class Scheme(str, Enum):
    w8a16 = "w8a16"
    w4a16 = "w4a16"
    w8a8 = "w8a8"


class AlgorithmName(str, Enum):
    rtn = "rtn"
    gptq = "gptq"
    awq = "awq"


class ObserverName(str, Enum):
    auto = "auto"
    minmax = "minmax"
    mse = "mse"


class Precision(str, Enum):
    b16 = "16bit"
    int8 = "int8"


class ChatTemplate(str, Enum):
    auto = "auto"
    on = "on"
    off = "off"


class DType(str, Enum):
    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


def _version(value: bool) -> None:
    if value:
        out_console.print(f"optkit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
) -> None:
    """optkit: checkpoint -> calibrate -> quantize -> export, with the evidence to ship it."""


def _group_size(value: str | None) -> int | str | None:
    if value is None or value == "channel":
        return value
    try:
        return int(value)
    except ValueError:
        raise RecipeError(f"--group-size: {value!r} is not a number or 'channel'") from None


def _layer_precision(value: str) -> dict:
    pattern, sep, precision = value.rpartition("=")
    if not sep or not pattern:
        raise RecipeError(f"--layer: {value!r} is not PATTERN=PRECISION (for example 'model.layers.0.*=8bit')")
    return {"match": pattern, "precision": precision}


def _quiet_libraries() -> None:
    """transformers draws its own tqdm bars while loading; optkit's stages replace them."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _print_summary(result) -> None:  # result: optkit.pipeline.QuantizeResult
    s = result.to_json()
    t = Table(title=f"optkit quantize: {result.model_name}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("scheme", f"{s['scheme']} ({s['algorithm']}), unquantized tensors and scales in {s['dtype']}")
    by_scheme: dict[str, int] = {}
    for sch in [*result.plan.linears.values(), *result.plan.embeddings.values()]:
        by_scheme[sch.label()] = by_scheme.get(sch.label(), 0) + 1
    t.add_row("quantized", ", ".join(f"{n} layers {lbl}" for lbl, n in by_scheme.items()))
    t.add_row(
        "params",
        f"{s['params_quantized'] / 1e6:,.1f}M of {s['params_total'] / 1e6:,.1f}M quantized "
        f"({100 * s['params_quantized'] / s['params_total']:.1f}%)",
    )
    t.add_row("kept 16-bit", ", ".join(result.plan.excluded) if result.plan.excluded else "none")
    if result.plan.skipped:
        t.add_row("SKIPPED", "\n".join(f"{n}: {why}" for n, why in result.plan.skipped.items()))
    else:
        t.add_row("skipped", "none")
    c = s["calibration"]
    t.add_row(
        "calibration",
        f"{c['num_samples']} x {c['seq_len']} tokens from {c['source']} (seed {c['seed']}), "
        f"fingerprint {c['fingerprint'][:12]}",
    )
    t.add_row(
        "size",
        f"{_mb(s['bytes_16bit'])} at 16-bit -> {_mb(s['weight_bytes'])} weights "
        f"({s['size_ratio']:.3f}x, {s['bits_per_weight']:.2f} bits/weight); artifact {_mb(s['artifact_bytes'])}",
    )
    t.add_row("time", ", ".join(f"{k} {v:.1f}s" for k, v in s["timings_s"].items()) +
              f"; total {sum(s['timings_s'].values()):.1f}s")
    if s.get("output_error"):
        oe = s["output_error"]
        t.add_row(
            "output error",
            f"mean relative output error of {oe['layers']} calibrated layers {oe['mean']:.2e} "
            f"(round-to-nearest on the same inputs: {oe['mean_rtn']:.2e})",
        )
    if s.get("most_sensitive"):
        top = s["most_sensitive"][:5]
        t.add_row("most sensitive", "\n".join(f"{r['layer']}: KL " + ", ".join(f"{k} {v:.2e}" for k, v in r["kl"].items()) for r in top))
    for note in s.get("notices", []):
        t.add_row("note", note)
    t.add_row("peak memory", f"{s['peak_rss_mb']:,.0f} MB resident (whole process)")
    for w in s.get("warnings", []):
        t.add_row("WARNING", w)
    for note in s["runtime_notes"]:
        t.add_row("WARNING", note)
    t.add_row("artifact", f"{s['artifact']}  (check it with: optkit verify {s['artifact']})")
    out_console.print(t)


def _write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def _run(recipe, summary_json: Path | None) -> None:
    from optkit.pipeline import run_recipe
    from optkit.progress import RichReporter

    _quiet_libraries()
    result = run_recipe(recipe, RichReporter(err_console))
    _print_summary(result)
    if summary_json is not None:
        _write_json_atomic(summary_json, result.to_json())


SummaryOpt = Annotated[Optional[Path], typer.Option("--summary-json", help="Also write the summary as JSON here.")]


@app.command()
def quantize(
    model: Annotated[str, typer.Argument(help="'default', a HF model directory, a .gguf file, or a hub id.")] = "default",
    scheme: Annotated[
        Scheme, typer.Option(help="w8a16 / w4a16 (weight-only int8 / int4) or w8a8 (int8 weights and per-token int8 activations).")
    ] = Scheme.w4a16,
    algorithm: Annotated[
        AlgorithmName, typer.Option(help="rtn (round-to-nearest), gptq (Hessian error compensation) or awq (activation-aware scaling).")
    ] = AlgorithmName.rtn,
    observer: Annotated[
        ObserverName, typer.Option(help="Scale choice: minmax, mse (clipping search); auto = mse for gptq, else minmax.")
    ] = ObserverName.auto,
    importance: Annotated[
        Optional[bool],
        typer.Option("--importance/--no-importance", help="Weight the mse search by activation energy (default: on for gptq)."),
    ] = None,
    act_order: Annotated[bool, typer.Option("--act-order/--no-act-order", help="GPTQ: activation order, static groups.")] = True,
    damp: Annotated[float, typer.Option(help="GPTQ dampening (fraction of the mean Hessian diagonal).")] = 0.01,
    smoothquant: Annotated[
        Optional[float], typer.Option(help="SmoothQuant migration strength alpha in [0, 1] (w8a8 only).")
    ] = None,
    bits_per_weight: Annotated[
        Optional[float], typer.Option(help="Mixed precision: average bits per weight budget over the quantized Linears.")
    ] = None,
    max_kl: Annotated[Optional[float], typer.Option(help="Mixed precision: largest predicted KL divergence.")] = None,
    layer: Annotated[
        Optional[list[str]], typer.Option(help="PATTERN=4bit|8bit|16bit: precision per Linear name pattern (repeatable).")
    ] = None,
    resume: Annotated[bool, typer.Option(help="Resume an interrupted layer-by-layer run from its last finished block.")] = True,
    group_size: Annotated[
        Optional[str], typer.Option(help="32, 64, 128, 256 or 'channel'. Default: channel (w8a16), 128 (w4a16).")
    ] = None,
    asym: Annotated[bool, typer.Option("--asym", help="Asymmetric (integer zero point per group).")] = False,
    out: Annotated[Optional[Path], typer.Option(help="Artifact directory (default artifacts/<model>-<scheme>).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing artifact at --out.")] = False,
    include: Annotated[Optional[list[str]], typer.Option(help="Glob or re:REGEX of Linear layers to quantize (repeatable).")] = None,
    exclude: Annotated[Optional[list[str]], typer.Option(help="Glob or re:REGEX of Linear layers to keep 16-bit (repeatable).")] = None,
    lm_head: Annotated[Precision, typer.Option(help="Output projection precision.")] = Precision.b16,
    embeddings: Annotated[Precision, typer.Option(help="Input embedding precision.")] = Precision.b16,
    allow_skip: Annotated[bool, typer.Option("--allow-skip", help="Keep layers that do not fit the group size in 16-bit.")] = False,
    dtype: Annotated[DType, typer.Option(help="dtype of unquantized tensors and scales.")] = DType.auto,
    calib: Annotated[str, typer.Option(help="'builtin', a .txt/.raw/.tokens/.jsonl/.parquet file, or hf:DATASET.")] = "builtin",
    calib_split: Annotated[str, typer.Option(help="Dataset split for hf: sources.")] = "train",
    text_field: Annotated[str, typer.Option(help="Text column/key of the calibration source.")] = "text",
    num_samples: Annotated[int, typer.Option(help="Calibration windows.")] = 128,
    seq_len: Annotated[int, typer.Option(help="Tokens per calibration window.")] = 512,
    seed: Annotated[int, typer.Option(help="Calibration seed.")] = 0,
    chat_template: Annotated[ChatTemplate, typer.Option(help="Render conversations with the chat template.")] = ChatTemplate.auto,
    revision: Annotated[Optional[str], typer.Option(help="Hub revision for hub ids.")] = None,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Accept .bin/.pt weights (loaded weights_only).")] = False,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Run model code from the checkpoint.")] = False,
    summary_json: SummaryOpt = None,
) -> None:
    """Quantize MODEL (round-to-nearest, GPTQ, AWQ, SmoothQuant W8A8, mixed precision) and export a
    compressed-tensors artifact."""
    from optkit.recipe import recipe_from_dict

    quant: dict = {
        "scheme": scheme.value,
        "group_size": _group_size(group_size),
        "symmetric": not asym,
        "algorithm": algorithm.value,
        "observer": observer.value,
        "importance": importance,
        "gptq": {"act_order": act_order, "damp": damp},
        "resume": resume,
        "lm_head": lm_head.value,
        "embeddings": embeddings.value,
        "allow_skip": allow_skip,
    }
    if smoothquant is not None:
        quant["smoothquant"] = {"alpha": smoothquant}
    if bits_per_weight is not None or max_kl is not None:
        quant["mixed_precision"] = {"bits_per_weight": bits_per_weight, "max_kl": max_kl}
    if layer:
        quant["layers"] = [_layer_precision(x) for x in layer]
    if include:
        quant["include"] = include
    if exclude:
        quant["exclude"] = exclude
    data = {
        "model": {"source": model, "revision": revision, "allow_pickle": allow_pickle, "trust_remote_code": trust_remote_code},
        "calibration": {
            "source": calib,
            "split": calib_split,
            "text_field": text_field,
            "num_samples": num_samples,
            "seq_len": seq_len,
            "seed": seed,
            "chat_template": chat_template.value,
        },
        "quantization": quant,
        "export": {"out": str(out) if out else None, "dtype": dtype.value, "overwrite": overwrite},
    }
    _run(recipe_from_dict(data, "command line"), summary_json)


@app.command()
def run(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML file.")],
    out: Annotated[Optional[Path], typer.Option(help="Override export.out.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Override export.overwrite.")] = False,
    summary_json: SummaryOpt = None,
) -> None:
    """Run the pipeline described by a recipe file. With 'variants' and 'report': build and
    measure every variant, write report.json/.md/.html, exit 1 when the gates fail."""
    from optkit.recipe import load_recipe

    r = load_recipe(recipe)
    updates: dict = {}
    if out is not None:
        updates["out"] = str(out)
    if overwrite:
        updates["overwrite"] = True
    if r.variants:  # a sign-off: every variant built and measured, one report, gates decide the exit code
        if out is not None:
            r = r.model_copy(update={"report": r.report.model_copy(update={"out": str(out)})})
        _signoff(r)
        return
    if updates:
        r = r.model_copy(update={"export": r.export.model_copy(update=updates)})
    _run(r, summary_json)


def _signoff(recipe) -> None:
    from optkit.progress import RichReporter
    from optkit.report import Report, evaluate_gates, exit_code, exit_message, write_report
    from optkit.signoff import run_signoff

    _quiet_libraries()
    report_dict, out_dir = run_signoff(recipe, RichReporter(err_console))
    report = evaluate_gates(Report.model_validate(report_dict))
    write_report(report, out_dir)
    for v in report.variants:
        if v.status != "ok":
            err_console.print(f"variant {v.name} FAILED: {v.error}", markup=False, highlight=False, soft_wrap=True)
    out_console.print(f"report: {out_dir}/report.md, report.html, report.json", markup=False, highlight=False, soft_wrap=True)
    out_console.print(exit_message(report), markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(exit_code(report))


@app.command()
def validate(files: Annotated[list[Path], typer.Argument(help="Recipe files to check.")]) -> None:
    """Check recipe files without running them (exit 2 if any is invalid)."""
    from optkit.recipe import load_recipe

    bad = 0
    for f in files:
        try:
            load_recipe(f)
            out_console.print(f"ok: {f}")
        except RecipeError as err:
            bad += 1
            err_console.print(f"invalid: {err}", markup=False, highlight=False, soft_wrap=True)
    if bad:
        raise typer.Exit(2)


@app.command()
def schema(out: Annotated[Optional[Path], typer.Option(help="Write to this file instead of stdout.")] = None) -> None:
    """Print the recipe JSON schema (for editor completion)."""
    from optkit.recipe import recipe_json_schema

    if out is None:
        sys.stdout.write(json.dumps(recipe_json_schema(), indent=2, sort_keys=True) + "\n")
    else:
        _write_json_atomic(out, recipe_json_schema())


@app.command()
def verify(artifact: Annotated[Path, typer.Argument(help="Artifact directory.")]) -> None:
    """Re-hash every artifact file against its manifest (exit 1 if anything differs)."""
    from optkit.export import verify_artifact

    problems = verify_artifact(artifact)
    if problems:
        for p in problems:
            err_console.print(f"FAIL {artifact}/{p}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    out_console.print(f"ok: {artifact}: every file matches optkit.json")


def _int_list(value: str, name: str) -> tuple[int, ...]:
    try:
        items = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        items = ()
    if not items or any(i <= 0 for i in items):
        raise UserError(f"--{name} {value!r}: give positive integers separated by commas", hint=f"e.g. --{name} 1,4,16")
    return items


@app.command()
def bench(
    model: Annotated[Optional[str], typer.Argument(help="An optkit artifact, a HF checkpoint directory, or 'default'.")] = None,
    synthetic: Annotated[
        Optional[str], typer.Option(help="Random weights of a named shape: smollm2-135m, llama-3.2-1b, llama-3-8b, qwen2.5-7b.")
    ] = None,
    weights: Annotated[str, typer.Option(help="Synthetic weight format: bf16, w8a16, w4a16 (g128), w4a16-g64, w4a16-g32, w8a8.")] = "w4a16",
    prompt_lens: Annotated[str, typer.Option(help="Prompt lengths for TTFT, comma-separated.")] = "128,512,2048",
    batch_sizes: Annotated[str, typer.Option(help="Decode batch sizes, comma-separated.")] = "1,4,16,64",
    decode_tokens: Annotated[int, typer.Option(help="Tokens generated per request in the decode runs.")] = 64,
    offline_requests: Annotated[int, typer.Option(help="Requests of mixed lengths in the offline run (0: skip).")] = 64,
    repeats: Annotated[int, typer.Option(help="Timed repeats per measurement (after warm-up).")] = 3,
    warmup: Annotated[int, typer.Option(help="Untimed warm-up runs per measurement.")] = 1,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N.")] = "auto",
    dtype: Annotated[DType, typer.Option(help="Compute dtype (auto: bfloat16 where it is fast).")] = DType.auto,
    kernel: Annotated[str, typer.Option(help="Matmul kernel for quantized layers (auto picks per scheme and device).")] = "auto",
    kv_cache_memory: Annotated[
        str, typer.Option(help="KV cache budget: bytes with a unit (2GiB) or a fraction of free memory (0.2).")
    ] = "0.2",
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    threads: Annotated[Optional[int], typer.Option(help="CPU threads (default: torch's choice).")] = None,
    compile_decode: Annotated[
        bool,
        typer.Option("--compile/--no-compile", help="Compile the decode step with torch.compile (faster; a minute of warm-up)."),
    ] = True,
    cuda_graphs: Annotated[bool, typer.Option(help="With --compile on a GPU: capture CUDA graphs (mode reduce-overhead).")] = False,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the full result as JSON here.")] = None,
) -> None:
    """Measure the runner: TTFT per prompt length, decode tokens/s per batch size, offline
    throughput, decode bandwidth against the machine's peak, KV and peak memory."""
    from optkit.serve.bench import BenchSettings, render, run_bench
    from optkit.serve.engine import EngineConfig, LLMEngine
    from optkit.serve.loader import load_source
    from optkit.serve.synthetic import synthetic_source

    if (model is None) == (synthetic is None):
        raise UserError("give either MODEL or --synthetic NAME (not both)", hint="e.g. optkit bench --synthetic llama-3-8b")
    settings = BenchSettings(
        prompt_lens=_int_list(prompt_lens, "prompt-lens"), batch_sizes=_int_list(batch_sizes, "batch-sizes"),
        decode_tokens=decode_tokens, offline_requests=offline_requests, repeats=repeats, warmup=warmup,
    )
    if decode_tokens < 2 or repeats < 1 or warmup < 0 or offline_requests < 0:
        raise UserError("--decode-tokens must be >= 2, --repeats >= 1, --warmup and --offline-requests >= 0")
    _quiet_libraries()
    source = synthetic_source(synthetic, weights) if synthetic else load_source(model)
    longest = max(max(settings.prompt_lens) + 1, settings.decode_prompt_len + decode_tokens,
                  settings.offline_prompt_range[1] + settings.offline_output_range[1])
    cfg = EngineConfig(
        device=device, dtype=dtype.value, kernel=kernel, kv_cache_memory=kv_cache_memory, block_size=block_size,
        threads=threads, compile=compile_decode, compile_mode="reduce-overhead" if cuda_graphs else None,
        max_model_len=min(longest, source.config.max_position_embeddings),
        max_num_batched_tokens=max(2048, max(settings.prompt_lens)),
    )
    err_console.print(f"loading {source.path}" + (" (SYNTHETIC random weights: speed only, no quality)" if source.synthetic else ""))
    engine = LLMEngine(source, cfg)
    if not engine.native:
        err_console.print(f"WARNING: {engine.fallback_reason}; measuring the slower transformers fallback")
    result = run_bench(engine, settings, lambda msg: err_console.print(f"  {msg}"))
    for table in render(result):
        out_console.print(table)
    if json_out is not None:
        _write_json_atomic(json_out, result)


report_app = typer.Typer(help="Render and compare sign-off reports.", no_args_is_help=True)
app.add_typer(report_app, name="report")


@report_app.command("render")
def report_render(
    report_json: Annotated[Path, typer.Argument(help="A report.json written by a sign-off run.")],
    out: Annotated[Path, typer.Option(help="Directory for report.json, report.md and report.html (created or updated).")],
    check: Annotated[bool, typer.Option(help="Exit 1 when the gates fail (as a sign-off run does).")] = False,
) -> None:
    """Re-evaluate the gates of a report and write it as JSON, Markdown and self-contained HTML."""
    from optkit.report import evaluate_gates, exit_code, exit_message, load_report, write_report

    r = evaluate_gates(load_report(report_json))
    write_report(r, out)
    out_console.print(f"wrote {out}/report.json, report.md, report.html", markup=False, highlight=False, soft_wrap=True)
    out_console.print(exit_message(r), markup=False, highlight=False, soft_wrap=True)
    if check and exit_code(r):
        raise typer.Exit(1)


@report_app.command("compare")
def report_compare(
    old: Annotated[Path, typer.Argument(help="The earlier report.json.")],
    new: Annotated[Path, typer.Argument(help="The later report.json.")],
    threshold: Annotated[float, typer.Option(help="Percent change that counts, when larger than the measured noise.")] = 5.0,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write every comparison row as JSON here.")] = None,
) -> None:
    """Compare two reports metric by metric; exit 1 when any metric got worse beyond
    max(threshold, noise) or a variant now fails. Prints Markdown (fits $GITHUB_STEP_SUMMARY)."""
    from optkit.report import compare, load_report, render_compare_markdown

    if threshold < 0:
        raise UserError(f"--threshold {threshold}: give a percentage >= 0", hint="e.g. --threshold 5")
    result = compare(load_report(old), load_report(new), threshold_pct=threshold)
    sys.stdout.write(render_compare_markdown(result))
    if json_out is not None:
        _write_json_atomic(json_out, result.model_dump(mode="json"))
    raise typer.Exit(result.exit_code)


def main() -> None:
    debug = "--debug" in sys.argv[1:]
    try:
        app()
    except UserError as err:
        if debug:
            raise
        err_console.print(f"error: {err}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("interrupted: nothing was written at the output path")
        sys.exit(130)


if __name__ == "__main__":
    main()
