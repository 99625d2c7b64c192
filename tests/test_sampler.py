"""Sampler: the top-k / top-p / min-p masks against a plain-Python reference, greedy rows, seeded
reproducibility, logprobs, and a chi-square test of the sampled distribution.

Every random source is seeded, so these tests are deterministic.
"""
from __future__ import annotations

import itertools
import math
from typing import Iterator

import pytest
import torch

from kvflow.sampling_params import SamplingParams
from kvflow.workers.sampler import Sampler, SamplingBatch, apply_top_k_top_p_min_p

# Chi-square critical values at p = 0.001 by degrees of freedom (standard tables).
CHI2_CRITICAL_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def softmax(values: dict[int, float]) -> dict[int, float]:
    top = max(values.values())
    exps = {i: math.exp(v - top) for i, v in values.items()}
    total = sum(exps.values())
    return {i: e / total for i, e in exps.items()}


def reference_probs(row: list[float], temperature: float, top_k: int, top_p: float,
                    min_p: float) -> dict[int, float]:
    """HF warper order in float64: temperature, top-k, top-p, min-p. Token id -> probability
    of the tokens that survive (renormalised)."""
    scaled = {i: x / temperature for i, x in enumerate(row)}
    order = sorted(scaled, key=lambda i: scaled[i], reverse=True)
    if top_k > 0:
        order = order[:top_k]
    if top_p < 1:
        # The smallest set of top tokens whose probability reaches top_p (at least one).
        probs, cum, kept = softmax({i: scaled[i] for i in order}), 0.0, []
        for i in order:
            kept.append(i)
            cum += probs[i]
            if cum >= top_p:
                break
        order = kept
    probs = softmax({i: scaled[i] for i in order})
    threshold = min_p * max(probs.values())
    return softmax({i: scaled[i] for i in order if probs[i] >= threshold})


def apply_masks(logits: torch.Tensor, params: list[tuple[float, int, float, float]]
                ) -> torch.Tensor:
    """Temperature then the masks, the way Sampler._draw calls apply_top_k_top_p_min_p."""
    temperature, top_k, top_p, min_p = (torch.tensor(col) for col in zip(*params))
    return apply_top_k_top_p_min_p(logits / temperature.unsqueeze(1), top_k, top_p, min_p)


# The implementation under test: torch ops, or the C kernels the CPU worker's sampler calls
# (cpu_ops.sample, argmax and logprobs); set by the `impl` fixture.
IMPL: dict = {}


@pytest.fixture(params=["torch", "c"])
def impl(request: pytest.FixtureRequest) -> Iterator[str]:
    from kvflow.kernels import cpu_ops
    IMPL.clear()
    if request.param == "c":
        IMPL.update(draw=cpu_ops.sample, argmax=cpu_ops.argmax, top_logprobs=cpu_ops.logprobs)
    yield str(request.param)
    IMPL.clear()


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int] | None = None,
           seed: int = 0) -> tuple[list[int], list[dict[int, float]] | None]:
    positions = [0] * len(params) if positions is None else positions
    return Sampler(seed, **IMPL)(logits, SamplingBatch(params, positions))


# --- masks -------------------------------------------------------------------------------

def test_masks_match_the_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    grid = list(itertools.product((0.5, 1.0, 1.7), (-1, 1, 3, 10, 40), (1.0, 0.95, 0.8, 0.3),
                                  (0.0, 0.05, 0.2)))
    logits = torch.randn(len(grid), 64, generator=gen) * 2        # [180, 64], no ties
    assert all(len(set(row)) == 64 for row in logits.tolist())
    masked = apply_masks(logits, grid)
    scaled = logits / torch.tensor([g[0] for g in grid]).unsqueeze(1)
    for row, (t, k, p, m) in enumerate(grid):
        expected = reference_probs(logits[row].tolist(), t, k, p, m)
        kept = torch.isfinite(masked[row]).nonzero().flatten().tolist()
        assert sorted(kept) == sorted(expected), (t, k, p, m)
        # Survivors keep their (temperature-scaled) logits untouched.
        assert torch.equal(masked[row, kept], scaled[row, kept])
        got = masked[row].double().softmax(-1)
        assert all(abs(got[i].item() - q) < 1e-6 for i, q in expected.items())


