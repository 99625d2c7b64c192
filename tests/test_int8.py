"""quantization="int8" (layers/linear.py Int8Linear: W8A8 for prefills and large batches,
W8A16 for decode steps): the per-token quantization kernel against its
torch reference, the int8 linear against the float linear, 7-bit weights on oneDNN's
AVX2 path and the engine as an AVX2 CPU runs it, and the default model end to end against
HF transformers in float32."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvflow import LLM, SamplingParams
from kvflow.kernels import cpu_ops
from kvflow.workers.hardware import _cpuinfo
from kvflow.workers.layers.linear import (Int8Linear, quantize_rows_ref, quantize_weight,
                                          scale_rows_ref)

pytestmark = pytest.mark.skipif(Int8Linear.works() is not None,
                                reason=f"oneDNN int8 GEMM unavailable: {Int8Linear.works()}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_kernel_matches_reference(kernels: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 3 * 576, generator=gen) * 3).to(dtype)[:, :1000]   # strided rows
    x[5] = 0                                                               # a zero row
    q, scales = cpu_ops.quantize_rows(x)
    q_ref, scales_ref = quantize_rows_ref(x)
    torch.testing.assert_close(scales, scales_ref, rtol=1e-6, atol=0)
    zero = 128
    assert scales[5] == 1.0 and bool((q[5] == zero).all())
    assert int(q.min()) >= 1 and int(q.max()) <= 255
    # Only values within rounding of a half step may round the other way (-ffast-math's
    # reciprocal; bf16 inputs land near halves more often): by one, rarely.
    diff = (q.int() - q_ref.int()).abs()
    assert int(diff.max()) <= 1 and int((diff > 0).sum()) <= x.numel() // 400
    # Dequantized, every row is within half a step of x.
    back = (q.float() - zero) * scales.unsqueeze(1)
    assert bool(((back - x.float()).abs() <= scales.unsqueeze(1) * 0.5 + 1e-6).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_scale_rows_kernel_matches_reference(kernels: str, dtype: torch.dtype,
                                            with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    y, scales = torch.randn(9, 300, generator=gen) * 50, torch.rand(9, generator=gen)
    bias = torch.randn(300, generator=gen) if with_bias else None
    expected = scale_rows_ref(y, scales, bias, dtype)
    got = cpu_ops.scale_rows(y.clone(), scales, bias, dtype)
    assert got.dtype == dtype
    # One rounding to dtype in both; float32 may differ by the fused multiply-add's last bit.
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)


KERNELS = [dict(quantize_rows=cpu_ops.quantize_rows, scale_rows=cpu_ops.scale_rows),
           dict(quantize_rows=quantize_rows_ref, scale_rows=scale_rows_ref),
           dict(quantize_rows=cpu_ops.quantize_rows, scale_rows=cpu_ops.scale_rows,
                gemm=cpu_ops.i8_gemm, gemm_pack=cpu_ops.i8_gemm_pack, weight_levels=63),
           dict(quantize_rows=cpu_ops.quantize_rows, scale_rows=cpu_ops.scale_rows,
                gemm=cpu_ops.i8_gemm, gemm_pack=cpu_ops.i8_gemm_pack,
                # the widest weights this library's GEMM takes (8 bits with AVX512-VNNI)
                weight_levels=max(cpu_ops.i8_gemm_weight_levels(), 63),
                gemm_levels=cpu_ops.i8_gemm_weight_levels())]


@pytest.mark.parametrize("kernels", KERNELS, ids=["c", "torch", "c-own-gemm", "c-own-gemm-widest"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_int8_linear_matches_the_float_linear(kernels, dtype: torch.dtype,  # type: ignore[no-untyped-def]
                                              num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    w = torch.randn(960, 576, generator=gen) * 0.05
    x = torch.randn(num_tokens, 576, generator=gen)
    bias = torch.randn(960, generator=gen)
    method = Int8Linear(**kernels)
    prepared = method.prepare(w.to(dtype))
    # kvflow's GEMM where it takes the weights: 7 bits on any build, 8 with AVX512-VNNI
    assert prepared.own_gemm == ("gemm" in kernels and cpu_ops.i8_gemm_available()
                                 and method.weight_levels <= cpu_ops.i8_gemm_weight_levels())
    got = method.apply(x.to(dtype), w, prepared, bias.to(dtype))
    assert got.dtype == dtype and got.shape == (num_tokens, 960)
    ref = F.linear(x, w, bias)
    # The exact product of the quantized operands: what oneDNN must return (up to the output
    # rounding to `dtype`); the weights 7-bit where the CPU lacks VNNI (gemm_weight_levels).
    qw, w_scales = quantize_weight(w.to(dtype), method.weight_levels)
    qx, x_scales = quantize_rows_ref(x.to(dtype))
    exact = ((qx.float() - 128) @ qw.float().t()) * x_scales[:, None] * w_scales + bias
    out_tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), exact, rtol=out_tol, atol=out_tol)
    # Against the float layer: int8 rounding of both operands, ~1% of the output's scale.
    err = (got.float() - ref).abs().max() / ref.abs().max()
    assert float(err) < 0.03, float(err)


PROMPTS = ["The capital of France is", "def fibonacci(n):\n",
           "Write a haiku about the sea.", "1, 2, 3, 5, 8, 13, 21,",
           "Explain in one paragraph why the sky is blue.", "A recipe for pancakes:\n1."]


def test_default_model_int8_tracks_float32_hf(default_model: str) -> None:
    """int8's own greedy tokens, scored by HF float32 on the same prefixes (one forward over
    prompt + output): at every position int8's token is one of HF's top 5 and the two
    logprobs of it are close. Batched (decode steps of six rows: W8A8, W7A8 without VNNI)
    and alone (decodes W8A16). Per position, so one near-tie does not cascade as counting
    tokens before the first divergence from HF's own greedy run would."""
    from transformers import AutoModelForCausalLM
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)
    with LLM(default_model, quantization="int8", dtype="float32", kv_cache_memory_gb=0.1,
             in_process=True) as llm:
        prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
        outs = llm.generate(prompts, params, use_tqdm=False)
        outs += [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    hf = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    in_top5, diffs = [], []
    for prompt, out in zip(prompts * 2, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
        lp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)      # predicting outputs
        for i, token in enumerate(out.token_ids):
            in_top5.append(token in lp[i].topk(5).indices.tolist())
            assert out.logprobs is not None
            diffs.append(abs(out.logprobs[i][token] - float(lp[i, token])))
    assert sum(in_top5) >= 0.98 * len(in_top5), sum(in_top5) / len(in_top5)
    assert float(np.mean(diffs)) < 0.2, float(np.mean(diffs))


@pytest.mark.parametrize("arch", ["default", "qwen2"])
def test_smoothing_folds_exactly(default_model: str, tmp_path, arch: str,  # type: ignore[no-untyped-def]
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """SmoothQuant only moves scale between a linear's input and its weight: in float32, the
    folded producers (norms, v rows with GQA sharing, up rows, biases) times the consumers'
    input_scale give the same logits as the original model."""
    from kvflow.config import make_engine_config
    from kvflow.workers.layers.linear import OneDnnLinear
    from kvflow.workers.smoothing import (calibration_ids, input_absmax, prefill_logits,
                                          smooth)
    from kvflow.workers.worker import Worker
    from model_helpers import make_tiny_model
    monkeypatch.setattr(OneDnnLinear, "works", classmethod(lambda cls, dtype: False))
    path = default_model if arch == "default" else make_tiny_model(
        default_model, str(tmp_path), "qwen2", num_attention_heads=6, num_key_value_heads=2,
        hidden_size=96)
    worker = Worker(make_engine_config(path, dtype="float32", kv_cache_memory_gb=0.02,
                                       device="cpu", attention_backend="torch"))
    model = worker.model
    ids = calibration_ids(path, 49152)[:40]

    def logits() -> torch.Tensor:
        return prefill_logits(model, worker.kv_cache, ids)

    before = logits()
    pairs = model.smoothing_pairs()
    absmax = input_absmax(model, worker.kv_cache, [p.consumer for p in pairs], ids)
    smooth(pairs, absmax)
    scales = [p.consumer.input_scale for p in pairs]
    assert all(s is not None and not torch.allclose(s, torch.ones_like(s)) for s in scales)
    for pair in pairs:                       # what Int8Linear.prepare would be given
        weight = pair.consumer.weight
        if pair.consumer is model.lm_head:   # tied to the embedding: scale a copy
            pair.consumer.weight = torch.nn.Parameter(weight.data * pair.consumer.input_scale,
                                                      requires_grad=False)
        else:
            weight.data.mul_(pair.consumer.input_scale)
    torch.testing.assert_close(logits(), before, rtol=1e-4, atol=1e-3)


def test_int8_under_tensor_parallelism(tiny_models: dict[str, str]) -> None:
    """Each rank smooths and quantizes its own shards (row-parallel inputs are per-rank
    channels; the calibration pass runs on every rank with its all-reduces): TP=2 follows
    TP=1 int8 on the tiny Llama under the top-5 rule (per-rank weight scales differ, so
    near-ties of the random model may flip). Each prompt twice: decode steps of six rows,
    which on CPUs without VNNI run kvflow's GEMM in the fused step (per-rank input widths)."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    prompts = ["Hello, my name is", "The capital of France is", "1, 2, 3,"] * 2
    runs = []
    for tp in (1, 2):
        with LLM(tiny_models["llama"], tensor_parallel_size=tp, quantization="int8",
                 dtype="float32", kv_cache_memory_gb=0.05) as llm:
            runs.append(llm.generate(prompts, greedy, use_tqdm=False))
    exact = 0
    for one, two in zip(*runs):
        assert one.logprobs is not None and two.logprobs is not None
        for i, (a, b) in enumerate(zip(one.token_ids, two.token_ids)):
            if a != b:
                assert a in two.logprobs[i] and b in one.logprobs[i], (i, one, two)
                break
            exact += 1
    assert exact >= len(prompts) * 4, exact


def test_a_cpu_without_vnni_runs_int8_with_7_bit_weights(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without VNNI (faked flags here) the GEMM's weights are quantized to 7 bits (|q| <= 63)
    and activations stay 8-bit, so no pair of u8 x s8 products can saturate a 16-bit sum;
    results stay close to the float layer. The decode (gemv) rows stay 8-bit."""
    from kvflow.workers.layers import linear
    monkeypatch.setattr(linear, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    method = Int8Linear(cpu_ops.quantize_rows, cpu_ops.scale_rows, gemv=cpu_ops.gemv,
                        max_rows=4)
    assert method.weight_levels == 63 and "W7A8" in method.name
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 576, generator=gen), torch.randn(9, 576, generator=gen)
    prepared = method.prepare(w)
    assert prepared.rows is not None and int(prepared.rows.abs().max()) == 127
    q, scales = linear.quantize_weight(w, 63)
    assert int(q.abs().max()) == 63
    assert torch.allclose(q.float() * scales.unsqueeze(1), w, atol=float(scales.max()) / 2 + 1e-6)
    got, ref = method.apply(x, w, prepared), torch.nn.functional.linear(x, w)
    assert float((got - ref).abs().max() / ref.abs().max()) < 0.05


@pytest.mark.parametrize("flags,own_rows,plain_rows", [
    ("avx2 fma", 4, 48), ("avx2 fma avx512f avx512_vnni", 8, 32), ("avx2 fma avx_vnni", 4, 4),
    ("avx512f amx_int8", 4, 4), ("avx512f avx512_vnni amx_int8", 4, 4)])
def test_int8_runs_w8a16_on_the_gemv_kernel_then_a_gemm(monkeypatch: pytest.MonkeyPatch,
                                                        flags: str, own_rows: int,
                                                        plain_rows: int) -> None:
    """The engine's int8 layers run products of up to GEMV_MAX_ROWS rows W8A16 on the gemv
    kernel, larger ones on a GEMM: kvflow's (kernels/cpu_gemm_i8.c) where the CPU lacks
    AMX-INT8 and the library's kernel takes its weights (W7A8 without VNNI; W8A8 where the
    library was built with AVX512-VNNI, the gemv kernel then up to 8 rows), else oneDNN's
    W8A8 (up to 32 rows on the gemv kernel with AVX512-VNNI, 48 without VNNI); either way
    the product is the float layer's within int8 rounding. Flags that claim a VNNI or
    AMX-INT8 this CPU lacks cannot be honoured (oneDNN's 8-bit GEMM saturates its sums
    without them): the engine must refuse to start, naming why, rather than run wrong."""
    from kvflow.workers.hardware import cpu_flags
    from kvflow.workers.layers.linear import int8_gemv_rows
    from kvflow.workers.layers.ops import GEMV_MAX_ROWS, choose_ops
    without_vnni = flags == "avx2 fma"
    assert int8_gemv_rows(frozenset(flags.split()), GEMV_MAX_ROWS, True) == own_rows
    assert int8_gemv_rows(frozenset(flags.split()), GEMV_MAX_ROWS, False) == plain_rows
    wide = {"avx512_vnni", "avx_vnni", "amx_int8"}
    claims_more = bool(set(flags.split()) & wide) and not cpu_flags() & wide
    monkeypatch.setenv("KVFLOW_CPU_FLAGS", flags)
    if claims_more:
        with pytest.raises(ValueError, match="int8' cannot run: oneDNN's int8 linear gave "
                                             "wrong results on this CPU"):
            choose_ops(torch.device("cpu"), "cpu", torch.float32, False, "int8")
        return
    # kvflow's GEMM: 7-bit weights on any build with it, 8-bit ones where it has VNNI
    own = cpu_ops.i8_gemm_available() and "amx_int8" not in flags and (
        without_vnni or cpu_ops.i8_gemm_weight_levels() == 127)
    rows = own_rows if own else plain_rows
    method = choose_ops(torch.device("cpu"), "cpu", torch.float32, False, "int8").linear
    assert isinstance(method, Int8Linear) and method.max_rows == rows
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 576, generator=gen)
    prepared = method.prepare(w)
    assert prepared.own_gemm == own
    assert ("W7A8" in method.name) == without_vnni
    calls: dict[str, list[int]] = {"gemv": [], "gemm": []}
    for name in calls:
        fn = getattr(method, name)
        if fn is not None:
            setattr(method, name, lambda x, *a, _f=fn, _n=name, **k:
                    calls[_n].append(x.shape[0]) or _f(x, *a, **k))
    sizes = (1, 4, 5, 9, 32, 49)
    for m in sizes:
        x = torch.randn(m, 576, generator=gen)
        got, ref = method.apply(x, w, prepared), torch.nn.functional.linear(x, w)
        assert float((got - ref).abs().max() / ref.abs().max()) < 0.05
    assert calls["gemv"] == [m for m in sizes if m <= rows]
    assert calls["gemm"] == ([m for m in sizes if m > rows] if own else [])


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kvflows_int8_gemm_is_the_exact_integer_product(kernels: str, with_bias: bool,
                                                       dtype: torch.dtype) -> None:
    """kernels/cpu_gemm_i8.c against the exact product of the same quantized operands (int64
    sums), on every ISA build (AVX2: 7-bit weights, 4 x 16 tiles; AVX512-VNNI: 8-bit weights,
    8 x 32 tiles), at shapes that leave partial tiles (rows not a multiple of 4 or 8,
    outputs not of 16 or 32, inputs not of 4: one row, seven, 17, 69) and at the default
    model's; the worst case of its sums (every activation 255, every weight at +-the
    build's limit) too."""
    if not cpu_ops.i8_gemm_available():
        pytest.skip("this build has no kvflow int8 GEMM (no AVX2)")
    levels = cpu_ops.i8_gemm_weight_levels()
    # the CPU's own flags (not KVFLOW_CPU_FLAGS): the builds follow the CPU
    flags = _cpuinfo().get("flags", "").split()
    vnni = kernels in ("native", "avx512") and "avx512_vnni" in flags
    assert levels == (127 if vnni else 63)
    gen = torch.Generator().manual_seed(3)
    cases = [(1, 1, 1), (9, 17, 3), (1, 17, 13), (7, 40, 64), (8, 64, 8), (17, 48, 100),
             (69, 33, 577), (130, 96, 576), (5, 576, 1536)]
    for m, n, k in cases:
        w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen) * 3
        q, w_scales = quantize_weight(w, levels)
        qx, x_scales = cpu_ops.quantize_rows(x)
        if m in (7, 17):                                     # the worst case of the sums
            qx.fill_(255)
            q = torch.where(torch.rand(n, k, generator=gen) < 0.5, levels, -levels).to(torch.int8)
        bias = torch.randn(n, generator=gen) if with_bias else None
        packed = cpu_ops.i8_gemm_pack(q, w_scales)
        assert packed is not None
        got = cpu_ops.i8_gemm(qx, x_scales, packed, bias, dtype)
        sums = ((qx.long() - 128) @ q.long().t()).double()  # exact
        exact = sums * w_scales.double() * x_scales[:, None].double()
        exact = exact + (0 if bias is None else bias.double())
        assert got.dtype == dtype and got.shape == (m, n)
        tol = 1e-6 if dtype == torch.float32 else 2 ** -8
        torch.testing.assert_close(got.double(), exact.to(dtype).double(), rtol=tol,
                                   atol=tol * float(exact.abs().max()))
    # Weights past the build's limit (8-bit ones could saturate AVX2's pair sums), and -128
    # (whose absolute value int8 cannot hold): not packed.
    for value in ((100, -64) if levels == 63 else ()) + (-128,):
        assert cpu_ops.i8_gemm_pack(torch.full((4, 8), value, dtype=torch.int8),
                                    torch.ones(4)) is None
    assert cpu_ops.i8_gemm_pack(torch.full((4, 8), levels, dtype=torch.int8),
                                torch.ones(4)) is not None


