"""A hand-built report: four variants with numbers chosen so that gate boundaries are exact.

bf16 is the baseline (200 MB of weights, 20 tok/s at batch 1). Ratios are exact in binary
floating point where a test sits on a boundary: 70/200 = 0.35 and 30/20 = 1.5 are correctly
rounded divisions whose true value is the literal, so they equal the float literals exactly.
"""

from __future__ import annotations

import pytest

from optkit.report.schema import Report

GATES = ["kl_divergence <= 0.05", "top1_agreement >= 0.9", "decode_speedup >= 1.5", "size_ratio <= 0.7"]


def _m(value, unit="", method="test", spread_pct=None, n=3):
    out = {"value": value, "unit": unit, "method": method}
    if spread_pct is not None:
        half = value * spread_pct / 200.0
        out["spread"] = {"min": value - half, "max": value + half, "n": n}
    return out


def _variant(name, *, weight, tok_s, kl=None, top1=None, ppl=None, ttft=None, tasks=None, scheme=None, noise=5.0):
    return {
        "name": name, "scheme": scheme, "algorithm": "gptq" if "gptq" in name else None,
        "memory": {"weight_bytes": _m(weight, "bytes"), "bits_per_weight": _m(16.0 * weight / 200e6),
                   "kv_bytes_per_token": _m(23040, "bytes")},
        "quality": {
            "perplexity": _m(ppl) if ppl is not None else None,
            "kl_divergence": _m(kl, "nats") if kl is not None else None,
            "top1_agreement": _m(top1) if top1 is not None else None,
            "tasks": {t: {"accuracy": _m(a), "n": 200} for t, a in (tasks or {}).items()},
            "samples": [{"prompt": "The capital of France is", "text": f"Paris ({name})"}],
        },
        "speed": {
            "prefill": [{"prompt_tokens": 512, "ttft_ms": _m(ttft, "ms", spread_pct=noise), "tok_s": _m(512e3 / ttft, "tok/s")}]
            if ttft else [],
            "decode": [{"batch": 1, "tok_s": _m(tok_s, "tok/s", spread_pct=noise), "itl_ms_p50": _m(1e3 / tok_s, "ms"),
                        "itl_ms_p99": _m(1.3e3 / tok_s, "ms")},
                       {"batch": 4, "tok_s": _m(3 * tok_s, "tok/s", spread_pct=noise)}],
        },
        "roofline": {"points": [
            {"phase": "decode", "label": "decode b1", "intensity_flop_per_byte": 270e6 / weight,
             "achieved_tflops": 270e6 * tok_s / 1e12, "achieved_gb_s": weight * tok_s / 1e9},
            {"phase": "prefill", "label": "prefill 512", "intensity_flop_per_byte": 512 * 270e6 / weight,
             "achieved_tflops": 512 * 270e6 / (ttft or 100) * 1e3 / 1e12, "achieved_gb_s": weight / (ttft or 100) * 1e3 / 1e9},
        ]},
    }


def make_report_dict() -> dict:
    return {
        "schema_version": 1,
        "provenance": {
            "recipe": {"version": 1, "model": {"source": "default"}}, "recipe_sha256": "ab" * 32,
            "checkpoint_fingerprint": "cd" * 32, "calibration_fingerprint": "ef" * 32,
            "artifact_hashes": {"w8a16": {"model.safetensors": "01" * 32}},
            "packages": {"torch": "2.13.0+cpu"}, "hardware": {"cpu": "Test CPU", "threads": 2},
            "date": "2025-01-01T00:00:00Z", "optkit_version": "0.1.0",
            "engine": {"name": "optkit-runner"}, "command": "optkit run recipes/signoff.yaml",
        },
        "machine": {"peak_read_bandwidth": _m(24.0, "GB/s", "sum() over 1 GiB"),
                    "peak_matmul": {"bfloat16": _m(1.5, "TFLOP/s", "2048^3 matmul")}},
        "baseline": "bf16",
        "variants": [
            _variant("bf16", weight=200e6, tok_s=20.0, ppl=28.0, ttft=200.0, tasks={"arc": 0.5}, scheme="bf16"),
            _variant("w8a16", weight=110e6, tok_s=30.0, kl=0.002, top1=0.97, ppl=28.1, ttft=180.0, tasks={"arc": 0.495},
                     scheme="w8a16"),
            _variant("w4a16-gptq", weight=70e6, tok_s=45.0, kl=0.05, top1=0.9, ppl=32.0, ttft=250.0, scheme="w4a16"),
            _variant("w4a16-rtn", weight=70e6, tok_s=46.0, kl=0.2, top1=0.75, ppl=40.0, ttft=250.0, scheme="w4a16"),
            {"name": "w8a8", "status": "failed", "error": "no int8 activation kernel on this device", "scheme": "w8a8"},
        ],
        "gates": list(GATES),
    }


@pytest.fixture
def report_dict() -> dict:
    return make_report_dict()


@pytest.fixture
def report(report_dict) -> Report:
    return Report.model_validate(report_dict)
