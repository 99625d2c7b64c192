"""Shared fixtures: the default model folder, tiny random models, and the HF reference."""
from __future__ import annotations

import pytest
import torch

from kvflow.frontend.model_files import ensure_default_model
from kvflow.kernels import cpu_ops
from model_helpers import make_tiny_model

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def default_model() -> str:
    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_models(default_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(default_model, str(root / arch), arch)
            for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(params=list(cpu_ops.ISA_FLAGS))
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test three times, on every machine: the library as built for this CPU (its
    AVX-512 BF16 attention path where the CPU has one), built without AVX512-BF16 (what an
    AVX-512 CPU such as Cascade Lake runs) and without AVX-512 at all (AVX2 CPUs)."""
    if request.param != "native":
        monkeypatch.setattr(cpu_ops, "_state", {"lib": cpu_ops.load_isa(request.param)})
    return str(request.param)
