"""GPU throughput on nano-vllm's workload, plus kernel-level figures. Needs a CUDA GPU.

Workload (nano-vllm's bench.py, exactly): 256 requests, prompt lengths and output lengths each
uniform in 100..1024, prompt token ids uniform in 0..10000 (Python's `random`, seed 0, drawn in
nano-vllm's order), ignore_eos, temperature 0.6; Qwen3-0.6B's shape with random weights
(load_format="dummy"), bf16, max_model_len 4096. Output tok/s = requested output tokens / wall
time of one generate() call (after a warm-up request), as nano-vllm counts it.

Rows: kvflow with CUDA graphs (+ torch.compile), kvflow eager (enforce_eager), and HF
transformers' batched generate on the first --hf-requests requests (left-padded, sampling to the
subset's longest output: credited only the tokens the requests asked for, so its rate is that
subset's own, not extrapolated). Each row runs in a fresh subprocess, so GPU memory starts clean.

Kernel figures: the card's copy bandwidth (bytes read + written by a large device-to-device
copy), the paged decode attention kernel's achieved bandwidth (K/V bytes read / time) at a few
batch sizes (each call replayed from a CUDA graph, as decode runs it), and a decode step (graph
replay + LM head) against the floor of reading every weight and the batch's K/V once at copy
bandwidth.

With --multiprocess (frontend, EngineCore and worker as separate processes, as served) the
kvflow rows also time one request alone: TPOT of a 512-token prompt's 256 greedy outputs
((time of 257 tokens - time of 1) / 256, the median of 3); --async-scheduling runs them with
EngineCore planning each step while the previous one runs.

    python benchmarks/gpu_throughput.py                  # everything (a few minutes on an H100)
    python benchmarks/gpu_throughput.py --skip-hf --skip-eager
    python benchmarks/gpu_throughput.py --skip-hf --skip-eager --multiprocess [--async-scheduling]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3_0_6B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936,
    "tie_word_embeddings": True, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


# --- workload and model folder -------------------------------------------------------------

def nano_vllm_workload(num_requests: int = 256, seed: int = 0
                       ) -> tuple[list[list[int]], list[int]]:
    """nano-vllm bench.py's draws, in its order: prompts first, then max_tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))]
               for _ in range(num_requests)]
    max_tokens = [rng.randint(100, 1024) for _ in range(num_requests)]
    return prompts, max_tokens


def make_model_dir(out_dir: str, config: dict[str, Any] = QWEN3_0_6B) -> str:
    """config.json of a shape (Qwen3-0.6B's) plus tokenizer files (KVFLOW_TOKENIZER_DIR, else
    the default model's, else a word-level one written here: the workload is token ids)."""
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    from kvflow.frontend.model_files import DEFAULT_FOLDER, cache_dir
    for source in (os.environ.get("KVFLOW_TOKENIZER_DIR"),
                   os.path.join(cache_dir(), DEFAULT_FOLDER)):
        if source and os.path.isfile(os.path.join(source, "tokenizer.json")):
            for name in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(source, name)):
                    shutil.copy(os.path.join(source, name), out_dir)
            return out_dir
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    return out_dir


# --- timing helpers ------------------------------------------------------------------------

def cuda_time(fn, iters: int = 20, warmup: int = 3) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of fn() on the GPU (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def graph_time(fn, calls: int = 20) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of one fn() replayed from a CUDA graph of `calls` back-to-back calls, as
    decode runs it: a host-timed launch would measure Python's launch cost for small inputs."""
    fn()                                            # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_time(graph.replay, iters=10) / calls


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    seconds = cuda_time(lambda: dst.copy_(src), iters=10)
    return 2 * num_bytes / seconds


# --- the parts, each run in its own subprocess ---------------------------------------------

def part_kvflow(model_dir: str, eager: bool, args: argparse.Namespace) -> dict:
    from kvflow import LLM, SamplingParams
    prompts, max_tokens = nano_vllm_workload()
    llm = LLM(model_dir, load_format="dummy", dtype="bfloat16", max_model_len=4096,
              max_num_seqs=256, max_num_batched_tokens=16384, enforce_eager=eager,
              block_size=args.block_size, in_process=not args.multiprocess,
              async_scheduling=args.async_scheduling)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)      # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert [len(o.token_ids) for o in outs] == max_tokens
    result = {"tok_s": sum(max_tokens) / seconds, "seconds": seconds,
              "num_tokens": sum(max_tokens), "num_blocks": llm.engine.num_blocks}  # type: ignore
    if not args.multiprocess:
        result["backend"] = llm.engine.worker.backend.name                      # type: ignore
        if not eager:
            result["decode_steps"] = decode_step_figures(llm)
    else:
        result["tpot_ms"] = one_request_tpot(llm)
    llm.shutdown()
    return result


