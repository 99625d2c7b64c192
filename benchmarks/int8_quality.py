"""How close quantization="int8", and the other storage types, stay to float32 on the default
model.

int8 runs two ways (layers/linear.py, Int8Linear): prefills and large batches W8A8 (or W7A8,
7-bit weights, on CPUs without VNNI), decode steps of a few tokens W8A16. For
each prompt, float32 generates 64 greedy tokens. Then each variant (bfloat16; int8 W8A8 with
float32 or bfloat16 activations, 7-bit weights, without SmoothQuant
(workers/smoothing.py); int8 W8A16, the decode path, for every product; float32 with a
bfloat16 KV cache; float32 and bfloat16 with an int8 KV cache (kv_cache_dtype="int8");
dtype="auto" as a CPU without bfloat16 arithmetic runs it, float32 on
bfloat16 weights and KV cache) is compared with float32 in two ways:
- teacher-forced: one forward pass over prompt + float32's tokens; at every generated position,
  whether the variant's argmax is float32's token, and |logprob difference| of that token;
- free-running: the variant's own greedy tokens; how many equal float32's before the first
  divergence. All prompts run as one batch (decode steps of 10 rows: W8A8), and one at a time
  ("alone": decodes W8A16, as a single user gets them).

    python benchmarks/int8_quality.py [--max-tokens 64] [--variants bfloat16,auto...]
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvflow import LLM, SamplingParams                                    # noqa: E402
from kvflow.config import make_engine_config                              # noqa: E402
from kvflow.frontend.model_files import ensure_default_model              # noqa: E402
from kvflow.workers.hardware import cpu_flags, cpu_model                  # noqa: E402
from kvflow.workers.layers import ops as ops_module                       # noqa: E402
from kvflow.workers.layers.linear import gemm_weight_levels               # noqa: E402
from kvflow.workers.models.llama import LlamaForCausalLM                  # noqa: E402
from kvflow.workers.smoothing import prefill_logits                      # noqa: E402
from kvflow.workers.worker import Worker                                  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def quicksort(items):\n",
    "Explain in one paragraph why the sky is blue.",
    "1, 2, 3, 5, 8, 13, 21,",
    "The three most important inventions of the twentieth century are",
    "Translate to French: The weather is lovely today and we are going to the beach.",
    "A recipe for pancakes:\n1.",
    "Once upon a time, a small robot woke up in an empty library and",
    "SELECT name, COUNT(*) FROM orders",
]
VARIANTS = {"bfloat16": dict(dtype="bfloat16"),
            "int8, no SmoothQuant": dict(dtype="float32", quantization="int8"),
            "int8 (float32 activations)": dict(dtype="float32", quantization="int8"),
            "int8 (bfloat16 activations)": dict(dtype="bfloat16", quantization="int8"),
            "int8, 7-bit weights (W7A8)": dict(dtype="float32", quantization="int8"),
            "int8 W8A16 everywhere": dict(dtype="float32", quantization="int8"),
            "float32, bfloat16 KV cache": dict(dtype="float32", kv_cache_dtype="bfloat16"),
            "float32, int8 KV cache": dict(dtype="float32", kv_cache_dtype="int8"),
            "bfloat16, int8 KV cache": dict(dtype="bfloat16", kv_cache_dtype="int8"),
            "auto without AVX512-BF16/AMX": dict(dtype="auto")}
# The flags that variant decides by (workers/hardware.py): an AVX2-only CPU's.
AVX2_FLAGS = "sse4_2 avx avx2 fma f16c bmi2"
FLAGS = os.environ.get("KVFLOW_CPU_FLAGS")            # the others': as the run was started


def patched(name: str) -> None:
    """What a variant changes: SmoothQuant off, 7-bit weights (as on CPUs without
    VNNI), every product on the W8A16 decode path, or the CPU's flags."""
    from kvflow.workers.layers import linear, ops
    os.environ.pop("KVFLOW_CPU_FLAGS", None)
    flags = AVX2_FLAGS if "without AVX512-BF16" in name else FLAGS
    if flags is not None:
        os.environ["KVFLOW_CPU_FLAGS"] = flags
    LlamaForCausalLM.smoothing_pairs = (                      # type: ignore[method-assign]
        (lambda self: []) if "no SmoothQuant" in name else smoothing_pairs)
    linear.gemm_weight_levels = (lambda flags: 63) if "7-bit" in name else GEMM_WEIGHT_LEVELS
    ops.GEMV_MAX_ROWS = 1 << 30 if "W8A16" in name else GEMV_MAX_ROWS


