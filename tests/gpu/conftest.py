"""GPU-only tests: skipped without CUDA. Run them (with tests/kernels and the GPU benchmark) by
`bash benchmarks/gpu_suite.sh`, or alone by `python -m pytest tests/gpu -q`.

The model is a small Qwen3-shaped random model saved as safetensors in a temp folder; its
tokenizer comes from KVFLOW_TOKENIZER_DIR, else the default model's cached folder, else a
word-level tokenizer written on the spot (the tests send token ids; text is only decoded).
"""
from __future__ import annotations

import gc
from typing import Iterator

import pytest
import torch

from gpu_helpers import VOCAB_SIZE, write_tokenizer


@pytest.fixture(scope="session")
def qwen3_small(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3-0.6B's shape (head_dim 128, GQA 2, tied embeddings, rope_theta 1e6), fewer and
    narrower layers; random bf16 weights saved as safetensors."""
    import transformers
    out_dir = str(tmp_path_factory.mktemp("qwen3_small"))
    config = transformers.Qwen3Config(
        vocab_size=VOCAB_SIZE, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    write_tokenizer(out_dir)
    return out_dir


@pytest.fixture(autouse=True)
def _free_gpu_memory() -> Iterator[None]:
    """In-process engines hold their KV cache and graphs until collected: collect after each."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
