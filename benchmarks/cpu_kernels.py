"""The CPU kernels against their baselines, on the default model's shapes.

With --gemv: the decode-shaped linear (cpu_gemv.c; row-major weights, bfloat16 in the AMX
tile layout where the CPU has AMX, bfloat16 in panels under float32 x, the same panels in 12
bits a weight, bfloat16 in pair panels under bfloat16 x where the CPU has AVX512-BF16, int8
in panels) against oneDNN (torch's packed linear) and against a plain
memory read. The 12-bit panels' GB/s are the bfloat16 bytes they stand for over the time
(the bytes read are 76% of that). For each of the model's weight shapes and types, enough
copies of the matrix to exceed the caches (1 GiB) are multiplied by one row each, in turn,
so every weight comes from memory as in a decode step; GB/s = weight bytes / time. The read
bandwidth: a float32 sum over 1 GiB. The Python call's overhead (a few us a matrix) is
included, which understates the small shapes. With --huge-pages the copies (and the AMX
tiles and panels) are in 2 MB pages, as the engine holds them; oneDNN's stay in its own.

    python benchmarks/cpu_kernels.py --gemv [--isa avx2] [--rows 1] [--huge-pages]

Otherwise the attention kernel against the torch backend, in three measurements, each with
its baseline in the same run:
- decode attention over all layers of one step (batch, context ~ uniform(ctx/2, 3ctx/2)),
  with each request's blocks in one run (what the block manager aims for) and scattered at
  random (its worst case): the `cpu` backend, and the `torch` backend's gathers + bmm;
- prefill attention of one layer, for a batch of prompts and for one long prompt: `cpu` (the
  backend as it runs: the kernel's tiles, or on CPUs with AMX SDPA for long bfloat16
  prompts), the kernel's flash-style tiles of 32 rows, the same kernel row by row (how it ran
  before the tiles: each new token a causal row), and `torch` (one SDPA call per request),
  with GFLOP/s (4 x heads x head_dim x n(n+1)/2 per prompt);
- the greedy argmax over [batch, vocab] logits: the C kernel against torch.argmax.

    python benchmarks/cpu_kernels.py --batch 64 --context 400 [--dtype float32]
        [--kv-dtype bfloat16|int8] [--isa avx2] [--block-size 16] [--huge-pages]

--block-size sets the cache's block size (a power of two; the engine's default: 16);
--huge-pages puts the cpu backend's cache in one tensor in 2 MB pages, [K/V, layer, ...] as
workers/kv_cache.py holds the engine's (the torch backend's dequantized copies, where
--kv-dtype differs from --dtype, stay in torch's allocations). On an AMD EPYC Zen 5 (2
threads, 32 rows of ~400 keys over 30 layers, bfloat16) neither helped decode attention:
blocks of 16, 32, 64, 128 tokens 9.6, 10.4, 11.1, 12.7 ms in runs, 13.0, 12.9, 13.4, 13.8
scattered; in runs 9.1 ms with 2 MB pages against 9.4 with 4 KB ones (within the noise),
scattered the same. The kernel reads 64 GB/s with the cache in L3 (`--layers 1 --batch 16
--context 800`, 10 MB) and 33-37 GB/s from memory in runs (a 47-50 GB/s reading): memory
latency, not its arithmetic, is what holds it there.

With --kv-dtype int8 the cpu backend reads an int8 cache (kv_cache_dtype="int8": rows of
int8 values and their scale) and the torch backend the same values dequantized into --dtype.
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import numpy as np
import torch

from kvflow.kernels import cpu_ops
from kvflow.workers.attention import CpuBackend, SeqSpan, TorchBackend


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `repeats` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def spans_for(lengths: list[int], q_lens: list[int], block_size: int, num_blocks: int,
              placement: str, rng: np.random.Generator) -> list:
    """(first row, q_len, context, block ids) per request, blocks in runs or scattered."""
    need = [-(-n // block_size) for n in lengths]
    order = rng.permutation(num_blocks) if placement == "scattered" else np.arange(num_blocks)
    spans, used, row = [], 0, 0
    for n, q_len, nb in zip(lengths, q_lens, need):
        spans.append(SeqSpan(row, q_len, n, order[used:used + nb]))
        used, row = used + nb, row + q_len
    assert used <= num_blocks
    return spans


GEMV_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
               "lm_head": (49152, 576)}                                # SmolLM2-135M


def in_pages(args: argparse.Namespace) -> Callable[[torch.Tensor], torch.Tensor]:
    """Where the copies live: 2 MB pages (workers/huge_pages.py, as the engine holds its
    decode weights) with --huge-pages, else where torch allocated them (4 KB pages)."""
    from kvflow.workers.huge_pages import Arena
    return Arena().place if args.huge_pages else (lambda t: t)


def gemv_bandwidth(args: argparse.Namespace) -> None:
    from kvflow.workers.layers.linear import OneDnnLinear, quantize_weight
    big = torch.ones(256 * 2**20)
    read = big.numel() * 4 / min(timed(big.sum, 1) for _ in range(5)) / 1e9
    del big
    print(f"read bandwidth (float32 sum over 1 GiB, {args.threads} threads): {read:.1f} GB/s; "
          f"x: {args.rows} row(s); kernels built for {args.isa}; weights in "
          f"{'2 MB pages, as the engine holds them' if args.huge_pages else 'torch allocations'}")
    print(f"{'shape':10s}{'weights':>9s}{'MB':>7s}{'gemv GB/s':>11s}{'of read':>9s}"
          f"{'AMX tiles GB/s':>16s}{'panels GB/s':>13s}{'12-bit GB/s':>13s}"
          f"{'pairs GB/s':>12s}{'12-bit pairs':>14s}{'oneDNN GB/s':>13s}")
    print("(packed layouts' GB/s: of the bfloat16 weights' bytes, whatever bytes they read)")
    onednn = OneDnnLinear()
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        for name, (n, k) in GEMV_SHAPES.items():
            w = torch.randn(n, k)
            if dtype == torch.int8:
                q, scales = quantize_weight(w)
                weight, nbytes = q, n * k + 4 * n
                x = torch.randn(args.rows, k)
            else:
                weight, scales, nbytes = w.to(dtype), None, n * k * dtype.itemsize
                x = torch.randn(args.rows, k).to(dtype)
            place = in_pages(args)                  # one arena for all copies, as the engine
            copies = [place(weight.clone()) for _ in range(max(2, min(400, 2**30 // nbytes)))]
            ours = timed(lambda: [cpu_ops.gemv(x, c, scales) for c in copies], 3)

            def packed_gbs(pack: Callable, xs: torch.Tensor, layout: str,
                           with_scales: bool = False) -> str:
                """GB/s of the copies packed by `pack` into `layout` ("-" where it refuses)."""
                if pack(weight) is None:
                    return "-"
                place = in_pages(args)
                packed = [place(pack(c)) for c in copies]
                sc = scales if with_scales else None
                t = timed(lambda: [cpu_ops.gemv(xs, p, sc, layout=layout) for p in packed], 3)
                return f"{len(copies) * nbytes / t / 1e9:.1f}"

            bf16 = dtype == torch.bfloat16
            # bf16 in the AMX layout, where the CPU has it; in panels under float32 x (no
            # AVX512-BF16) and in 12-bit panels; in pair panels under bf16 x (AVX512-BF16)
            # and, at one row, in 12-bit pair panels
            tiles = packed_gbs(cpu_ops.pack_amx, x, "amx") if bf16 else "-"
            panels = packed_gbs(cpu_ops.pack_panels, x.float(), "panels") if bf16 else "-"
            panels12 = packed_gbs(cpu_ops.pack_panels12, x.float(), "panels12") if bf16 else "-"
            pairs = packed_gbs(cpu_ops.pack_pairs, x, "pairs") if bf16 else "-"
            pairs12 = (packed_gbs(cpu_ops.pack_pairs12, x, "pairs12") if bf16 and args.rows == 1
                       else "-")
            if dtype == torch.int8:                                          # int8 panels
                panels = packed_gbs(cpu_ops.pack_i8_panels, x, "panels", with_scales=True)
            theirs = "-"
            # oneDNN's int8 GEMM quantizes x: not comparable; it has no bfloat16 path on AVX2
            if dtype != torch.int8 and onednn.works(dtype):
                packed = [onednn.prepare(c) for c in copies]
                t = timed(lambda: [onednn.apply(x, c, p) for c, p in zip(copies, packed)], 3)
                theirs = f"{len(copies) * nbytes / t / 1e9:.1f}"
                del packed
            gbs = len(copies) * nbytes / ours / 1e9
            print(f"{name:10s}{str(dtype)[6:]:>9s}{nbytes / 1e6:7.1f}{gbs:11.1f}"
                  f"{gbs / read:9.0%}{tiles:>16s}{panels:>13s}{panels12:>13s}{pairs:>12s}"
                  f"{pairs12:>14s}{theirs:>13s}",
                  flush=True)
            del copies


def as_values(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A cache's values in `dtype` (an int8 cache's rows dequantized)."""
    if cache.dtype == torch.int8:
        return cpu_ops.dequantize_kv_rows(cache).to(dtype)
    return cache.to(dtype)


