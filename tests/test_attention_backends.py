"""Backend choice, execution config checks, and the paged backends' metadata (fast, CPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow import LLM
from kvflow.config import make_engine_config
from kvflow.workers.attention import SeqSpan, resolve_backend
from kvflow.workers.cuda_graphs import batch_size_ladder

CPU = torch.device("cpu")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")


@pytest.mark.parametrize("kwargs, message", [
    (dict(device="tpu"), "device='tpu' must be one of"),
    (dict(attention_backend="xformers"), "attention_backend='xformers' must be one of"),
    (dict(attention_backend="flash_attn", block_size=16), "block_size to be a multiple of 256"),
    (dict(attention_backend="flash_attn", block_size=256, device="cpu"), "needs CUDA"),
    (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization=0.0 must be in"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization=1.5 must be in"),
])
def test_bad_execution_config(tiny_models: dict[str, str], kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_engine_config(tiny_models["llama"], **kwargs)


def test_execution_config_values(tiny_models: dict[str, str]) -> None:
    config = make_engine_config(tiny_models["llama"], device="cpu", enforce_eager=True,
                                gpu_memory_utilization=0.5)
    assert (config.device, config.enforce_eager, config.cache.gpu_memory_utilization) == (
        "cpu", True, 0.5)
    assert config.cache.kv_cache_memory_gb is None        # decided by the worker


@no_cuda
def test_auto_backend_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    bf16 = torch.bfloat16
    assert resolve_backend("auto", CPU, 16, bf16) == "cpu"          # C kernels (test_cpu_ops)
    assert resolve_backend("auto", CPU, 256, bf16) == "cpu"
    assert resolve_backend("torch", CPU, 16, torch.float32) == "torch"
    with pytest.raises(ValueError, match="needs TRITON_INTERPRET=1"):
        resolve_backend("triton", CPU, 16, bf16)
    with pytest.raises(ValueError, match="flash_attn"):
        resolve_backend("flash_attn", CPU, 256, bf16)


@no_cuda
def test_cuda_device_without_cuda_is_a_clear_error(tiny_models: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="device='cuda' but CUDA is not available"):
        LLM(tiny_models["llama"], device="cuda", in_process=True)


def test_batch_size_ladder() -> None:
    assert batch_size_ladder(1) == [1]
    assert batch_size_ladder(6) == [1, 2, 4, 6]
    assert batch_size_ladder(40) == [1, 2, 4, 8, 16, 32, 40]
    ladder = batch_size_ladder(10_000)
    assert ladder[-1] == 512 and all(b - a <= 16 for a, b in zip(ladder, ladder[1:]))


def test_paged_metadata_rows_and_tables() -> None:
    pytest.importorskip("triton")
    from kvflow.workers.attention import TritonBackend
    backend = TritonBackend(4, 2, 8, torch.float32, CPU)
    blocks = [np.array([7, 3, 5]), np.array([1]), np.array([2, 6])]
    # Rows: decode(0), prefill 3 rows (1-3), decode(4), prefill 2 rows (5-6).
    decodes = [SeqSpan(0, 1, 9, blocks[0]), SeqSpan(4, 1, 2, blocks[1])]
    prefills = [SeqSpan(1, 3, 3, blocks[1]), SeqSpan(5, 2, 6, blocks[2])]
    meta = backend.build_metadata(np.arange(7), decodes, prefills)
    assert meta.decode is not None and meta.prefill is not None
    assert isinstance(meta.decode.rows, torch.Tensor)          # not adjacent: gather indices
    assert isinstance(meta.prefill.rows, torch.Tensor)
    assert meta.decode.rows.tolist() == [0, 4]
    assert meta.prefill.rows.tolist() == [1, 2, 3, 5, 6]
    assert meta.decode.block_tables.tolist() == [[7, 3, 5], [1, 0, 0]]
    assert meta.decode.context_lens.tolist() == [9, 2]
    assert meta.prefill.cu_seqlens_q.tolist() == [0, 3, 5]
    assert meta.prefill.cu_seqlens_k.tolist() == [0, 3, 9]
    assert (meta.prefill.max_seqlen_q, meta.prefill.max_seqlen_k) == (3, 6)
    adjacent = backend.build_metadata(
        np.arange(3), [SeqSpan(0, 1, 9, blocks[0]), SeqSpan(1, 1, 2, blocks[1])],
        [SeqSpan(2, 1, 1, blocks[2])])
    assert adjacent.decode is not None and adjacent.decode.rows == slice(0, 2)
