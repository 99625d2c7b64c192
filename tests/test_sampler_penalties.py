"""min_tokens, logit_bias and the repetition / frequency / presence penalties: each against HF's
logits processor or a plain-Python reference of OpenAI's formula, then through the Sampler
(greedy, batch independence, seeds), validation, the scheduler's and the tracker's stop
rules, and one end-to-end run.

Every random source is seeded, so these tests are deterministic.
"""
from __future__ import annotations

import random
import re
from typing import Iterator

import pytest
import torch
from transformers import (MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor)

from kvflow import LLM
from kvflow.kernels import cpu_ops
from kvflow.core.validation import check_request
from kvflow.frontend.outputs import RequestOutput, RequestTracker
from kvflow.ipc.messages import RequestDelta
from kvflow.sampling_params import SamplingParams
from kvflow.workers.logits_processors import apply_logits_processors
from kvflow.workers.sampler import Sampler, SamplingBatch
from test_scheduler import EOS, make_core, run_all, scripted, submit

VOCAB = 64
EOS_IDS = (EOS, 5)


def histories(num_rows: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Random prompt + output token ids per row (few distinct ids, so many repeats), and
    each row's number of output tokens (0 for some)."""
    rng = random.Random(seed)
    token_ids, num_outputs = [], []
    for _ in range(num_rows):
        prompt = [rng.randrange(VOCAB // 2) for _ in range(rng.randint(1, 20))]
        output = [rng.randrange(VOCAB // 4, VOCAB) for _ in range(rng.choice((0, 1, 5, 15)))]
        token_ids.append(prompt + output)
        num_outputs.append(len(output))
    return token_ids, num_outputs


def random_logits(num_rows: int, seed: int) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


# The implementation under test: the torch ops, or the C kernels the CPU worker uses
# (cpu_ops.penalize and cpu_ops.sample); set by the `impl` fixture.
IMPL: dict = {}


@pytest.fixture(params=["torch", "c"])
def impl(request: pytest.FixtureRequest) -> Iterator[str]:
    IMPL.clear()
    if request.param == "c":
        IMPL.update(penalize=cpu_ops.penalize, draw=cpu_ops.sample, argmax=cpu_ops.argmax,
                    top_logprobs=cpu_ops.logprobs)
    yield str(request.param)
    IMPL.clear()


def process(logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]],
            num_outputs: list[int]) -> torch.Tensor:
    return apply_logits_processors(logits.clone(), params, token_ids, num_outputs, EOS_IDS,
                                   IMPL.get("penalize"))


def reference(row: list[float], p: SamplingParams, token_ids: list[int], num_output: int
              ) -> list[float]:
    """The whole pipeline in plain Python floats: min_tokens mask and logit_bias, then HF's
    repetition penalty over prompt + output, then OpenAI's frequency and presence penalties
    over the output only."""
    out = list(row)
    if num_output < p.min_tokens:
        for t in (*EOS_IDS, *(p.stop_token_ids or ())):
            out[t] = float("-inf")
    for t, bias in (p.logit_bias or {}).items():
        out[t] += bias
    outputs = token_ids[len(token_ids) - num_output:]
    for t in set(token_ids):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(outputs):
        count = outputs.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def assert_close(got: torch.Tensor, expected: torch.Tensor | list[float]) -> None:
    torch.testing.assert_close(got, torch.as_tensor(expected, dtype=got.dtype), rtol=1e-6,
                               atol=1e-5)


# --- each processor against its reference ------------------------------------------------

def test_repetition_penalty_matches_hf(impl: str) -> None:
    penalties = [0.5, 1.0, 1.3, 2.0, 1.3, 0.8]
    logits = random_logits(len(penalties), seed=0)
    token_ids, num_outputs = histories(len(penalties), seed=0)
    params = [SamplingParams(repetition_penalty=p) for p in penalties]
    got = process(logits, params, token_ids, num_outputs)
    for i, penalty in enumerate(penalties):
        hf = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([token_ids[i]]),
                                                       logits[i:i + 1].clone())
        assert_close(got[i], hf[0])
    assert torch.equal(got[1], logits[1])                          # 1.0 is off


def test_logit_bias_matches_hf_sequence_bias(impl: str) -> None:
    rng = random.Random(1)
    biases = [{rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(n)}
              for n in (1, 5, 0, 12)]
    logits = random_logits(len(biases), seed=1)
    token_ids, num_outputs = histories(len(biases), seed=1)
    params = [SamplingParams(logit_bias=b or None) for b in biases]
    got = process(logits, params, token_ids, num_outputs)
    for i, bias in enumerate(biases):
        if not bias:
            assert torch.equal(got[i], logits[i])
            continue
        hf = SequenceBiasLogitsProcessor([[[t], v] for t, v in bias.items()])(
            torch.tensor([token_ids[i]]), logits[i:i + 1].clone())
        assert_close(got[i], hf[0])


def test_min_tokens_matches_hf_and_masks_stop_token_ids(impl: str) -> None:
    # (min_tokens, outputs so far): below the minimum, exactly at it, past it, and off.
    cases = [(3, 0), (3, 2), (3, 3), (3, 7), (1, 0), (0, 0), (15, 14)]
    logits = random_logits(len(cases), seed=2)
    token_ids = [list(range(10, 20)) + [30] * n for _, n in cases]
    params = [SamplingParams(min_tokens=m, max_tokens=20, stop_token_ids=[7, 40, VOCAB + 3])
              for m, _ in cases]                    # an out-of-vocabulary stop id is ignored
    got = process(logits, params, token_ids, [n for _, n in cases])
    for i, (m, n) in enumerate(cases):
        hf = MinNewTokensLengthLogitsProcessor(10, m, [*EOS_IDS, 7, 40])(
            torch.tensor([token_ids[i]]), logits[i:i + 1].clone())
        assert torch.equal(got[i], hf[0]), (m, n)
        assert bool(torch.isinf(got[i, [EOS, 5, 7, 40]]).all()) == (n < m)


def test_frequency_and_presence_count_output_tokens_only(impl: str) -> None:
    settings = [(0.5, 0.0), (0.0, 1.5), (-1.0, 2.0), (2.0, -2.0), (0.0, 0.0), (0.3, 0.7)]
    logits = random_logits(len(settings), seed=3)
    token_ids, num_outputs = histories(len(settings), seed=3)
    params = [SamplingParams(frequency_penalty=f, presence_penalty=p) for f, p in settings]
    got = process(logits, params, token_ids, num_outputs)
    for i, (f, p) in enumerate(settings):
        outputs = token_ids[i][len(token_ids[i]) - num_outputs[i]:]
        expected = [x - f * outputs.count(t) - p * (t in outputs)
                    for t, x in enumerate(logits[i].tolist())]
        assert_close(got[i], expected)
    # A prompt token never generated is untouched (the prompt does not count here).
    only_prompt = [t for t in set(token_ids[5]) if t not in token_ids[5][-num_outputs[5]:]]
    assert only_prompt and torch.equal(got[5, only_prompt], logits[5, only_prompt])


def all_settings(num_rows: int, seed: int) -> list[SamplingParams]:
    """Every processor at once, random values, some rows plain."""
    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        if i % 3 == 2:
            rows.append(SamplingParams(temperature=0.0))
            continue
        rows.append(SamplingParams(
            temperature=0.0, max_tokens=20, min_tokens=rng.choice((0, 4, 20)),
            stop_token_ids=[rng.randrange(VOCAB)],
            logit_bias={rng.randrange(VOCAB): rng.uniform(-5, 5) for _ in range(3)},
            repetition_penalty=rng.uniform(0.5, 2.0), frequency_penalty=rng.uniform(-2, 2),
            presence_penalty=rng.uniform(-2, 2)))
    return rows


def test_all_processors_together_in_vllm_order(impl: str) -> None:
    params = all_settings(9, seed=4)
    logits = random_logits(9, seed=4)
    token_ids, num_outputs = histories(9, seed=4)
    got = process(logits, params, token_ids, num_outputs)
    for i, p in enumerate(params):
        assert_close(got[i], reference(logits[i].tolist(), p, token_ids[i], num_outputs[i]))


# --- through the sampler -----------------------------------------------------------------

def sample(logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]],
           num_outputs: list[int], seed: int = 0
           ) -> tuple[list[int], list[dict[int, float]] | None]:
    batch = SamplingBatch(params, num_outputs, token_ids)
    return Sampler(seed, eos_token_ids=EOS_IDS, **IMPL)(logits, batch)


