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
    dtype, why, slow = hardware.resolve_dtype("auto", CPU, BF16_CHECKPOINT)
    assert dtype == expected and "checkpoint says bfloat16" in why and not slow
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
    dtype, why, slow = hardware.resolve_dtype("float16", CPU, {})
    assert dtype == torch.float16 and "AVX512-FP16" in why and slow
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx512_fp16"}))
    assert hardware.resolve_dtype("float16", CPU, {}) == (torch.float16, "float16 as asked",
                                                          False)


def test_the_worker_runs_the_resolved_dtype(default_model: str) -> None:
    """On this machine's CPU, whichever it is: the model's weights and KV cache take the dtype
    that torch's own ISA checks call native."""
    config = make_engine_config(default_model, kv_cache_memory_gb=0.05, device="cpu")
    assert config.model.dtype == "auto"
    worker = Worker(config)
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    expected = torch.bfloat16 if native else torch.float32
    assert worker.dtype == expected
    assert worker.model.model.embed_tokens.weight.dtype == expected
    assert worker.kv_cache.tensor.dtype == expected
