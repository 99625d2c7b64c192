"""kvflow's C kernels for CPU (kvflow/kernels/cpu_ops.c) against the torch code they replace.

References: the torch attention backend (computed in float32 from the same bf16 inputs, so the
check is of the kernel, not of the reference's own bf16 roundings), and the model's own torch
functions for RMSNorm, SiLU-and-mul and rotary. Shapes are awkward on purpose: contexts of one
token and of exact block multiples, head_dim off the specialised sizes, query rows out of order,
strided inputs.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvflow.kernels import cpu_ops
from kvflow.workers.hardware import cpu_flags
from kvflow.kernels.torch_attention import store_kv as torch_store_kv
from kvflow.workers.attention import (CpuBackend, SeqSpan, TorchBackend, cpu_kernels_usable,
                                      resolve_backend)
from kvflow.workers.layers.norm import add_rms_norm, rms_norm
from kvflow.workers.layers.rotary import RotaryEmbedding, apply_rotary
from kvflow.workers.layers.activation import silu_and_mul

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]
# float32: summation order only. bfloat16: one rounding of the output (2^-8 relative).
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}
# Attention's (queries and output, KV cache) dtypes: the model's dtype for both, float32
# arithmetic over a bfloat16 cache, or either over an int8 one (kv_cache_dtype). The reference
# reads the same cache values (an int8 cache's rows dequantized).
KV_CASES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
            (torch.float32, torch.bfloat16), (torch.float32, torch.int8),
            (torch.bfloat16, torch.int8)]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def test_the_kernels_build_here() -> None:
    """CI's machine has a C compiler: a build failure must fail loudly, not fall back."""
    assert cpu_ops.library() is not None, cpu_ops.build_error()
    assert cpu_kernels_usable(torch.bfloat16) is None


