#!/usr/bin/env bash
# llama.cpp's llama-server built for an older x86 CPU than this one, so that the peer runs as
# such a CPU would, beside kvflow's ISA-restricted kernels (`cpu_peers.py --isa`): the same
# llama.cpp source as ../shared/tools/llama-server.sh (which makes the GGUFs, linked here),
# with GGML_NATIVE off and the instruction sets of the CPU named:
#   avx2    AVX2 + FMA + F16C, no AVX-512, no VNNI (AMD EPYC Zen 2/3, older Xeons)
#   avx512  AVX-512 F/CD/BW/DQ/VL + VNNI, no AVX512-BF16, no VBMI, no AMX
#           (Intel Xeon Cascade Lake)
#
#   LLAMA_SERVER_DIR=$(bash benchmarks/llama_server_isa.sh avx2) \
#       python benchmarks/cpu_peers.py --isa avx2 --only kvflow-auto,llamacpp-Q8_0
#   LLAMA_SERVER_DIR=$(bash benchmarks/llama_server_isa.sh avx512) \
#       python benchmarks/cpu_peers.py --isa avx512 --only kvflow-auto,llamacpp-Q8_0
#
# Prints the folder (default ~/.cache/kvflow-bench/llama.cpp-ISA) on stdout; ~10-20 minutes
# the first time on 2 cores, then instant.
set -euo pipefail
isa=${1:-avx2}
case "$isa" in
  avx2)   flags=(-DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF) ;;
  avx512) flags=(-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=OFF
                 -DGGML_AVX512_VBMI=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF
                 -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
  *) echo "usage: $0 [avx2|avx512]" >&2; exit 2 ;;
esac
here=$(cd "$(dirname "$0")" && pwd)
# The native build and the GGUFs, in their own folder whatever LLAMA_SERVER_DIR says (that
# script works in $LLAMA_SERVER_DIR, and would rebuild a native llama-server over this one).
native=$(env -u LLAMA_SERVER_DIR bash "$here/../../shared/tools/llama-server.sh")
default_dir=$HOME/.cache/kvflow-bench/llama.cpp-$isa
if [ "$isa" = avx2 ]; then DIR=${LLAMA_SERVER_AVX2_DIR:-$default_dir}; else DIR=$default_dir; fi
if [ "$(realpath -m "$DIR")" = "$(realpath -m "$native")" ]; then
  echo "the $isa build must not share the native build's folder ($DIR)" >&2; exit 2
fi
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
        -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "${flags[@]}" \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DBUILD_SHARED_LIBS=OFF >&2
  cmake --build "$work/build" -j "$(nproc)" --target llama-server >&2
  cp "$work/build/bin/llama-server" "$DIR/"
  echo "$isa" > "$DIR/isa"                   # cpu_peers.py --isa checks it
fi
for f in "$native"/*.gguf; do ln -sf "$f" "$DIR/"; done
echo "$DIR"
