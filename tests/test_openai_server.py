"""The OpenAI-compatible HTTP server end to end: a real `launch.py serve` (default model,
float32) and the official `openai` client, sync and async, against LLM(in_process=True) on the
same weights; errors, disconnects, back-pressure, metrics and health."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster_helpers import ServeProcess, serve_ready, tagged_processes, wait_exited
from kvflow import LLM, Client, SamplingParams
from kvflow.frontend.tokenizer import Tokenizer

PROMPTS = ["Hello, my name is", "The capital of France is", "def square(x):"]
CHATS = [[{"role": "user", "content": "Name three primes."}],
         [{"role": "system", "content": "You are terse."},
          {"role": "user", "content": "What is the sea?"}]]
TOKEN_PROMPT = [504, 3458, 282, 4649, 314]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
BLOCK_SIZE = 16


def serve(model: str, *args: str, zmq: bool = True) -> ServeProcess:
    return serve_ready("--dtype", "float32", "--served-model-name", "default", *args,
                       model=model, kv_cache_memory_gb=0.2, zmq=zmq)


@pytest.fixture(scope="module")
def server(default_model: str) -> Iterator[ServeProcess]:
    s = serve(default_model)
    try:
        yield s
    finally:
        s.cleanup()


@pytest.fixture(scope="module")
def llm(default_model: str) -> Iterator[LLM]:
    with LLM(default_model, in_process=True, dtype="float32", kv_cache_memory_gb=0.2) as llm:
        yield llm


@pytest.fixture(scope="module")
def tokenizer(default_model: str) -> Tokenizer:
    return Tokenizer(default_model)


def client(s: ServeProcess, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.url}/v1", api_key=kw.pop("api_key", "none"),
                         max_retries=0, timeout=kw.pop("timeout", 120), **kw)


def metrics(s: ServeProcess) -> dict[str, float]:
    """Every sample of /metrics by name and labels, e.g. 'kvflow:x_total{finished_reason=stop}'."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{s.url}/metrics").text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                              if k not in ("model_name", "le"))
            key = sample.name + (f"{{{labels}}}" if labels else "")
            if "le" not in sample.labels:
                out[key] = sample.value
    return out