def _cache(fast: CpuBackend, num_blocks: int, kv_dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A random cache of kv_dtype in `fast`'s layout, and the float32 values the reference
    reads (an int8 cache's rows dequantized: the store's quantization is tested apart)."""
    num_kv_heads, head_dim = fast.kv_shape
    values = torch.randn(num_kv_heads, num_blocks * fast.block_size, head_dim)
    if kv_dtype == torch.int8:
        cache = cpu_ops.quantize_kv_rows(values)
        assert cache.shape == fast.cache_shape(num_blocks)
        return cache, cpu_ops.dequantize_kv_rows(cache)
    cache = values.to(kv_dtype)
    return cache, cache.float()


def _spans(context_lens: list[int], q_lens: list[int], block_size: int, num_blocks: int,
           first_row: int = 0) -> list[tuple[int, int, int, np.ndarray]]:
    """Requests with shuffled, disjoint block tables; packed rows from first_row on."""
    perm = np.random.default_rng(1).permutation(num_blocks)
    spans, used, row = [], 0, first_row
    for ctx, q_len in zip(context_lens, q_lens):
        n = -(-ctx // block_size)
        spans.append(SeqSpan(row, q_len, ctx, perm[used:used + n]))
        used, row = used + n, row + q_len
    return spans


# Head shapes: SmolLM2's (9, 3, 64); head_dim 96 ends on half an accumulator tile and group 5
# spans two tiles of query heads in the AVX-512 path; 48 and 16 are not multiples of 32.
HEAD_SHAPES = [(9, 3, 64), (4, 4, 128), (10, 2, 96), (8, 2, 48), (6, 1, 16)]


@pytest.mark.parametrize("dtype,kv_dtype", KV_CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEAD_SHAPES)
@pytest.mark.parametrize("block_size", [16, 5])
def test_decode_attention_matches_torch(kernels: str, dtype: torch.dtype, kv_dtype: torch.dtype,
                                        num_heads: int, num_kv_heads: int, head_dim: int,
                                        block_size: int) -> None:
    # 512 keys: one segment; 513 and 1300: two and three (cpu_ops.c's ROW_SEG), combined
    context_lens = [1, block_size, 2 * block_size, 37, 130, 3 * block_size + 1, 512, 513, 1300]
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 7
    spans = _spans(context_lens, [1] * len(context_lens), block_size, num_blocks)
    spans = spans[::-1]                              # rows out of request order
    slots = np.zeros(len(spans), dtype=np.int64)     # the store is not under test here
    fast = CpuBackend(block_size, num_kv_heads, head_dim, dtype, CPU, kv_dtype)
    ref = TorchBackend(block_size, num_kv_heads, head_dim, torch.float32, CPU)
    k_cache, k_ref = _cache(fast, num_blocks, kv_dtype)
    v_cache, v_ref = _cache(fast, num_blocks, kv_dtype)
    q = torch.randn(len(spans), num_heads, head_dim).to(dtype)
    scale = head_dim ** -0.5
    out = fast.attend(q, k_cache, v_cache, fast.build_metadata(slots, spans, []), scale)
    expected = ref.attend(q.float(), k_ref, v_ref,
                          ref.build_metadata(slots, spans, []), scale)
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype,kv_dtype", KV_CASES)
def test_split_decode_rows_do_not_depend_on_the_batch(kernels: str, dtype: torch.dtype,
                                                      kv_dtype: torch.dtype) -> None:
    """A decode row whose context is split into segments (one task each, combined by the
    last) gets the same bits alone, with one other row or in a batch of 40."""
    bs, kv_heads, heads, d = 16, 3, 9, 64
    contexts = [1100] + [37 + 29 * i for i in range(39)]
    num_blocks = sum(-(-c // bs) for c in contexts) + 1
    spans = _spans(contexts, [1] * len(contexts), bs, num_blocks)
    fast = CpuBackend(bs, kv_heads, d, dtype, CPU, kv_dtype)
    k_cache, _ = _cache(fast, num_blocks, kv_dtype)
    v_cache, _ = _cache(fast, num_blocks, kv_dtype)
    q = torch.randn(len(spans), heads, d).to(dtype)

    def attend(n: int) -> torch.Tensor:
        slots = np.zeros(n, dtype=np.int64)
        return fast.attend(q[:n], k_cache, v_cache, fast.build_metadata(slots, spans[:n], []),
                           0.125)

    alone, batch = attend(1), attend(len(spans))
    assert torch.equal(alone, batch[:1]) and torch.equal(attend(2)[:1], alone)


@pytest.mark.parametrize("dtype,kv_dtype", KV_CASES)
def test_mixed_batch_matches_torch_backend(kernels: str, dtype: torch.dtype,
                                           kv_dtype: torch.dtype) -> None:
    """Decodes by the kernel and prefills (one with a cached prefix) by the torch path, in one
    batch with the prefill rows first: every row lands where the torch backend puts it."""
    bs, kv_heads, heads, d = 16, 3, 9, 64
    prefills = _spans([40, 70], [40, 22], bs, 64)            # the second has 48 cached tokens
    decodes = _spans([1, 33, 100], [1, 1, 1], bs, 90, first_row=62)   # reads may share blocks
    slots = np.zeros(65, dtype=np.int64)
    fast = CpuBackend(bs, kv_heads, d, dtype, CPU, kv_dtype)
    ref = TorchBackend(bs, kv_heads, d, torch.float32, CPU)
    k_cache, k_ref = _cache(fast, 90, kv_dtype)
    v_cache, v_ref = _cache(fast, 90, kv_dtype)
    q = torch.randn(65, heads, d).to(dtype)
    out = fast.attend(q, k_cache, v_cache, fast.build_metadata(slots, decodes, prefills), 0.125)
    expected = ref.attend(q.float(), k_ref, v_ref,
                          ref.build_metadata(slots, decodes, prefills), 0.125)
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])


# The prefill tiles' cases: every (dtype, cache dtype) by float32 FMAs, and bfloat16 over a
# bfloat16 cache by vdpbf16ps too (scores and P V, P rounded to bfloat16: cpu_ops.set_tile_dot;
# on by default on AMD CPUs with AVX512-BF16 only).
TILE_CASES = [(*case, False) for case in KV_CASES] + [(torch.bfloat16, torch.bfloat16, True)]


@contextlib.contextmanager
def tiles_by_dot(dot: bool, kernels: str) -> Iterator[None]:
    """The bfloat16 tiles by vdpbf16ps (dot) or FMAs within; a build without vdpbf16ps says so
    (and runs the FMAs)."""
    has = cpu_ops.set_tile_dot(dot)
    assert has == (kernels == "native" and torch.cpu._is_avx512_bf16_supported())
    try:
        yield
    finally:
        cpu_ops.set_tile_dot(cpu_ops.tile_dot_pays())


@pytest.mark.parametrize("dtype,kv_dtype,dot", TILE_CASES)
@pytest.mark.parametrize("block_size", [16, 5])
def test_prefill_chunks_match_torch_backend(kernels: str, dtype: torch.dtype,
                                            kv_dtype: torch.dtype, dot: bool,
                                            block_size: int) -> None:
    """Prefills alone, as the kernel runs them (each new token a causal row): a whole
    300-token prompt, a 50-token chunk after 120 computed tokens, a one-token chunk; bfloat16
    tiles by FMAs and by vdpbf16ps."""
    spans = _spans([300, 170, 9], [300, 50, 1], block_size, 120)
    slots = np.zeros(351, dtype=np.int64)
    fast = CpuBackend(block_size, 2, 64, dtype, CPU, kv_dtype)
    ref = TorchBackend(block_size, 2, 64, torch.float32, CPU)
    k_cache, k_ref = _cache(fast, 120, kv_dtype)
    v_cache, v_ref = _cache(fast, 120, kv_dtype)
    q = torch.randn(351, 8, 64).to(dtype)
    with tiles_by_dot(dot, kernels):
        out = fast.attend(q, k_cache, v_cache, fast.build_metadata(slots, [], spans), 0.125)
    expected = ref.attend(q.float(), k_ref, v_ref,
                          ref.build_metadata(slots, [], spans), 0.125)
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype,kv_dtype,dot", TILE_CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEAD_SHAPES)
@pytest.mark.parametrize("block_size", [16, 5])
def test_prefill_tiles_match_torch_backend(kernels: str, dtype: torch.dtype,
                                           kv_dtype: torch.dtype, dot: bool, num_heads: int,
                                           num_kv_heads: int, head_dim: int,
                                           block_size: int) -> None:
    """Prefill runs around the tiled path's edges, with decodes between them: 15 rows (by
    rows), exactly 16 and 32 (one tile), 33 after 40 cached tokens (a tile and one row's),
    and 100 after 3 cached (tiles whose diagonal falls mid key tile, and odd key counts in a
    tile: a pair of keys half padding for vdpbf16ps's P V). Contexts past one key tile,
    block size 5 splits key tiles across blocks; bfloat16 tiles by FMAs and by vdpbf16ps."""
    q_lens = [15, 1, 16, 32, 1, 33, 100]
    contexts = [15, 57, 16, 32, 9, 73, 103]
    num_blocks = sum(-(-c // block_size) for c in contexts) + 3
    spans = _spans(contexts, q_lens, block_size, num_blocks)
    decodes = [s for s in spans if s.num_query_tokens == 1]
    prefills = [s for s in spans if s.num_query_tokens > 1]
    num_rows = sum(q_lens)
    slots = np.zeros(num_rows, dtype=np.int64)
    fast = CpuBackend(block_size, num_kv_heads, head_dim, dtype, CPU, kv_dtype)
    ref = TorchBackend(block_size, num_kv_heads, head_dim, torch.float32, CPU)
    k_cache, k_ref = _cache(fast, num_blocks, kv_dtype)
    v_cache, v_ref = _cache(fast, num_blocks, kv_dtype)
    q = torch.randn(num_rows, num_heads, head_dim).to(dtype) * 3    # peaked softmax rows
    meta = fast.build_metadata(slots, decodes, prefills)
    with tiles_by_dot(dot, kernels):
        out = fast.attend(q, k_cache, v_cache, meta, head_dim ** -0.5)
    expected = ref.attend(q.float(), k_ref, v_ref,
                          ref.build_metadata(slots, decodes, prefills), head_dim ** -0.5)
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])
    # The partition into work items: which rows went through a tile.
    items = cpu_ops.attention_work_items(meta.table_rows, meta.context_lens, meta.q_rows,
                                         head_dim)
    tiled = sorted(rows for _, rows in items if rows > 1)
    assert sum(rows for _, rows in items) == num_rows
    if head_dim % 32:                                  # 48, 16: every row alone
        assert tiled == []
    else:   # the 15-row run and the decodes alone; 16, 32, 32+1, 32+32+32+4 in tiles
        assert tiled == [4, 16, 32, 32, 32, 32, 32]
        assert len(items) == len(tiled) + 15 + 2 + 1


@pytest.mark.parametrize("flags,dtype,kv_dtype,to_sdpa", [
    ("avx512f avx512_bf16 amx_tile amx_bf16", torch.bfloat16, torch.bfloat16, True),
    ("avx512f avx512_bf16", torch.bfloat16, torch.bfloat16, False),   # no AMX: all in C
    ("avx512f avx512_bf16 amx_tile amx_bf16", torch.float32, torch.float32, False),
    ("avx512f avx512_bf16 amx_tile amx_bf16", torch.bfloat16, torch.int8, False)])
def test_long_bfloat16_prompts_go_to_sdpa_with_amx(monkeypatch: pytest.MonkeyPatch, flags: str,
                                                   dtype: torch.dtype, kv_dtype: torch.dtype,
                                                   to_sdpa: bool) -> None:
    """On a CPU with AMX, bfloat16 prompts of SDPA_MIN_ROWS tokens or more (one with a cached
    prefix among them) are attended by SDPA, the rest of the batch by the kernel, every row
    where the torch backend puts it; elsewhere, in float32, and over an int8 cache (which only
    the kernel reads), the kernel does them all."""
    from kvflow.workers.attention.cpu_backend import SDPA_MIN_ROWS
    monkeypatch.setenv("KVFLOW_CPU_FLAGS", flags)
    bs, kv_heads, heads, d = 16, 3, 9, 64
    q_lens = [1, SDPA_MIN_ROWS, 40, SDPA_MIN_ROWS + 30, 1]
    contexts = [70, SDPA_MIN_ROWS, 40, SDPA_MIN_ROWS + 100, 9]      # the 4th: 70 cached
    num_blocks = sum(-(-c // bs) for c in contexts) + 2
    spans = _spans(contexts, q_lens, bs, num_blocks)
    decodes = [s for s in spans if s.num_query_tokens == 1]
    prefills = [s for s in spans if s.num_query_tokens > 1]
    slots = np.zeros(sum(q_lens), dtype=np.int64)
    fast = CpuBackend(bs, kv_heads, d, dtype, CPU, kv_dtype)
    ref = TorchBackend(bs, kv_heads, d, torch.float32, CPU)
    k_cache, k_ref = _cache(fast, num_blocks, kv_dtype)
    v_cache, v_ref = _cache(fast, num_blocks, kv_dtype)
    q = torch.randn(sum(q_lens), heads, d).to(dtype)
    meta = fast.build_metadata(slots, decodes, prefills)
    assert len(meta.sdpa_prefills) == (2 if to_sdpa else 0)
    assert meta.q_rows.numel() == sum(q_lens) - (2 * SDPA_MIN_ROWS + 30 if to_sdpa else 0)
    out = fast.attend(q, k_cache, v_cache, meta, 0.125)
    expected = ref.attend(q.float(), k_ref, v_ref,
                          ref.build_metadata(slots, decodes, prefills), 0.125)
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])
    only = fast.build_metadata(slots[:SDPA_MIN_ROWS], [], [spans[1]._replace(first_row=0)])
    assert only.q_rows.numel() == (0 if to_sdpa else SDPA_MIN_ROWS)   # nothing for the kernel
    out = fast.attend(q[:SDPA_MIN_ROWS], k_cache, v_cache, only, 0.125)
    expected = ref.attend(q[:SDPA_MIN_ROWS].float(), k_ref, v_ref,
                          ref.build_metadata(slots[:SDPA_MIN_ROWS], [],
                                             [spans[1]._replace(first_row=0)]), 0.125)
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (300, 576), (7, 40)])
def test_rms_norm_matches_torch(kernels: str, dtype: torch.dtype, rows: int,
                                hidden: int) -> None:
    wide = torch.randn(rows, hidden + 8).to(dtype) * 3
    x = wide[:, 4:4 + hidden]                        # strided rows
    weight = (torch.rand(hidden) + 0.5).to(dtype)
    torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5),
                               **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (37, 576), (4, 40)])
def test_add_rms_norm_matches_torch(kernels: str, dtype: torch.dtype, rows: int,
                                   hidden: int) -> None:
    """The residual add fused into the norm: the sum is exactly torch's (one rounding to the
    dtype), written into the residual, and the norm of it matches rms_norm."""
    x = (torch.randn(rows, 2 * hidden) * 3).to(dtype)[:, :hidden]          # strided rows
    residual = (torch.randn(rows, hidden) * 3).to(dtype)
    weight = torch.rand(hidden).to(dtype)
    expected_norm, expected_sum = add_rms_norm(x, residual, weight, 1e-5)
    out, new_residual = cpu_ops.add_rms_norm(x, residual, weight, 1e-5)
    assert new_residual.data_ptr() == residual.data_ptr()
    assert torch.equal(new_residual, expected_sum)
    torch.testing.assert_close(out, expected_norm, **TOL[dtype])


def test_rms_norm_per_head_3d(kernels: str) -> None:
    """Qwen3's q/k norms: a [tokens, heads, head_dim] view of the fused qkv output."""
    qkv = torch.randn(5, 16 * 12).to(torch.bfloat16)
    q = qkv[:, :8 * 16].view(5, 8, 16)
    weight = torch.rand(16).to(torch.bfloat16)
    out = cpu_ops.rms_norm(q, weight, 1e-6)
    assert out.shape == (5, 8, 16)
    torch.testing.assert_close(out, rms_norm(q, weight, 1e-6), **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (64, 1536), (3, 24)])
