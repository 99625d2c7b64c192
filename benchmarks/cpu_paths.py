"""kvflow's CPU paths side by side on this CPU: one request's TPOT and the 32-request offline
workload's output tok/s for each, in-process on --cores cores, with dummy weights of the
default model's shape (no model files needed, so it runs on any machine with a C compiler:
a lent GPU machine's CPU too), each path in its own process, the rounds alternating so that a
drift in the machine's speed falls on each path alike.

Paths: `auto` (this CPU's defaults), `auto-no12` (without the 12-bit copies one-row products
read: cpu_one_row_copy="off"; beside AMX tiles that also leaves the greedy head out, which
needs the copy there), `int8`, and this CPU as another x86
(cpu_peers.ISA_ENV: kvflow's kernel build and CPU flags, oneDNN, ATen and MKL capped):
`avx512` (AVX-512 and VNNI without BF16, a Cascade Lake), `avx512-no12`, `avx2`, `avx2-no12`.

    python benchmarks/cpu_paths.py [--paths auto,auto-no12,int8] [--cores 2] [--rounds 2]

TPOT: (time of a request's 201 tokens - time of its first) / 200, a 300-token prompt, the
median of 3; the workload: cpu_peers' (32 requests, prompts 32-512 and outputs 32-256 tokens,
all in flight, greedy, ignore_eos). The weights are random, so greedy heads and the like see
other logits than a trained model's: compare paths with each other, not with the peers.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cpu_peers import ISA_ENV, make_workload  # noqa: E402
from gpu_throughput import make_model_dir  # noqa: E402

PATHS = ("auto", "auto-no12", "int8", "avx512", "avx512-no12", "avx2", "avx2-no12")
# The default model's (SmolLM2-135M-Instruct) shape.
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
    "tie_word_embeddings": True, "rope_theta": 100000.0, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


def run_path(path: str, model_dir: str, cores: int) -> dict:
    """In this process (the parent set the environment), on the first `cores` cores it may
    use: TPOT ms and workload tok/s."""
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])
    from kvflow import LLM, SamplingParams
    options = dict(quantization="int8") if path == "int8" else {}
    if path.endswith("-no12"):
        options["cpu_one_row_copy"] = "off"
    args = argparse.Namespace(seed=0, prompt_len=(32, 512), output_len=(32, 256))
    prompts, outputs = make_workload(args, SMOLLM2_135M["vocab_size"], 32, "offline")
    with LLM(model_dir, load_format="dummy", device="cpu", in_process=True, num_threads=cores,
             kv_cache_memory_gb=1.0, enable_prefix_caching=False, max_num_seqs=32,
             **options) as llm:                                   # type: ignore[arg-type]
        llm.generate([[5] * 40], SamplingParams(max_tokens=8), use_tqdm=False)   # warm-up
        tpots = []
        for prompt in prompts[:3]:
            prompt = (prompt * 10)[:300]
            times = []
            for n in (1, 201):
                start = time.perf_counter()
                llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n,
                                                      ignore_eos=True), use_tqdm=False)
                times.append(time.perf_counter() - start)
            tpots.append((times[1] - times[0]) / 200 * 1e3)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rate = sum(outputs) / (time.perf_counter() - start)
    return {"tpot_ms": statistics.median(tpots), "tok_s": rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", default="auto,auto-no12,int8,avx512,avx512-no12",
                        help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--cores", type=int, default=2,
                        help="the cores (the first N this process may use) and threads")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300, help="seconds a path's run")
    parser.add_argument("--json", default=None, help="write the results here too")
    parser.add_argument("--run", nargs=2, metavar=("PATH", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print("RESULT " + json.dumps(run_path(args.run[0], args.run[1], args.cores)), flush=True)
        return
    paths = args.paths.split(",")
    for path in paths:
        if path not in PATHS:
            parser.error(f"--paths: unknown path {path!r} (one of {', '.join(PATHS)})")
    cores = sorted(os.sched_getaffinity(0))[:args.cores]
    with open("/proc/cpuinfo") as f:
        name = next((line.split(":", 1)[1].strip() for line in f
                     if line.startswith("model name")), "unknown CPU")
    print(f"{name}; cores {cores}; dummy weights of the default model's shape", flush=True)
    results: dict[str, list[dict]] = {path: [] for path in paths}
    with tempfile.TemporaryDirectory() as folder:
        model_dir = make_model_dir(folder, SMOLLM2_135M)
        for r in range(args.rounds):
            for path in paths if r % 2 == 0 else paths[::-1]:
                env = {**os.environ, **ISA_ENV.get(path.removesuffix("-no12"), {})}
                command = [sys.executable, os.path.abspath(__file__), "--cores",
                           str(args.cores), "--run", path, model_dir]
                try:
                    done = subprocess.run(command, env=env, capture_output=True, text=True,
                                          timeout=args.timeout)
                    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
                    if done.returncode or not line:
                        last = (done.stderr.strip().splitlines() or ["no result"])[-1]
                        raise RuntimeError(f"exit status {done.returncode}: {last}")
                    result = json.loads(line[-1].removeprefix("RESULT "))
                except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
                    result = {"error": str(e)}
                results[path].append(result)
                shown = (result.get("error") or f"TPOT {result['tpot_ms']:.2f} ms, 32 requests "
                         f"{result['tok_s']:.1f} tok/s")
                print(f"round {r + 1} {path}: {shown}", flush=True)
    print(f"\n| path | TPOT ms (median of rounds) | 32 requests tok/s |\n|---|---|---|")
    for path, runs in results.items():
        ok = [x for x in runs if "error" not in x]
        if ok:
            print(f"| {path} | {statistics.median(x['tpot_ms'] for x in ok):.2f} | "
                  f"{statistics.median(x['tok_s'] for x in ok):.1f} |")
        else:
            print(f"| {path} | failed | failed |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": name, "cores": cores, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