def one_request_tpot(llm) -> float:  # type: ignore[no-untyped-def]
    """Milliseconds per output token of one request alone (512-token prompt, greedy): the
    median of 3 (time of 257 tokens - time of 1) / 256."""
    from kvflow import SamplingParams
    rng = random.Random(1)
    prompt = [rng.randrange(0, 10000) for _ in range(512)]

    def seconds(n: int) -> float:
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - start
    runs = sorted((seconds(257) - seconds(1)) / 256 for _ in range(3))
    return 1e3 * runs[1]


def decode_step_figures(llm) -> list[dict]:  # type: ignore[no-untyped-def]
    """One decode step (forward + LM head) at a few batch sizes and contexts, replayed from its
    CUDA graph; the report sets it against reading every weight and the batch's K/V once at
    copy bandwidth."""
    import numpy as np

    from kvflow.workers.attention import SeqSpan
    worker = llm.engine.worker
    runner, model, bs = worker.runner, worker.model, worker.config.cache.block_size
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
    kv_per_token = worker.kv_cache.bytes_per_block // bs       # K and V, every layer
    rows = []
    for batch, ctx in ((1, 512), (32, 512), (128, 1024), (256, 1024)):
        per_seq = -(-ctx // bs)
        if (runner.graphs is None or batch > runner.graphs.max_batch
                or batch * per_seq > worker.num_blocks):
            continue
        decodes = [SeqSpan(i, 1, ctx, np.arange(i * per_seq, (i + 1) * per_seq))
                   for i in range(batch)]
        slots = np.asarray([d[3][(ctx - 1) // bs] * bs + (ctx - 1) % bs for d in decodes])
        graph_batch = runner.graphs.load(np.zeros(batch, dtype=np.int64),
                                         np.full(batch, ctx - 1), slots, decodes)
        seconds = cuda_time(lambda: model.compute_logits(runner.graphs.replay(graph_batch)))
        rows.append({"batch": batch, "context": ctx, "step_ms": 1e3 * seconds,
                     "weight_bytes": weight_bytes, "kv_bytes": batch * ctx * kv_per_token})
    return rows


def part_attention() -> dict:
    """The Triton paged decode kernel alone, Qwen3-0.6B's attention shape, bf16."""
    from kvflow.kernels.decode_attention import paged_decode_attention
    copy_bw = copy_bandwidth()
    rows = []
    num_heads, num_kv_heads, head_dim, block_size = 16, 8, 128, 16
    for batch, ctx in ((1, 4096), (16, 2048), (64, 1024), (256, 1024)):
        per_seq = ctx // block_size
        num_blocks = batch * per_seq
        k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device="cuda",
                              dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, -1)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        seconds = graph_time(lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens,
                                                            head_dim ** -0.5))
        kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
        rows.append({"batch": batch, "context": ctx, "us": 1e6 * seconds,
                     "gb_s": kv_bytes / seconds / 1e9, "of_copy": kv_bytes / seconds / copy_bw})
    return {"copy_gb_s": copy_bw / 1e9, "decode_attention": rows,
            "device": torch.cuda.get_device_name()}


def part_hf(model_dir: str, num_requests: int) -> dict:
    import transformers
    prompts, max_tokens = nano_vllm_workload()
    prompts, max_tokens = prompts[:num_requests], max_tokens[:num_requests]
    config = transformers.AutoConfig.from_pretrained(model_dir)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    torch.set_default_dtype(torch.float32)
    model.generation_config.eos_token_id = None
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):                  # left padding, as HF wants for generate
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    kwargs = dict(attention_mask=mask, do_sample=True, temperature=0.6, top_p=1.0, top_k=0,
                  max_new_tokens=max(max_tokens), min_new_tokens=max(max_tokens),
                  pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:, -8:], **{**kwargs, "attention_mask": mask[:, -8:],
                                       "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"tok_s": sum(max_tokens) / seconds, "seconds": seconds, "num_requests": num_requests,
            "num_tokens": sum(max_tokens), "padded_tokens": len(prompts) * max(max_tokens)}


# --- driver --------------------------------------------------------------------------------

def run_part(part: str, model_dir: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--part", part, "--model-dir", model_dir,
           "--hf-requests", str(args.hf_requests), "--block-size", str(args.block_size)]
    cmd += ["--multiprocess"] if args.multiprocess else []
    cmd += ["--async-scheduling"] if args.async_scheduling else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    print(f"... {part}", flush=True)
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"part {part!r} failed with exit code {done.returncode}")
    line = done.stdout.strip().splitlines()[-1]
    print(f"    {part}: {line}", flush=True)     # kept even if a later part runs out of time
    return json.loads(line)