def test_silu_and_mul_matches_torch(kernels: str, dtype: torch.dtype, rows: int,
                                    inter: int) -> None:
    x = (torch.randn(rows, 2 * inter) * 4).to(dtype)
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 32])
def test_rotary_matches_torch(kernels: str, dtype: torch.dtype, head_dim: int) -> None:
    rotary = RotaryEmbedding({"rope_theta": 10000.0}, head_dim, 512)
    heads, kv_heads, tokens = 9, 3, 11
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)           # strided views,
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 511, 7, 100, 3, 3, 250, 64, 9])    # as the model has them
    got_q, got_k = cpu_ops.apply_rotary(positions, q, k, rotary.cos, rotary.sin)
    ref_q, ref_k = apply_rotary(positions, q, k, rotary.cos, rotary.sin)
    torch.testing.assert_close(got_q, ref_q, **TOL[dtype])
    torch.testing.assert_close(got_k, ref_k, **TOL[dtype])


@pytest.mark.parametrize("dtype,kv_dtype", KV_CASES)
@pytest.mark.parametrize("num_tokens", [1, 5, 700])
def test_store_kv_matches_torch(kernels: str, dtype: torch.dtype, kv_dtype: torch.dtype,
                                num_tokens: int) -> None:
    """K and V as the model hands them over: strided views of the fused qkv output; float32
    rows into a bfloat16 cache rounded as torch rounds them; rows into an int8 cache quantized
    as quantize_kv_rows does (its values and scale bytes), each within half a step of x."""
    heads, kv_heads, d, num_slots = 9, 3, 64, 1024
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * d).to(dtype)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(num_tokens, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(num_tokens, kv_heads, d)
    slots = torch.randperm(num_slots)[:num_tokens]              # scattered, out of order
    if kv_dtype == torch.int8:
        got = [cpu_ops.quantize_kv_rows(torch.randn(kv_heads, num_slots, d)) for _ in range(2)]
        want = [c.clone() for c in got]
        for src, cache in zip((k, v), want):
            cache[:, slots] = cpu_ops.quantize_kv_rows(src.transpose(0, 1))
        cpu_ops.store_kv(k, v, got[0], got[1], slots)
        for src, g, w in zip((k, v), got, want):
            # The scales' bytes exactly; a value may sit one step off where x / scale is a
            # tie within a rounding (-ffast-math may evaluate x * (1 / scale) as x / scale).
            assert torch.equal(g[..., -4:], w[..., -4:])
            assert (g[:, :, :-4].int() - w[:, :, :-4].int()).abs().max() <= 1
            rows = g[:, slots]
            error = cpu_ops.dequantize_kv_rows(rows) - src.transpose(0, 1).float()
            step = rows[..., -4:].contiguous().view(torch.float32)
            assert (error.abs() <= step * (0.5 + 1e-5)).all()
        return
    got = [torch.randn(kv_heads, num_slots, d).to(kv_dtype) for _ in range(2)]
    want = [c.clone() for c in got]
    torch_store_kv(k.to(kv_dtype), v.to(kv_dtype), want[0], want[1], slots)
    cpu_ops.store_kv(k, v, got[0], got[1], slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_kernels_refuse_indices_outside_their_tensors() -> None:
    """A bad slot or table entry raises instead of writing or reading out of bounds (float32
    rows into a float32 cache, into a bfloat16 one and into an int8 one)."""
    cache = torch.zeros(2, 64, 16)                   # 4 blocks of 16 slots
    rows = torch.randn(3, 2, 16)
    int8 = torch.zeros(2, 64, 16 + cpu_ops.KV_I8_EXTRA, dtype=torch.int8)
    for bad in (64, -1):
        for target in (cache, cache.bfloat16(), int8):
            with pytest.raises(IndexError, match="slot"):
                cpu_ops.store_kv(rows, rows, target, target.clone(), torch.tensor([0, bad, 5]))
            assert target.abs().sum() == 0           # nothing written on refusal
    q, out = torch.randn(2, 4, 16), torch.empty(2, 4, 16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    good = dict(table_rows=torch.tensor([0, 1], dtype=torch.int32),
                context_lens=torch.tensor([5, 32], dtype=torch.int32),
                q_rows=torch.tensor([1, 0]))
    cpu_ops.paged_attention(q, cache, cache, table, block_size=16, scale=1.0, out=out, **good)
    for field, value in (("table_rows", [0, 2]), ("context_lens", [0, 5]),
                         ("context_lens", [5, 33]), ("q_rows", [2, 0])):
        bad = dict(good, **{field: torch.tensor(value, dtype=good[field].dtype)})
        for k_cache in (cache, int8):
            with pytest.raises(IndexError, match="outside"):
                cpu_ops.paged_attention(q, k_cache, k_cache, table, block_size=16, scale=1.0,
                                        out=out, **bad)
    with pytest.raises(IndexError, match="outside"):
        cpu_ops.paged_attention(q, cache, cache, torch.tensor([[0, 1], [2, 4]],
                                                               dtype=torch.int32),
                                block_size=16, scale=1.0, out=out, **good)


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_matches_torch(kernels: str, dtype: torch.dtype) -> None:
    """Greedy sampling's argmax: first index of the max, ties across and inside the 256-wide
    chunks the kernel reduces, a max in a short last chunk, strided rows, one-element rows."""
    x = torch.randn(6, 49152 + 3).to(dtype)
    top = x.max() + 1
    x[0, -1] = top                                   # in the short last chunk
    x[1, 300] = x[1, 5000] = top                     # tie across chunks: the first wins
    x[2, 257] = x[2, 260] = top                      # tie inside a chunk
    x[3, 0] = top
    x[4] = 0.0                                       # all equal: index 0
    x[5, 10], x[5, 20] = -0.0, 0.0                   # -0 == +0: the first wins
    x[5, :10], x[5, 11:20], x[5, 21:] = -1.0, -2.0, float("-inf")
    masked = torch.full((2, 700), float("-inf")).to(dtype)
    masked[1, 600:] = float("inf")                   # infinities compare exactly
    for logits in (x, x[:, 1:-1], x[:, :1], x[:0], masked):
        torch.testing.assert_close(cpu_ops.argmax(logits), logits.argmax(dim=-1),
                                   rtol=0, atol=0)


def test_without_a_compiler_everything_stays_on_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_ops, "_state", {})
    monkeypatch.setenv("CC", "kvflow-no-such-compiler")
    assert cpu_ops.library() is None
    assert "kvflow-no-such-compiler" in (cpu_ops.build_error() or "")
    assert resolve_backend("auto", CPU, 16, torch.bfloat16) == "torch"
    with pytest.raises(ValueError, match="attention_backend='cpu' cannot run: the kernels did "
                                         "not build"):
        resolve_backend("cpu", CPU, 16, torch.bfloat16)


def test_backend_choice_on_cpu() -> None:
    assert resolve_backend("auto", CPU, 16, torch.bfloat16) == "cpu"
    assert resolve_backend("auto", CPU, 16, torch.float32) == "cpu"
    assert resolve_backend("auto", CPU, 16, torch.float16) == "torch"   # no float16 kernels
    assert resolve_backend("torch", CPU, 16, torch.bfloat16) == "torch"
    with pytest.raises(ValueError, match="attention_backend='cpu' cannot run: dtype"):
        resolve_backend("cpu", CPU, 16, torch.float16)


# --- decode-shaped linears (cpu_gemv.c) -----------------------------------------------------

GEMV_SHAPES = [(1, 576, 576), (7, 13, 33), (4, 960, 576), (16, 577, 1536), (3, 5, 3)]


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("w_dtype", ["same", torch.bfloat16, torch.int8])
@pytest.mark.parametrize("m,n,k", GEMV_SHAPES)
def test_gemv_matches_torch(kernels: str, x_dtype: torch.dtype, w_dtype: object, m: int,
                            n: int, k: int) -> None:
    """x W^T + bias against float64 torch on the same operands: one row and seven, rows of
    W not a multiple of the tile, K not a multiple of the vector width, a strided x (rows
    apart or contiguous: the same bits); bfloat16 weights under float32 x (dtype="auto"
    without bfloat16 arithmetic); int8 weights with their row scales and SmoothQuant's input
    scale."""
    x = torch.randn(m, 2 * k)[:, ::2].to(x_dtype)             # strided rows of x
    bias = torch.randn(n)
    if w_dtype == torch.int8:
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scales, in_scale = torch.rand(n) / 50 + 1e-3, torch.rand(k) + 0.5
        weight = w.double() * scales.double()[:, None]
        xd = x.double() * in_scale.double()
    else:
        w_type = x_dtype if w_dtype == "same" else w_dtype
        w, scales, in_scale = torch.randn(n, k).to(w_type), None, None   # type: ignore[arg-type]
        weight, xd = w.double(), x.double()
    got = cpu_ops.gemv(x, w, scales, bias, in_scale=in_scale)
    ref = xd @ weight.T + bias.double()
    assert got.dtype == x_dtype and got.shape == (m, n)
    scale = float(ref.abs().max())
    if w_dtype == torch.int8 and x_dtype == torch.float32:
        # int8 sums in integers over x rounded per row to +-xq_max(K): each x' = x in_scale
        # may move by half a step, peak / (2 xq_max), so an output by that times sum |W|.
        step = xd.abs().amax(dim=1, keepdim=True) / int8_x_levels(k)
        bound = step / 2 * weight.abs().sum(dim=1)[None, :] + 1e-5 * scale
        assert bool(((got.double() - ref).abs() <= bound).all())
        assert float((got.double() - ref).abs().max()) > 0     # x was rounded, not exact
    elif x_dtype == torch.float32:
        torch.testing.assert_close(got.double(), ref, atol=1e-5 * scale, rtol=1e-5)
    else:                     # the sums in float32, one bf16 rounding of the output
        torch.testing.assert_close(got.double(), ref, atol=4e-3 * scale, rtol=8e-3)
    one = cpu_ops.gemv(x[:1], w, scales, bias, in_scale=in_scale)
    assert torch.equal(one, got[:1])          # a row's result does not depend on the batch
    assert torch.equal(cpu_ops.gemv(_apart(x), w, scales, bias, in_scale=in_scale), got)
    assert cpu_ops.gemv(x[:0], w, scales, bias, in_scale=in_scale).shape == (0, n)  # no rows


def _apart(x: torch.Tensor) -> torch.Tensor:
    """x's values [m, k] in rows k + 6 elements apart: gemv copies such rows, where it reads
    contiguous ones in place."""
    wide = torch.zeros(x.shape[0], x.shape[1] + 6, dtype=x.dtype)
    wide[:, : x.shape[1]] = x
    return wide[:, : x.shape[1]]


def int8_x_levels(k: int) -> int:
    """cpu_gemv.c's xq_max: the integers x is rounded to for int8 weights, +-this, fewer for
    long rows so that no 32-bit lane can overflow."""
    return min(16383, (2**31 - 1) // (127 * (k // 8 + 2)))


@pytest.mark.parametrize("k", [31, 4100, 20000, 70001])
def test_gemv_int8_sums_cannot_overflow(kernels: str, k: int) -> None:
    """The worst case for the integer sums: every weight +-127 and every x at the row's peak
    with the same sign, over rows long enough that x gets fewer levels (20000, 70001). The
    result is then exact: x rounds to +-xq_max without error."""
    w = torch.full((5, k), 127, dtype=torch.int8)
    w[1] = -127
    x = torch.full((3, k), 2.5)
    x[1] = -0.75
    scales = torch.full((5,), 0.01)
    got = cpu_ops.gemv(x, w, scales)
    ref = x.double() @ (w.double() * 0.01).T
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=0)
    assert int8_x_levels(k) < 16383 or k < 8000


def test_gemv_int8_rows_with_inf_or_nan(kernels: str) -> None:
    """A row of x holding an inf or NaN gives NaN outputs, as the float product would; the
    other rows are untouched."""
    w, scales = torch.randint(-127, 128, (9, 64), dtype=torch.int8), torch.rand(9) + 0.1
    x = torch.randn(3, 64)
    clean = cpu_ops.gemv(x, w, scales)
    x[1, 5], x[2, 0] = float("inf"), float("nan")
    got = cpu_ops.gemv(x, w, scales)
    assert torch.equal(got[0], clean[0])
    assert bool(got[1:].isnan().all())


@pytest.mark.parametrize("m", [1, 7, 16, 17, 32, 33, 70])
@pytest.mark.parametrize("n,k", [(960, 576), (48, 64), (16, 1536)])
def test_gemv_amx_layout_matches_torch(kernels: str, m: int, n: int, k: int) -> None:
    """bfloat16 weights in the AMX tile layout (pack_amx), where the library has AMX and Linux
    grants it: any row count (32 at a time), the bias, bfloat16 and float32 outputs, against
    float64 torch; a row's result does not depend on the batch. Builds without AMX (and CPUs
    without it) must refuse to pack, so that the weight stays row-major."""
    x = torch.randn(m, 2 * k)[:, ::2].bfloat16()
    w, bias = torch.randn(n, k).bfloat16(), torch.randn(n)
    packed = cpu_ops.pack_amx(w)
    if cpu_ops.gemv_amx_rows() == 0:
        assert kernels != "native" or "amx_bf16" not in cpu_flags()
        assert packed is None
        return
    assert packed is not None and packed.shape == w.shape and not torch.equal(packed, w)
    ref = x.double() @ w.double().T + bias.double()
    scale = float(ref.abs().max())
    got = cpu_ops.gemv(x, packed, None, bias, layout="amx")
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), ref, atol=4e-3 * scale, rtol=8e-3)
    wide = cpu_ops.gemv(x, packed, None, bias, out_dtype=torch.float32, layout="amx")
    torch.testing.assert_close(wide.double(), ref, atol=1e-5 * scale, rtol=1e-5)
    assert torch.equal(cpu_ops.gemv(x[:1], packed, None, bias, layout="amx"), got[:1])
    with pytest.raises(RuntimeError, match="amx layout.s path cannot run"):
        cpu_ops.gemv(x.float(), packed, layout="amx")        # the tile path takes bf16 x only


