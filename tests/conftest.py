"""Shared fixtures: the default model folder, tiny random models, and the HF reference."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from kvflow.frontend.model_files import ensure_default_model

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def default_model() -> str:
    return ensure_default_model()


def make_tiny_model(default_model: str, out_dir: str, arch: str, **overrides: object) -> str:
    """A tiny randomly initialised HF model (Llama/Qwen2/Qwen3) saved as a local folder, with
    the default model's tokenizer (same vocab size) so text prompts work too."""
    import transformers
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config}[arch]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM}[arch]
    kwargs: dict = dict(vocab_size=49152, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                        initializer_range=0.2)
    if arch == "qwen3":
        kwargs["head_dim"] = 32
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs)).float()
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        src = os.path.join(default_model, name)
        if os.path.exists(src):
            shutil.copy(src, out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_models(default_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(default_model, str(root / arch), arch)
            for arch in ("llama", "qwen2", "qwen3")}
