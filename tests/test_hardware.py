"""dtype="auto" on CPU follows what the CPU runs natively (workers/hardware.py)."""
from __future__ import annotations

import pytest
import torch

from kvflow.workers import hardware
from kvflow.workers.worker import Worker
from kvflow.config import make_engine_config

CPU = torch.device("cpu")
BF16_CHECKPOINT = {"torch_dtype": "bfloat16"}


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_on_cpu_is_bf16_only_where_native(monkeypatch: pytest.MonkeyPatch, native: bool,
                                               expected: torch.dtype) -> None:
    monkeypatch.setattr(hardware, "native_bf16", lambda: native)
    dtype, why, slow, weights = hardware.resolve_dtype("auto", CPU, BF16_CHECKPOINT)
    assert dtype == expected and "checkpoint says bfloat16" in why and not slow
    assert weights == (None if native else torch.bfloat16)      # bfloat16 weights either way
    # A float32 or float16 checkpoint changes nothing: never float16 on CPU by default.
    assert hardware.resolve_dtype("auto", CPU, {"torch_dtype": "float16"})[0] == expected


def test_explicit_dtype_wins_and_cuda_keeps_the_checkpoint(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    monkeypatch.setattr(hardware, "native_bf16", lambda: False)
    assert hardware.resolve_dtype("bfloat16", CPU, {})[0] == torch.bfloat16
    assert hardware.resolve_dtype("auto", torch.device("cuda"), BF16_CHECKPOINT)[0] \
        == torch.bfloat16
    assert hardware.resolve_dtype("auto", torch.device("cuda"), {})[0] == torch.float32


def test_explicit_float16_on_cpu_without_avx512_fp16_is_warned(monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx512f"}))
    dtype, why, slow, weights = hardware.resolve_dtype("float16", CPU, {})
    assert dtype == torch.float16 and "AVX512-FP16" in why and slow and weights is None
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx512_fp16"}))
    assert hardware.resolve_dtype("float16", CPU, {}) == (torch.float16, "float16 as asked",
                                                          False, None)


def test_the_worker_runs_the_resolved_dtype(default_model: str) -> None:
    """On this machine's CPU, whichever it is: the model's weights take the dtype that torch's
    own ISA checks call native (float32 arithmetic over bfloat16 values elsewhere); the KV
    cache is bfloat16 either way (under float32 the cpu backend rounds K/V as it stores)."""
    config = make_engine_config(default_model, kv_cache_memory_gb=0.05, device="cpu")
    assert config.model.dtype == "auto"
    worker = Worker(config)
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    expected = torch.bfloat16 if native else torch.float32
    assert worker.dtype == expected
    assert worker.model.model.embed_tokens.weight.dtype == expected
    assert worker.kv_cache.tensor.dtype == torch.bfloat16


def test_without_native_bf16_auto_streams_bf16_weights(default_model: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """As a CPU without AVX512-BF16 or AMX: float32 activations, weight matrices rounded to
    bfloat16's values and a bfloat16 KV cache; the gemv kernel (and so the fused decode step)
    reads a bfloat16 copy of the weights and oneDNN a float32 one of the same values.
    dtype="float32" keeps the weights as loaded and a float32 KV cache."""
    monkeypatch.setenv("KVFLOW_CPU_FLAGS", "sse4_2 avx avx2 fma f16c bmi2")
    worker = Worker(make_engine_config(default_model, kv_cache_memory_gb=0.05, device="cpu"))
    assert (worker.dtype, worker.weight_dtype) == (torch.float32, torch.bfloat16)
    assert worker.kv_cache.tensor.dtype == worker.backend.kv_dtype == torch.bfloat16
    table = worker.model.model.embed_tokens.weight
    assert table.dtype == torch.float32 and torch.equal(table, table.bfloat16().float())
    qkv = worker.model.model.layers[0].self_attn.qkv_proj
    assert qkv.prepared.plain.dtype == torch.bfloat16 and qkv.prepared.packed is not None
    assert qkv.prepared.layout == "panels"                   # 960 outputs: whole panels
    assert worker.runner.fused is not None
    assert "bfloat16 weights in panels" in worker.ops.linear.name
    x = torch.randn(2, qkv.prepared.plain.shape[1])
    onednn = qkv(x.repeat(35, 1))                # 70 rows: oneDNN's float32 copy
    assert torch.equal(onednn[:2], onednn[-2:])
    torch.testing.assert_close(qkv(x), onednn[:2], rtol=1e-5, atol=1e-5)   # the panels
    exact = Worker(make_engine_config(default_model, kv_cache_memory_gb=0.05, device="cpu",
                                      dtype="float32"))
    assert exact.weight_dtype == exact.kv_cache.tensor.dtype == torch.float32
    plain = exact.model.model.layers[0].self_attn.qkv_proj.prepared.plain
    assert plain.dtype == torch.float32 and not torch.equal(plain, plain.bfloat16().float())
    # Half the bytes a block: twice the blocks in the same memory (to the block).
    assert 2 * worker.kv_cache.bytes_per_block == exact.kv_cache.bytes_per_block
    assert worker.num_blocks // 2 == exact.num_blocks


def test_kv_cache_dtype_option(default_model: str) -> None:
    """kv_cache_dtype="bfloat16" (and "int8") under float32 on the cpu backend; refused,
    naming why, where no kernel reads such a cache (the torch backend) and for dtypes kvflow
    has none of."""
    config = lambda **kw: make_engine_config(default_model, kv_cache_memory_gb=0.05,  # noqa: E731
                                             device="cpu", dtype="float32", **kw)
    worker = Worker(config(kv_cache_dtype="bfloat16"))
    assert (worker.dtype, worker.kv_cache.tensor.dtype) == (torch.float32, torch.bfloat16)
    assert worker.kv_cache.bytes_per_block == 2 * 30 * 16 * 3 * 64 * 2
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16' under dtype float32 needs"):
        Worker(config(kv_cache_dtype="bfloat16", attention_backend="torch"))
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' must be one of"):
        config(kv_cache_dtype="fp8")
    # int8: rows of 64 int8 values and a float32 scale; only the cpu backend's kernels read it.
    int8 = Worker(config(kv_cache_dtype="int8"))
    assert (int8.dtype, int8.kv_cache.tensor.dtype) == (torch.float32, torch.int8)
    assert int8.kv_cache.bytes_per_block == 2 * 30 * 16 * 3 * (64 + 4)
    for other in (dict(attention_backend="torch"), dict(device="cuda")):   # before any worker
        with pytest.raises(ValueError, match="kv_cache_dtype='int8' needs the cpu attention"):
            make_engine_config(default_model, kv_cache_dtype="int8", **other)
    # auto on the torch backend stays in the arithmetic's dtype (no kernel for the mix).
    fallback = Worker(config(attention_backend="torch"))
    assert fallback.kv_cache.tensor.dtype == torch.float32