def test_masks_of_wide_nuclei_and_large_k_match_the_reference() -> None:
    """Top-p looks at the TOP_P_WINDOW largest logits first: a flat row whose nucleus is wider
    is redone over the whole vocabulary; a top-k past the window sorts k candidates."""
    from kvflow.workers import sampler
    gen = torch.Generator().manual_seed(2)
    vocab = 3 * sampler.TOP_P_WINDOW
    logits = torch.randn(4, vocab, generator=gen) * torch.tensor([[0.05], [0.05], [4.0], [0.3]])
    grid = [(1.0, -1, 0.9, 0.0),       # nucleus ~0.9 x vocab: past the window
            (1.0, -1, 0.3, 0.0),       # ~0.3 x vocab: just inside or past it
            (1.0, -1, 0.9, 0.0),       # peaked: inside the window
            (1.0, 2500, 0.99, 0.01)]   # k past the window, then top-p and min-p
    masked = apply_masks(logits, grid)
    sizes = []
    for row, (t, k, p, m) in enumerate(grid):
        expected = reference_probs(logits[row].tolist(), t, k, p, m)
        kept = torch.isfinite(masked[row]).nonzero().flatten().tolist()
        assert sorted(kept) == sorted(expected), (row, len(kept), len(expected))
        sizes.append(len(kept))
    assert sizes[0] > sampler.TOP_P_WINDOW and sizes[3] > sampler.TOP_P_WINDOW
    assert sizes[2] < sampler.TOP_P_WINDOW


def test_chunked_masks_and_draws_equal_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large batches are masked and drawn CHUNK_ELEMENTS at a time (peak memory): with two
    rows a chunk (the last one alone; rows 0 and 4 redone over the whole vocabulary, in the
    first and in a later chunk) the masks and the tokens drawn are those of one pass."""
    from kvflow.workers import sampler
    gen = torch.Generator().manual_seed(5)
    vocab = 3 * sampler.TOP_P_WINDOW
    logits = torch.randn(7, vocab, generator=gen) * torch.tensor(
        [[0.05], [4.0], [0.3], [1.0], [0.05], [2.0], [0.5]])
    grid = [(1.0, -1, 0.9, 0.0), (0.7, -1, 0.9, 0.0), (1.0, 900, 0.99, 0.01),
            (1.0, -1, 1.0, 0.0), (1.3, -1, 0.5, 0.05), (1.0, 40, 1.0, 0.0), (0.9, -1, 1.0, 0.2)]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in grid]
    batch = SamplingBatch(params, [0] * len(params), [[0]] * len(params))

    def run() -> tuple[torch.Tensor, list[list[int]]]:
        draws = Sampler(11)
        return apply_masks(logits, grid), [draws(logits, batch)[0] for _ in range(20)]

    masks, ids = run()
    monkeypatch.setattr(sampler, "CHUNK_ELEMENTS", 2 * vocab)
    chunked_masks, chunked_ids = run()
    assert torch.equal(chunked_masks, masks)
    assert chunked_ids == ids
    assert len({tuple(i) for i in ids}) > 1          # the draws are not all alike


def test_masks_keep_at_least_the_top_token() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]] * 3)
    masked = apply_masks(logits, [(1.0, 1, 1.0, 0.0), (1.0, -1, 0.01, 0.0), (1.0, -1, 1.0, 1.0)])
    assert torch.isfinite(masked).sum(dim=1).tolist() == [1, 1, 1]
    assert masked.argmax(dim=1).tolist() == [1, 1, 1]


def test_rows_without_filters_keep_every_token_in_a_mixed_batch() -> None:
    # top_p = 1 means off: a float32 cumsum reaching 1.0 early must not cut a long tail.
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 4096, generator=gen) * 3
    masked = apply_masks(logits, [(1.0, -1, 1.0, 0.0), (1.0, 5, 1.0, 0.0),
                                  (1.0, -1, 1.0, 0.0), (0.8, -1, 0.5, 0.1)])
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    assert int(torch.isfinite(masked[1]).sum()) == 5


# --- greedy and seeds --------------------------------------------------------------------

def test_greedy_rows_are_argmax(impl: str) -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 50, generator=gen)
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 else
              SamplingParams(temperature=1.5, top_k=10, seed=i) for i in range(8)]
    ids, logprobs = sample(logits, params)
    argmax = logits.argmax(dim=1).tolist()
    assert [ids[i] for i in range(0, 8, 2)] == argmax[0::2]
    assert logprobs is None
    all_greedy, _ = sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert all_greedy == argmax


def test_bf16_logits_give_the_float32_results(impl: str) -> None:
    """The runner hands the LM head's logits over as they are: greedy rows take their argmax
    directly (torch's, and the CPU kernel's when the cpu backend runs); draws and logprobs are
    computed from float32 copies, so a bf16 batch gives exactly the float32 batch's results."""
    from kvflow.kernels import cpu_ops
    logits = (torch.randn(6, 300, generator=torch.Generator().manual_seed(9)) * 3).bfloat16()
    logits[1, 7] = logits[1, 200] = logits[1].max() + 1            # a tie: the first wins
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, top_p=0.9, seed=5, logprobs=1),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=6),
              SamplingParams(temperature=0.0)]
    expected = sample(logits.float(), params, seed=3)
    assert sample(logits, params, seed=3) == expected
    assert expected[0][1] == 7
    if cpu_ops.library() is not None:
        sampler = Sampler(3, **{**IMPL, "argmax": cpu_ops.argmax})
        assert sampler(logits, SamplingBatch(params, [0] * 6)) == expected


