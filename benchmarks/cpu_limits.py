"""kvflow under a container's CPU limit: one request's TPOT through the multi-process `LLM`
inside a cgroup that grants --cpus CPUs of time (what `docker --cpus` and a Kubernetes CPU
limit set), with the default thread count (kvflow/workers/cpu_threads.py: the limit, rounded
down) against one thread per CPU of the machine (--num-threads, the default before, from
os.cpu_count()), alternating, in the same run. Needs root and a writable cgroup filesystem
(v2 cpu.max, or v1's cpu controller).

    sudo python benchmarks/cpu_limits.py --cpus 1 --rounds 2
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import random, sys, time
from kvflow import LLM, SamplingParams
kwargs = {} if sys.argv[1] == "default" else {"num_threads": int(sys.argv[1])}
llm = LLM(sys.argv[2], **kwargs)
random.seed(0)
prompt = [random.randrange(100, 40000) for _ in range(200)]
def run(n):
    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    return time.perf_counter() - start
run(4)
tpots = [(run(129) - run(1)) / 128 * 1e3 for _ in range(3)]
print(" ".join(f"{t:.1f}" for t in tpots))
llm.shutdown()
"""


def make_cgroup(cpus: float) -> Path:
    """A new cgroup granting `cpus` CPUs of time per 100 ms period."""
    name = f"kvflow-bench-{os.getpid()}"
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    if v2.exists() and "cpu" in v2.read_text().split():
        group = Path("/sys/fs/cgroup") / name
        group.mkdir()
        (group / "cpu.max").write_text(f"{int(cpus * 100000)} 100000\n")
        return group
    for base in (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpu,cpuacct")):
        if (base / "cpu.cfs_quota_us").exists():
            group = base / name
            group.mkdir()
            (group / "cpu.cfs_period_us").write_text("100000\n")
            (group / "cpu.cfs_quota_us").write_text(f"{int(cpus * 100000)}\n")
            return group
    sys.exit("no writable cgroup cpu controller here (v2 cpu.max or v1 cpu)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--cpus", type=float, default=1.0, help="the cgroup's CPU limit")
    parser.add_argument("--num-threads", type=int, default=os.cpu_count() or 1,
                        help="the thread count to compare with (default: os.cpu_count())")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from kvflow.frontend.model_files import ensure_default_model
    model = args.model or ensure_default_model()
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    print(next((line for line in lscpu if line.startswith("Model name")), "CPU: ?").strip(),
          f"| {os.cpu_count()} CPUs, cgroup limit {args.cpus:g} CPUs")
    group = make_cgroup(args.cpus)
    try:
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(CHILD)
        for _ in range(args.rounds):
            for threads in (str(args.num_threads), "default"):
                # The shell joins the cgroup, then becomes the benchmark (children inherit it).
                out = subprocess.run(
                    ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$0" "$@"',
                     sys.executable, f.name, threads, model],
                    capture_output=True, text=True)
                label = (f"num_threads={threads}" if threads != "default"
                         else "default (cpu_threads.plan)")
                result = out.stdout.strip().splitlines()[-1:] or [out.stderr[-500:]]
                print(f"{label:30s} TPOT ms {result[0]}", flush=True)
    finally:
        os.unlink(f.name)
        group.rmdir()


if __name__ == "__main__":
    main()
