"""The sampler on CPU: torch ops against the C kernels, in the same run.

The whole `Sampler` call (kvflow/workers/sampler.py) on the default model's vocabulary (49152
logits a row), at 1 row (one request decoding) and at 32 rows (32 requests), for the settings
users send: greedy, temperature, top-p, top-k, min-p, a repetition penalty over a 600-token
history, logprobs. "torch" is the Sampler's torch path (the reference, and the GPU's);
"C" is what a CPU worker uses where the C kernels build (`cpu_ops.argmax`, `sample`,
`penalize`, `logprobs`). Both get the same uniforms, so they draw the same tokens.

    python benchmarks/sampler.py [--rows 1 32] [--repeats 10] [--threads 2]
"""
from __future__ import annotations

import argparse
import platform
import random
import time

import torch

from kvflow.kernels import cpu_ops
from kvflow.sampling_params import SamplingParams
from kvflow.workers.sampler import Sampler, SamplingBatch

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 0.7": dict(temperature=0.7),
    "+ top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "+ top_k 50": dict(temperature=0.7, top_k=50),
    "min_p 0.1": dict(temperature=1.0, min_p=0.1),
    "repetition 1.1": dict(temperature=0.7, repetition_penalty=1.1),
    "greedy + logprobs 5": dict(temperature=0.0, logprobs=5),
}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--history", type=int, default=600, help="tokens a row has seen")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_ops.library() is None:
        raise SystemExit(f"the C kernels did not build: {cpu_ops.build_error()}")
    samplers = {"torch": Sampler(0, eos_token_ids=[2]),
                "C": Sampler(0, argmax=cpu_ops.argmax, eos_token_ids=[2], draw=cpu_ops.sample,
                             penalize=cpu_ops.penalize, top_logprobs=cpu_ops.logprobs)}
    print(f"CPU: {cpu_name()}, {args.threads} threads; "
          f"vocabulary {args.vocab}; ms per Sampler call (best of 3 x {args.repeats})")
    print(f"{'setting':22s} {'rows':>4s} {'torch':>9s} {'C':>9s} {'torch / C':>9s}")
    rng = random.Random(0)
    for rows in args.rows:
        logits = torch.randn(rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
        history = [[rng.randrange(args.vocab) for _ in range(args.history)]
                   for _ in range(rows)]
        for name, setting in SETTINGS.items():
            batch = SamplingBatch([SamplingParams(**setting)] * rows, [200] * rows, history)
            times = {k: best_ms(lambda s=s: s(logits, batch), args.repeats)  # type: ignore[misc]
                     for k, s in samplers.items()}
            print(f"{name:22s} {rows:4d} {times['torch']:9.3f} {times['C']:9.3f} "
                  f"{times['torch'] / times['C']:8.1f}x", flush=True)


if __name__ == "__main__":
    main()
