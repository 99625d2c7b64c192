"""Data parallelism: one kvflow replica against two behind vllm-router (round_robin and
cache_aware), on a workload whose requests share long prefixes (a few "system prompts").

Prints output tok/s, the prefix-cache hit rate over all replicas (hit tokens / queried tokens,
from each replica's /metrics) and how many requests were lost. On a 2-core machine two
replicas share the cores (one thread each), so throughput says little; the hit rate and zero
lost requests are the figures that matter there.

    python benchmarks/dp_router.py [--num-requests 96] [--prefixes 6] [--concurrency 16]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import socket
import subprocess
import sys
import time
from typing import Iterator

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from serve import cpu_info, stop                                          # noqa: E402

ROUTER = os.path.join(os.path.dirname(sys.executable), "vllm-router")
WORDS = ("parcel delivery customs return label tracking address weekend courier depot "
         "signature refund invoice warehouse damaged express international").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args} did not come up (exit code {proc.poll()})")
        time.sleep(0.5)


@contextlib.contextmanager
def cluster(replicas: int, policy: str | None, threads: int) -> Iterator[tuple[str, list[str]]]:
    """(the URL clients use, the replicas' URLs)."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        urls = []
        for _ in range(replicas):
            port = free_port()
            procs.append(subprocess.Popen(
                [sys.executable, "launch.py", "serve", "--model", "default", "--port", str(port),
                 "--num-threads", str(threads), "--served-model-name", "default"],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True))
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs):
            wait_healthy(f"{url}/health", proc)
        front = urls[0]
        if policy is not None:
            port = free_port()
            procs.append(subprocess.Popen(
                [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                 "--worker-urls", *urls, "--prometheus-host", "127.0.0.1",
                 "--prometheus-port", str(free_port())],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
            front = f"http://127.0.0.1:{port}"
            wait_healthy(f"{front}/v1/models", procs[-1])
        yield front, urls
    finally:
        for proc in procs:
            stop(proc)


def metric(urls: list[str], name: str) -> float:
    total = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def workload(args: argparse.Namespace) -> list[str]:
    rng = random.Random(args.seed)
    systems = [" ".join(rng.choice(WORDS) for _ in range(args.prefix_words))
               for _ in range(args.prefixes)]
    return [f"{rng.choice(systems)}\nQuestion {i}: {' '.join(rng.sample(WORDS, 6))}?"
            for i in range(args.num_requests)]


async def run(front: str, prompts: list[str], args: argparse.Namespace) -> tuple[int, int, float]:
    """(tokens generated, requests lost, seconds)."""
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(prompt: str) -> int:
            async with sem:
                r = await client.post(f"{front}/v1/completions", json={
                    "model": "default", "prompt": prompt, "max_tokens": args.max_tokens,
                    "temperature": 0, "ignore_eos": True})
                return int(r.json()["usage"]["completion_tokens"]) if r.status_code == 200 else -1
        start = time.perf_counter()
        got = await asyncio.gather(*(one(p) for p in prompts), return_exceptions=True)
        elapsed = time.perf_counter() - start
    tokens = [g for g in got if isinstance(g, int) and g >= 0]
    return sum(tokens), len(prompts) - len(tokens), elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--prefixes", type=int, default=6)
    parser.add_argument("--prefix-words", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(cpu_info())
    prompts = workload(args)
    cores = os.cpu_count() or 1
    setups = [("1 replica", 1, None, cores), ("2 replicas, round_robin", 2, "round_robin",
                                               max(1, cores // 2)),
              ("2 replicas, cache_aware", 2, "cache_aware", max(1, cores // 2))]
    print(f"{len(prompts)} requests over {args.prefixes} shared prefixes of {args.prefix_words} "
          f"words, {args.max_tokens} tokens each, concurrency {args.concurrency}")
    for name, replicas, policy, threads in setups:
        with cluster(replicas, policy, threads) as (front, urls):
            tokens, lost, elapsed = asyncio.run(run(front, prompts, args))
            hits = metric(urls, "kvflow:prefix_cache_hits_total")
            queries = metric(urls, "kvflow:prefix_cache_queries_total")
        print(f"{name:26s} {tokens / elapsed:7.1f} output tok/s, prefix-cache hit rate "
              f"{hits / max(queries, 1):5.1%}, {lost} requests lost", flush=True)


if __name__ == "__main__":
    main()
