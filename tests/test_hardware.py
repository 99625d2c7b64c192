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
    holds a bfloat16 copy of the weights in panels. With cpu_prefill_copy="off" the panels
    take every row count and oneDNN keeps no float32 copy; with "on" it keeps one, which
    takes products of more than 64 rows, with the same values. dtype="float32" keeps the weights as loaded and a float32 KV cache."""
    from kvflow.workers.layers.linear import EVERY_ROW
    monkeypatch.setenv("KVFLOW_CPU_FLAGS", "sse4_2 avx avx2 fma f16c bmi2")
    config = lambda **kw: make_engine_config(default_model, kv_cache_memory_gb=0.05,  # noqa: E731
                                             device="cpu", **kw)
    worker = Worker(config(cpu_prefill_copy="off"))
    assert (worker.dtype, worker.weight_dtype) == (torch.float32, torch.bfloat16)
    assert worker.kv_cache.tensor.dtype == worker.backend.kv_dtype == torch.bfloat16
    table = worker.model.model.embed_tokens.weight
    assert table.dtype == torch.float32 and torch.equal(table, table.bfloat16().float())
    qkv = worker.model.model.layers[0].self_attn.qkv_proj
    assert qkv.prepared.plain.dtype == torch.bfloat16 and qkv.prepared.packed is None
    assert qkv.prepared.layout == "panels"                   # 960 outputs: whole panels
    assert qkv.method.gemv_rows(qkv.prepared) == EVERY_ROW
    assert worker.runner.fused is not None
    assert "bfloat16 weights in panels" in worker.ops.linear.name
    x = torch.randn(2, qkv.prepared.plain.shape[1])
    many = qkv(x.repeat(150, 1))                 # 300 rows, a prefill's: the panels too
    assert torch.equal(many[:2], many[-2:]) and torch.equal(qkv(x), many[:2])
    copied = Worker(config(cpu_prefill_copy="on"))
    qkv_copied = copied.model.model.layers[0].self_attn.qkv_proj
    assert qkv_copied.prepared.packed is not None and qkv_copied.prepared.layout == "panels"
    assert qkv_copied.method.gemv_rows(qkv_copied.prepared) == 64
    onednn = qkv_copied(x.repeat(35, 1))         # 70 rows: oneDNN's float32 copy
    assert torch.equal(qkv_copied(x), qkv(x))   # up to 64 rows: the same panels
    torch.testing.assert_close(onednn[:2], many[:2], rtol=1e-5, atol=1e-5)
    exact = Worker(config(dtype="float32"))
    assert exact.weight_dtype == exact.kv_cache.tensor.dtype == torch.float32
    plain = exact.model.model.layers[0].self_attn.qkv_proj.prepared.plain
    assert plain.dtype == torch.float32 and not torch.equal(plain, plain.bfloat16().float())
    ref = x.double() @ plain.bfloat16().double().T      # the values the panels hold
    torch.testing.assert_close(many[:2].double(), ref, rtol=1e-5,
                               atol=1e-5 * float(ref.abs().max()))
    # Half the bytes a block: twice the blocks in the same memory (to the block).
    assert 2 * worker.kv_cache.bytes_per_block == exact.kv_cache.bytes_per_block
    assert worker.num_blocks // 2 == exact.num_blocks


def test_cpu_prefill_copy_auto_follows_the_ram(default_model: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu_prefill_copy="auto" keeps oneDNN's copy of the paneled weights while it takes at
    most an eighth of the RAM available at load (the default model's float32 copy: ~0.5 GB),
    else the panels take every product; "on" keeps it whatever the RAM."""
    from kvflow.workers import worker as worker_module
    from kvflow.workers.layers.ops import keep_copy
    assert keep_copy("auto", 1 << 30, 8 << 30) and not keep_copy("auto", (1 << 30) + 1, 8 << 30)
    assert keep_copy("on", 1 << 40, 0) and not keep_copy("off", 0, 1 << 40)
    monkeypatch.setenv("KVFLOW_CPU_FLAGS", "sse4_2 avx avx2 fma f16c bmi2")
    config = lambda **kw: make_engine_config(default_model, kv_cache_memory_gb=0.05,  # noqa: E731
                                             device="cpu", **kw)
    kept = {}
    for available_gb, option in ((64, "auto"), (2, "auto"), (2, "on")):
        monkeypatch.setattr(worker_module, "available_memory_bytes",
                            lambda gb=available_gb: gb << 30)
        worker = Worker(config(cpu_prefill_copy=option))
        down = worker.model.model.layers[0].mlp.down_proj.prepared
        assert worker.ops.linear.gemm_copy == (down.packed is not None)
        kept[(available_gb, option)] = worker.ops.linear.gemm_copy
    assert kept == {(64, "auto"): True, (2, "auto"): False, (2, "on"): True}


def test_cpu_one_row_copy_follows_the_option_and_the_ram(default_model: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu_one_row_copy: "auto" makes the 12-bit copy of the paneled weights while it takes
    at most an eighth of the RAM available at load (the default model's: ~0.2 GB; with 2 GB,
    made while oneDNN's 0.54 GB float32 copy is not: each is weighed alone), "on" whatever
    the RAM, "off" never; every paneled weight (30 layers' four and the LM head) follows,
    and the linear's name says which."""
    from kvflow.workers.layers.linear import GemvWeight
    from kvflow.workers import worker as worker_module
    monkeypatch.setenv("KVFLOW_CPU_FLAGS", "sse4_2 avx avx2 fma f16c bmi2")
    config = lambda **kw: make_engine_config(default_model, kv_cache_memory_gb=0.05,  # noqa: E731
                                             device="cpu", **kw)
    made = {}
    for available_gb, option in ((64, "auto"), (2, "auto"), (1, "auto"), (1, "on"),
                                 (64, "off")):
        monkeypatch.setattr(worker_module, "available_memory_bytes",
                            lambda gb=available_gb: gb << 30)
        worker = Worker(config(cpu_one_row_copy=option))
        linear = worker.ops.linear
        paneled = [m.prepared for m in worker.model.modules()
                   if isinstance(getattr(m, "prepared", None), GemvWeight)
                   and m.prepared.layout == "panels"]
        assert len(paneled) == 4 * 30 + 1
        assert all((p.one_row is not None) == linear.one_row_copy for p in paneled)
        assert ("12-bit" in linear.name) == linear.one_row_copy
        made[(available_gb, option)] = (linear.one_row_copy, linear.gemm_copy)
    assert made == {(64, "auto"): (True, True), (2, "auto"): (True, False),
                    (1, "auto"): (False, False), (1, "on"): (True, False),
                    (64, "off"): (False, True)}


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
