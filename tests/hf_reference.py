"""HF transformers as the correctness reference, and docs/design.md §4's rule for logit ties."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Reference:
    token_ids: list[int]
    logprobs: list[torch.Tensor]        # per generated token: log_softmax over the vocab


def hf_greedy(model_path: str, prompts: list[list[int]], max_tokens: int,
              dtype: torch.dtype = torch.float32, device: str = "cpu",
              weights: torch.dtype | None = None,
              kv: torch.dtype | None = None) -> list[Reference]:
    """Greedy continuations by HF transformers, one prompt at a time (no padding effects).
    `weights`: every weight matrix (not norms or biases) rounded to that dtype's values first,
    computing in `dtype` all the same; `kv`: every key and value rounded to that dtype's
    values as it enters the cache (the cache update returns what attention reads, the new
    token's own key included); torch.int8: each head's key and value row quantized as
    kvflow's int8 cache stores it (cpu_ops.quantize_kv_rows) and read back."""
    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import DynamicLayer
    from kvflow.kernels.cpu_ops import dequantize_kv_rows, quantize_kv_rows
    update = DynamicLayer.update

    def stored(x: torch.Tensor) -> torch.Tensor:     # [batch, heads, tokens, head_dim]
        assert kv is not None
        if kv == torch.int8:
            return dequantize_kv_rows(quantize_kv_rows(x)).to(x.dtype)
        return x.to(kv).to(x.dtype)

    if kv is not None:
        def rounded(self, key, value, *args, **kwargs):  # type: ignore[no-untyped-def]
            return update(self, stored(key), stored(value), *args, **kwargs)
        DynamicLayer.update = rounded                     # type: ignore[method-assign]
    try:
        return _hf_greedy(model_path, prompts, max_tokens, dtype, device, weights)
    finally:
        DynamicLayer.update = update                      # type: ignore[method-assign]


def _hf_greedy(model_path: str, prompts: list[list[int]], max_tokens: int, dtype: torch.dtype,
               device: str, weights: torch.dtype | None) -> list[Reference]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    if weights is not None:
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() >= 2:
                    param.copy_(param.to(weights))
    model.generation_config.eos_token_id = None      # we compare with ignore_eos=True
    refs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0)
        refs.append(Reference(out.sequences[0, len(prompt):].tolist(),
                              [torch.log_softmax(l[0].float(), -1).cpu() for l in out.logits]))
    return refs


def assert_greedy_match(ours: list[int], our_logprobs: list[dict[int, float]],
                        ref: Reference, top: int = 5) -> int:
    """Tokens equal up to the first divergence; there each side's token must be in the other's
    top-`top` (a tie within rounding). Returns the number of positions compared exactly."""
    assert len(ours) == len(ref.token_ids), (len(ours), len(ref.token_ids))
    for i, (a, b) in enumerate(zip(ours, ref.token_ids)):
        if a == b:
            continue
        ref_top = ref.logprobs[i].topk(top).indices.tolist()
        our_top = sorted(our_logprobs[i], key=our_logprobs[i].get, reverse=True)[:top]
        assert a in ref_top and b in our_top, (
            f"diverged at {i}: ours {a} (HF top-{top} {ref_top}), HF {b} (ours {our_top})")
        return i
    return len(ours)
