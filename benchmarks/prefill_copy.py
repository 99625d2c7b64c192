"""cpu_prefill_copy="on" against "off": the memory oneDNN's copy of the paneled weights costs and
the prefill time it saves, paired in one process.

Two in-process engines on the same model, one keeping oneDNN's copy of the weights the gemv
kernel holds in panels or pair panels (used for products of more than 64 rows: prompts), one
without (the panels take every product). Each reports the bytes its worker's tensors take
(parameters and prepared weights, counted once per storage; oneDNN's opaque copies by element
count) and the process's RSS growth while it was built. Then, in alternating order each round:
16 random prompts of 512 tokens (1 output token each), one prompt of 2000, and the 32-request
offline workload of benchmarks/cpu_peers.py (prompts 32-512, outputs 32-256, greedy,
ignore_eos). Each figure is printed per round and as off/on ratios per round (the pairs), so a
drift of the machine's speed during the run cancels.

    python benchmarks/prefill_copy.py [--isa avx2|avx512] [--rounds 4] [--skip-workload]

--isa runs the engines as that CPU (cpu_peers.ISA_ENV: kvflow's kernel build and flags, oneDNN,
ATen and MKL capped): where dtype="auto" is float32 arithmetic on bfloat16 weights, whose
oneDNN copy is float32. Natively on a CPU with AVX512-BF16 it is bfloat16 on pair panels.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cpu_peers import ISA_ENV, make_workload  # noqa: E402


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tensor_bytes(worker) -> int:  # type: ignore[no-untyped-def]
    """The worker model's parameters and prepared weights, each storage once."""
    import torch
    seen: set[int] = set()
    total = 0

    def walk(obj) -> None:  # type: ignore[no-untyped-def]
        nonlocal total
        if isinstance(obj, torch.Tensor):
            if obj.numel() == 0:
                return
            try:
                key, size = obj.untyped_storage().data_ptr(), obj.untyped_storage().nbytes()
            except NotImplementedError:              # oneDNN's opaque packed weight
                key, size = id(obj), obj.numel() * obj.element_size()
            if key not in seen:
                seen.add(key)
                total += size
        elif isinstance(obj, (tuple, list)):
            for item in obj:
                walk(item)

    for module in worker.model.modules():
        for param in module.parameters(recurse=False):
            walk(param.data)
        walk(getattr(module, "prepared", None))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--isa", choices=sorted(ISA_ENV), default=None)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--skip-workload", action="store_true",
                        help="prefill only, not the 32-request workload")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.isa and any(os.environ.get(k) != v for k, v in ISA_ENV[args.isa].items()):
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, **ISA_ENV[args.isa]})
    import torch

    from kvflow import LLM, SamplingParams
    from kvflow.frontend.model_files import ensure_default_model
    torch.set_num_threads(os.cpu_count() or 1)
    model = ensure_default_model() if args.model == "default" else args.model
    engines, memory = {}, {}
    for name in ("on", "off"):
        gc.collect()
        before = rss()
        llm = LLM(model, in_process=True, kv_cache_memory_gb=1.0, enable_prefix_caching=False,
                  cpu_prefill_copy=name, seed=args.seed)
        gc.collect()
        worker = llm.engine.worker                      # type: ignore[union-attr]
        engines[name] = llm
        memory[name] = (tensor_bytes(worker), rss() - before)
        print(f"{name}: {worker.ops.linear.name}; weights {memory[name][0] / 2**20:.0f} MiB, "
              f"RSS +{memory[name][1] / 2**20:.0f} MiB", flush=True)
    rng = random.Random(args.seed)
    vocab = engines["on"].config.model.vocab_size

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    one = SamplingParams(max_tokens=1, temperature=0.0)
    workload = argparse.Namespace(seed=args.seed, prompt_len=(32, 512), output_len=(32, 256))
    prompts, outputs = make_workload(workload, vocab, 32, "offline")
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outputs]

    def run(llm: LLM) -> tuple[float, float, float]:
        batch = [ids(512) for _ in range(16)]
        t0 = time.perf_counter()
        llm.generate(batch, one, use_tqdm=False)
        t1 = time.perf_counter()
        llm.generate([ids(2000)], one, use_tqdm=False)
        t2 = time.perf_counter()
        rate = 0.0
        if not args.skip_workload:
            llm.generate(prompts, params, use_tqdm=False)
            rate = sum(outputs) / (time.perf_counter() - t2)
        return 16 * 512 / (t1 - t0), 1e3 * (t2 - t1), rate

    for llm in engines.values():                        # warm-up
        llm.generate([ids(600)], one, use_tqdm=False)
    figures: dict[str, list[tuple[float, float, float]]] = {"on": [], "off": []}
    for r in range(args.rounds):
        for name in ("on", "off") if r % 2 == 0 else ("off", "on"):
            figures[name].append(run(engines[name]))
            prefill, long_ms, rate = figures[name][-1]
            print(f"round {r} {name}: prefill {prefill:.0f} tok/s, 2000-token prompt "
                  f"{long_ms:.0f} ms" + (f", 32 requests {rate:.1f} tok/s" if rate else ""),
                  flush=True)
    labels = ["prefill tok/s", "2000-token prompt ms", "32 requests tok/s"]
    for i, label in enumerate(labels[:2] if args.skip_workload else labels):
        on = [f[i] for f in figures["on"]]
        off = [f[i] for f in figures["off"]]
        ratios = ", ".join(f"{b / a:.3f}" for a, b in zip(on, off))
        print(f"{label}: on {statistics.median(on):.1f}, off {statistics.median(off):.1f} "
              f"(medians); off/on per round {ratios}")
    print(f"weights: on {memory['on'][0] / 2**20:.0f} MiB, off {memory['off'][0] / 2**20:.0f} "
          f"MiB ({memory['off'][0] / memory['on'][0]:.2f}x)")
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
