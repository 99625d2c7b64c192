"""Offline throughput: kvflow vs HF transformers' batched generate on the same workload.

nano-vllm's bench shape scaled for a small CPU: N requests with random token-id prompts and
random output lengths (seeded), ignore_eos, greedy, bf16. HF generates the whole batch to the
longest output length (it cannot stop rows early); both are credited only the tokens each
request asked for, and HF's padded token count is printed too.

    python benchmarks/throughput.py --num-requests 64
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    parser.add_argument("--load-format", default="safetensors")
    parser.add_argument("--quantization", default=None, choices=["int8"])
    parser.add_argument("--seed", type=int, default=0)


def make_workload(args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    """Seeded random token-id prompts and output lengths (args.model must be a folder)."""
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(*args.prompt_len))]
               for _ in range(args.num_requests)]
    outputs = [rng.randint(*args.output_len) for _ in range(args.num_requests)]
    return prompts, outputs


def run_kvflow(args: argparse.Namespace, prompts: list[list[int]], outputs: list[int]) -> float:
    from kvflow import LLM, SamplingParams
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory_gb=args.kv_cache_memory_gb,
              max_num_seqs=args.num_requests, load_format=args.load_format, in_process=True,
              quantization=args.quantization)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)      # warm-up
    core, runner = llm.engine.core, llm.engine.worker.runner
    core.times.__init__()
    runner.times.__init__()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outs] == outputs
    steps = core.times.num_steps
    per_step = lambda s: f"{1e3 * s / steps:7.2f} ms"  # noqa: E731
    print(f"kvflow: {sum(outputs)} tokens in {elapsed:.1f} s, {steps} steps; per step: "
          f"schedule {per_step(core.times.schedule)}, prepare {per_step(runner.times.prepare)}, "
          f"forward {per_step(runner.times.forward)}, sample {per_step(runner.times.sample)}, "
          f"update {per_step(core.times.update)}")
    llm.shutdown()
    return sum(outputs) / elapsed


def run_hf(args: argparse.Namespace, prompts: list[list[int]], outputs: list[int]) -> float:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(args.model,
                                                 dtype=getattr(torch, args.dtype)).eval()
    model.generation_config.eos_token_id = None
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):                  # left padding, as HF wants for generate
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(outputs),
                       min_new_tokens=max(outputs), pad_token_id=0)
    elapsed = time.perf_counter() - start
    print(f"HF:     {sum(outputs)} requested tokens ({len(prompts) * max(outputs)} generated "
          f"with padding) in {elapsed:.1f} s")
    return sum(outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    from kvflow.frontend.model_files import resolve_model
    args.model = resolve_model(args.model)
    prompts, outputs = make_workload(args)
    print(f"workload: {args.num_requests} requests, prompt len {args.prompt_len}, output len "
          f"{args.output_len}, {args.dtype}, torch threads {torch.get_num_threads()}")
    ours = run_kvflow(args, prompts, outputs)
    print(f"kvflow: {ours:.1f} output tok/s")
    if not args.skip_hf:
        theirs = run_hf(args, prompts, outputs)
        print(f"HF:     {theirs:.1f} output tok/s")
        print(f"ratio kvflow / HF: {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