@dataclass
class Quality:
    top1: float            # teacher-forced argmax agreement
    mean_abs_dlogprob: float
    free_prefix: float     # mean share of tokens equal before the first divergence


def log_probs(worker: Worker, ids: list[int]) -> torch.Tensor:
    """log_softmax of every position's logits, one prefill pass."""
    return torch.log_softmax(prefill_logits(worker.model, worker.kv_cache, ids).float(), dim=-1)


def generate(path: str, prompts: list[list[int]], max_tokens: int, alone: bool = False,
             **options: object) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(path, kv_cache_memory_gb=0.2, in_process=True,
             **options) as llm:                                         # type: ignore[arg-type]
        if alone:
            return [llm.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def prefix_share(free: list[list[int]], reference: list[list[int]]) -> float:
    return float(np.mean([next((i for i, (a, b) in enumerate(zip(f, r)) if a != b), len(r))
                          / len(r) for f, r in zip(free, reference)]))


smoothing_pairs = LlamaForCausalLM.smoothing_pairs
GEMM_WEIGHT_LEVELS = gemm_weight_levels
GEMV_MAX_ROWS = ops_module.GEMV_MAX_ROWS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--variants", help="comma-separated prefixes of the variants to run "
                        "(default: all)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    path = ensure_default_model()
    flags = cpu_flags()
    print(f"CPU: {cpu_model()}; " + ", ".join(
        f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
        if f in flags))
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    reference = generate(path, prompts, args.max_tokens, dtype="float32")
    reference_alone = generate(path, prompts, args.max_tokens, alone=True, dtype="float32")
    base = Worker(make_engine_config(path, dtype="float32", kv_cache_memory_gb=0.05,
                                     device="cpu"))
    sequences = [p + r for p, r in zip(prompts, reference)]
    ref_lp = [log_probs(base, s) for s in sequences]
    print(f"{len(PROMPTS)} prompts x {args.max_tokens} greedy tokens, against float32:")
    print(f"{'variant':30s} {'top-1 agree':>12s} {'mean |dlogprob|':>16s} "
          f"{'free-run prefix':>16s} {'alone':>7s}")
    for name, options in VARIANTS.items():
        if args.variants and not any(name.startswith(v) for v in args.variants.split(",")):
            continue
        patched(name)
        worker = Worker(make_engine_config(path, kv_cache_memory_gb=0.05, device="cpu",
                                           **options))           # type: ignore[arg-type]
        agree, diffs = [], []
        for prompt, seq, lp in zip(prompts, sequences, ref_lp):
            ours = log_probs(worker, seq)
            rows = torch.arange(len(prompt) - 1, len(seq) - 1)     # predicting the outputs
            chosen = torch.tensor(seq[len(prompt):])
            agree.append((ours[rows].argmax(-1) == chosen).float())
            diffs.append((ours[rows, chosen] - lp[rows, chosen]).abs())
        free = generate(path, prompts, args.max_tokens, **options)
        alone = generate(path, prompts, args.max_tokens, alone=True, **options)
        q = Quality(float(torch.cat(agree).mean()), float(torch.cat(diffs).mean()),
                    prefix_share(free, reference))
        print(f"{name:30s} {q.top1:12.3f} {q.mean_abs_dlogprob:16.4f} {q.free_prefix:16.3f} "
              f"{prefix_share(alone, reference_alone):7.3f}")
    patched("")


if __name__ == "__main__":
    main()
