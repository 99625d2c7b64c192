"""quantization="int8" (W8A8, layers/linear.py Int8Linear): the per-token quantization kernel
against its torch reference, the int8 linear against the float linear, and the default model
end to end against HF transformers in float32 under docs/design.md §4's top-5 rule."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_reference import assert_greedy_match, hf_greedy
from kvflow import LLM, SamplingParams
from kvflow.kernels import cpu_ops
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
    assert scales[5] == 1.0 and bool((q[5] == 128).all())
    # Only values within rounding of a half step may round the other way (-ffast-math's
    # reciprocal; bf16 inputs land near halves more often): by one, rarely.
    diff = (q.int() - q_ref.int()).abs()
    assert int(diff.max()) <= 1 and int((diff > 0).sum()) <= x.numel() // 1000
    # Dequantized, every row is within half a step of x.
    back = (q.float() - 128) * scales.unsqueeze(1)
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


KERNELS = [(cpu_ops.quantize_rows, cpu_ops.scale_rows), (quantize_rows_ref, scale_rows_ref)]


@pytest.mark.parametrize("kernels", KERNELS, ids=["c", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_int8_linear_matches_the_float_linear(kernels, dtype: torch.dtype,  # type: ignore[no-untyped-def]
                                              num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    w = torch.randn(960, 576, generator=gen) * 0.05
    x = torch.randn(num_tokens, 576, generator=gen)
    bias = torch.randn(960, generator=gen)
    method = Int8Linear(*kernels)
    got = method.apply(x.to(dtype), w, method.prepare(w.to(dtype)), bias.to(dtype))
    assert got.dtype == dtype and got.shape == (num_tokens, 960)
    ref = F.linear(x, w, bias)
    # The exact product of the quantized operands: what oneDNN must return (up to the output
    # rounding to `dtype`).
    qw, w_scales = quantize_weight(w.to(dtype))
    qx, x_scales = quantize_rows_ref(x.to(dtype))
    exact = ((qx.float() - 128) @ qw.float().t()) * x_scales[:, None] * w_scales + bias
    out_tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), exact, rtol=out_tol, atol=out_tol)
    # Against the float layer: int8 rounding of both operands, ~1% of the output's scale.
    err = (got.float() - ref).abs().max() / ref.abs().max()
    assert float(err) < 0.03, float(err)


PROMPTS = ["The capital of France is", "def fibonacci(n):\n",
           "Write a haiku about the sea.", "1, 2, 3, 5, 8, 13, 21,"]


def test_default_model_int8_tracks_float32_hf(default_model: str) -> None:
    """Greedy int8 tokens equal HF float32's up to the first divergence, and there each
    side's token is in the other's top-5; int8 keeps most tokens of the float model."""
    max_tokens = 16
    with LLM(default_model, quantization="int8", dtype="float32", kv_cache_memory_gb=0.1) as llm:
        prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
        outs = llm.generate(prompts,
                            SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5,
                                           ignore_eos=True))
    refs = hf_greedy(default_model, prompts, max_tokens)
    exact = 0
    for out, ref in zip(outs, refs):
        assert out.logprobs is not None
        exact += assert_greedy_match(out.token_ids, out.logprobs, ref)
    assert exact >= 0.5 * len(PROMPTS) * max_tokens, exact


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
    near-ties of the random model may flip)."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    prompts = ["Hello, my name is", "The capital of France is", "1, 2, 3,"]
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


def test_int8_refused_without_vnni(default_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An AVX2 CPU without VNNI would saturate oneDNN's 16-bit partial sums: a clear error,
    not wrong tokens."""
    from kvflow.workers.layers import linear
    monkeypatch.setattr(linear, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert "VNNI" in (Int8Linear.works() or "")
    from kvflow.config import make_engine_config
    from kvflow.workers.worker import Worker
    with pytest.raises(ValueError, match="quantization='int8' cannot run: .*VNNI"):
        Worker(make_engine_config(default_model, quantization="int8", device="cpu",
                                  kv_cache_memory_gb=0.02))