def test_gemv_linear_holds_amx_tiles_where_it_can() -> None:
    """GemvLinear with pack_amx: a bfloat16 weight it can tile is held tiled beside oneDNN's
    copy, and every row count (the AMX path up to amx_rows, oneDNN above) gives F.linear's
    result; shapes the tile path cannot take stay row-major on the gemv kernel."""
    from kvflow.workers.layers.linear import (GemvLinear, LinearMethod, OneDnnLinear,
                                              gemv_operands)
    rows = cpu_ops.gemv_amx_rows()
    # As the engine chooses (layers/ops.py): oneDNN where its bfloat16 path runs on this CPU
    # (AVX2 alone has none), else torch's plain linear beside the kernel.
    onednn = OneDnnLinear.works(torch.bfloat16)
    method = GemvLinear(cpu_ops.gemv, OneDnnLinear() if onednn else LinearMethod(), 4,
                        cpu_ops.pack_amx, rows)
    for n, k in [(96, 64), (40, 64)]:                  # 40 outputs: not a multiple of 16
        w = torch.randn(n, k).bfloat16()
        prepared = method.prepare(w)
        tiled = rows > 0 and n % 16 == 0 and onednn
        assert (prepared.layout == "amx") == tiled
        assert (gemv_operands(prepared).layout == "amx") == tiled
        for m in (1, 5, 32, 40):
            x = torch.randn(m, k).bfloat16()
            ref = x.double() @ w.double().T
            torch.testing.assert_close(method.apply(x, w, prepared).double(), ref,
                                       atol=4e-3 * float(ref.abs().max()), rtol=8e-3)


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 32, 33, 70])
@pytest.mark.parametrize("n,k", [(960, 576), (64, 31), (32, 1)])
def test_gemv_panel_layout_matches_torch(kernels: str, m: int, n: int, k: int) -> None:
    """bfloat16 weights in panels (pack_panels) under float32 x, on every build: row counts
    that split into uneven blocks (7, 13, 33, 70), K not a multiple of anything, the bias, an
    input scale, bfloat16 x and output, against float64 torch; a row's result does not depend
    on the batch. Output counts that are not a multiple of the panel stay unpacked."""
    x = torch.randn(m, 2 * k)[:, ::2]
    w, bias, in_scale = torch.randn(n, k).bfloat16(), torch.randn(n), torch.rand(k) + 0.5
    packed = cpu_ops.pack_panels(w)
    assert packed is not None and packed.shape == w.shape
    assert cpu_ops.pack_panels(w[: n - 8]) is None and cpu_ops.pack_panels(w.float()) is None
    ref = (x.double() * in_scale.double()) @ w.double().T + bias.double()
    scale = float(ref.abs().max())
    got = cpu_ops.gemv(x, packed, None, bias, in_scale=in_scale, layout="panels")
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), ref, atol=1e-5 * scale, rtol=1e-5)
    assert torch.equal(cpu_ops.gemv(x[:1], packed, None, bias, in_scale=in_scale,
                                    layout="panels"), got[:1])
    xb = x.bfloat16()
    half = cpu_ops.gemv(xb, packed, None, bias, layout="panels")
    ref = xb.double() @ w.double().T + bias.double()
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.double(), ref, atol=4e-3 * scale, rtol=8e-3)


