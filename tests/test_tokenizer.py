"""The frontend's tokenizer (tokenizers + Jinja, no torch) against transformers' AutoTokenizer,
and the incremental detokenizer / stop strings against a full decode."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvflow.frontend.outputs import RequestOutput, RequestTracker
from kvflow.frontend.tokenizer import Tokenizer
from kvflow.ipc.messages import RequestDelta
from kvflow.sampling_params import SamplingParams

TEXTS = ["Hello, world!", "  leading spaces\tand tabs\n\nnewlines", "naïve café — 東京 🚀",
         "def f(x):\n    return x ** 2", "<|im_start|>user\nhi<|im_end|>", "12345.6789e-10"]
CHATS = [
    [{"role": "user", "content": "Name three primes."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
]


@pytest.fixture(scope="module")
def ours(default_model: str) -> Tokenizer:
    return Tokenizer(default_model)


@pytest.fixture(scope="module")
def theirs(default_model: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(default_model)


def test_encode_matches_transformers(ours: Tokenizer, theirs) -> None:
    for text in TEXTS:
        assert ours.encode(text) == theirs(text).input_ids


def test_chat_template_matches_transformers(ours: Tokenizer, theirs) -> None:
    for chat in CHATS:
        for gen in (True, False):
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == \
                theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)


def test_incremental_detokenization_equals_full_decode(ours: Tokenizer, theirs) -> None:
    for text in TEXTS:
        ids = ours.encode(text)
        stream = ours.stream_decoder()
        pieces = "".join(stream.add(i) for i in ids)
        assert pieces == theirs.decode(ids, skip_special_tokens=True)


def _track(ours: Tokenizer, ids: list[int], stop: list[str]) -> tuple[RequestOutput, str]:
    out = RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1])
    tracker = RequestTracker(out, SamplingParams(stop=stop, max_tokens=100), ours)
    streamed = ""
    for i in ids:
        done = tracker.apply(RequestDelta("r", [i]))
        streamed += tracker.new_text()
        if done:
            break
    return out, streamed


def test_stop_string_truncates_and_stream_never_leaks_it(ours: Tokenizer) -> None:
    text = "The answer is 42. END of story, more text after."
    ids = ours.encode(text)
    out, streamed = _track(ours, ids, ["END of"])
    assert out.finish_reason == "stop"
    assert out.text == "The answer is 42. "
    assert streamed == out.text          # held-back characters never included the stop string
    out, streamed = _track(ours, ids, ["never appears"])
    assert out.finish_reason is None and out.text == text


def test_frontend_modules_do_not_import_torch() -> None:
    code = ("import sys, kvflow.frontend.tokenizer, kvflow.frontend.outputs, kvflow.core.scheduler;"
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr
