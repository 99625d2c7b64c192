"""Data parallelism with tools users already run: two `launch.py serve` replicas behind
vllm-router (PyPI), on 127.0.0.1. Every request is answered exactly once; requests sharing a
long prefix stay on one replica under `cache_aware` (its prefix-cache hits show it); a replica
SIGKILLed under load is dropped by the router's health check and later requests succeed on
the other."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import httpx
import pytest

from cluster_helpers import ServeProcess, free_port, wait_exited

ROUTER = os.path.join(os.path.dirname(sys.executable), "vllm-router")
PREFIX = ("You are the support assistant of a parcel company. Answer questions about parcels, "
          "delivery times, customs forms and returns politely and in one sentence. Tracking "
          "numbers look like XX-0000-0000. Never promise a delivery date. ") * 3


def successes(replica: ServeProcess) -> float:
    """Requests this replica finished (any reason), from its /metrics."""
    text = httpx.get(f"{replica.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvflow:request_success_total{"))


def prefix_hits(replica: ServeProcess) -> float:
    text = httpx.get(f"{replica.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvflow:prefix_cache_hits_total{"))


class Router:
    def __init__(self, replicas: list[ServeProcess], policy: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        assert os.path.exists(ROUTER), f"{ROUTER} is missing: install the dev extra"
        self.proc = subprocess.Popen(
            [ROUTER, "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
             "--worker-urls", *[r.url for r in replicas], "--health-check-interval-secs", "1",
             "--health-failure-threshold", "2", "--health-check-timeout-secs", "2",
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        deadline = time.monotonic() + 60
        try:
            while not self._ready():
                assert self.proc.poll() is None, f"vllm-router exited with {self.proc.returncode}"
                assert time.monotonic() < deadline, "vllm-router did not start in 60 s"
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def complete(self, prompt: str, max_tokens: int = 4) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/completions", timeout=120, json={
            "model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


@pytest.fixture(scope="module")
def replicas(default_model: str) -> Iterator[list[ServeProcess]]:
    reps = [ServeProcess("--num-threads", "1", "--served-model-name", "default",
                         model=default_model, kv_cache_memory_gb=0.2, zmq=False)
            for _ in range(2)]
    try:
        for r in reps:
            r.wait_serving()
        yield reps
    finally:
        for r in reps:
            r.cleanup()


@pytest.fixture
def router(replicas: list[ServeProcess]) -> Iterator[Router]:
    r = Router(replicas, "cache_aware")
    try:
        yield r
    finally:
        r.stop()


def test_every_request_answered_exactly_once(replicas: list[ServeProcess],
                                             router: Router) -> None:
    before = [successes(r) for r in replicas]
    prompts = [f"Request {i}: name a colour." if i % 2 else PREFIX + f"Question {i}: hello?"
               for i in range(16)]
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(router.complete, prompts))
    assert [r.status_code for r in responses] == [200] * len(prompts)
    ids = {r.json()["id"] for r in responses}
    assert len(ids) == len(prompts)
    after = [successes(r) for r in replicas]
    assert sum(after) - sum(before) == len(prompts)          # none lost, none doubled


def test_shared_prefix_stays_on_one_replica(replicas: list[ServeProcess],
                                            router: Router) -> None:
    before = [successes(r) for r in replicas]
    hits_before = [prefix_hits(r) for r in replicas]
    for i in range(6):
        assert router.complete(PREFIX + f"Customer {i}: where is my parcel?").status_code == 200
    served = [successes(r) - b for r, b in zip(replicas, before)]
    hits = [prefix_hits(r) - h for r, h in zip(replicas, hits_before)]
    assert sorted(served) == [0, 6], served
    home = served.index(6)
    assert hits[home] > 0 and hits[1 - home] == 0, hits


def test_replica_killed_under_load_is_dropped(replicas: list[ServeProcess],
                                              router: Router) -> None:
    """Runs last: it kills a replica of the module's pair."""
    stop = threading.Event()
    statuses: list[int] = []

    def load() -> None:
        while not stop.is_set():
            try:
                statuses.append(router.complete("Background load, say hi.", 8).status_code)
            except httpx.HTTPError:
                statuses.append(-1)

    threads = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        victim, survivor = replicas
        tree = victim.tree()
        os.killpg(victim.pid, signal.SIGKILL)             # the whole replica, as a machine dies
        assert not wait_exited(tree, 10), "processes of the killed replica are left"
        time.sleep(3)                                     # two failed health checks (1 s apart)
    finally:
        stop.set()
        for t in threads:
            t.join(150)
    assert statuses.count(200) > 0
    # The router has dropped it: every later request lands on the survivor.
    deadline = time.monotonic() + 30
    while router.complete("Probe: say hi.").status_code != 200:
        assert time.monotonic() < deadline, "the router kept failing after the replica died"
    before = successes(survivor)
    for i in range(6):
        response = router.complete(f"After the failure {i}: say hi.")
        assert response.status_code == 200, response.text
    assert successes(survivor) - before == 6