def _pairs_here(kernels: str) -> bool:
    """Whether this build multiplies bfloat16 pair panels: built with AVX512-BF16, which the
    native build is where the CPU has it (the other builds leave it out). The CPU's own
    flags, not KVFLOW_CPU_FLAGS: the native build follows the CPU."""
    return kernels == "native" and torch.cpu._is_avx512_bf16_supported()


@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 13, 32, 33, 70])
@pytest.mark.parametrize("n,k", [(960, 576), (64, 30), (32, 2)])
def test_gemv_pair_layout_matches_torch(kernels: str, m: int, n: int, k: int) -> None:
    """bfloat16 weights in pair panels (pack_pairs) under bfloat16 x: where the build has
    AVX512-BF16, row counts that split into uneven blocks (7, 13, 33, 70), strided x (rows
    apart are copied, contiguous ones read in place: the same bits), the bias,
    bfloat16 and float32 output, against float64 torch; a row's result does not depend on
    the batch. Elsewhere, and for shapes or operands it cannot take, nothing is packed and
    the layout is refused."""
    x = torch.randn(m, 2 * k).bfloat16()[:, ::2]
    w, bias = torch.randn(n, k).bfloat16(), torch.randn(n)
    packed = cpu_ops.pack_pairs(w)
    if not _pairs_here(kernels):
        assert packed is None
        with pytest.raises(RuntimeError, match="pairs"):
            cpu_ops.gemv(x, w, None, bias, layout="pairs")
        return
    assert packed is not None and packed.shape == w.shape
    assert cpu_ops.pack_pairs(w[: n - 8]) is None and cpu_ops.pack_pairs(w.float()) is None
    assert cpu_ops.pack_pairs(w[:, : k - 1]) is None                       # K odd
    ref = x.double() @ w.double().T + bias.double()
    scale = float(ref.abs().max())
    got = cpu_ops.gemv(x, packed, None, bias, out_dtype=torch.float32, layout="pairs")
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), ref, atol=1e-5 * scale, rtol=1e-5)
    assert torch.equal(cpu_ops.gemv(x[-1:], packed, None, bias, out_dtype=torch.float32,
                                    layout="pairs"), got[-1:])
    assert torch.equal(cpu_ops.gemv(_apart(x), packed, None, bias, out_dtype=torch.float32,
                                    layout="pairs"), got)
    assert cpu_ops.gemv(x[:0], packed, None, bias, layout="pairs").shape == (0, n)
    half = cpu_ops.gemv(x, packed, None, bias, layout="pairs")
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.double(), ref, atol=4e-3 * scale, rtol=8e-3)
    with pytest.raises(RuntimeError, match="pairs"):                      # x must be bf16
        cpu_ops.gemv(x.float(), packed, None, bias, layout="pairs")


def test_gemv_linear_holds_bfloat16_pair_panels(kernels: str) -> None:
    """GemvLinear with pack_pairs (bfloat16 arithmetic without AMX): where the build has
    AVX512-BF16, a weight whose outputs fill whole panels is held in pair panels alone (no
    copy for oneDNN: the panels take every row count, prefill-sized too); others are
    row-major beside oneDNN's copy. Every row count gives the product, and a row's result
    does not depend on the batch it is in on the panels."""
    from kvflow.workers.layers.linear import (EVERY_ROW, GemvLinear, LinearMethod,
                                              OneDnnLinear, gemv_operands)
    inner = OneDnnLinear() if OneDnnLinear.works(torch.bfloat16) else LinearMethod()
    method = GemvLinear(cpu_ops.gemv, inner, 4, pack_pairs=cpu_ops.pack_pairs)
    for n, k in [(96, 64), (40, 64)]:                   # 40 outputs: not a whole panel
        w = torch.randn(n, k).bfloat16()
        prepared = method.prepare(w)
        paired = _pairs_here(kernels) and n % 32 == 0
        assert (prepared.layout == "pairs") == paired
        if paired:                                      # the fused path reads the same copy
            assert gemv_operands(prepared).weight is prepared.plain
            assert not torch.equal(prepared.plain, w)   # packed, not row-major
            assert prepared.packed is None
        else:
            assert (prepared.packed is not None) == isinstance(inner, OneDnnLinear)
        assert method.gemv_rows(prepared) == (EVERY_ROW if paired else 4)
        for m in (1, 7, 33, 64, 65, 300):
            x = torch.randn(m, k).bfloat16()
            ref = x.double() @ w.double().T
            got = method.apply(x, w, prepared)
            torch.testing.assert_close(got.double(), ref,
                                       atol=4e-3 * float(ref.abs().max()), rtol=8e-3)
            if paired:
                assert torch.equal(got[-1:], method.apply(x[-1:], w, prepared))


def _whole_groups(packed: torch.Tensor) -> int:
    """The count of groups pack_panels12 kept whole (the packed bytes' first int64)."""
    return int(packed.view(-1)[:8].view(torch.int64)[0])