def test_int8_gemv_rows_are_held_in_panels_where_the_shape_allows(kernels: str) -> None:
    """The engine's int8 method (choose_ops) keeps the gemv kernel's int8 rows in panels
    where the outputs fill whole panels (the row-major copy is not kept beside them), and
    row-major elsewhere; both give the row-major kernel's very bits at one and four rows."""
    from kvflow.workers.layers.linear import gemv_operands
    from kvflow.workers.layers.ops import choose_ops
    method = choose_ops(torch.device("cpu"), "cpu", torch.float32, False, "int8").linear
    assert isinstance(method, Int8Linear)
    gen = torch.Generator().manual_seed(0)
    for n, layout in ((96, "panels"), (40, "rows")):
        w = torch.randn(n, 576, generator=gen)
        prepared = method.prepare(w)
        operands = gemv_operands(prepared)
        assert operands is not None and operands.layout == prepared.layout == layout
        q, scales = quantize_weight(w)
        for m in (1, 4):
            x = torch.randn(m, 576, generator=gen)
            assert torch.equal(method.apply(x, w, prepared), cpu_ops.gemv(x, q, scales))


AVX2_CHECK = """
import torch, sys
from kvflow.workers.layers.linear import Int8Linear
gen = torch.Generator().manual_seed(0)
w = torch.randn(64, 576, generator=gen)
w[:, ::2] = w.abs().max()                     # pairs of large weights, the worst case
x = torch.randn(8, 576, generator=gen).abs()
x[:, ::2] = x.max()                           # ... against pairs of the largest inputs
errors = []
for levels in (63, 127):
    method = Int8Linear(weight_levels=levels)
    got, ref = method.apply(x, w, method.prepare(w)), torch.nn.functional.linear(x, w)
    errors.append(float((got - ref).abs().max() / ref.abs().max()))
print(errors[0], errors[1])
"""


