"""Greedy tokens from an int8 copy of the LM head plus exact rows (workers/greedy_head.py,
kernels/cpu_gemv.c `greedy_head`, `greedy_head_pairs`) against the reference: the LM head's
own kernel's full product (the bfloat16 panels under float32 arithmetic; the pair panels,
bfloat16 logits) and the first index of its maximum, on every ISA build; cases where the
int8 logits alone pick another token; exact ties, and ties after rounding to bfloat16; and
the engine's tokens with the head on and off."""
from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.kernels import cpu_ops
from kvflow.workers.greedy_head import MAX_ROWS, GreedyHead


def reference(x: torch.Tensor, weight: torch.Tensor) -> list[int]:
    """The LM head's logits as its bfloat16 panels compute them, and their argmax."""
    panels = cpu_ops.pack_panels(weight.to(torch.bfloat16))
    assert panels is not None
    logits = cpu_ops.gemv(x, panels, layout="panels")
    return torch.argmax(logits, dim=-1).tolist()


def int8_only(x: torch.Tensor, head: GreedyHead) -> list[int]:
    """What the int8 copy alone would pick."""
    layout = "panels" if head.q_type == cpu_ops.I8_PANELS else "rows"
    return torch.argmax(cpu_ops.gemv(x, head.q, head.scales, layout=layout), dim=-1).tolist()


def weights(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16).float()


@pytest.mark.parametrize("k", [96, 75])          # int8 panels; K odd: int8 rows
def test_tokens_equal_the_full_product_and_argmax(kernels: str, k: int) -> None:
    if cpu_ops.pack_panels(torch.zeros(32, 8, dtype=torch.bfloat16)) is None:
        pytest.skip("this build has no vector path: the LM head has no panels")
    w = weights(32 * 37, k, 0)
    g = torch.Generator().manual_seed(1)
    # 300 rows within a few bfloat16 steps of row 0: near-ties when x points along it.
    w[1:301] = (w[0] + torch.randn(300, k, generator=g) * 0.002).to(torch.bfloat16).float()
    head = GreedyHead(w)
    assert (head.q_type == cpu_ops.I8_PANELS) == (k % 2 == 0)
    differs = 0
    for trial in range(60):
        rows = (1, 7, MAX_ROWS)[trial % 3]
        x = torch.randn(rows, k, generator=g) * (0.3 + trial % 7)
        if trial % 2:
            x += w[0] * 30
        expected = reference(x, w)
        assert head(x) == expected
        assert all(1 <= c <= w.shape[0] for c in head.last_candidates)
        differs += sum(a != b for a, b in zip(int8_only(x, head), expected))
    # The int8 logits alone pick another token now and then: the exact rows decide those.
    assert differs > 0


def test_near_ties_and_exact_ties(kernels: str) -> None:
    """Rows one bfloat16 step apart win by their exact sums; equal rows: the first wins."""
    if cpu_ops.pack_panels(torch.zeros(32, 8, dtype=torch.bfloat16)) is None:
        pytest.skip("this build has no vector path: the LM head has no panels")
    w = weights(32 * 8, 64, 2)
    w[200] = w[17]                                # an exact tie, later index
    w[90] = w[17]
    w[91] = w[17]
    w[91, 3] = torch.tensor(w[17, 3].item()).to(torch.bfloat16).float() * (1 + 2 ** -7)
    head = GreedyHead(w)
    x = torch.stack([w[17] * 40, w[91] * 40, -w[17] * 40, torch.zeros(64)])
    x[3, 3] = 1.0
    expected = reference(x, w)
    assert head(x) == expected
    assert expected[0] in (17, 91)                # 17 before its copies at 90 and 200


def test_rows_the_bound_cannot_decide_fall_back() -> None:
    """inf or NaN, a zero row (every token ties) and rows so large that the int8 logits
    overflow (though the exact ones would not): None, and the full logits decide."""
    w = weights(32 * 4, 32, 3)
    head = GreedyHead(w)
    assert head(torch.full((1, 32), float("nan"))) is None
    x = torch.ones(2, 32)
    x[1, 5] = float("inf")
    assert head(x) is None
    assert head(torch.zeros(1, 32)) is None
    assert head(torch.ones(1, 32)) is not None
    assert head(torch.randn(1, 32, generator=torch.Generator().manual_seed(4)) * 3e36) is None


