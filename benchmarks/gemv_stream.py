"""A decode step's linears streamed as the fused step streams them, against a plain read of
the same bytes: how close each weight layout's kernel comes to the memory's speed.

benchmarks/cpu_kernels.py --gemv times each shape alone through Python (a few us a call, a
large share of a small matrix). Here a C program (gemv_stream.c, built on first use) calls
kvflow's kernel library directly, as cpu_decode.c does: a step is every shape of a layer in
order, for LAYERS layers, each call on its own copy of the weights (2 MB pages), so every
byte comes from memory. After each step it reads the same buffers plainly (each matrix
split evenly over the threads, one load a cache line). Several builds (--isa, --lib) take
turns in one process, so a drift in the VM's speed falls on each alike.

    python benchmarks/gemv_stream.py [--layout pairs12] [--rows 1] [--isa native,avx2]
        [--lib OTHER.so ...]

Layouts, and x's dtype as the fused step passes it (its model dtype): panels (bfloat16
weights, float32 x), panels12 (their 12-bit copy, float32 x: what a step of one to a few
requests reads on CPUs without AVX512-BF16), pairs (bfloat16 pair panels, bfloat16 x,
AVX512-BF16), pairs12 (their 12-bit copy: what it reads on AVX512-BF16 CPUs without AMX),
i8 (int8 panels; bfloat16 x where the first build has AVX512-BF16, else float32). Default:
pairs12 where the first --isa build has AVX512-BF16, else panels12. A build that cannot hold
a layout says so. GB/s: of the bytes the layout holds.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvflow.config import cache_dir  # noqa: E402
from kvflow.kernels import cpu_ops  # noqa: E402

LAYOUTS = {"panels": 4, "i8": 5, "panels12": 6, "pairs": 7, "pairs12": 8}
SHAPES = "960x576,576x576,3072x576,576x1536"    # the default model's qkv, o, gate_up, down


def build_harness() -> Path:
    source = Path(__file__).with_name("gemv_stream.c")
    key = hashlib.blake2b(source.read_bytes() + cpu_ops._cpu_id().encode(),   # -march=native
                          digest_size=8).hexdigest()
    target = Path(cache_dir()) / "bench" / f"gemv_stream-{key}"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise SystemExit(f"no C compiler: {compiler!r} not on PATH (set CC)")
    subprocess.run([compiler, "-O2", "-march=native", "-fopenmp", str(source), "-o", str(target),
                    "-ldl", "-lm"], check=True)
    return target


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", choices=list(LAYOUTS), default=None)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--shapes", default=SHAPES, help="a layer's linears, NxK,...")
    parser.add_argument("--isa", default="native",
                        help="kernel builds, comma-separated (native, avx512, avx2)")
    parser.add_argument("--lib", action="append", default=[],
                        help="another build of the kernel library to compare (a path)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    libs = {isa: str(cpu_ops._build(cpu_ops.ISA_FLAGS[isa])) for isa in args.isa.split(",")}
    bf16 = bool(cpu_ops._load(Path(next(iter(libs.values())))).gemv_pairs_available())
    layout = args.layout or ("pairs12" if bf16 else "panels12")
    xtype = 1 if layout in ("pairs", "pairs12") or (layout == "i8" and bf16) else 0
    libs.update({path: path for path in args.lib})
    harness = build_harness()
    print(f"{cpu_name()}, {args.threads} threads; layout {layout}, {args.rows} row(s) of "
          f"{'bfloat16' if xtype else 'float32'}, {args.layers} layers of {args.shapes}",
          flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    result = subprocess.run([str(harness), str(LAYOUTS[layout]), str(xtype), str(args.rows),
                             str(args.layers), str(args.reps), args.shapes, *libs.values()],
                            env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(result.stderr.strip() or f"gemv_stream exited {result.returncode}")
    names = {path: name for name, path in libs.items()}
    for line in result.stdout.splitlines():
        path, _, rest = line.partition(": ")
        print(f"{names.get(path, path)}: {rest}")


if __name__ == "__main__":
    main()