def wait_for(check: Any, timeout: float) -> float:
    """Poll `check()` until true; the seconds it took (AssertionError after `timeout`)."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, "condition not met in time"
        time.sleep(0.05)
    return time.monotonic() - start


# --- results equal the engine's ------------------------------------------------------------

def test_completions_equal_llm_generate(server: ServeProcess, llm: LLM) -> None:
    expected = llm.generate([*PROMPTS, TOKEN_PROMPT], GREEDY, use_tqdm=False)
    c = client(server)
    for prompt, ref in zip([*PROMPTS, TOKEN_PROMPT], expected):
        r = c.completions.create(model="default", prompt=prompt, max_tokens=MAX_TOKENS,
                                 temperature=0)
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.completion_tokens == len(ref.token_ids)
    # Several prompts in one request: one choice each, in order.
    r = c.completions.create(model="default", prompt=PROMPTS, max_tokens=MAX_TOKENS,
                             temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.text for ch in r.choices] == [o.text for o in expected[:3]]
    r = c.completions.create(model="default", prompt=[TOKEN_PROMPT, TOKEN_PROMPT[:3]],
                             max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == expected[3].text
    assert r.usage.prompt_tokens == len(TOKEN_PROMPT) + 3


def test_http_and_zmq_clients_share_one_engine(server: ServeProcess, llm: LLM) -> None:
    [ref] = llm.generate(PROMPTS[2], GREEDY, use_tqdm=False)
    with Client(server.address, timeout=60) as zc:
        stream = zc.stream(PROMPTS[2], GREEDY)
        first = next(stream)                  # a ZMQ request in flight while HTTP is served
        r = client(server).completions.create(model="default", prompt=PROMPTS[2],
                                              max_tokens=MAX_TOKENS, temperature=0)
        rest = "".join(d.text for d in stream)
    assert r.choices[0].text == ref.text == first.text + rest


def test_echo_and_stop_strings(server: ServeProcess, llm: LLM) -> None:
    c = client(server)
    [ref] = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    r = c.completions.create(model="default", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                             temperature=0, echo=True)
    assert r.choices[0].text == PROMPTS[0] + ref.text
    stop = ref.text[3:6]                       # a stop string the greedy text will meet
    kw: dict[str, Any] = dict(model="default", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                              temperature=0, stop=stop)
    stops = metrics(server).get("kvflow:request_success_total{finished_reason=stop}", 0)
    cut = c.completions.create(**kw).choices[0]
    assert cut.text == ref.text[:ref.text.index(stop)] and cut.finish_reason == "stop"
    assert metrics(server)["kvflow:request_success_total{finished_reason=stop}"] == stops + 1
    kept = c.completions.create(**kw, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == ref.text[:ref.text.index(stop) + len(stop)]


def test_chat_equals_llm_chat(server: ServeProcess, llm: LLM) -> None:
    c = client(server)
    models = c.models.list().data
    assert [m.id for m in models] == ["default"]
    for messages in CHATS:
        [ref] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24),
                         use_tqdm=False)
        r = c.chat.completions.create(model=models[0].id, messages=messages,  # type: ignore
                                      max_tokens=24, temperature=0)
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == ref.text
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        r = c.chat.completions.create(model="default", messages=messages,  # type: ignore
                                      max_completion_tokens=24, temperature=0)
        assert r.choices[0].message.content == ref.text
    # No max_tokens: as many as the context and the KV cache leave (an EOS ends it first).
    [ref] = llm.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=400), use_tqdm=False)
    assert ref.finish_reason == "stop"
    r = c.chat.completions.create(model="default", messages=CHATS[0],  # type: ignore
                                  temperature=0)
    assert r.choices[0].message.content == ref.text
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three"},
                                          {"type": "text", "text": "primes."}]}]
    [ref] = llm.chat([{"role": "user", "content": "Name three\nprimes."}],
                     SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    r = c.chat.completions.create(model="default", messages=parts,  # type: ignore
                                  max_tokens=10, temperature=0)
    assert r.choices[0].message.content == ref.text


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_stream_joins_to_whole(server: ServeProcess, kind: str) -> None:
    c = client(server)
    kw: dict[str, Any] = dict(model="default", max_tokens=30, temperature=0, stop=[" and"])
    if kind == "chat":
        create = c.chat.completions.create
        kw["messages"] = CHATS[0]
    else:
        create = c.completions.create            # type: ignore[assignment]
        kw["prompt"] = "Once upon a time"
    whole = create(**kw)
    chunks = list(create(**kw, stream=True, stream_options={"include_usage": True}))
    body = [ch for ch in chunks if ch.choices]
    if kind == "chat":
        assert body[0].choices[0].delta.role == "assistant"
        text = "".join(ch.choices[0].delta.content or "" for ch in body)
        assert text == whole.choices[0].message.content
    else:
        assert "".join(ch.choices[0].text for ch in body) == whole.choices[0].text
    reasons = [ch.choices[0].finish_reason for ch in body if ch.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(ch.usage is None for ch in chunks[:-1])


def test_usage_exact_and_cached_tokens(server: ServeProcess, tokenizer: Tokenizer) -> None:
    c = client(server)
    prompt = f"{uuid.uuid4().hex} " + "The sea is wide and the sky is blue. " * 8
    num_prompt = len(tokenizer.encode(prompt))
    first = c.completions.create(model="default", prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens == num_prompt
    assert first.usage.completion_tokens == 4 and first.usage.total_tokens == num_prompt + 4
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    hits = metrics(server)["kvflow:prefix_cache_hits_total"]
    again = c.completions.create(model="default", prompt=prompt, max_tokens=4, temperature=0)
    # Every full block but the one holding the last prompt token comes from the cache.
    cached = (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert again.usage.prompt_tokens_details.cached_tokens == cached
    assert metrics(server)["kvflow:prefix_cache_hits_total"] == hits + cached


def test_n_choices_and_seed_independent_of_batch(server: ServeProcess) -> None:
    c = client(server)
    kw = dict(model="default", prompt="My favourite animal is", max_tokens=10,
              temperature=1.0, seed=1234)
    r = c.completions.create(n=3, **kw)                      # type: ignore[call-overload]
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert len({ch.text for ch in r.choices}) > 1            # each choice draws its own
    alone = c.completions.create(**kw).choices[0].text       # type: ignore[call-overload]

    async def crowd() -> list[str]:
        ac = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                timeout=120)
        others = [ac.completions.create(model="default", prompt=f"Story number {i}:",
                                        max_tokens=12, temperature=0.8, seed=i)
                  for i in range(23)]
        outs = await asyncio.gather(ac.completions.create(**kw), *others)  # type: ignore
        await ac.close()
        return [o.choices[0].text for o in outs]
    texts = asyncio.run(crowd())
    assert texts[0] == alone == r.choices[0].text


def test_logprobs_equal_engine(server: ServeProcess, llm: LLM) -> None:
    c = client(server)
    [ref] = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=6, logprobs=3),
                         use_tqdm=False)
    assert ref.logprobs is not None
    r = c.completions.create(model="default", prompt=PROMPTS[1], max_tokens=6, temperature=0,
                             logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs) == 6
    for token_id, mine, top, ref_lp in zip(ref.token_ids, lp.token_logprobs, lp.top_logprobs,
                                           ref.logprobs):
        assert mine == pytest.approx(ref_lp[token_id], abs=1e-4)
        assert sorted(top.values()) == pytest.approx(sorted(ref_lp.values()), abs=1e-4)
    assert "".join(lp.tokens) == r.choices[0].text

    [ref] = llm.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=6, logprobs=2),
                     use_tqdm=False)
    assert ref.logprobs is not None
    r = c.chat.completions.create(model="default", messages=CHATS[0],  # type: ignore
                                  max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    for token_id, entry, ref_lp in zip(ref.token_ids, content, ref.logprobs):
        assert entry.logprob == pytest.approx(ref_lp[token_id], abs=1e-4)
        best = sorted(ref_lp.values(), reverse=True)[:2]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(best, abs=1e-4)


def test_penalties_bias_and_min_tokens_reach_the_sampler(server: ServeProcess, llm: LLM,
                                                         tokenizer: Tokenizer) -> None:
    c = client(server)
    prompt = "List the days of the week: Monday, Tuesday,"
    cases: list[tuple[dict[str, Any], SamplingParams]] = [
        (dict(presence_penalty=1.5, frequency_penalty=1.0),
         SamplingParams(temperature=0, max_tokens=16, presence_penalty=1.5,
                        frequency_penalty=1.0)),
        (dict(extra_body={"repetition_penalty": 1.3}),
         SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3)),
    ]
    for api, params in cases:
        [ref] = llm.generate(prompt, params, use_tqdm=False)
        plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16),
                             use_tqdm=False)[0]
        assert ref.text != plain.text                     # the penalty matters here
        r = c.completions.create(model="default", prompt=prompt, max_tokens=16,
                                 temperature=0, **api)
        assert r.choices[0].text == ref.text
    forced = tokenizer.encode(" banana")[-1]
    r = c.completions.create(model="default", prompt=prompt, max_tokens=5, temperature=0,
                             logit_bias={str(forced): 100})
    assert r.choices[0].text == tokenizer.decode([forced] * 5)
    eos = llm.config.model.eos_token_ids[0]
    r = c.completions.create(model="default", prompt=prompt, max_tokens=8, temperature=0,
                             logit_bias={str(eos): 100}, extra_body={"min_tokens": 5})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "stop"


# --- bad input -----------------------------------------------------------------------------

BAD = [
    ("completions", b"{not json", "", "malformed JSON"),
    ("completions", {"prompt": ""}, "prompt", "prompt is empty"),
    ("completions", {"prompt": []}, "prompt", "prompt is empty"),
    ("completions", {"prompt": [1] * 9000}, "prompt", "exceeds max_model_len"),
    ("completions", {"prompt": "Hi", "max_tokens": 9000}, "max_tokens", "max_model_len"),
    ("completions", {"prompt": [10**7]}, "prompt", "outside the vocabulary"),
    ("completions", {"prompt": "Hi", "temperature": -1}, "temperature", "-1"),
    ("completions", {"prompt": "Hi", "top_p": 2}, "top_p", "2"),
    ("completions", {"prompt": "Hi", "max_tokens": "ten"}, "max_tokens", "int"),
    ("completions", {"prompt": "Hi", "logprobs": 21}, "logprobs", "21"),
    ("completions", {"prompt": "Hi", "n": 0}, "n", "n=0"),
    ("completions", {"prompt": "Hi", "best_of": 3}, "best_of", "best_of=3"),
    ("completions", {"prompt": "Hi", "suffix": "!"}, "suffix", "not supported"),
    ("completions", {"prompt": "Hi", "echo": True, "logprobs": 1}, "echo", "not supported"),
    ("completions", {"prompt": "Hi", "presence_penalty": 5}, "presence_penalty", "5"),
    ("completions", {"prompt": "Hi", "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ("completions", {"prompt": "Hi", "logit_bias": {"99999999": 1}}, "logit_bias", "99999999"),
    ("completions", {"prompt": "Hi", "stream_options": {"include_usage": True}},
     "stream_options", "stream=true"),
    ("completions", {"prompt": {"a": 1}}, "prompt", "prompt must be"),
    ("chat", {}, "messages", "messages"),
    ("chat", {"messages": []}, "messages", "must not be empty"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages", "'robot'"),
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages", "image_url"),
    ("chat", {"messages": [{"role": "user", "content": "x"}],       # auto: needs the flags
              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice",
     "--enable-auto-tool-choice"),
    ("chat", {"messages": [{"role": "user", "content": "x"}],
              "response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ("completions", {"prompt": "Hi", "functions": [{"name": "f"}]}, "functions",
     "not supported"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs", "logprobs=true"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
              "top_logprobs": 30}, "top_logprobs", "30"),
]


@pytest.mark.parametrize("endpoint,body,param,words", BAD,
                         ids=[f"{e}-{p or 'json'}-{i}" for i, (e, _, p, _) in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(server: ServeProcess, endpoint: str, body: Any,
                                             param: str, words: str) -> None:
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    content = body if isinstance(body, bytes) else json.dumps({"model": "default", **body})
    r = httpx.post(server.url + path, content=content, timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error", error
    if param:
        assert error["param"] == param, error
    good = client(server).completions.create(model="default", prompt="Hi", max_tokens=2)
    assert good.choices[0].finish_reason == "length"


def test_bad_streaming_request_is_a_status_not_an_event(server: ServeProcess) -> None:
    for body in ({"prompt": ""}, {"prompt": [10**7]}, {"prompt": "Hi", "max_tokens": 9000}):
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "default", "stream": True, **body})
        assert r.status_code == 400 and "error" in r.json(), r.text


def test_streamed_logprobs_equal_whole(server: ServeProcess) -> None:
    c = client(server)
    kw: dict[str, Any] = dict(model="default", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                              logprobs=2)
    whole = c.completions.create(**kw).choices[0].logprobs
    chunks = [ch.choices[0].logprobs for ch in c.completions.create(**kw, stream=True)
              if ch.choices and ch.choices[0].logprobs]
    assert [t for lp in chunks for t in lp.tokens] == whole.tokens
    assert [x for lp in chunks for x in lp.token_logprobs] == whole.token_logprobs
    assert [x for lp in chunks for x in lp.text_offset] == whole.text_offset


def test_unknown_model_and_path(server: ServeProcess) -> None:
    c = client(server)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.completions.create(model="gpt-5", prompt="Hi", max_tokens=2)
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


def test_tokenize_detokenize_version(server: ServeProcess, tokenizer: Tokenizer) -> None:
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPTS[1]}).json()
    assert r["tokens"] == tokenizer.encode(PROMPTS[1]) and r["count"] == len(r["tokens"])
    plain = httpx.post(server.url + "/tokenize", json={"prompt": PROMPTS[1],
                                                       "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.tokenizer.encode(PROMPTS[1],
                                                         add_special_tokens=False).ids
    assert httpx.post(server.url + "/detokenize",
                      json={"tokens": r["tokens"]}).json() == {"prompt": PROMPTS[1]}
    chat = httpx.post(server.url + "/tokenize", json={"messages": CHATS[0]}).json()
    assert chat["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(CHATS[0]))
    assert httpx.post(server.url + "/detokenize", json={"tokens": [-1]}).status_code == 400
    assert "version" in httpx.get(server.url + "/version").json()


# --- disconnects and metrics ---------------------------------------------------------------

def test_dropped_clients_are_aborted(server: ServeProcess) -> None:
    running = "kvflow:num_requests_running"
    long = {"model": "default", "prompt": "Tell me a long story.", "max_tokens": 2000,
            "ignore_eos": True}
    aborts = metrics(server).get("kvflow:request_success_total{finished_reason=abort}", 0)
    with httpx.stream("POST", server.url + "/v1/completions", json={**long, "stream": True},
                      timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
        assert metrics(server)[running] == 1
    print(f"\n[latency] dropped stream -> running 0: "
          f"{wait_for(lambda: metrics(server)[running] == 0, 2.0):.3f} s")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=long, timeout=1.5)
    print(f"[latency] timed-out client -> running 0: "
          f"{wait_for(lambda: metrics(server)[running] == 0, 2.0):.3f} s")
    after = metrics(server)
    assert after["kvflow:request_success_total{finished_reason=abort}"] == aborts + 2
    assert after["kvflow:num_requests_waiting"] == 0
    assert after["kvflow:kv_cache_usage_perc"] == 0
    assert "Traceback" not in server.log and "internal error" not in server.log, server.log
    assert client(server).completions.create(model="default", prompt="Hi",
                                             max_tokens=2).usage.completion_tokens == 2


def test_metrics_count_exactly(server: ServeProcess, tokenizer: Tokenizer) -> None:
    before = metrics(server)
    prompts = [f"Request {i}: {uuid.uuid4().hex}" for i in range(3)]
    c = client(server)
    for i, p in enumerate(prompts):
        c.completions.create(model="default", prompt=p, max_tokens=3 + i, temperature=0,
                             extra_body={"ignore_eos": True})
    after = metrics(server)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)
    assert grew("kvflow:prompt_tokens_total") == sum(len(tokenizer.encode(p)) for p in prompts)
    assert grew("kvflow:generation_tokens_total") == 3 + 4 + 5
    assert grew("kvflow:request_success_total{finished_reason=length}") == 3
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):
        assert grew(f"kvflow:{name}_count") == 3, name
    assert grew("kvflow:inter_token_latency_seconds_count") == 2 + 3 + 4
    assert grew("kvflow:request_generation_tokens_sum") == 12
    assert grew("kvflow:prefix_cache_queries_total") == grew("kvflow:prompt_tokens_total")
    assert after["kvflow:num_requests_running"] == 0
    assert 0 <= after["kvflow:kv_cache_usage_perc"] < 1


def test_metrics_follow_stats_across_a_restart() -> None:
    """Gauges and counters are touched only when the engine's stats change; a restarted
    engine's first stats (totals from zero) must still show, not the dead engine's."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvflow.frontend.metrics import Metrics
    from kvflow.ipc.messages import EngineStats
    m = Metrics("default", CollectorRegistry())

    def read() -> dict[str, float]:
        text = generate_latest(m.registry).decode()
        return {s.name: s.value for f in text_string_to_metric_families(text)
                for s in f.samples}
    m.record_stats(EngineStats(num_running=3, num_waiting=2, kv_usage=0.5,
                               prefix_cache_queries=40, prefix_cache_hits=16))
    m.record_stats(EngineStats(num_running=3, num_waiting=1, kv_usage=0.5,
                               prefix_cache_queries=50, prefix_cache_hits=16))
    got = read()
    assert (got["kvflow:num_requests_running"], got["kvflow:num_requests_waiting"],
            got["kvflow:kv_cache_usage_perc"]) == (3, 1, 0.5)
    assert (got["kvflow:prefix_cache_queries_total"], got["kvflow:prefix_cache_hits_total"]
            ) == (50, 16)
    m.record_restart("worker", num_resumed=3)
    m.record_stats(EngineStats(num_running=0, num_waiting=0, kv_usage=0.0,
                               prefix_cache_queries=10, prefix_cache_hits=0))
    got = read()
    assert (got["kvflow:num_requests_running"], got["kvflow:num_requests_waiting"],
            got["kvflow:kv_cache_usage_perc"]) == (0, 0, 0)
    assert got["kvflow:prefix_cache_queries_total"] == 60     # the new engine's 10 added
    assert got["kvflow:requests_resumed_total"] == 3