def _pairs_here(kernels: str) -> bool:
    """Whether this build has the pair panels (AVX512-BF16: the native build on such a CPU)."""
    return kernels == "native" and cpu_ops.pairs_available()


def _refuses(kernels: str) -> None:
    """A build without the pair panels (no AVX512-BF16) refuses a bfloat16 head."""
    assert not _pairs_here(kernels)
    head = GreedyHead((torch.randn(64, 32) * 0.05).bfloat16())
    with pytest.raises(RuntimeError, match="cannot run"):
        head(torch.randn(1, 32).bfloat16())


def reference_pairs(x: torch.Tensor, weight: torch.Tensor) -> list[int]:
    """The LM head's bfloat16 logits as its pair panels compute them, and their argmax."""
    pairs = cpu_ops.pack_pairs(weight)
    assert pairs is not None
    return torch.argmax(cpu_ops.gemv(x, pairs, layout="pairs"), dim=-1).tolist()


@pytest.mark.parametrize("k", [96, 64])
def test_pair_panels_tokens_equal_the_full_product_and_argmax(kernels: str, k: int) -> None:
    """bfloat16 weights, x and logits (the pair panels): the head's tokens are the pair
    panels' full product's argmax, near-ties included, while the int8 logits alone pick
    another token now and then; a build without pair panels refuses."""
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(32 * 37, k, generator=g) * 0.05).bfloat16()
    w[1:301] = (w[0].float() + torch.randn(300, k, generator=g) * 0.002).bfloat16()
    head = GreedyHead(w)
    if not _pairs_here(kernels):
        _refuses(kernels)
        return
    differs = 0
    for trial in range(60):
        rows = (1, 7, MAX_ROWS)[trial % 3]
        x = torch.randn(rows, k, generator=g) * (0.3 + trial % 7)
        if trial % 2:
            x += w[0].float() * 30
        x = x.bfloat16()
        expected = reference_pairs(x, w)
        assert head(x) == expected
        assert all(1 <= c <= w.shape[0] for c in head.last_candidates)
        differs += sum(a != b for a, b in zip(int8_only(x, head), expected))
    assert differs > 0


def test_pair_panels_ties_after_rounding(kernels: str) -> None:
    """bfloat16 logits tie far more often than float32 ones: a row whose exact sum is below
    another's by more than the bound's width, but rounds to the same bfloat16, wins when it
    comes first (the argmax of the rounded logits), so it must stay a candidate; after the
    other it loses; an exact copy after: the first wins. The two rows hold multiples of
    1/8 up to 127/8, so their int8 copies are exact and the bound is narrow (~0.04 here).
    A build without pair panels refuses."""
    if not _pairs_here(kernels):
        _refuses(kernels)
        return
    g = torch.Generator().manual_seed(6)
    k = 64
    w = (torch.randn(32 * 8, k, generator=g) * 0.05).bfloat16()
    top = torch.zeros(k)
    top[0], top[k - 1] = 12.5, 127 / 8                   # 127 / 8: the row's int8 scale 1/8
    low = top.clone()
    low[1] = -0.125
    x = torch.zeros(2, k)
    x[:, 0], x[:, 1] = 8.0, 1.0                           # logits 100 and 99.875: both 100.0
    for first, (a, b) in ((9, (9, 17)), (17, (17, 200))):   # in bfloat16 (its step there: 0.5)
        w2 = w.clone()
        w2[a], w2[b] = (low, top) if first == 9 else (top, low)
        w2[90 if a < 90 else 250] = w2[17]               # an exact copy of row 17, later
        head = GreedyHead(w2)
        logits = cpu_ops.gemv(x.bfloat16(), cpu_ops.pack_pairs(w2), layout="pairs",
                              out_dtype=torch.float32)
        assert float(logits[0, 17]) - float(logits[0, a if first == 9 else b]) == 0.125
        expected = reference_pairs(x.bfloat16(), w2)
        assert expected == [first, first]
        assert head(x.bfloat16()) == expected


def test_pair_panels_rows_the_bound_cannot_decide_fall_back(kernels: str) -> None:
    """As test_rows_the_bound_cannot_decide_fall_back, with bfloat16 x; a build without pair
    panels refuses."""
    if not _pairs_here(kernels):
        _refuses(kernels)
        return
    w = (torch.randn(32 * 4, 32, generator=torch.Generator().manual_seed(3)) * 0.05).bfloat16()
    head = GreedyHead(w)
    x = torch.ones(2, 32).bfloat16()
    assert head(x) is not None
    x[1, 5] = float("inf")
    assert head(x) is None
    assert head(torch.full((1, 32), float("nan")).bfloat16()) is None
    assert head(torch.zeros(1, 32).bfloat16()) is None
    assert head((torch.ones(1, 32) * 3e36).bfloat16()) is None


