#!/usr/bin/env bash
# The GPU checks of the runner issue, in one script (not run yet: no GPU was lent to that issue).
# On a CUDA machine with the project set up (bash scripts/setup.sh after installing a CUDA torch):
#   bash benchmarks/gpu_runner.sh OUT_DIR
# 1. every test marked gpu (kernels vs the dequantize reference, flex / flash-attn paged decode);
# 2. optkit bench on the synthetic Llama-3-8B shape in bf16, W8A16 and W4A16 at batch 1 and 32,
#    compiled decode step with and without CUDA graphs; each JSON has decode bandwidth as a
#    fraction of the GPU's measured read bandwidth (target: W4A16 batch 1 >= 60 %).
set -euo pipefail
out=${1:-gpu-runner-results}
mkdir -p "$out"
py=.venv/bin/python
$py -m pytest -m gpu -q tests/kernels tests/attention tests/serve 2>&1 | tee "$out/pytest-gpu.txt"
for weights in bf16 w8a16 w4a16; do
  for graphs in --no-cuda-graphs --cuda-graphs; do
    .venv/bin/optkit bench --synthetic llama-3-8b --weights "$weights" --device cuda \
      --prompt-lens 128,512,2048 --batch-sizes 1,32 --decode-tokens 64 --offline-requests 0 \
      --repeats 3 --kv-cache-memory 16GiB $graphs \
      --json "$out/llama-3-8b-$weights${graphs#--no}.json" 2>&1 | tee "$out/llama-3-8b-$weights${graphs#--no}.txt"
  done
done
$py - "$out" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text())
    b = {d["batch"]: d["tok_s"]["median"] for d in r["decode"]}
    bw = r.get("decode_bandwidth", {})
    print(f"{f.stem:40s} b1 {b.get(1, 0):8.1f} tok/s  b32 {b.get(32, 0):8.1f} tok/s  "
          f"bandwidth {bw.get('achieved_gb_s', 0):7.1f} GB/s = {100 * (bw.get('fraction_of_peak') or 0):5.1f} % of peak")
PY
