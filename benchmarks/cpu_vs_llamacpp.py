"""Offline CPU throughput: kvflow (dtype auto, float32, bfloat16; int8) against llama.cpp's
server (F32, BF16, F16, Q8_0 GGUFs of the same weights), on one workload, in one run.

The workload: N requests (default 32) of seeded random token-id prompts (32..512 tokens) and
output lengths (32..256), greedy, ignore_eos, all in flight at once. kvflow runs it through
`LLM.generate`; llama-server (../shared/tools/llama-server.sh builds it and the GGUFs) gets all
N requests concurrently on N slots. Each figure is also given as a fraction of its compute
floor: the workload's matmul FLOPs (2 x linear params x tokens, plus attention) over the matmul
GFLOP/s this CPU reaches in that dtype (measured here, at 256 rows).

    python benchmarks/cpu_vs_llamacpp.py [--num-requests 32] [--only kvflow-int8,llamacpp-Q8_0]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import httpx
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from serve import cpu_info, server                                        # noqa: E402

KVFLOW = {"kvflow-auto": dict(dtype="auto"), "kvflow-float32": dict(dtype="float32"),
          "kvflow-bfloat16": dict(dtype="bfloat16"),
          "kvflow-int8": dict(dtype="auto", quantization="int8")}
LLAMACPP = ["llamacpp-F32", "llamacpp-BF16", "llamacpp-F16", "llamacpp-Q8_0"]
# The matmul kind whose speed bounds each engine's run (llama.cpp's Q8_0 dot products are int8;
# without AVX512-FP16 it converts F16 weights and computes in float32).
FLOOR_KIND = {"kvflow-float32": "float32", "kvflow-bfloat16": "bfloat16",
              "kvflow-int8": "int8", "llamacpp-F32": "float32", "llamacpp-BF16": "bfloat16",
              "llamacpp-F16": "float32", "llamacpp-Q8_0": "int8"}


def make_workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(*args.prompt_len))]
               for _ in range(args.num_requests)]
    return prompts, [rng.randint(*args.output_len) for _ in range(args.num_requests)]


def matmul_gflops(kind: str, m: int = 256, k: int = 576, n: int = 1536) -> float:
    """GFLOP/s of an [m, k] x [k, n] matmul in `kind`, as the engines run them (oneDNN packed
    weights for float32/bfloat16/float16; oneDNN's u8 x s8 GEMM for int8)."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * 0.05
    if kind == "int8":
        from kvflow.kernels import cpu_ops
        from kvflow.workers.layers.linear import Int8Linear
        method = Int8Linear(cpu_ops.quantize_rows, cpu_ops.scale_rows)      # as kvflow runs it
        prepared = method.prepare(w)
        fn = lambda: method.apply(x, w, prepared)                       # noqa: E731
    else:
        dtype = getattr(torch, kind)
        xd, wd = x.to(dtype), w.to(dtype)
        fn = lambda: torch.nn.functional.linear(xd, wd)                 # noqa: E731
    for _ in range(5):
        fn()
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < 1.0:
        fn()
        reps += 1
    return 2 * m * k * n * reps / (time.perf_counter() - start) / 1e9


def workload_flops(hf: dict, prompts: list[list[int]], outputs: list[int]) -> float:
    """2 x (linear + LM head params) per token, plus QK^T and PV over each token's context."""
    h, layers, inter = hf["hidden_size"], hf["num_hidden_layers"], hf["intermediate_size"]
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"])
    d = h // heads
    per_layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * inter
    params = layers * per_layer + hf["vocab_size"] * h
    flops = 0.0
    for prompt, out in zip(prompts, outputs):
        tokens = len(prompt) + out
        contexts = tokens * (tokens + 1) / 2                     # sum of each token's context
        flops += 2 * params * tokens + 4 * layers * heads * d * contexts
    return flops


def run_kvflow(name: str, args: argparse.Namespace, prompts: list[list[int]],
               outputs: list[int]) -> float:
    from kvflow import LLM, SamplingParams
    with LLM(args.model, max_num_seqs=args.num_requests, kv_cache_memory_gb=1.0,
             **KVFLOW[name]) as llm:                                   # type: ignore[arg-type]
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)   # warm-up
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outs] == outputs
    return elapsed


