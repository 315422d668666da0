from __future__ import annotations

import json
from pathlib import Path

import pytest

from optkit.errors import UserError
from optkit.report.from_bench import machine_from_bench, memory_from_bench, roofline_from_bench, speed_from_bench

BENCH = Path(__file__).resolve().parents[2] / "reports" / "bench-smollm2-w4a16-g64-int8head.json"


@pytest.fixture
def bench() -> dict:
    return json.loads(BENCH.read_text())


def test_bench_sections(bench):
    s = speed_from_bench(bench)
    d1 = s.decode_at(1)
    assert d1.tok_s.value == bench["decode"][0]["tok_s"]["median"] and d1.tok_s.spread.n == 3
    assert abs(d1.tok_s.noise_pct - bench["decode"][0]["tok_s"]["spread_pct"]) < 1e-9
    p = s.prefill_at(128)
    assert abs(p.ttft_ms.value - 1e3 * bench["prefill"][0]["ttft_s"]["median"]) < 1e-9 and p.ttft_ms.unit == "ms"
    m = memory_from_bench(bench)
    assert m.kv_bytes_per_token.value == 23040 and m.max_context_tokens.value == bench["kv"]["budget_bytes"] // 23040
    assert machine_from_bench(bench).peak_read_bandwidth.value == bench["machine"]["read_gb_s"]
    params = 134_515_008
    roof = roofline_from_bench(bench, params, "bfloat16")
    dec = next(pt for pt in roof.points if pt.label == "decode b1")
    assert abs(dec.intensity_flop_per_byte - 2 * params / bench["weight_bytes_per_step"]) < 1e-9
    assert abs(dec.achieved_gb_s - bench["decode_bandwidth"]["achieved_gb_s"]) < 1e-6


def test_bench_version_checked(bench):
    bench["schema_version"] = 7
    with pytest.raises(UserError, match="schema_version 7"):
        speed_from_bench(bench)