@pytest.mark.parametrize("n,k", [(960, 576), (64, 1536), (32, 2), (96, 602), (64, 70)])
def test_gemv_panels12_give_the_bfloat16_panels_bits(kernels: str, n: int, k: int) -> None:
    """bfloat16 panels in 12 bits a weight (pack_panels12), on every build: the same bits as
    the bfloat16 panels (which test_gemv_panel_layout_matches_torch checks against float64
    torch) for one row (decoded in registers, P12_NP panels at once and the range's last
    ones alone; a group whole in some of them and not in others), two to panels12_rows()
    (3 on AVX2, 4 on AVX-512: decoded in registers once for all the rows, a panel at a
    time) and more (decoded into a panel, then blocks of rows), with the bias, an input
    scale, bfloat16 x and output; K not a multiple of a group (602, 70, 2). Gaussian weights
    take under 80% of the bfloat16 bytes; weights spread over many exponents and both signs
    keep whole groups (raw bfloat16) and still give the same bits. Odd K and output counts
    that are not a multiple of the panel are refused."""
    w = torch.randn(n, k).bfloat16()
    spread = (torch.randn(n, k) * 2.0 ** torch.randint(-60, 60, (n, k)).float()).bfloat16()
    spread[:, : k // 2] = w[:, : k // 2]               # some groups plain, some whole
    mixed = w.clone()                  # the same group plain in some panels, whole in others
    mixed[16:32] = spread[16:32]       # (the second of a call's panels on AVX2, the first's
    mixed[32:48] = spread[32:48]       # half on AVX-512; then the first of the next pair)
    bias, in_scale = torch.randn(n), torch.rand(k) + 0.5
    assert cpu_ops.panels12_rows() == (4 if cpu_ops.library().gemv_panel_width() == 32 else 3)
    assert cpu_ops.pack_panels12(w[: n - 8]) is None and cpu_ops.pack_panels12(w.float()) is None
    assert cpu_ops.pack_panels12(w[:, : k - 1].contiguous()) is None
    for weight, whole in ((w, False), (spread, True), (mixed, n > 32 and k > 2)):
        panels, packed = cpu_ops.pack_panels(weight), cpu_ops.pack_panels12(weight)
        assert panels is not None and packed is not None and packed.dtype == torch.uint8
        assert packed.shape[0] == n
        if whole:
            assert _whole_groups(packed) > 0
        elif k > 2:                  # the odd group of a gaussian's tails may be kept whole
            assert packed.numel() < 0.8 * 2 * n * k
        for m in (1, 2, 3, 4, 5, 7, 13, 33):
            x = torch.randn(m, 2 * k)[:, ::2]
            for b, s in ((bias, in_scale), (None, None)):
                want = cpu_ops.gemv(x, panels, None, b, in_scale=s, layout="panels")
                got = cpu_ops.gemv(x, packed, None, b, in_scale=s, layout="panels12")
                assert torch.equal(got, want), (m, b is None)
            xb = x.bfloat16()
            assert torch.equal(cpu_ops.gemv(xb, packed, None, bias, layout="panels12"),
                               cpu_ops.gemv(xb, panels, None, bias, layout="panels"))


@pytest.mark.parametrize("n,k", [(960, 576), (64, 1536), (32, 2), (96, 602), (64, 70),
                                 (160, 64)])
def test_gemv_pairs12_give_the_pair_panels_bits(kernels: str, n: int, k: int) -> None:
    """Pair panels in 12 bits a weight (pack_pairs12), where the build has AVX512-BF16: one
    row of bfloat16 x gives the pair panels' bits (which test_gemv_pair_layout_matches_torch
    checks against float64 torch): four panels a call and a range's last ones alone (160
    outputs: 5 panels), a group whole in some panels and not in others, with the bias,
    float32 and bfloat16 output, K not a multiple of a group; so do 2 to pairs12_rows() rows.
    Gaussian weights take under 80% of the bfloat16 bytes. More rows, float32 x, odd K,
    outputs that are not a multiple of the panel and float32 weights are refused; a build
    without AVX512-BF16 packs nothing."""
    w = torch.randn(n, k).bfloat16()
    if not _pairs_here(kernels):
        assert cpu_ops.pack_pairs12(w) is None
        return
    spread = (torch.randn(n, k) * 2.0 ** torch.randint(-60, 60, (n, k)).float()).bfloat16()
    spread[:, : k // 2] = w[:, : k // 2]               # some groups plain, some whole
    mixed = w.clone()                                  # one group plain in some panels,
    mixed[16:32] = spread[16:32]                       # whole in others (the first panel's
    mixed[32:48] = spread[32:48]                       # second vector, the second's first)
    bias = torch.randn(n)
    assert cpu_ops.pack_pairs12(w[: n - 8]) is None and cpu_ops.pack_pairs12(w.float()) is None
    assert cpu_ops.pack_pairs12(w[:, : k - 1].contiguous()) is None
    for weight, whole in ((w, False), (spread, True), (mixed, n > 32 and k > 2)):
        pairs, packed = cpu_ops.pack_pairs(weight), cpu_ops.pack_pairs12(weight)
        assert pairs is not None and packed is not None and packed.dtype == torch.uint8
        assert packed.shape[0] == n
        if whole:
            assert _whole_groups(packed) > 0
        elif k > 2:
            assert packed.numel() < 0.8 * 2 * n * k
        x = torch.randn(1, k).bfloat16()
        for b, out in ((bias, torch.float32), (None, torch.bfloat16)):
            want = cpu_ops.gemv(x, pairs, None, b, out_dtype=out, layout="pairs")
            got = cpu_ops.gemv(x, packed, None, b, out_dtype=out, layout="pairs12")
            assert torch.equal(got, want), (b is None, out)
        assert torch.equal(cpu_ops.gemv(_apart(x), packed, None, bias,
                                        out_dtype=torch.float32, layout="pairs12"),
                           cpu_ops.gemv(x, pairs, None, bias, out_dtype=torch.float32,
                                        layout="pairs"))
        rows = cpu_ops.pairs12_rows()
        for m in range(2, rows + 1):           # two panels a call
            xm = torch.randn(m, k).bfloat16()
            assert torch.equal(cpu_ops.gemv(xm, packed, None, bias, layout="pairs12"),
                               cpu_ops.gemv(xm, pairs, None, bias, layout="pairs")), m
        assert cpu_ops.gemv(x[:0], packed, None, bias, layout="pairs12").shape == (0, n)
        with pytest.raises(RuntimeError, match="pairs12"):                   # a few rows
            cpu_ops.gemv(torch.randn(rows + 1, k).bfloat16(), packed, layout="pairs12")
        with pytest.raises(RuntimeError, match="pairs12"):                   # x must be bf16
            cpu_ops.gemv(x.float(), packed, layout="pairs12")


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 13, 32, 33, 70])
@pytest.mark.parametrize("n,k", [(960, 576), (64, 1536), (32, 2), (96, 602)])
def test_gemv_int8_panel_layout_gives_the_row_major_bits(kernels: str, m: int, n: int,
                                                         k: int) -> None:
    """int8 weights in panels (pack_i8_panels) on every build: the same exact integer sums,
    scaled the same way, as the row-major int8 kernel, so the very same bits for every row
    count (one row: four panels at once; two to four: two; more: blocks, uneven at 7, 13, 33,
    70), K over the 256 inputs after which the sums move to 64 bits (1536, 602), with the bias
    and SmoothQuant's input scale, float32 and bfloat16 x; and the row-major kernel is itself
    checked against float64 torch (test_gemv_matches_torch). Odd K and output counts that
    are not a multiple of the panel stay row-major."""
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scales, in_scale = torch.rand(n) / 50 + 1e-3, torch.rand(k) + 0.5
    bias = torch.randn(n)
    packed = cpu_ops.pack_i8_panels(w)
    assert packed is not None and packed.shape == w.shape
    assert k == 2 or not torch.equal(packed, w)          # at K = 2 the layouts coincide
    assert cpu_ops.pack_i8_panels(w[: n - 8]) is None
    assert cpu_ops.pack_i8_panels(w[:, : k - 1].contiguous()) is None
    for x in (torch.randn(m, 2 * k)[:, ::2], torch.randn(m, k).bfloat16()):
        for b, s in ((bias, in_scale), (None, None)):
            rows = cpu_ops.gemv(x, w, scales, b, in_scale=s)
            panels = cpu_ops.gemv(x, packed, scales, b, in_scale=s, layout="panels")
            assert torch.equal(panels, rows)
    ref = x.double() @ (w.double() * scales.double()[:, None]).T
    torch.testing.assert_close(panels.double(), ref, atol=8e-3 * float(ref.abs().max()),
                               rtol=1.6e-2)


def test_gemv_int8_panels_worst_case_sums(kernels: str) -> None:
    """The integer sums' worst case in panels too (every weight +-127, every x at the row's
    peak, 4100 inputs: sixteen 256-input blocks moved into 64 bits); and a row of x with an
    inf or NaN gives NaNs there only."""
    k = 4100
    w = torch.full((32, k), 127, dtype=torch.int8)
    w[1::2] = -127
    x = torch.full((3, k), 2.5)
    x[1] = -0.75
    scales = torch.full((32,), 0.01)
    packed = cpu_ops.pack_i8_panels(w)
    assert packed is not None
    got = cpu_ops.gemv(x, packed, scales, layout="panels")
    torch.testing.assert_close(got.double(), x.double() @ (w.double() * 0.01).T, rtol=1e-6,
                               atol=0)
    x[1, 7] = float("nan")
    got = cpu_ops.gemv(x, packed, scales, layout="panels")
    assert bool(got[1].isnan().all()) and not bool(got[[0, 2]].isnan().any())


