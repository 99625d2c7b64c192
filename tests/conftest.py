"""Shared fixtures: the default model folder, tiny random models, and the HF reference."""
from __future__ import annotations

import pytest
import torch

from kvflow.frontend.model_files import ensure_default_model
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
