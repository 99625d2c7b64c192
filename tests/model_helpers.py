"""Tiny randomly initialised models for tests (a module of its own: tests/ has two conftest.py
files, so `from conftest import ...` would be ambiguous)."""
from __future__ import annotations

import os
import shutil

import torch


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