def prefill_attention(backends: dict, lengths: list[int], cache: list[torch.Tensor],
                      args: argparse.Namespace, rng: np.random.Generator) -> None:
    """One layer's prefill of these prompts: the cpu backend as it runs them (on CPUs with AMX,
    bfloat16 prompts of SDPA_MIN_ROWS or more go to SDPA), the kernel's tiles, the same kernel
    row by row (the entries reversed, so no run of rows is a tile: how it ran before the
    tiles), and the torch backend (one SDPA call per request)."""
    cpu = backends["cpu"]
    block_size, heads, head_dim = cpu.block_size, 9, 64
    kernel_only = CpuBackend(block_size, cpu.kv_shape[0], head_dim, cpu.dtype, cpu.device,
                             cpu.kv_dtype)
    kernel_only.sdpa_min_rows = 0
    num_blocks = cache[0].shape[1] // block_size
    spans = spans_for(lengths, lengths, block_size, num_blocks, "runs", rng)
    scale = head_dim ** -0.5
    q = torch.randn(sum(lengths), heads, head_dim).to(cpu.dtype)
    slots = np.zeros(sum(lengths), dtype=np.int64)
    as_torch = [as_values(t, cpu.dtype) for t in cache]   # the torch backend's: its dtype's
    runs = {"cpu": (cpu, cpu.build_metadata(slots, [], spans)),
            "tiles": (kernel_only, kernel_only.build_metadata(slots, [], spans)),
            "torch": (backends["torch"], backends["torch"].build_metadata(slots, [], spans))}
    meta = runs["tiles"][1]
    runs["rows"] = (kernel_only, type(meta)(meta.slot_mapping, meta.block_tables,
                                            meta.table_rows.flip(0), meta.context_lens.flip(0),
                                            meta.q_rows.flip(0)))
    assert all(rows == 1 for _, rows in cpu_ops.attention_work_items(
        runs["rows"][1].table_rows, runs["rows"][1].context_lens, runs["rows"][1].q_rows,
        head_dim))
    result = {name: timed(lambda: backend.attend(q, *(as_torch if name == "torch" else cache),
                                                 meta, scale), args.repeats)
              for name, (backend, meta) in runs.items()}
    # bfloat16 tiles: by vdpbf16ps where cpu_ops.tile_dot_pays() (AMD with AVX512-BF16), else
    # by float32 FMAs; the other way too where this build has both
    if cpu.dtype == torch.bfloat16 and cpu.kv_dtype == torch.bfloat16:
        dot = cpu_ops.tile_dot_pays()
        if cpu_ops.set_tile_dot(not dot):
            backend, meta = runs["tiles"]
            result["tiles by float32 FMAs" if dot else "tiles by vdpbf16ps"] = timed(
                lambda: backend.attend(q, *cache, meta, scale), args.repeats)
        cpu_ops.set_tile_dot(dot)
    flops = sum(4 * heads * head_dim * n * (n + 1) / 2 for n in lengths)
    what = (f"{len(lengths)} prompts of 32..256 ({sum(lengths)} tokens)" if len(lengths) > 1
            else f"one prompt of {lengths[0]} tokens")
    sdpa = len(runs["cpu"][1].sdpa_prefills)
    print(f"prefill attention, one layer, {what} (the cpu backend sends {sdpa} to SDPA):")
    print("  " + ", ".join(f"{name} {1e3 * s:.2f} ms ({flops / s / 1e9:.0f} GFLOP/s)"
                           for name, s in result.items())
          + f"; tiles vs rows {result['rows'] / result['tiles']:.2f}x, cpu vs torch "
          f"{result['torch'] / result['cpu']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=15, help="prefill: prompts 32..256")
    parser.add_argument("--long-prompt", type=int, default=2048,
                        help="prefill: then one prompt of this many tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--kv-dtype", default=None, choices=["bfloat16", "float32", "int8"],
                        help="the KV cache's dtype (default: --dtype's); float32 arithmetic "
                             "with a bfloat16 cache is what dtype='auto' runs on CPUs "
                             "without AVX512-BF16; int8: kv_cache_dtype='int8'")
    parser.add_argument("--isa", default="native", choices=list(cpu_ops.ISA_FLAGS),
                        help="build the kernels for this CPU less AVX512-BF16 (avx512) or "
                             "less AVX-512 (avx2): the code other CPUs run")
    parser.add_argument("--gemv", action="store_true",
                        help="the decode-shaped linear's GB/s instead (see above)")
    parser.add_argument("--rows", type=int, default=1, help="--gemv: rows of x")
    parser.add_argument("--block-size", type=int, default=16,
                        help="attention: the KV cache's block size in tokens (a power of "
                             "two, as the engine takes)")
    parser.add_argument("--huge-pages", action="store_true",
                        help="the gemv's weight copies (--gemv) or the KV cache in 2 MB pages, "
                             "as the engine holds them (workers/huge_pages.py); else in "
                             "torch's allocations")
    args = parser.parse_args()
    if args.block_size < 1 or args.block_size & (args.block_size - 1):
        parser.error(f"--block-size {args.block_size}: must be a power of two")
    torch.set_num_threads(args.threads)
    if cpu_ops.library() is None:
        raise SystemExit(f"the C kernels did not build: {cpu_ops.build_error()}")
    if args.isa != "native":
        cpu_ops._state["lib"] = cpu_ops.load_isa(args.isa)
    if args.gemv:
        return gemv_bandwidth(args)
    rng = np.random.default_rng(0)
    block_size, kv_heads, heads, head_dim = args.block_size, 3, 9, 64  # SmolLM2-135M
    dtype, scale = getattr(torch, args.dtype), head_dim ** -0.5
    kv_dtype = getattr(torch, args.kv_dtype or args.dtype)
    cpu = torch.device("cpu")
    backends = {"cpu": CpuBackend(block_size, kv_heads, head_dim, dtype, cpu, kv_dtype),
                "torch": TorchBackend(block_size, kv_heads, head_dim, dtype, cpu)}

    contexts = rng.integers(args.context // 2, args.context * 3 // 2, args.batch).tolist()
    # enough blocks for the decode contexts and for the prefill part's prompts (<= 256 each)
    num_blocks = max(sum(-(-c // block_size) for c in contexts),
                     args.prompts * -(-256 // block_size),
                     -(-args.long_prompt // block_size)) * 5 // 4
    values = (kv_heads, num_blocks * block_size, head_dim)
    caches = [[cpu_ops.quantize_kv_rows(torch.randn(values)) if kv_dtype == torch.int8
               else torch.randn(values).to(kv_dtype)
               for _ in range(2)] for _ in range(args.layers)]  # a cache per layer
    pages = "torch allocations"
    if args.huge_pages:     # one tensor [K/V, layer, ...] in 2 MB pages, as workers/kv_cache.py
        from kvflow.workers.huge_pages import advise
        whole = torch.empty((2, args.layers, *caches[0][0].shape), dtype=caches[0][0].dtype)
        pages = "2 MB pages" if advise(whole) else "torch allocations (2 MB pages refused)"
        for i, pair in enumerate(caches):
            for j, t in enumerate(pair):
                whole[j, i].copy_(t)
                pair[j] = whole[j, i]
    row_bytes = caches[0][0].shape[-1] * kv_dtype.itemsize       # an int8 row: + its scale
    kv_bytes = 2 * sum(contexts) * kv_heads * row_bytes * args.layers
    layers = {"cpu": caches, "torch": caches if kv_dtype == dtype else [   # torch: its dtype's
        [as_values(t, dtype) for t in pair] for pair in caches]}
    q = torch.randn(args.batch, heads, head_dim).to(dtype)
    slots = np.zeros(args.batch, dtype=np.int64)
    print(f"decode attention, {args.layers} layers, batch {args.batch}, mean context "
          f"{np.mean(contexts):.0f} ({kv_bytes / 1e6:.0f} MB of K/V a step), {args.dtype} "
          f"({kv_dtype} cache in {pages}, blocks of {block_size}), "
          f"kernels built for {args.isa}, {args.threads} threads")
    for placement in ("runs", "scattered"):
        spans = spans_for(contexts, [1] * args.batch, block_size, num_blocks, placement, rng)
        result = {}
        for name, backend in backends.items():
            meta = backend.build_metadata(slots, spans, [])
            result[name] = timed(lambda: [backend.attend(q, k, v, meta, scale)
                                          for k, v in layers[name]], args.repeats)
        print(f"  blocks {placement:9s}: cpu {1e3 * result['cpu']:7.1f} ms "
              f"({kv_bytes / result['cpu'] / 1e9:4.1f} GB/s), torch "
              f"{1e3 * result['torch']:7.1f} ms: {result['torch'] / result['cpu']:.1f}x")

    del layers
    for lengths in (rng.integers(32, 257, args.prompts).tolist(), [args.long_prompt]):
        prefill_attention(backends, lengths, caches[0], args, rng)

    logits = torch.randn(args.batch, 49152).to(dtype)
    ours = timed(lambda: cpu_ops.argmax(logits), args.repeats * 3)
    theirs = timed(lambda: logits.float().argmax(dim=-1), args.repeats * 3)
    print(f"greedy argmax [{args.batch}, 49152] {args.dtype}: C {1e3 * ours:.3f} ms, torch (float32 "
          f"copy + argmax) {1e3 * theirs:.3f} ms: {theirs / ours:.1f}x")


if __name__ == "__main__":
    main()