def test_greedy_takes_the_argmax_of_the_processed_logits(impl: str) -> None:
    params = [SamplingParams(temperature=0.0, repetition_penalty=3.0, frequency_penalty=2.0,
                             logprobs=2)] * 12
    logits = random_logits(12, seed=5)
    token_ids, num_outputs = histories(12, seed=5)
    ids, logprobs = sample(logits, params, token_ids, num_outputs)
    expected = process(logits, params, token_ids, num_outputs).argmax(dim=1).tolist()
    assert ids == expected and ids != logits.argmax(dim=1).tolist()
    raw = logits.log_softmax(dim=-1)                    # logprobs stay those of the raw logits
    assert logprobs is not None
    for i, entry in enumerate(logprobs):
        assert set(raw[i].topk(2).indices.tolist()) <= set(entry)
        assert all(abs(v - raw[i, t].item()) < 1e-5 for t, v in entry.items())


def test_plain_rows_are_unaffected_by_penalised_rows(impl: str) -> None:
    plain = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=11),
             SamplingParams(temperature=1.0, top_k=8), SamplingParams(top_p=0.7, seed=3)]
    penalised = all_settings(6, seed=6)[:2] + [SamplingParams(temperature=1.0, min_tokens=2,
                                                              presence_penalty=1.0)]
    params = [plain[0], penalised[0], plain[1], plain[2], penalised[1], plain[3], penalised[2]]
    logits = random_logits(len(params), seed=6)
    token_ids, num_outputs = histories(len(params), seed=6)
    ids, _ = sample(logits, params, token_ids, num_outputs)
    plain_rows = [0, 2, 3, 5]
    # The same batch without the penalised rows' settings: the plain rows do not change
    # (unseeded draws included: the batch's noise is the same).
    neutral = [params[i] if i in plain_rows else SamplingParams(temperature=1.0)
               for i in range(len(params))]
    ids_neutral, _ = sample(logits, neutral, token_ids, num_outputs)     # the fast path
    assert [ids[i] for i in plain_rows] == [ids_neutral[i] for i in plain_rows]
    for i in (0, 2, 5):                                 # greedy and seeded rows: as alone
        alone, _ = sample(logits[i:i + 1], [params[i]], token_ids[i:i + 1], num_outputs[i:i + 1])
        assert alone == [ids[i]], i


