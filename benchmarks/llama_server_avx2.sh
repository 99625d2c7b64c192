#!/usr/bin/env bash
# llama.cpp's llama-server built for an AVX2-only CPU (no AVX-512, no VNNI), so that the peer
# too runs as such a CPU would on any x86 machine: the same llama.cpp source as
# ../shared/tools/llama-server.sh (which makes the GGUFs, linked here), with GGML_NATIVE off.
#
#   LLAMA_SERVER_DIR=$(bash benchmarks/llama_server_avx2.sh) \
#       python benchmarks/cpu_peers.py --isa avx2 --only kvflow-auto,llamacpp-Q8_0
#
# Prints the folder (default ~/.cache/kvflow-bench/llama.cpp-avx2) on stdout; ~10-20 minutes
# the first time on 2 cores, then instant.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
native=$(bash "$here/../../shared/tools/llama-server.sh")      # the GGUFs (and the version)
DIR=${LLAMA_SERVER_AVX2_DIR:-$HOME/.cache/kvflow-bench/llama.cpp-avx2}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
if [ ! -x "$DIR/llama-server" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$PY" -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$work" >&2
  tar xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
  src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON \
        -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF \
        -DGGML_AVX_VNNI=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DBUILD_SHARED_LIBS=OFF >&2
  cmake --build "$work/build" -j "$(nproc)" --target llama-server >&2
  cp "$work/build/bin/llama-server" "$DIR/"
fi
for f in "$native"/*.gguf; do ln -sf "$f" "$DIR/"; done
echo "$DIR"
