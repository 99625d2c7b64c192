"""Bad input gets a ValueError naming the field and value before anything runs, and the engine
keeps serving: the same LLM then runs the good prompts of the batch and gives the same tokens."""
from __future__ import annotations

import os

import pytest

from kvflow import LLM, SamplingParams

GOOD = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(default_model: str):
    with LLM(default_model, kv_cache_memory_gb=0.05, max_model_len=256) as llm:
        yield llm


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.5), "temperature=-0.5"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(top_k=0), "top_k=0"),
    (dict(top_k=-2), "top_k=-2"),
    (dict(min_p=-0.1), "min_p=-0.1"),
    (dict(min_p=1.1), "min_p=1.1"),
    (dict(max_tokens=0), "max_tokens=0"),
    (dict(logprobs=21), "logprobs=21"),
    (dict(stop=[""]), "stop="),
])
def test_invalid_sampling_params(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_engine_keeps_working(llm: LLM) -> None:
    good = ["The sky is", "Two plus two is"]
    expected = [o.token_ids for o in llm.generate(good, GOOD, use_tqdm=False)]
    cases = [
        ([], "prompt 1: prompt is empty"),
        ("", "prompt 1: prompt is empty"),
        ([5] * 300, "prompt length 300 exceeds max_model_len=256"),
        ([5] * 250, "max_tokens=8 exceeds max_model_len=256"),
        ([5, 49152], "token id 49152 is outside the vocabulary"),
        ([-1], "token id -1 is outside the vocabulary"),
        ({"prompt_token_ids": [5]}, "prompt 1: a prompt is a string or a list of token ids"),
        ([5, "x"], "prompt 1: a prompt is a string or a list of token ids"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([good[0], bad, good[1]], GOOD, use_tqdm=False)
        outs = llm.generate(good, GOOD, use_tqdm=False)
        assert [o.token_ids for o in outs] == expected


def test_request_that_can_never_fit_the_kv_cache(default_model: str) -> None:
    # One 16-token block of the default model in float32 is 737,280 bytes: 4 blocks = 64 tokens.
    with LLM(default_model, kv_cache_memory_gb=4 * 737_280 / 2**30, dtype="float32") as llm:
        with pytest.raises(ValueError, match="needs 5 KV blocks but the KV cache has only 4"):
            llm.generate([[5] * 60], SamplingParams(max_tokens=10), use_tqdm=False)
        out = llm.generate([[5] * 40], SamplingParams(max_tokens=10), use_tqdm=False)[0]
        assert len(out.token_ids) >= 1


def test_bad_model_paths(tmp_path: os.PathLike) -> None:
    with pytest.raises(ValueError, match="no such directory"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path))


def test_model_folder_without_weights(default_model: str, tmp_path: os.PathLike) -> None:
    for name in ("config.json", "tokenizer.json"):
        os.symlink(os.path.join(default_model, name), os.path.join(tmp_path, name))
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("kwargs, message", [
    (dict(dtype="float8"), "dtype='float8'"),
    (dict(block_size=12), "block_size=12 must be a power of two"),
    (dict(max_num_seqs=0), "max_num_seqs=0"),
    (dict(kv_cache_memory_gb=-1.0), "kv_cache_memory_gb=-1.0"),
    (dict(max_model_len=100_000), "max_model_len=100000 exceeds"),
    (dict(load_format="pickle"), "load_format='pickle'"),
    (dict(quantization="int4"), "quantization='int4' must be one of"),
    (dict(cpu_prefill_copy="yes"), "cpu_prefill_copy='yes' must be one of"),
    (dict(cpu_one_row_copy="no"), "cpu_one_row_copy='no' must be one of"),
    (dict(quantization="int8", device="cuda"), "quantization='int8' runs on CPU"),
])
def test_bad_engine_arguments(default_model: str, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(default_model, **kwargs)


def test_sampling_params_list_length_mismatch(llm: LLM) -> None:
    with pytest.raises(ValueError, match="sampling_params has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], [GOOD], use_tqdm=False)
