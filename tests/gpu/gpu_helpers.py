"""Helpers of the GPU tests (tests/gpu): the CUDA skip mark, tokenizer files for a random model
folder, and a kvflow run as an HF-style reference for the tie rule."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from hf_reference import Reference
from kvflow.frontend.model_files import DEFAULT_FOLDER, cache_dir

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VOCAB_SIZE = 49152          # the default model's tokenizer


def write_tokenizer(out_dir: str) -> None:
    """Tokenizer files for a model folder: from KVFLOW_TOKENIZER_DIR, else the default model's
    cached folder, else a word-level tokenizer written here (the tests send token ids)."""
    default_folder = os.path.join(cache_dir(), DEFAULT_FOLDER)
    for source in (os.environ.get("KVFLOW_TOKENIZER_DIR"), default_folder):
        if source and os.path.isfile(os.path.join(source, "tokenizer.json")):
            for name in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(source, name)):
                    shutil.copy(os.path.join(source, name), out_dir)
            return
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"t{i}": i for i in range(VOCAB_SIZE)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))


def as_reference(token_ids: list[int], logprobs: list[dict[int, float]]) -> Reference:
    """A kvflow run as the `Reference` of assert_greedy_match (its top-k logprobs, rest -inf)."""
    dense = []
    for step in logprobs:
        row = torch.full((VOCAB_SIZE,), float("-inf"))
        row[list(step)] = torch.tensor(list(step.values()))
        dense.append(row)
    return Reference(token_ids, dense)