def report(results: dict) -> None:
    att = results["attention"]
    print(f"\nGPU: {att['device']}; Qwen3-0.6B shape, dummy weights, bf16; nano-vllm workload "
          f"(256 requests, prompts and outputs uniform in 100..1024, temperature 0.6)")
    print(f"{'engine':<34}{'output tok/s':>14}{'seconds':>10}{'tokens':>10}")
    for name, key in (("kvflow, CUDA graphs + compile", "graphs"), ("kvflow, eager", "eager")):
        if key in results:
            r = results[key]
            how = f"{r['backend']} attention" if "backend" in r else "separate processes"
            print(f"{name:<34}{r['tok_s']:>14.0f}{r['seconds']:>10.1f}{r['num_tokens']:>10}"
                  f"   ({how}, {r['num_blocks']} KV blocks)")
            if "tpot_ms" in r:
                print(f"{'  one request alone: TPOT ms':<34}{r['tpot_ms']:>14.2f}")
    if "hf" in results:
        r = results["hf"]
        name = f"HF transformers ({r['num_requests']} of 256)"
        print(f"{name:<34}{r['tok_s']:>14.0f}{r['seconds']:>10.1f}{r['num_tokens']:>10}"
              f"   ({r['padded_tokens']} generated with padding)")
    print("(nano-vllm reported 1434 tok/s and vLLM 1362 tok/s on this workload on an RTX 4070 "
          "laptop GPU)")
    print(f"\ncopy bandwidth (read + write): {att['copy_gb_s']:.0f} GB/s")
    print(f"{'decode attention: batch':<26}{'context':>9}{'us':>9}{'GB/s':>9}{'of copy':>9}")
    for r in att["decode_attention"]:
        print(f"{'':<20}{r['batch']:>6}{r['context']:>9}{r['us']:>9.1f}{r['gb_s']:>9.0f}"
              f"{r['of_copy']:>9.0%}")
    steps = results.get("graphs", {}).get("decode_steps", [])
    if steps:
        print(f"{'decode step (graph): batch':<28}{'context':>8}{'ms':>8}{'KV GB':>8}"
              f"{'floor ms':>10}{'ratio':>7}")
        for r in steps:
            floor_ms = 1e3 * (r["weight_bytes"] + r["kv_bytes"]) / (att["copy_gb_s"] * 1e9)
            print(f"{'':<22}{r['batch']:>6}{r['context']:>8}{r['step_ms']:>8.2f}"
                  f"{r['kv_bytes'] / 1e9:>8.2f}{floor_ms:>10.2f}{r['step_ms'] / floor_ms:>7.1f}x")
        print(f"(weights: {steps[0]['weight_bytes'] / 1e9:.2f} GB; the floor reads the weights "
              f"and the batch's K/V once at copy bandwidth)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-eager", action="store_true")
    parser.add_argument("--hf-requests", type=int, default=32,
                        help="HF transformers runs the first N requests of the workload")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--multiprocess", action="store_true",
                        help="kvflow as separate EngineCore/worker processes (default: "
                             "in-process, like nano-vllm's single process)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="with --multiprocess: EngineCore plans each step while the "
                             "previous one runs")
    parser.add_argument("--part", choices=["graphs", "eager", "hf", "attention"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.async_scheduling and not args.multiprocess:
        parser.error("--async-scheduling needs --multiprocess")
    if not torch.cuda.is_available():
        sys.exit("gpu_throughput.py needs a CUDA GPU")
    if args.part:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        result = {"graphs": lambda: part_kvflow(args.model_dir, False, args),
                  "eager": lambda: part_kvflow(args.model_dir, True, args),
                  "hf": lambda: part_hf(args.model_dir, args.hf_requests),
                  "attention": part_attention}[args.part]()
        print(json.dumps(result))
        return
    with tempfile.TemporaryDirectory(prefix="kvflow-qwen3-0.6b-") as model_dir:
        make_model_dir(model_dir)
        parts = ["attention", "graphs"] + ([] if args.skip_eager else ["eager"])
        parts += [] if args.skip_hf else ["hf"]
        results = {part: run_part(part, model_dir, args) for part in parts}
    report(results)


if __name__ == "__main__":
    main()
