#!/usr/bin/env bash
# Every GPU check and benchmark of kvflow in one call, on a machine with a CUDA GPU:
#
#     bash benchmarks/gpu_suite.sh          # tests/kernels, tests/gpu, benchmarks/gpu_throughput.py
#     bash benchmarks/gpu_suite.sh tests    # only the two test suites
#     bash benchmarks/gpu_suite.sh bench    # only the benchmark (more arguments go to it,
#                                           # e.g. `bench --skip-hf`; see its --help)
#     bash benchmarks/gpu_suite.sh cpu      # not in `all`: kvflow's CPU paths on the machine's
#                                           # CPU (on the lent machines an Intel Xeon with AMX),
#                                           # on 2 of its cores: gemv_stream.py's layouts, then
#                                           # cpu_paths.py (more arguments go to it;
#                                           # ~7 minutes there: `cpu --rounds 1` for ~4)
#
# On the lent GPU machine a command may run 10 minutes: run `tests`, `bench` and `cpu` as
# separate calls.
# Needs torch with CUDA, triton, transformers, tokenizers, safetensors, jinja2, numpy, tqdm,
# psutil, pytest, plus pyzmq, msgspec and llguidance (flash-attn optional: its backend is then
# tested too). The lent GPU image (torch 2.11 + CUDA 13, Triton 3.6, transformers, Python 3.12,
# no network) lacks only those three: download their wheels where pip works, into a git-ignored
# folder (llguidance's wheel is manylinux_2_31),
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
#         --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#         pyzmq msgspec llguidance
# and point WHEELS at that folder there (`WHEELS=.whl bash benchmarks/gpu_suite.sh`): they are
# installed into /tmp/kvflow-site first. The random test and benchmark models need tokenizer
# files: KVFLOW_TOKENIZER_DIR (a folder with tokenizer.json), else the default model's cached
# folder, else a word-level tokenizer is written (prompts are token ids, so any will do).
# Exit status: 0 only if every part passed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHAT=${1:-all}
shift || true
export PYTHONUNBUFFERED=1
if [ -n "${WHEELS:-}" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvflow-site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/kvflow-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
WHAT=$WHAT $PY - <<'PY' || exit 1
import os, torch, triton, zmq, msgspec, transformers
assert torch.cuda.is_available() or os.environ["WHAT"] == "cpu", "no CUDA GPU visible"
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU"
print(f"{gpu}: torch {torch.__version__}, triton {triton.__version__}, "
      f"transformers {transformers.__version__}")
try:
    import flash_attn
    print("flash-attn", flash_attn.__version__)
except ImportError:
    print("flash-attn: not installed (its test is skipped)")
PY
status=0
if [ "$WHAT" = all ] || [ "$WHAT" = tests ]; then
    echo "=== tests/kernels (every Triton kernel against its torch reference, on the GPU)"
    $PY -m pytest tests/kernels -q -rs || status=1
    echo "=== tests/gpu (HF equality in bf16, CUDA graphs vs eager, flash-attn vs triton)"
    $PY -m pytest tests/gpu -q -rs || status=1
fi
if [ "$WHAT" = all ] || [ "$WHAT" = bench ]; then
    echo "=== benchmarks/gpu_throughput.py (nano-vllm's workload, Qwen3-0.6B shape)"
    $PY benchmarks/gpu_throughput.py "$@" || status=1
fi
if [ "$WHAT" = cpu ]; then
    echo "=== benchmarks/gemv_stream.py (a decode step's linears against a plain read, 2 threads)"
    for layout in pairs12 pairs i8; do
        $PY benchmarks/gemv_stream.py --layout $layout --threads 2 || status=1
    done
    $PY benchmarks/gemv_stream.py --layout panels12 --isa avx512,native --threads 2 || status=1
    echo "=== benchmarks/cpu_paths.py (in-process, 2 cores, dummy weights, the default model's shape)"
    CUDA_VISIBLE_DEVICES= $PY benchmarks/cpu_paths.py "$@" || status=1
fi
exit $status
