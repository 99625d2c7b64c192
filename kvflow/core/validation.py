"""Request checks shared by the frontend (raise before anything runs) and EngineCore (reply
with an error): both must agree on what is acceptable."""
from __future__ import annotations

from kvflow.sampling_params import SamplingParams


def check_request(prompt_token_ids: list[int], params: SamplingParams, *, max_model_len: int,
                  vocab_size: int, block_size: int, num_blocks: int) -> str | None:
    """None if the request can run, else a message naming the field and its value."""
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        return "prompt is empty"
    if num_prompt > max_model_len:
        return f"prompt length {num_prompt} exceeds max_model_len={max_model_len}"
    if num_prompt + params.max_tokens > max_model_len:
        return (f"prompt length {num_prompt} + max_tokens={params.max_tokens} exceeds "
                f"max_model_len={max_model_len}")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        return (f"prompt token id {str(bad)[:40]} is outside the vocabulary "
                f"[0, {vocab_size})")
    if params.top_k > vocab_size:
        return f"top_k={params.top_k} exceeds the vocabulary size {vocab_size} (-1 is off)"
    bad = next((t for t in params.logit_bias or () if not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"logit_bias token id {bad} is outside the vocabulary [0, {vocab_size})"
    need = -(-(num_prompt + params.max_tokens) // block_size)
    if need > num_blocks:
        return (f"prompt length {num_prompt} + max_tokens={params.max_tokens} needs {need} KV "
                f"blocks but the KV cache has only {num_blocks}; raise kv_cache_memory_gb")
    return None