# --- servers of their own: API key, back-pressure, a dead worker ---------------------------

def test_api_key_and_back_pressure(default_model: str) -> None:
    s = serve(default_model, "--api-key", "sekrit", "--max-waiting-requests", "1",
              "--max-num-seqs", "1")
    try:
        with pytest.raises(openai.AuthenticationError):
            client(s).models.list()
        with pytest.raises(openai.AuthenticationError):
            client(s, api_key="wrong").completions.create(model="default", prompt="Hi")
        assert httpx.get(s.url + "/health").status_code == 200          # open
        assert httpx.get(s.url + "/metrics").status_code == 200
        c = client(s, api_key="sekrit")
        assert c.models.list().data[0].id == "default"
        body = {"model": "default", "prompt": "Tell me a story.", "max_tokens": 500,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer sekrit"}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
        wait_for(lambda: metrics(s)["kvflow:num_requests_running"] == 0, 2.0)

        async def burst() -> list[Any]:
            ac = openai.AsyncOpenAI(base_url=f"{s.url}/v1", api_key="sekrit", max_retries=0,
                                    timeout=120)
            tasks = [ac.completions.create(model="default", prompt=f"Count to {i}",
                                           max_tokens=30, extra_body={"ignore_eos": True})
                     for i in range(6)]
            outs = await asyncio.gather(*tasks, return_exceptions=True)
            await ac.close()
            return outs
        outs = asyncio.run(burst())
        refused = [o for o in outs if isinstance(o, openai.APIStatusError)]
        assert refused and all(o.status_code == 503 for o in refused), outs
        assert refused[0].response.headers["retry-after"]
        assert any(not isinstance(o, Exception) for o in outs), outs
        assert c.completions.create(model="default", prompt="Hi",
                                    max_tokens=2).usage.completion_tokens == 2
    finally:
        s.cleanup()


def test_health_503_after_worker_killed(default_model: str) -> None:
    """Fail-stop (--max-engine-restarts 0): the stream ends with an error event, /health and
    new requests answer 503 with a short message (the worker's traceback stays in the log)."""
    s = serve(default_model, "--max-engine-restarts", "0", zmq=False)     # HTTP only
    try:
        assert httpx.get(s.url + "/health").status_code == 200
        body = {"model": "default", "prompt": "Tell me a story.", "max_tokens": 1000,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            s.workers()[0].kill()
            killed = time.monotonic()
            rest = [line for line in lines if line]
        assert json.loads(rest[-2][len("data: "):])["error"]["message"], rest[-2:]
        assert rest[-1] == "data: [DONE]"
        took = wait_for(lambda: httpx.get(s.url + "/health").status_code == 503, 5.0)
        print(f"\n[latency] worker SIGKILL -> /health 503: {time.monotonic() - killed:.3f} s "
              f"(polled {took:.3f} s)")
        for stream in (False, True):
            r2 = httpx.post(s.url + "/v1/completions", json={"model": "default", "prompt": "Hi",
                                                             "stream": stream})
            message = r2.json()["error"]["message"]
            assert r2.status_code == 503 and "not available" in message, message
            assert "Traceback" not in message and "request id" in message
        s.signal(15)
        assert s.wait(10) == 0, s.log
        assert not wait_exited(s.started, 5) and not tagged_processes(s.tag)
    finally:
        s.cleanup()