def test_gemv_linear_streams_bfloat16_panels_under_float32(kernels: str) -> None:
    """GemvLinear under float32 weights with a bfloat16 stream and pack_panels (dtype="auto"
    without bfloat16 arithmetic): a weight whose outputs fill whole panels is held in panels
    alone (no float32 copy for oneDNN: the panels take every row count, prefill-sized too);
    others row-major beside oneDNN's float32 copy. Every row count (the row-major kernel up
    to max_rows, oneDNN above) gives the product of the bfloat16-valued weight, and a row's
    result on the panels does not depend on its batch."""
    from kvflow.workers.layers.linear import (EVERY_ROW, GemvLinear, LinearMethod,
                                              OneDnnLinear, gemv_operands)
    inner = OneDnnLinear() if OneDnnLinear.works(torch.float32) else LinearMethod()
    method = GemvLinear(cpu_ops.gemv, inner, 32, None, 0, torch.bfloat16, cpu_ops.pack_panels)
    for n, k in [(96, 64), (40, 64)]:                   # 40 outputs: not a whole panel
        w = torch.randn(n, k).bfloat16().float()        # bfloat16 values, as loaded
        prepared = method.prepare(w)
        paneled = n % 32 == 0
        assert (prepared.layout == "panels") == paneled
        assert gemv_operands(prepared).layout == prepared.layout
        assert (prepared.packed is None) == (paneled or not isinstance(inner, OneDnnLinear))
        assert method.gemv_rows(prepared) == (EVERY_ROW if paneled else 32)
        for m in (1, 7, 33, 64, 65, 300):
            x = torch.randn(m, k)
            ref = x.double() @ w.double().T
            got = method.apply(x, w, prepared)
            torch.testing.assert_close(got.double(), ref,
                                       atol=1e-5 * float(ref.abs().max()), rtol=1e-5)
            if paneled:
                assert torch.equal(got[-1:], method.apply(x[-1:], w, prepared))


@pytest.mark.parametrize("layout", ["panels", "pairs"])
def test_gemv_many_rows_in_blocks(kernels: str, layout: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu_ops.gemv multiplies a prefill's rows in blocks of GEMV_BLOCK_BYTES of x (so x
    stays in the caches): the same bits as one call, blocks of every size and a last short
    one, x's rows further apart than K, the bias, an output dtype other than x's; no rows."""
    w = torch.randn(64, 48).bfloat16()
    packed = cpu_ops.pack_panels(w) if layout == "panels" else cpu_ops.pack_pairs(w)
    if packed is None:                     # a build without AVX512-BF16 holds no pair panels
        assert layout == "pairs" and not _pairs_here(kernels)
        return
    x = torch.randn(150, 80)
    x = (x if layout == "panels" else x.bfloat16())[:, :48]       # rows 80 apart
    bias = torch.randn(64)
    out_dtypes = [x.dtype] + ([torch.float32] if layout == "pairs" else [torch.bfloat16])
    whole = {d: cpu_ops.gemv(x, packed, None, bias, out_dtype=d, layout=layout)
             for d in out_dtypes}
    for rows in (1, 7, 64):
        monkeypatch.setattr(cpu_ops, "GEMV_BLOCK_MIN_ROWS", rows)
        monkeypatch.setattr(cpu_ops, "GEMV_BLOCK_BYTES", 1)
        for dtype in out_dtypes:
            got = cpu_ops.gemv(x, packed, None, bias, out_dtype=dtype, layout=layout)
            assert got.dtype == dtype and torch.equal(got, whole[dtype])
        assert cpu_ops.gemv(x[:0], packed, None, bias, layout=layout).shape == (0, 64)
    ref = x.double() @ w.double().T + bias.double()
    torch.testing.assert_close(whole[x.dtype].double(), ref,
                               atol=1e-2 * float(ref.abs().max()), rtol=1e-2)


def test_gemv_linear_reads_12_bit_panels_for_a_few_rows(kernels: str) -> None:
    """With pack_panels12, GemvLinear keeps a second copy of each paneled weight in 12-bit
    panels and reads it for up to panels12_rows rows (one by default; the engine passes
    cpu_ops.panels12_rows()): the same bits as the bfloat16 panels, which more rows keep
    reading; the fused decode path gets the copy and its row limit (gemv_operands)."""
    from kvflow.workers.layers.linear import (GemvLinear, LinearMethod, OneDnnLinear,
                                              gemv_operands)
    inner = OneDnnLinear() if OneDnnLinear.works(torch.float32) else LinearMethod()
    plain = GemvLinear(cpu_ops.gemv, inner, 32, None, 0, torch.bfloat16, cpu_ops.pack_panels)
    method = GemvLinear(cpu_ops.gemv, inner, 32, None, 0, torch.bfloat16, cpu_ops.pack_panels,
                        cpu_ops.pack_panels12)
    rows = cpu_ops.panels12_rows()
    few = GemvLinear(cpu_ops.gemv, inner, 32, None, 0, torch.bfloat16, cpu_ops.pack_panels,
                     cpu_ops.pack_panels12, panels12_rows=rows)
    assert "one row: 12-bit" in method.name and "12-bit" not in plain.name
    w = torch.randn(96, 64).bfloat16().float()
    prepared, reference, wide = method.prepare(w), plain.prepare(w), few.prepare(w)
    if prepared.layout != "panels":                     # a build without vectors
        assert prepared.one_row is None and wide.one_row is None
        return
    assert f"<= {rows} rows: 12-bit" in few.name
    assert prepared.one_row is not None and reference.one_row is None
    assert (prepared.one_row_rows, wide.one_row_rows) == (1, rows) and rows > 1
    assert gemv_operands(wide).one_row is wide.one_row
    assert gemv_operands(wide).one_row_rows == rows
    bias = torch.randn(96)
    for m in (1, 2, rows, rows + 1, 7):
        x = torch.randn(m, 64)
        want = plain.apply(x, w, reference, bias)
        assert torch.equal(method.apply(x, w, prepared, bias), want)
        assert torch.equal(few.apply(x, w, wide, bias), want)
    calls: list[str] = []
    for linear in (method, few):
        linear.gemv = (lambda *a, layout="rows": calls.append(layout)  # type: ignore[method-assign]
                       or cpu_ops.gemv(*a, layout=layout))
    method.apply(torch.randn(1, 64), w, prepared)
    method.apply(torch.randn(2, 64), w, prepared)
    few.apply(torch.randn(rows, 64), w, wide)
    few.apply(torch.randn(rows + 1, 64), w, wide)
    assert calls == ["panels12", "panels", "panels12", "panels"]


def test_gemv_linear_reads_12_bit_pair_panels_for_one_row(kernels: str) -> None:
    """With pack_pairs12 (bfloat16 arithmetic, AVX512-BF16), GemvLinear keeps a second copy
    of each pair-paneled weight in 12 bits and reads it for one row only: the same bits as
    the pair panels, which more rows keep reading; the fused decode path gets the copy."""
    from kvflow.workers.layers.linear import (GemvLinear, LinearMethod, OneDnnLinear,
                                              gemv_operands)
    inner = OneDnnLinear() if OneDnnLinear.works(torch.bfloat16) else LinearMethod()
    plain = GemvLinear(cpu_ops.gemv, inner, 4, pack_pairs=cpu_ops.pack_pairs)
    method = GemvLinear(cpu_ops.gemv, inner, 4, pack_pairs=cpu_ops.pack_pairs,
                        pack_pairs12=cpu_ops.pack_pairs12)
    assert "12-bit" in method.name and "12-bit" not in plain.name
    w = torch.randn(96, 64).bfloat16()
    prepared, reference = method.prepare(w), plain.prepare(w)
    if prepared.layout != "pairs":                 # no AVX512-BF16 in this build
        assert prepared.one_row is None
        assert not _pairs_here(kernels)
        return
    assert prepared.one_row is not None and reference.one_row is None
    assert gemv_operands(prepared).one_row is prepared.one_row
    bias = torch.randn(96)
    for m in (1, 2, 7):
        x = torch.randn(m, 64).bfloat16()
        assert torch.equal(method.apply(x, w, prepared, bias), plain.apply(x, w, reference, bias))
    calls: list[str] = []
    method.gemv = lambda *a, layout="rows": calls.append(layout) or cpu_ops.gemv(*a, layout=layout)
    method.apply(torch.randn(1, 64).bfloat16(), w, prepared)
    method.apply(torch.randn(2, 64).bfloat16(), w, prepared)
    assert calls == ["pairs12", "pairs"]
    # As the engine builds it: up to pairs12_rows() rows read the copy, the same bits.
    rows = cpu_ops.pairs12_rows()
    few = GemvLinear(cpu_ops.gemv, inner, 4, pack_pairs=cpu_ops.pack_pairs,
                     pack_pairs12=cpu_ops.pack_pairs12, pairs12_rows=rows)
    wide = few.prepare(w)
    assert wide.one_row_layout == "pairs12" and wide.one_row_rows == rows > 1
    calls.clear()
    few.gemv = lambda *a, layout="rows": calls.append(layout) or cpu_ops.gemv(*a, layout=layout)
    for m in range(1, rows + 2):
        x = torch.randn(m, 64).bfloat16()
        assert torch.equal(few.apply(x, w, wide, bias), plain.apply(x, w, reference, bias))
    assert calls == ["pairs12"] * rows + ["pairs"]


def test_gemv_linear_beside_amx_tiles_reads_12_bit_pair_panels_for_one_row(
        kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where AMX takes bfloat16 (its tiles faked here: this CPU need not have them; nothing
    below runs on the tiles), GemvLinear keeps a 12-bit pair-panel copy beside each tiled
    weight and reads it for one row: the pair panels' bits (on a build with AVX512-BF16);
    two rows go to the tiles. Without pack_pairs12 nothing is copied."""
    from kvflow.workers.layers.linear import (GemvLinear, LinearMethod, OneDnnLinear,
                                              gemv_operands)
    monkeypatch.setattr(cpu_ops, "gemv_amx_rows", lambda: 32)
    inner = OneDnnLinear() if OneDnnLinear.works(torch.bfloat16) else LinearMethod()
    tiles_only = GemvLinear(cpu_ops.gemv, inner, 4, cpu_ops.pack_amx, 32)
    method = GemvLinear(cpu_ops.gemv, inner, 4, cpu_ops.pack_amx, 32,
                        pack_pairs12=cpu_ops.pack_pairs12)
    pairs = GemvLinear(cpu_ops.gemv, inner, 4, pack_pairs=cpu_ops.pack_pairs)
    w = torch.randn(96, 64).bfloat16()
    prepared, alone = method.prepare(w), tiles_only.prepare(w)
    if prepared.packed is None:                      # no oneDNN copy: the tiles are not made
        assert prepared.layout == "rows"
        return
    assert prepared.layout == alone.layout == "amx" and alone.one_row is None
    assert torch.equal(prepared.plain, cpu_ops.pack_amx(w))
    assert "AMX <= 32" in method.name and "12-bit" not in tiles_only.name
    if not _pairs_here(kernels):                     # a build without AVX512-BF16
        assert prepared.one_row is None
        return
    assert "one row: 12-bit pair panels" in method.name
    assert torch.equal(prepared.one_row, cpu_ops.pack_pairs12(w))
    assert gemv_operands(prepared).one_row is prepared.one_row
    reference = pairs.prepare(w)
    bias = torch.randn(96)
    x = torch.randn(1, 64).bfloat16()
    assert torch.equal(method.apply(x, w, prepared, bias), pairs.apply(x, w, reference, bias))
    calls: list[str] = []
    method.gemv = lambda *a, layout="rows": calls.append(layout) or torch.zeros(1)
    method.apply(torch.randn(1, 64).bfloat16(), w, prepared)
    method.apply(torch.randn(2, 64).bfloat16(), w, prepared)
    assert calls == ["pairs12", "amx"]