def test_takes_only_plain_greedy_rows() -> None:
    """Up to max_rows rows (MAX_ROWS; one beside AMX tiles), each plain greedy."""
    plain = SamplingParams(temperature=0)
    head, one_row = GreedyHead(torch.randn(64, 32)), GreedyHead(torch.randn(64, 32), 1)
    assert head.takes([plain] * MAX_ROWS, masked=False)
    assert not head.takes([plain] * (MAX_ROWS + 1), masked=False)
    assert one_row.takes([plain], masked=False)
    assert not one_row.takes([plain] * 2, masked=False)
    assert not head.takes([plain], masked=True)
    assert not head.takes([], masked=False)
    for other in (SamplingParams(temperature=0.7), SamplingParams(temperature=0, logprobs=1),
                  SamplingParams(temperature=0, repetition_penalty=1.2),
                  SamplingParams(temperature=0, logit_bias={5: 3.0}),
                  SamplingParams(temperature=0, min_tokens=3)):
        assert not head.takes([plain, other], masked=False)


def test_engine_tokens_with_and_without_the_head(default_model: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """dtype="auto" as an AVX2 CPU (flags faked): the LM head is bfloat16 panels, the head is
    built and used for greedy steps (one to three rows), and the tokens equal the full LM
    head's; a batch with a sampled row goes through the sampler, as before."""
    monkeypatch.setenv("KVFLOW_CPU_FLAGS", "sse4_2 avx avx2 fma f16c bmi2")
    prompts = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time,"]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    mixed = [greedy, SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True),
             greedy]
    with LLM(default_model, in_process=True, kv_cache_memory_gb=0.2) as llm:
        from kvflow.frontend.engine_client import InProcessEngine
        assert isinstance(llm.engine, InProcessEngine)
        runner = llm.engine.worker.runner
        head = runner.greedy
        assert head is not None
        calls: list[int] = []

        def counted(hidden: torch.Tensor) -> list[int] | None:
            calls.append(hidden.shape[0])
            return GreedyHead.__call__(head, hidden)
        runner.greedy = counted                  # type: ignore[assignment]
        runner.greedy.takes = head.takes         # type: ignore[attr-defined]
        on = ([o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
              + [llm.generate([p], greedy, use_tqdm=False)[0].token_ids for p in prompts]
              + [o.token_ids for o in llm.generate(prompts, mixed, use_tqdm=False)])
        used = len(calls)
        runner.greedy = None
        off = ([o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
               + [llm.generate([p], greedy, use_tqdm=False)[0].token_ids for p in prompts]
               + [o.token_ids for o in llm.generate(prompts, mixed, use_tqdm=False)])
    assert on == off
    # Every step of the greedy runs (the prompt's and 23 decodes), none of the mixed one.
    assert used == 24 + 3 * 24 and set(calls) == {1, 3}


def test_engine_tokens_with_and_without_the_pair_panels_head(default_model: str) -> None:
    """dtype="bfloat16": where the LM head is pair panels (AVX512-BF16, no AMX), or AMX tiles
    whose one-row products read 12-bit pair panels, the head is built for them (for one-row
    steps only beside the tiles) and used for a request alone, and its tokens equal the full
    LM head's; elsewhere none is built for a bfloat16 head on another kernel."""
    prompts = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time,"]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(default_model, in_process=True, kv_cache_memory_gb=0.2, dtype="bfloat16") as llm:
        from kvflow.frontend.engine_client import InProcessEngine
        assert isinstance(llm.engine, InProcessEngine)
        runner = llm.engine.worker.runner
        head = runner.greedy
        prepared = runner.model.lm_head.prepared
        tiles = prepared.layout == "amx" and prepared.one_row is not None
        assert (head is not None) == (prepared.layout == "pairs" or tiles)
        if head is None:
            return
        assert head.dtype == torch.bfloat16 and head.max_rows == (1 if tiles else MAX_ROWS)
        on = [llm.generate([p], greedy, use_tqdm=False)[0].token_ids for p in prompts]
        runner.greedy = None
        off = [llm.generate([p], greedy, use_tqdm=False)[0].token_ids for p in prompts]
    assert on == off
