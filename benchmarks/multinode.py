"""What spreading the ranks over nodes costs in kvflow itself: the same offline workload with
tensor parallelism on one node (ipc sockets) and with one rank per "node", the other nodes
started as `launch.py serve --headless` processes on this host (tcp on 127.0.0.1, gloo over
loopback, heartbeats). Same machine, same cores, same ranks: what differs is the multi-node
path. A real network adds its own latency to every all-reduce, which this does not measure.

    python benchmarks/multinode.py --tp 3 --num-requests 32
"""
from __future__ import annotations

import argparse
import os
import secrets
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multiprocess import timed_generate  # noqa: E402
from throughput import add_workload_args, make_workload  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace, nnodes: int, prompts: list[list[int]],
        outputs: list[int]) -> tuple[float, dict[str, float]]:
    from kvflow import LLM
    from kvflow.ipc.auth import SECRET_VAR
    os.environ.setdefault(SECRET_VAR, secrets.token_hex(32))   # the nodes' shared secret
    port = free_port()
    headless = [subprocess.Popen(
        [sys.executable, os.path.join(REPO, "launch.py"), "serve", "--headless", "--model",
         args.model, "--tp", str(args.tp), "--nnodes", str(nnodes), "--node-rank", str(n),
         "--master-addr", "127.0.0.1", "--master-port", str(port), "--num-threads",
         str(args.num_threads), "--log-level", "WARNING"], cwd=REPO)
        for n in range(1, nnodes)]
    try:
        llm = LLM(args.model, tensor_parallel_size=args.tp, max_num_seqs=args.num_requests,
                  nnodes=nnodes, master_port=port, num_threads=args.num_threads,
                  dtype=args.dtype, kv_cache_memory_gb=args.kv_cache_memory_gb,
                  load_format=args.load_format)
        return timed_generate(llm, prompts, outputs)
    finally:
        for p in headless:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--tp", type=int, default=3,
                        help="ranks (the default model splits 3 ways, not 2)")
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, interleaved")
    args = parser.parse_args()
    from kvflow.frontend.model_files import resolve_model
    args.model = resolve_model(args.model)
    prompts, outputs = make_workload(args)
    results: dict[int, list[tuple[float, dict[str, float]]]] = {1: [], args.tp: []}
    for _ in range(args.repeats):
        for nnodes in (1, args.tp):
            results[nnodes].append(run(args, nnodes, prompts, outputs))
    for nnodes, runs in results.items():
        rates = ", ".join(f"{r:.1f}" for r, _ in runs)
        ipc = [1e6 * t["ipc"] / t["ipc_steps"] for _, t in runs]
        print(f"tp={args.tp} over {nnodes} node(s): output tok/s {rates}; IPC per step "
              f"(plan out + result back, minus rank 0's time) "
              f"{', '.join(f'{u:.0f}' for u in ipc)} us")
    one = max(r for r, _ in results[1])
    many = max(r for r, _ in results[args.tp])
    print(f"best of each: {args.tp} nodes / 1 node = {many / one:.3f} ({many:.1f} vs {one:.1f} "
          "output tok/s)")


if __name__ == "__main__":
    main()