def test_no_processing_without_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise AssertionError("processed logits for a batch without settings")
    monkeypatch.setattr("kvflow.workers.sampler.apply_logits_processors", fail)
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=1, top_k=3)]
    ids, _ = Sampler(0)(random_logits(2, seed=7), SamplingBatch(params, [0, 0]))
    assert len(ids) == 2


def test_seeded_penalised_row_is_independent_of_the_batch(impl: str) -> None:
    target = SamplingParams(temperature=1.0, seed=77, repetition_penalty=1.5,
                            frequency_penalty=0.5, presence_penalty=0.5, logit_bias={3: 2.0})
    logits = random_logits(1, seed=8)[0] * 0.3                      # flat: many likely tokens
    history, num_output = [1, 2, 3, 3, 9, 40, 40], 3
    alone, _ = sample(logits.unsqueeze(0), [target], [history], [num_output])
    others = all_settings(4, seed=8)
    for row in range(5):
        params = others[:row] + [target] + others[row:]
        batch = random_logits(5, seed=9 + row)
        batch[row] = logits
        token_ids, num_outputs = histories(5, seed=row)
        token_ids[row], num_outputs[row] = history, num_output
        for sampler_seed in (0, 1):
            ids, _ = sample(batch, params, token_ids, num_outputs, seed=sampler_seed)
            assert ids[row] == alone[0], (row, sampler_seed)


# --- validation --------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    (dict(presence_penalty=3.0), "presence_penalty=3.0"),
    (dict(frequency_penalty=-2.5), "frequency_penalty=-2.5"),
    (dict(repetition_penalty=0.0), "repetition_penalty=0.0"),
    (dict(logit_bias={5: 200.0}), "logit_bias[5]=200.0"),
    (dict(logit_bias={-1: 1.0}), "logit_bias[-1]=1.0"),
    (dict(min_tokens=-1), "min_tokens=-1"),
    (dict(min_tokens=17), "min_tokens=17"),                        # > max_tokens=16
])
def test_invalid_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        SamplingParams(**kwargs)


def test_logit_bias_id_outside_the_vocabulary_is_rejected() -> None:
    def check(params: SamplingParams) -> str | None:
        return check_request([1, 2], params, max_model_len=64, vocab_size=VOCAB,
                             block_size=16, num_blocks=8)
    assert check(SamplingParams(logit_bias={VOCAB - 1: 1.0})) is None
    error = check(SamplingParams(logit_bias={3: 1.0, VOCAB: 1.0}))
    assert error is not None and "logit_bias" in error and str(VOCAB) in error


# --- stop rules below min_tokens ---------------------------------------------------------

def test_scheduler_ignores_eos_and_stop_ids_below_min_tokens() -> None:
    scripts = {"eos": [EOS, EOS, 8, EOS, 9], "third": [8, EOS, EOS, 9],
               "stop_id": [7, 7, 7, 7], "plain": [8, EOS, 9]}
    core, _ = make_core(64, scripted(scripts))
    p = [10, 11, 12]
    submit(core, "eos", p, max_tokens=10, min_tokens=3)
    submit(core, "third", p, max_tokens=10, min_tokens=3)
    submit(core, "stop_id", p, max_tokens=10, min_tokens=2, stop_token_ids=[7])
    submit(core, "plain", p, max_tokens=10)
    got = {k: (v.token_ids, v.finish_reason) for k, v in run_all(core).items()}
    assert got == {"eos": ([EOS, EOS, 8, EOS], "stop"),
                   "third": ([8, EOS, EOS], "stop"),     # the 3rd token may stop (vLLM's rule)
                   "stop_id": ([7, 7], "stop"),
                   "plain": ([8, EOS], "stop")}