def test_sampled_tokens_are_always_allowed_by_the_masks(impl: str) -> None:
    gen = torch.Generator().manual_seed(3)
    grid = [(0.7, 5, 1.0, 0.0), (1.0, -1, 0.6, 0.0), (1.3, -1, 1.0, 0.3), (1.0, 8, 0.9, 0.1)]
    logits = torch.randn(400, 30, generator=gen)
    rows = [grid[i % 4] for i in range(400)]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in rows]
    ids, _ = sample(logits, params)
    for row, token_id in enumerate(ids):
        assert token_id in reference_probs(logits[row].tolist(), *rows[row]), row


def seeded_batch_tokens(logits: torch.Tensor, row: int, target: SamplingParams,
                        position: int, sampler_seed: int) -> int:
    """The token `target` gets at `position` when placed at `row` among unrelated rows."""
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=3),
              SamplingParams(temperature=1.2, seed=99), SamplingParams(top_p=0.5, min_p=0.1)]
    params = others[:row] + [target] + others[row:]
    positions = [7, 3, 0, 12][:row] + [position] + [7, 3, 0, 12][row:]
    batch = torch.randn(5, logits.shape[-1], generator=torch.Generator().manual_seed(row))
    batch[row] = logits
    ids, _ = sample(batch, params, positions, seed=sampler_seed)
    return ids[row]


def test_seeded_request_is_independent_of_the_batch(impl: str) -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(100, generator=gen) * 0.5                 # flat: many likely tokens
    target = SamplingParams(temperature=1.0, seed=1234)
    for position in (0, 5, 17):
        alone, _ = sample(logits.unsqueeze(0), [target], [position], seed=0)
        in_batches = {seeded_batch_tokens(logits, row, target, position, sampler_seed)
                      for row in range(5) for sampler_seed in (0, 1)}
        assert in_batches == {alone[0]}, position


def tokens_over_positions(logits: torch.Tensor, seed: int, num_positions: int) -> list[int]:
    params = [SamplingParams(temperature=1.0, seed=seed)] * num_positions
    ids, _ = sample(logits.expand(num_positions, -1), params, list(range(num_positions)))
    return ids


def test_different_seeds_and_positions_give_different_tokens(impl: str) -> None:
    logits = torch.zeros(50)                                       # uniform over 50 tokens
    a = tokens_over_positions(logits, seed=1, num_positions=60)
    b = tokens_over_positions(logits, seed=2, num_positions=60)
    assert a == tokens_over_positions(logits, seed=1, num_positions=60)
    # Independent uniform draws agree with probability 1/50: expect about 1 match in 60.
    assert sum(x != y for x, y in zip(a, b)) >= 50
    assert len(set(a)) >= 25                                       # positions differ too


# --- logprobs ----------------------------------------------------------------------------

def test_logprobs_are_top_k_plus_sampled_from_raw_logits(impl: str) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 200, generator=gen) * 2
    params = [SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=50.0, seed=7, logprobs=3),    # ~uniform: leaves top 3
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.5, top_k=2, seed=3, logprobs=0)]
    ids, logprobs = sample(logits, params)
    assert logprobs is not None and len(logprobs) == 4
    raw = logits.double().log_softmax(dim=-1)                      # before temperature/masks
    top3 = [set(raw[i].topk(3).indices.tolist()) for i in range(4)]
    assert ids[1] not in top3[1]
    assert set(logprobs[0]) == top3[0] and ids[0] in top3[0]
    assert set(logprobs[1]) == top3[1] | {ids[1]}
    assert set(logprobs[3]) == {ids[3]}
    for i in (0, 1, 3):
        for token_id, value in logprobs[i].items():
            assert abs(value - raw[i, token_id].item()) < 1e-5, (i, token_id)


# --- the sampled distribution ------------------------------------------------------------

def chi_square(counts: list[int], expected: dict[int, float], num_draws: int) -> float:
    return sum((counts[i] - num_draws * q) ** 2 / (num_draws * q) for i, q in expected.items())