async def _llamacpp_all(url: str, prompts: list[list[int]], outputs: list[int]) -> float:
    async with httpx.AsyncClient(timeout=3600) as client:
        await client.post(f"{url}/completion", json={"prompt": [1, 2, 3], "n_predict": 4})

        async def one(prompt: list[int], n: int) -> int:
            r = await client.post(f"{url}/completion", json={
                "prompt": prompt, "n_predict": n, "ignore_eos": True, "temperature": 0,
                "top_k": 1, "cache_prompt": False})
            r.raise_for_status()
            return int(r.json()["tokens_predicted"])

        start = time.perf_counter()
        got = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, outputs)))
        elapsed = time.perf_counter() - start
    assert list(got) == outputs, (got, outputs)
    return elapsed


def run_llamacpp(name: str, args: argparse.Namespace, prompts: list[list[int]],
                 outputs: list[int]) -> float:
    serve_args = argparse.Namespace(
        model=args.model, concurrency=[args.num_requests], prompt_len=args.prompt_len,
        output_len=args.output_len, llama_threads=args.threads, start_timeout=300)
    with server(name, serve_args) as url:
        return asyncio.run(_llamacpp_all(url, prompts, outputs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="llama-server's -t (kvflow takes the CPUs by default too)")
    parser.add_argument("--only", default="", help="comma-separated engines to run")
    args = parser.parse_args()
    if args.model == "default":
        from kvflow.frontend.model_files import ensure_default_model
        args.model = ensure_default_model()
    from kvflow.workers.hardware import resolve_dtype
    print(cpu_info())
    auto, why, _ = resolve_dtype("auto", torch.device("cpu"), {})
    print(f"kvflow dtype=auto here: {auto} ({why})")
    with open(os.path.join(args.model, "config.json")) as f:
        hf = json.load(f)
    prompts, outputs = make_workload(args, hf["vocab_size"])
    print(f"workload: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
          f"{sum(outputs)} output tokens, all in flight")
    torch.set_num_threads(os.cpu_count() or 1)
    floors = {kind: matmul_gflops(kind) for kind in ("float32", "bfloat16", "int8")}
    print("matmul GFLOP/s (256 x 576 x 1536): " + ", ".join(
        f"{k} {v:.0f}" for k, v in floors.items()))
    auto_kind = "bfloat16" if auto == torch.bfloat16 else "float32"
    FLOOR_KIND["kvflow-auto"] = auto_kind
    flops = workload_flops(hf, prompts, outputs)
    engines = list(KVFLOW) + LLAMACPP
    if args.only:
        engines = [e for e in engines if e in args.only.split(",")]
    rows = {}
    for name in engines:
        run = run_kvflow if name in KVFLOW else run_llamacpp
        elapsed = run(name, args, prompts, outputs)
        tok_s = sum(outputs) / elapsed
        floor = flops / (floors[FLOOR_KIND[name]] * 1e9)
        rows[name] = tok_s
        print(f"{name:18s} {tok_s:8.1f} output tok/s  ({elapsed:6.1f} s; "
              f"{floor / elapsed:5.1%} of the {FLOOR_KIND[name]} compute floor)", flush=True)
    best = lambda names: max((rows[n], n) for n in names if n in rows)  # noqa: E731
    kv_float = [n for n in ("kvflow-float32", "kvflow-bfloat16") if n in rows]
    llama = [n for n in LLAMACPP if n in rows]
    if "kvflow-auto" in rows and kv_float:
        v, n = best(kv_float)
        print(f"kvflow auto / best kvflow float ({n}): {rows['kvflow-auto'] / v:.2f}x")
    if "kvflow-auto" in rows and llama:
        v, n = best(llama)
        print(f"kvflow auto / best llama.cpp ({n}): {rows['kvflow-auto'] / v:.2f}x")
    if "kvflow-int8" in rows:
        if "kvflow-float32" in rows:
            print(f"kvflow int8 / kvflow float32: "
                  f"{rows['kvflow-int8'] / rows['kvflow-float32']:.2f}x")
        if "llamacpp-Q8_0" in rows:
            print(f"kvflow int8 / llama.cpp Q8_0: "
                  f"{rows['kvflow-int8'] / rows['llamacpp-Q8_0']:.2f}x")


if __name__ == "__main__":
    main()
