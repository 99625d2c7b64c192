"""The cluster's cost: the same offline workload through the multi-process LLM (EngineCore
and a worker as child processes, ZMQ + msgspec between them) and through in_process=True,
plus the per-step IPC overhead measured inside EngineCore (plan broadcast + result return:
round trip minus the time spent inside the worker).

    python benchmarks/multiprocess.py --num-requests 64
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import add_workload_args, make_workload  # noqa: E402


def timed_generate(llm, prompts: list[list[int]],  # type: ignore[no-untyped-def]
                   outputs: list[int]) -> tuple[float, dict[str, float]]:
    """Output tok/s of the workload after a warm-up, and EngineCore's timings (multi-process
    engines; {} in-process). Shuts the LLM down."""
    from kvflow import SamplingParams
    from kvflow.frontend.engine_client import InProcessEngine
    from kvflow.ipc.messages import GetTimings
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)      # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outs] == outputs
    timings = ({} if isinstance(llm.engine, InProcessEngine)   # else supervised processes
               else llm.engine.utility(GetTimings(0)))
    llm.shutdown()
    return sum(outputs) / elapsed, timings


def run(args: argparse.Namespace, in_process: bool, prompts: list[list[int]],
        outputs: list[int]) -> tuple[float, dict[str, float]]:
    from kvflow import LLM
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory_gb=args.kv_cache_memory_gb,
              max_num_seqs=args.num_requests, load_format=args.load_format,
              quantization=args.quantization, in_process=in_process)
    return timed_generate(llm, prompts, outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    args = parser.parse_args()
    from kvflow.frontend.model_files import resolve_model
    args.model = resolve_model(args.model)
    prompts, outputs = make_workload(args)
    multi, timings = run(args, False, prompts, outputs)
    single, _ = run(args, True, prompts, outputs)
    steps = timings["ipc_steps"]
    print(f"multi-process: {multi:.1f} output tok/s; in-process: {single:.1f} output tok/s; "
          f"ratio {multi / single:.3f}")
    print(f"IPC overhead per step (plan broadcast + result return): "
          f"{1e6 * timings['ipc'] / steps:.0f} us over {steps:.0f} steps; step time "
          f"{1e3 * timings['execute'] / timings['num_steps']:.1f} ms")


if __name__ == "__main__":
    main()
