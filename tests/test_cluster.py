"""The cluster end to end: `launch.py serve` + Client/AsyncClient against LLM(in_process=True),
streaming, many concurrent clients, abort, and tensor parallelism over gloo on CPU."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from typing import Iterator

import pytest

from cluster_helpers import ServeProcess
from model_helpers import make_tiny_model
from kvflow import AsyncClient, Client, LLM, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = ["Hello, my name is", "The capital of France is", "def square(x):",
           "Water boils at"]


@pytest.fixture(scope="module")
def server(default_model: str) -> Iterator[str]:
    with ServeProcess(model=default_model, kv_cache_memory_gb=0.2) as serve:
        serve.wait_serving()
        yield serve.address


@pytest.fixture(scope="module")
def reference(default_model: str) -> list[str]:
    with LLM(default_model, in_process=True, kv_cache_memory_gb=0.2) as llm:
        return [o.text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_client_matches_in_process_llm(server: str, reference: list[str]) -> None:
    with Client(server, timeout=60) as c:
        outs = [c.generate(p, GREEDY) for p in PROMPTS]
    assert [o.text for o in outs] == reference
    assert all(o.finish_reason == "length" and len(o.token_ids) == 20 for o in outs)


def test_multiprocess_llm_matches_in_process(default_model: str, reference: list[str]) -> None:
    with LLM(default_model, kv_cache_memory_gb=0.2) as llm:
        assert [o.text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference


def test_streaming_deltas_concatenate(server: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, stop=[" the"])
    with Client(server, timeout=60) as c:
        whole = c.generate(PROMPTS[1], params)
        deltas = list(c.stream(PROMPTS[1], params))
    assert "".join(d.text for d in deltas) == whole.text
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert [d.finish_reason for d in deltas if d.finish_reason] == [whole.finish_reason]
    assert deltas[-1].finish_reason is not None


def test_chat_through_client(server: str, default_model: str) -> None:
    messages = [{"role": "user", "content": "Name three primes."}]
    params = SamplingParams(temperature=0, max_tokens=16)
    with LLM(default_model, in_process=True, kv_cache_memory_gb=0.1) as llm:
        expected = llm.chat(messages, params, use_tqdm=False)[0].text
    with Client(server, timeout=60) as c:
        assert c.chat(messages, params).text == expected


def test_many_concurrent_clients(server: str) -> None:
    """16 clients (12 sync threads, 4 async) x 4 requests: each answered exactly once."""
    answers: dict[str, list[str]] = {}
    lock = threading.Lock()

    def sync_client(k: int) -> None:
        with Client(server, timeout=120) as c:
            for i in range(4):
                out = c.generate(f"Client {k} request {i}:", SamplingParams(max_tokens=4,
                                                                            seed=k * 10 + i))
                with lock:
                    answers.setdefault(f"{k}-{i}", []).append(out.finish_reason or "")

    async def async_clients() -> None:
        async def one(k: int) -> None:
            async with AsyncClient(server, timeout=120) as ac:
                outs = await asyncio.gather(*[ac.generate(f"Client {k} request {i}:",
                                                          SamplingParams(max_tokens=4))
                                              for i in range(4)])
                with lock:
                    for i, out in enumerate(outs):
                        answers.setdefault(f"{k}-{i}", []).append(out.finish_reason or "")
        await asyncio.gather(*[one(k) for k in range(12, 16)])

    threads = [threading.Thread(target=sync_client, args=(k,)) for k in range(12)]
    for t in threads:
        t.start()
    asyncio.run(async_clients())
    for t in threads:
        t.join(180)
    assert sorted(answers) == sorted(f"{k}-{i}" for k in range(16) for i in range(4))
    assert all(len(v) == 1 and v[0] in ("length", "stop") for v in answers.values())


def test_abort_frees_blocks(server: str) -> None:
    long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
    with Client(server, timeout=60) as c:
        idle = c.stats().num_free_blocks
        stream = c.stream("Tell me a very long story about the sea.", long)
        for _ in range(3):
            next(stream)
        busy = c.stats().num_free_blocks
        stream.close()                                  # closing the stream aborts it
        deadline = time.monotonic() + 10
        while c.stats().num_free_blocks != idle and time.monotonic() < deadline:
            time.sleep(0.1)
        assert busy < idle and c.stats().num_free_blocks == idle
        # The engine goes on serving after the abort.
        assert c.generate("Hi", SamplingParams(max_tokens=2)).finish_reason == "length"


def test_bad_request_through_client(server: str) -> None:
    with Client(server, timeout=60) as c:
        with pytest.raises(ValueError, match="exceeds max_model_len"):
            c.generate("Hi", SamplingParams(max_tokens=10**6))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            c.generate([10**7], SamplingParams(max_tokens=2))
        assert c.generate("Hi", SamplingParams(max_tokens=2)).finish_reason == "length"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tensor_parallel_2_matches_tp_1(default_model: str, tmp_path: os.PathLike,
                                        arch: str) -> None:
    path = make_tiny_model(default_model, str(tmp_path), arch)
    prompts = PROMPTS + [[7] * 45]
    # float32 on every CPU (dtype="auto" is bfloat16 where native): the sharded sums must not
    # differ by more than float32 rounding, or random weights' near-ties flip greedy tokens.
    with LLM(path, in_process=True, kv_cache_memory_gb=0.05, dtype="float32") as llm:
        tp1 = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(path, tensor_parallel_size=2, kv_cache_memory_gb=0.05, dtype="float32") as llm:
        tp2 = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert tp1 == tp2


def test_tensor_parallel_3_default_model(default_model: str) -> None:
    # 9 heads, 3 KV heads, intermediate 1536, vocab 49152: all split three ways (float32, as
    # in the TP=2 test).
    with LLM(default_model, in_process=True, kv_cache_memory_gb=0.1, dtype="float32") as llm:
        reference = [o.text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with LLM(default_model, tensor_parallel_size=3, kv_cache_memory_gb=0.1,
             dtype="float32") as llm:
        assert [o.text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference


def test_tensor_parallel_that_cannot_split(default_model: str) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide "
                                         "num_attention_heads=9"):
        LLM(default_model, tensor_parallel_size=2)


def test_client_vanishing_mid_stream_does_not_hurt_others(server: str,
                                                          reference: list[str]) -> None:
    gone = Client(server, timeout=60)
    stream = gone.stream("Tell me a long story.", SamplingParams(max_tokens=300,
                                                                 ignore_eos=True))
    next(stream)
    gone.ctx.destroy(linger=0)         # the process "disappears": no abort is ever sent
    with Client(server, timeout=60) as c:
        assert c.generate(PROMPTS[0], GREEDY).text == reference[0]


def test_clients_in_other_processes(server: str, reference: list[str]) -> None:
    code = ("import sys; from kvflow import Client, SamplingParams; "
            "c = Client(sys.argv[1], timeout=120); "
            "print(repr(c.generate(sys.argv[2], SamplingParams(temperature=0, max_tokens=20, "
            "ignore_eos=True)).text))")
    procs = [subprocess.Popen([sys.executable, "-c", code, server, p], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True) for p in PROMPTS[:2]]
    texts = [eval(p.communicate(timeout=180)[0]) for p in procs]
    assert texts == reference[:2]