def test_oneDNN_avx2_int8_does_not_saturate_with_7_bit_weights() -> None:
    """oneDNN's own AVX2 code path (ONEDNN_MAX_CPU_ISA=AVX2, in a fresh process): 8-bit
    activations times 8-bit weights saturate its 16-bit pair sums, times 7-bit weights they
    are exact up to rounding."""
    import subprocess
    import sys
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    done = subprocess.run([sys.executable, "-c", AVX2_CHECK], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seven, eight = map(float, done.stdout.split())
    assert seven < 0.03, seven
    assert eight > 0.05, eight            # saturated (natively both are ~2e-4)


def test_int8_runs_as_an_avx2_cpu_runs_it(default_model: str) -> None:
    """The whole engine as on an AVX2-only CPU (faked flags, oneDNN and torch at AVX2, the
    kernels built without AVX-512): int8 runs, and its greedy tokens are HF float32's top-5
    choices."""
    import subprocess
    import sys
    script = (
        "from kvflow import LLM, SamplingParams\n"
        f"with LLM({default_model!r}, quantization='int8', dtype='float32',"
        " kv_cache_memory_gb=0.1) as llm:\n"
        "    o = llm.generate(['The capital of France is'], SamplingParams(temperature=0,"
        " max_tokens=8, ignore_eos=True), use_tqdm=False)[0]\n"
        "print(' '.join(map(str, o.token_ids)))\n")
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2",
               MKL_ENABLE_INSTRUCTIONS="AVX2",
               KVFLOW_KERNEL_ISA="avx2", KVFLOW_CPU_FLAGS="sse4_2 avx avx2 fma f16c")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    tokens = [int(t) for t in done.stdout.split()]
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    from tokenizers import Tokenizer
    prompt = Tokenizer.from_file(os.path.join(default_model, "tokenizer.json")).encode(
        "The capital of France is").ids
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    assert all(t in row.topk(5).indices.tolist() for t, row in zip(tokens, logits))