@pytest.mark.parametrize("layout", ["panels", "panels12", "i8 panels", "pairs", "pairs12"])
def test_gemv_panels_give_the_same_bits_whatever_the_threads(kernels: str, layout: str) -> None:
    """Panels are shared out by work stealing (cpu_gemv.c shares_claim: a thread done with
    its own share takes groups from the back of the others'): with more threads than cores
    (so threads are preempted and their shares taken over), 1, 2 or 7 threads give the same
    bits, every output written once, at one row (groups of four), three rows (pairs) and
    nine (single panels); 3072 x 576 is the default model's gate_up (192 panels on AVX2)."""
    n, k = 3072, 576
    w = torch.randn(n, k)
    if layout == "i8 panels":
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scales = torch.rand(n) / 50 + 1e-3
        packed, name = cpu_ops.pack_i8_panels(q), "panels"
    elif layout in ("pairs", "pairs12"):
        pack = cpu_ops.pack_pairs if layout == "pairs" else cpu_ops.pack_pairs12
        scales, packed, name = None, pack(w.bfloat16()), layout
        if not _pairs_here(kernels):                   # a build without AVX512-BF16
            assert packed is None
            return
    else:
        scales = None
        pack = cpu_ops.pack_panels if layout == "panels" else cpu_ops.pack_panels12
        packed, name = pack(w.bfloat16()), layout
    assert packed is not None
    bias = torch.randn(n)
    threads = torch.get_num_threads()
    try:
        for m in ((1,) if layout == "pairs12" else (1, 3, 9)):      # 12-bit pairs: one row
            x = torch.randn(m, k)
            x = x.bfloat16() if layout.startswith("pairs") else x
            results = []
            for t in (1, 2, 7, 7, 7):
                torch.set_num_threads(t)
                results.append(cpu_ops.gemv(x, packed, scales, bias, layout=name))
            assert all(torch.equal(r, results[0]) for r in results[1:]), m
            assert bool(torch.isfinite(results[0]).all())
    finally:
        torch.set_num_threads(threads)


def test_one_row_12_bit_panels_are_made_on_every_x86(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 arithmetic on bfloat16 weights (dtype="auto" without AVX512-BF16): the 12-bit
    copy for one row is made on a CPU with or without AVX-512 (cpu_one_row_copy="off" turns
    it off: tests/test_hardware.py)."""
    from kvflow.workers.layers import ops
    from kvflow.workers.layers.linear import GemvLinear
    avx2, avx512 = "sse4_2 avx avx2 fma f16c bmi2", "sse4_2 avx avx2 fma f16c avx512f avx512bw"
    choices = {}
    for name, flags in (("avx2", avx2), ("avx512", avx512)):
        monkeypatch.setenv("KVFLOW_CPU_FLAGS", flags)
        linear = ops.choose_ops(torch.device("cpu"), "cpu", torch.float32, True,
                                weight_dtype=torch.bfloat16).linear
        assert isinstance(linear, GemvLinear)
        choices[name] = linear.pack_panels12 is not None and linear.makes_one_row_copies
    assert choices == {"avx2": True, "avx512": True}


def test_one_row_12_bit_pair_panels_are_chosen_by_the_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 arithmetic (dtype="auto" with AVX512-BF16, no AMX): the 12-bit copy of the
    pair panels for one row is made on a CPU with AVX512-BF16, and never where this build has
    no pair panels (then GemvLinear holds none to copy) or the CPU lacks AVX512-BF16."""
    from kvflow.workers.layers import ops
    from kvflow.workers.layers.linear import GemvLinear
    flags = "sse4_2 avx avx2 fma f16c avx512f avx512bw avx512_bf16"
    choices = {}
    for name, cpu in (("bf16", flags), ("no bf16", "sse4_2 avx avx2 fma f16c avx512f")):
        monkeypatch.setenv("KVFLOW_CPU_FLAGS", cpu)
        linear = ops.choose_ops(torch.device("cpu"), "cpu", torch.bfloat16, True).linear
        assert isinstance(linear, GemvLinear)
        choices[name] = linear.pack_pairs12 is not None
    here = ops.pair_panels()
    assert choices == {"bf16": here, "no bf16": False}
    assert ops.one_row_pairs12(frozenset(flags.split()))
    assert not ops.one_row_pairs12(frozenset("sse4_2 avx avx2 fma avx512f".split()))


def test_gemv_float32_output_of_bfloat16(kernels: str) -> None:
    x, w = torch.randn(3, 64).bfloat16(), torch.randn(9, 64).bfloat16()
    got = cpu_ops.gemv(x, w, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, x.float() @ w.float().T, atol=1e-4, rtol=1e-4)