def check_distribution(params: SamplingParams, num_draws: int = 20000) -> None:
    row = [1.2, 0.4, -0.3, 0.9, -1.0, 0.1]
    logits = torch.tensor([row]).expand(num_draws, -1)
    ids, _ = sample(logits, [params] * num_draws, seed=42)         # unseeded requests
    counts = torch.bincount(torch.tensor(ids), minlength=6).tolist()
    expected = reference_probs(row, params.temperature, params.top_k, params.top_p,
                               params.min_p)
    assert all(counts[i] == 0 for i in range(6) if i not in expected), counts
    df = len(expected) - 1
    statistic = chi_square(counts, expected, num_draws)
    assert statistic < CHI2_CRITICAL_P001[df], (statistic, counts, expected)


def test_temperature_sampling_matches_softmax(impl: str) -> None:
    check_distribution(SamplingParams(temperature=0.7))            # all 6 tokens, df = 5


def test_top_k_top_p_sampling_matches_renormalised_softmax(impl: str) -> None:
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    kept = reference_probs([1.2, 0.4, -0.3, 0.9, -1.0, 0.1], 0.7, 5, 0.9, 0.0)
    assert len(kept) == 4                                          # both masks bite
    check_distribution(params)


def test_min_p_sampling_matches_renormalised_softmax(impl: str) -> None:
    kept = reference_probs([1.2, 0.4, -0.3, 0.9, -1.0, 0.1], 1.0, -1, 1.0, 0.3)
    assert len(kept) == 4
    check_distribution(SamplingParams(temperature=1.0, min_p=0.3))


# --- the CPU kernel's draw (cpu_ops.sample) against the torch path --------------------------

def test_the_c_draw_picks_what_the_torch_path_picks(kernels: str) -> None:
    """Sampler(draw=cpu_ops.sample) against the torch masks + inverse-CDF draw, fed the same
    uniforms (same seed): the same token every time, across temperature, top-k, top-p, min-p
    and their mixes, a wide nucleus, masked (-inf) tokens, seeded rows, and a tied top."""
    from kvflow.kernels import cpu_ops
    gen = torch.Generator().manual_seed(3)
    vocab = 5000
    logits = torch.randn(8, vocab, generator=gen) * 3
    logits[5] *= 0.02                                    # flat: a nucleus past the window
    logits[6, ::3] = float("-inf")                       # masked tokens
    logits[7, 10] = logits[7, 20] = logits[7].max() + 2  # a tie at the top
    params = [SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=50),
              SamplingParams(temperature=1.5, top_k=10, top_p=0.8, min_p=0.05),
              SamplingParams(temperature=0.5, min_p=0.2),
              SamplingParams(temperature=1.0, seed=7),
              SamplingParams(temperature=1.0, top_p=0.95),
              SamplingParams(temperature=0.8, top_k=200, top_p=0.7),
              SamplingParams(temperature=1.2, top_p=0.5)]
    torch_sampler, c_sampler = Sampler(11), Sampler(11, draw=cpu_ops.sample)
    drawn = []
    for step in range(150):
        batch = SamplingBatch(params, [step] * len(params))
        ours, _ = c_sampler(logits, batch)
        theirs, _ = torch_sampler(logits, batch)
        assert ours == theirs, step
        drawn.append(ours)
    # and the draws vary where they should: every row but the peaked ones takes many ids
    distinct = [len({ids[row] for ids in drawn}) for row in range(len(params))]
    assert distinct[0] > 3 and distinct[5] > 100 and distinct[4] > 20
    assert all(ids[6] % 3 for ids in drawn)              # never a masked token


def test_a_vanishing_temperature_samples_greedily(impl: str) -> None:
    """A temperature below 1e-5 (allowed: > 0) takes the argmax, as in vLLM: logits / T would
    overflow (1e-40) and the draw give whatever NaNs give. The C draw also takes the argmax
    where x / T overflows."""
    from kvflow.kernels import cpu_ops
    logits = torch.randn(3, 700, generator=torch.Generator().manual_seed(13)) * 5
    for t in (1e-40, 1e-6):
        ids, _ = sample(logits, [SamplingParams(temperature=t, seed=s) for s in range(3)])
        assert ids == logits.argmax(dim=1).tolist(), t
    if impl == "c":
        u = torch.full((3,), 0.5, dtype=torch.float64)
        drawn = cpu_ops.sample(logits, [1e-40] * 3, [-1] * 3, [1.0] * 3, [0.0] * 3, u)
        assert drawn.tolist() == logits.argmax(dim=1).tolist()