def test_scheduler_still_stops_at_max_model_len_below_min_tokens() -> None:
    from kvflow.core.request import Request
    core, _ = make_core(64, max_model_len=64)
    core.scheduler.add_request(Request("long", list(range(300, 360)),
                                       SamplingParams(max_tokens=50, min_tokens=20)))
    out = run_all(core)["long"]
    assert (len(out.token_ids), out.finish_reason) == (4, "length")


class CharTokenizer:
    """Token id -> one character, enough for RequestTracker."""

    class Decoder:
        def add(self, token_id: int) -> str:
            return chr(ord("a") + token_id)

    def stream_decoder(self) -> Decoder:
        return self.Decoder()


def tracked_text(params: SamplingParams, token_ids: list[int]) -> tuple[str, int, str | None]:
    output = RequestOutput(request_id="r", prompt=None, prompt_token_ids=[0])
    tracker = RequestTracker(output, params, CharTokenizer())   # type: ignore[arg-type]
    for token_id in token_ids:
        if tracker.apply(RequestDelta("r", [token_id], None, None, 0)):
            break
    return output.text, len(output.token_ids), output.finish_reason


def test_stop_strings_are_looked_for_after_min_tokens() -> None:
    tokens = [1, 2, 1, 2, 3, 1, 2, 4]                                  # "bcbcdbce"
    assert tracked_text(SamplingParams(stop=["bc"]), tokens) == ("", 2, "stop")
    # vLLM's rule: from the token after the first min_tokens, on the text it adds (a stop
    # string may begin in earlier text).
    assert tracked_text(SamplingParams(stop=["bc"], min_tokens=2), tokens) == ("bc", 4, "stop")
    assert tracked_text(SamplingParams(stop=["bc"], min_tokens=3), tokens) == ("bc", 4, "stop")
    assert tracked_text(SamplingParams(stop=["bc"], min_tokens=4), tokens) == \
        ("bcbcd", 7, "stop")


# --- end to end --------------------------------------------------------------------------

def test_end_to_end_logit_bias_and_min_tokens(tiny_models: dict[str, str]) -> None:
    with LLM(tiny_models["llama"], in_process=True, kv_cache_memory_gb=0.01,
             max_num_seqs=4) as llm:
        eos = llm.config.model.eos_token_ids[0]
        forced, eos_first, plain = llm.generate(["Hello there"] * 3, [
            SamplingParams(temperature=0, max_tokens=6, logit_bias={1234: 100.0}),
            SamplingParams(temperature=0, max_tokens=10, min_tokens=4,
                           logit_bias={eos: 100.0}),
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)], use_tqdm=False)
    assert forced.token_ids == [1234] * 6
    # EOS wins as soon as it is allowed: after exactly min_tokens other tokens.
    assert eos_first.finish_reason == "stop" and len(eos_first.token_ids) == 5
    assert eos_first.token_ids[-1] == eos and eos not in eos_first.token_ids[:4]
    assert len(plain.token_ids) == 6 and plain.token_ids != forced.token_ids


def test_the_c_penalties_match_the_torch_ops_on_long_histories() -> None:
    """cpu_ops.penalize against apply_penalties' torch ops at a real vocabulary's size: long
    histories with many repeats, rows without outputs, rows the call skips untouched."""
    from kvflow.workers.logits_processors import apply_penalties
    rng = random.Random(12)
    vocab, rows = 5000, 8
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(12)) * 4
    token_ids = [[rng.randrange(vocab // (1 + r)) for _ in range(rng.randint(1, 900))]
                 for r in range(rows)]
    num_outputs = [rng.choice((0, 1, len(t) // 2, len(t))) for t in token_ids]
    params = [SamplingParams(repetition_penalty=rng.uniform(0.5, 2.0),
                             frequency_penalty=rng.uniform(-2, 2),
                             presence_penalty=rng.uniform(-2, 2)) for _ in range(rows)]
    picked = [0, 2, 3, 5, 6]                              # rows 1, 4, 7: not asked
    expected = logits.clone()
    part = expected[picked]
    apply_penalties(part, [params[i] for i in picked], [token_ids[i] for i in picked],
                    [num_outputs[i] for i in picked])
    expected[picked] = part
    got = logits.clone()
    cpu_ops.penalize(got, picked, [token_ids[i] for i in picked],
                     [num_outputs[i] for i in picked],
                     [params[i].repetition_penalty for i in picked],
                     [params[i].frequency_penalty for i in picked],
                     [params[i].presence_penalty for i in picked])
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    assert torch.equal(got[[1, 4, 7]], logits[[1, 4, 7]])
    assert not torch.equal(got[picked], logits[picked])
