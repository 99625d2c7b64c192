"""Fault tolerance of the real cluster (docs/design.md §1, "Death"): real processes, real signals.

- With restarts off (`--max-engine-restarts 0`, `max_engine_restarts=0`; restarts are
  tests/test_self_healing.py's), a worker or EngineCore killed: every pending and every new request fails with
  EngineDeadError within 5 s, and the rest of the engine side exits (through `launch.py serve`
  and a Client, and through `LLM`).
- The launcher, or the user's process holding an LLM, killed: its children exit by themselves.
- SIGTERM / Ctrl-C with --shutdown-timeout 0: everything stops within 10 s, exit code 0.
- A failure at start-up (a worker, a bad model folder) is a prompt, clear error, never a hang.
- Garbage on any socket is dropped: every process lives on and answers correctly.
- LLM.shutdown() and garbage collection of an LLM leave no process behind.

Every test collects the cluster's processes right after start-up and checks they are gone
(or, for the garbage tests, all alive); fixtures kill whatever is left, even on failure.
"""
from __future__ import annotations

import asyncio
import gc
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Generator, cast

import msgspec
import psutil
import pytest
import zmq

from cluster_helpers import (ENGINE_MODULE, REPO, TAG_VAR, WORKER_MODULE, ServeProcess,
                             arg_value, cpu_seconds, exited, failing_worker_env, free_port,
                             is_module, kill_processes, new_tag, send_signal_to_group,
                             tagged_processes, wait_exited, zombie_children)
from kvflow import LLM, AsyncClient, Client, EngineDeadError, SamplingParams
from kvflow.ipc.messages import (Abort, ClientAbort, ClientOutput, ClientRequest,
                                 ClientStatsRequest, EngineRequest, Ping, Pong, StepResult,
                                 GetTimings, WorkerReady)

DEATH_BOUND = 5.0        # a death is noticed, and its consequences done, within this
STOP_BOUND = 10.0        # a clean stop (SIGTERM / SIGINT) takes at most this
STARTUP_FAIL_BOUND = 30.0
KV_GB = 0.1
PROMPT = "The capital of France is"
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
FAIL_MESSAGE = "worker 0 failed at start-up on purpose"
encode = msgspec.msgpack.encode


def report(what: str, seconds: float) -> None:
    print(f"\n[latency] {what}: {seconds:.3f} s")


# --- fixtures ------------------------------------------------------------------------------

@pytest.fixture
def serve(default_model: str):
    """start(*args, env=..., model=..., wait=True) -> a ServeProcess; all killed at the end."""
    started: list[ServeProcess] = []

    def start(*args: str, env: dict[str, str] | None = None, model: str | None = None,
              wait: bool = True) -> ServeProcess:
        # Fail-stop and no drain, as these tests check (restarts and the drain are
        # tests/test_self_healing.py's).
        s = ServeProcess("--max-engine-restarts", "0", "--shutdown-timeout", "0", *args,
                         model=model or default_model, kv_cache_memory_gb=KV_GB, env=env)
        started.append(s)
        if wait:
            s.wait_serving()
        return s

    yield start
    for s in started:
        s.cleanup()


@pytest.fixture
def llm_tag(monkeypatch: pytest.MonkeyPatch):
    """Tags the processes an LLM in this test starts; kills any left at the end."""
    tag = new_tag()
    monkeypatch.setenv(TAG_VAR, tag)
    yield tag
    kill_processes(tagged_processes(tag))


# --- requests in flight --------------------------------------------------------------------

class InFlight:
    """Long requests in flight on a server: `num_sync` streams, each on its own Client in a
    thread, and `num_async` at once on one AsyncClient. Each records its outcome (the
    exception, or "finished") and when it came."""

    def __init__(self, address: str, num_sync: int = 2, num_async: int = 2,
                 timeout: float = 30.0) -> None:
        self.address, self.timeout = address, timeout
        self.results: list[tuple[Any, float]] = []
        self.first = [threading.Event() for _ in range(num_sync + num_async)]
        self.threads = [threading.Thread(target=self._sync, args=(e,), daemon=True)
                        for e in self.first[:num_sync]]
        if num_async:
            self.threads.append(threading.Thread(target=self._async, args=(
                self.first[num_sync:],), daemon=True))
        for t in self.threads:
            t.start()

    def _sync(self, first: threading.Event) -> None:
        with Client(self.address, timeout=self.timeout) as c:
            try:
                for _ in c.stream(PROMPT, LONG):
                    first.set()
                self.results.append(("finished", time.monotonic()))
            except Exception as e:
                self.results.append((e, time.monotonic()))

    def _async(self, firsts: list[threading.Event]) -> None:
        async def one(client: AsyncClient, first: threading.Event) -> None:
            try:
                async for _ in client.stream(PROMPT, LONG):
                    first.set()
                self.results.append(("finished", time.monotonic()))
            except Exception as e:
                self.results.append((e, time.monotonic()))

        async def main() -> None:
            async with AsyncClient(self.address, timeout=self.timeout) as client:
                await asyncio.gather(*(one(client, f) for f in firsts))
        asyncio.run(main())

    def wait_running(self, timeout: float = 90.0) -> None:
        """Until every request has its first tokens (so each is running in the engine)."""
        deadline = time.monotonic() + timeout
        while not all(e.is_set() for e in self.first):
            assert not self.results and time.monotonic() < deadline, \
                f"not every request got tokens in {timeout} s: {self.results}"
            time.sleep(0.01)

    def join(self, timeout: float) -> list[tuple[Any, float]]:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), \
            f"requests still waiting after {timeout} s: {self.results}"
        return self.results


def assert_all_dead(results: list[tuple[Any, float]], count: int, since: float,
                    match: str) -> float:
    """Every request failed with EngineDeadError naming `match`, within DEATH_BOUND of
    `since`; the slowest latency."""
    assert len(results) == count, results
    for err, _ in results:
        assert isinstance(err, EngineDeadError), repr(err)
        assert match in str(err), str(err)
    latency = max(t for _, t in results) - since
    assert latency < DEATH_BOUND, latency
    return latency


# --- 1, 2: a worker or EngineCore killed ---------------------------------------------------

@pytest.mark.parametrize("victim", ["worker", "engine_core"])
def test_serve_sigkill_engine_side(serve, victim: str) -> None:
    s = serve()
    launcher, engine, workers = s.started[0], s.engine_core(), s.workers()
    assert len(workers) == 1
    target = workers[0] if victim == "worker" else engine
    rest = [p for p in (engine, *workers) if p.pid != target.pid]
    match = (f"worker 0 (pid {target.pid}) died" if victim == "worker"
             else f"EngineCore (pid {target.pid}) died")
    flight = InFlight(s.address)
    flight.wait_running()

    killed_at = time.monotonic()
    target.kill()
    latency = assert_all_dead(flight.join(DEATH_BOUND + 5), 4, killed_at, match)
    report(f"serve: SIGKILL {victim} -> every pending request's EngineDeadError", latency)

    start = time.monotonic()                              # a new request fails at once
    with Client(s.address, timeout=DEATH_BOUND) as c, pytest.raises(EngineDeadError,
                                                                    match=re.escape(match)):
        c.generate(PROMPT, SHORT)
    report(f"serve: new request after {victim} death -> EngineDeadError",
           time.monotonic() - start)
    assert time.monotonic() - start < DEATH_BOUND

    survivors = wait_exited(rest, max(0.0, killed_at + DEATH_BOUND - time.monotonic()))
    assert not survivors, [(p.pid, cmdline_of(p)) for p in survivors]
    report(f"serve: SIGKILL {victim} -> rest of the engine side exited",
           time.monotonic() - killed_at)
    # The launcher stays up to tell clients, does not spin, and (by then) reaped its child.
    assert not exited(launcher)
    used = cpu_seconds(launcher, 1.0)
    assert used < 0.3, f"the launcher used {used:.2f} s of CPU in 1 s with a dead engine"
    assert not zombie_children([launcher])
    s.signal(signal.SIGTERM)
    assert s.wait(STOP_BOUND) == 0, s.log
    assert not tagged_processes(s.tag)


def cmdline_of(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return "?"


def our_zombies(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `procs` that are exited children of this process, not reaped."""
    pids = {p.pid for p in procs}
    return [p for p in zombie_children([psutil.Process()]) if p.pid in pids]


def _start_llm(default_model: str, tag: str) -> tuple[LLM, psutil.Process, list[psutil.Process]]:
    llm = LLM(default_model, kv_cache_memory_gb=KV_GB, max_engine_restarts=0)
    procs = tagged_processes(tag)
    [engine] = [p for p in procs if is_module(p, ENGINE_MODULE)]
    workers = [p for p in procs if is_module(p, WORKER_MODULE)]
    assert len(workers) == 1 and len(procs) == 2, [cmdline_of(p) for p in procs]
    return llm, engine, workers


def in_thread(fn: Any) -> tuple[threading.Thread, list[tuple[Any, float]]]:
    """Run `fn` in a daemon thread (a hang must fail the test, not block it); its outcome
    (the exception, or "returned") and when it came are appended to the list."""
    outcome: list[tuple[Any, float]] = []

    def run() -> None:
        try:
            fn()
            outcome.append(("returned", time.monotonic()))
        except Exception as e:
            outcome.append((e, time.monotonic()))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def outcome_of(thread: threading.Thread, outcome: list[tuple[Any, float]], timeout: float,
               what: str) -> tuple[Any, float]:
    thread.join(timeout)
    assert not thread.is_alive(), f"{what} still blocked after {timeout} s"
    [result] = outcome
    return result


@pytest.mark.parametrize("when", ["busy", "idle"])
@pytest.mark.parametrize("victim", ["worker", "engine_core"])
def test_llm_sigkill_engine_side(default_model: str, llm_tag: str, victim: str,
                                 when: str) -> None:
    """Killed in the middle of generate(), or between two calls: the next call must not
    block on a send to an engine that is gone."""
    llm, engine, workers = _start_llm(default_model, llm_tag)
    target = workers[0] if victim == "worker" else engine
    rest = [p for p in (engine, *workers) if p.pid != target.pid]
    match = f"(pid {target.pid}) died"
    if when == "busy":
        thread, outcome = in_thread(lambda: llm.generate([PROMPT] * 3, LONG, use_tqdm=False))
        deadline = time.monotonic() + 90
        while llm.last_stats.num_running == 0:            # the requests are running
            assert time.monotonic() < deadline and thread.is_alive(), outcome
            time.sleep(0.01)
    killed_at = time.monotonic()
    target.kill()
    if when == "idle":                                    # the engine side is gone first
        assert not wait_exited([target, *rest], DEATH_BOUND)
        thread, outcome = in_thread(lambda: llm.generate(PROMPT, SHORT, use_tqdm=False))
    err, at = outcome_of(thread, outcome, DEATH_BOUND + 5, "generate()")
    assert isinstance(err, EngineDeadError), repr(err)
    assert match in str(err), str(err)
    report(f"LLM: SIGKILL {victim} ({when}) -> generate() raises EngineDeadError",
           at - killed_at)
    assert at - killed_at < DEATH_BOUND

    start = time.monotonic()                              # and so does every later call
    with pytest.raises(EngineDeadError, match=re.escape(match)):
        llm.generate(PROMPT, SHORT, use_tqdm=False)
    assert time.monotonic() - start < 1.0
    survivors = wait_exited(rest, max(0.0, killed_at + DEATH_BOUND - time.monotonic()))
    assert not survivors, [cmdline_of(p) for p in survivors]
    thread, outcome = in_thread(llm.shutdown)
    assert outcome_of(thread, outcome, STOP_BOUND, "shutdown()")[0] == "returned"
    assert not tagged_processes(llm_tag)
    assert not our_zombies([engine, *workers])


# --- 3: the parent killed ------------------------------------------------------------------

def test_serve_sigkill_launcher(serve) -> None:
    s = serve()
    children = s.started[1:]
    assert len(children) == 2
    with Client(s.address, timeout=60) as c:
        deltas = cast(Generator[Any, None, None], c.stream(PROMPT, LONG))
        next(deltas)                                      # EngineCore is busy stepping
        killed_at = time.monotonic()
        s.proc.kill()
        survivors = wait_exited(children, DEATH_BOUND)
        assert not survivors, [cmdline_of(p) for p in survivors]
        report("serve: SIGKILL launcher -> EngineCore and worker exited",
               time.monotonic() - killed_at)
        assert not tagged_processes(s.tag)
        deltas.close()


def test_serve_sigkill_launcher_during_startup(serve) -> None:
    """Children busy starting up (the worker loading weights) still notice their orphaning at
    once: a thread watches the parent pipe until their main loop takes over."""
    s = serve(wait=False)
    deadline = time.monotonic() + 60
    while not any(is_module(p, WORKER_MODULE) for p in s.tree()):
        assert s.proc.poll() is None and time.monotonic() < deadline, s.log
        time.sleep(0.01)
    children = s.tree()[1:]
    killed_at = time.monotonic()
    s.proc.kill()
    survivors = wait_exited(children, DEATH_BOUND)
    assert not survivors, [cmdline_of(p) for p in survivors]
    report("serve: SIGKILL launcher during start-up -> children exited",
           time.monotonic() - killed_at)
    assert not tagged_processes(s.tag)


def test_sigkill_user_process_holding_llm(default_model: str) -> None:
    tag = new_tag()
    script = ("import sys, time\nfrom kvflow import LLM\n"
              f"llm = LLM(sys.argv[1], kv_cache_memory_gb={KV_GB})\n"
              "print('ready', flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, default_model], cwd=REPO,
                            env={**os.environ, TAG_VAR: tag}, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        assert select.select([proc.stdout], [], [], 120)[0], "the script did not start"
        assert proc.stdout.readline().strip() == "ready"
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) == 2
        killed_at = time.monotonic()
        proc.kill()
        survivors = wait_exited(children, DEATH_BOUND)
        assert not survivors, [cmdline_of(p) for p in survivors]
        report("LLM: SIGKILL user process -> EngineCore and worker exited",
               time.monotonic() - killed_at)
        assert not tagged_processes(tag)
    finally:
        kill_processes([*tagged_processes(tag)])
        proc.kill()
        proc.wait(10)


# --- 4: clean stop on SIGTERM / Ctrl-C -----------------------------------------------------

@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C (SIGINT to the process group)"])
def test_serve_signal_stops_cleanly(serve, how: str) -> None:
    s = serve()
    flight = InFlight(s.address, num_sync=1, num_async=1)
    flight.wait_running()
    sent_at = time.monotonic()
    if how == "SIGTERM":
        s.signal(signal.SIGTERM)
    else:
        send_signal_to_group(s.pid, signal.SIGINT)
    rc = s.wait(STOP_BOUND)
    assert rc == 0, s.log
    survivors = wait_exited(s.started, max(0.0, sent_at + STOP_BOUND - time.monotonic()))
    assert not survivors, [cmdline_of(p) for p in survivors]
    report(f"serve: {how} -> every process stopped", time.monotonic() - sent_at)
    assert not tagged_processes(s.tag)
    assert "stopped" in s.log and "Traceback" not in s.log, s.log
    # The clients of requests that were running are told, not left waiting forever.
    assert_all_dead(flight.join(DEATH_BOUND), 2, sent_at, "shutting down")


# --- 5: failures at start-up ---------------------------------------------------------------

def test_llm_worker_start_failure(default_model: str, llm_tag: str, tmp_path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in failing_worker_env(str(tmp_path)).items():
        monkeypatch.setenv(name, value)
    children_before = {p.pid for p in psutil.Process().children()}
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=FAIL_MESSAGE):
        LLM(default_model, kv_cache_memory_gb=KV_GB)
    elapsed = time.monotonic() - start
    report("LLM: worker 0 fails at start-up -> LLM() raises", elapsed)
    assert elapsed < STARTUP_FAIL_BOUND
    assert not tagged_processes(llm_tag)                  # gone before LLM() returned
    zombies = zombie_children([psutil.Process()])
    assert not [p for p in zombies if p.pid not in children_before]


def _run_to_exit(s: ServeProcess, timeout: float) -> tuple[int, dict[psutil.Process, str]]:
    """Wait for a launcher that should fail; its exit code and every process seen meanwhile
    (with its command line)."""
    seen: dict[psutil.Process, str] = {}
    deadline = time.monotonic() + timeout
    while s.proc.poll() is None:
        for p in s.tree():
            if p not in seen:
                seen[p] = cmdline_of(p)
        assert time.monotonic() < deadline, f"launch.py serve still running:\n{s.log}"
        time.sleep(0.05)
    return s.wait(5), seen


def test_serve_worker_start_failure(serve, tmp_path) -> None:
    s = serve(env=failing_worker_env(str(tmp_path)), wait=False)
    start = time.monotonic()
    rc, seen = _run_to_exit(s, STARTUP_FAIL_BOUND)
    report("serve: worker 0 fails at start-up -> launcher exits", time.monotonic() - start)
    assert rc != 0
    assert FAIL_MESSAGE in s.log and "error:" in s.log, s.log
    assert "serving on" not in s.log
    assert any(ENGINE_MODULE in line for line in seen.values())   # it got to the children
    assert not wait_exited(seen, 1.0)
    assert not tagged_processes(s.tag)


@pytest.mark.parametrize("kind", ["missing", "empty_folder", "broken_weights"])
def test_serve_bad_model_folder(serve, default_model: str, tmp_path, kind: str) -> None:
    model = str(tmp_path / "model")
    if kind != "missing":
        os.mkdir(model)
    if kind == "broken_weights":                          # loads up to the worker's load
        for name in os.listdir(default_model):
            if not name.endswith(".safetensors"):
                shutil.copy(os.path.join(default_model, name), model)
        with open(os.path.join(model, "model.safetensors"), "wb") as f:
            f.write(b"this is not a safetensors file" * 10)
    expected = {"missing": "no such directory", "empty_folder": "no config.json",
                "broken_weights": "SafetensorError"}[kind]
    s = serve(model=model, wait=False)
    start = time.monotonic()
    rc, seen = _run_to_exit(s, STARTUP_FAIL_BOUND)
    report(f"serve: bad model folder ({kind}) -> launcher exits", time.monotonic() - start)
    assert rc != 0
    assert "error:" in s.log and expected in s.log, s.log
    assert not wait_exited(seen, 1.0)
    assert not tagged_processes(s.tag)


def test_serve_busy_http_port_fails_before_the_cluster_starts(default_model: str) -> None:
    """A port another program holds: launch.py says which address, at once, before loading
    the model or starting a child (the socket is bound before the cluster takes ports)."""
    holder = socket.create_server(("127.0.0.1", free_port()))
    s = ServeProcess("--max-engine-restarts", "0", model=default_model,
                     kv_cache_memory_gb=KV_GB, port=holder.getsockname()[1])
    try:
        start = time.monotonic()
        rc, seen = _run_to_exit(s, STARTUP_FAIL_BOUND)
        report("serve: HTTP port in use -> launcher exits", time.monotonic() - start)
        assert rc != 0
        assert f"cannot listen on 127.0.0.1:{s.port}" in s.log, s.log
        assert not any(is_module(p, m) for p in seen for m in (ENGINE_MODULE, WORKER_MODULE))
        assert not tagged_processes(s.tag)
    finally:
        holder.close()
        s.cleanup()


def test_http_port_bound_twice_the_second_to_listen_fails_by_name() -> None:
    """Two launchers that bound one port while loading (SO_REUSEADDR lets sockets that do not
    listen share it): the second to listen is told, by address, not left without a socket
    (uvloop ignores a failed listen)."""
    from kvflow.frontend.api.api_server import _listen, bind_http
    port = free_port()
    first, second = bind_http("127.0.0.1", port), bind_http("127.0.0.1", port)
    try:
        _listen(first, "127.0.0.1", port)
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port}"):
            _listen(second, "127.0.0.1", port)
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            bind_http("127.0.0.1", port)              # once one listens, binding fails too
    finally:
        for sock in first + second:
            sock.close()


# --- 6: garbage on every socket ------------------------------------------------------------

GARBAGE: list[list[bytes]] = [
    [b""], [b"\x00"], [b"\xc1"], [b"\xff" * 7], [bytes(range(256)) * 4],
    [b"a", b"b", b"c"],                                   # multipart
    [b"\xdd\xff\xff\xff\xff"],                            # a 4G-element array, truncated
    [b"\x91" * 5000],                                     # nested arrays
    [encode(5)], [encode({"a": 1})], [encode([1, 2, 3])], [encode(["nope", 1])],
    [b"\x93\xadClientRequest\xa2\xff\xfe\x80"],           # invalid UTF-8 in a str
    [b"\x94\xadEngineRequest\xa2\xff\xfe\x91\x01\x80"],
    [encode(Ping(1))], [encode(ClientOutput("x"))],       # valid, but the wrong direction
]


@pytest.fixture(scope="module")
def healthy(default_model: str):
    """One served cluster for the garbage tests, and the right answer to PROMPT."""
    s = ServeProcess(model=default_model, kv_cache_memory_gb=KV_GB)
    try:
        s.wait_serving()
        with Client(s.address, timeout=60) as c:
            expected = c.generate(PROMPT, SHORT).token_ids
        assert len(expected) == SHORT.max_tokens
        yield s, expected
    finally:
        s.cleanup()


def assert_healthy(s: ServeProcess, expected: list[int], while_running: Any = None) -> None:
    """A real request gets the right answer (`while_running()` is called once it streams),
    and every process of the cluster is the one that started, alive."""
    with Client(s.address, timeout=60) as c:
        tokens: list[int] = []
        for delta in c.stream(PROMPT, SHORT):
            tokens += delta.token_ids
            if while_running is not None:
                while_running()
                while_running = None
        assert tokens == expected
    alive = s.tree()
    assert {p.pid for p in alive} == {p.pid for p in s.started}
    assert not any(exited(p) for p in s.started), s.log


def push_garbage(address: str, messages: list[list[bytes]]) -> None:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.connect(address)
        for frames in messages:
            sock.send_multipart(frames)
        sock.close(linger=5000)                           # delivered before we go on
    finally:
        ctx.destroy(linger=0)


def test_garbage_to_client_socket(healthy) -> None:
    s, expected = healthy
    raw = msgspec.Raw(encode(SamplingParams(max_tokens=2)))
    bad_requests = {                                      # well-formed, but invalid: an error
        "r1": ClientRequest("r1", raw),                   # no prompt
        "r2": ClientRequest("r2", msgspec.Raw(encode("nope")), prompt="hi"),
        "r3": ClientRequest("r3", msgspec.Raw(encode({"temperature": "hot"})), prompt="hi"),
        "r4": ClientRequest("r4", raw, prompt_token_ids=[-1]),
        "r5": ClientRequest("r5", raw, prompt_token_ids=[2**63]),
        "r6": ClientRequest("r6", raw, messages=[{"no_role": "x"}]),
        "r7": ClientRequest("r7", raw, prompt_token_ids=[]),
        "r8": ClientRequest("r8", msgspec.Raw(b"\xa2\xff\xfe"), prompt="hi"),
    }
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(s.address)
        for frames in GARBAGE:
            sock.send_multipart(frames)                   # no key frame: dropped unread
            sock.send_multipart([b"", *frames])           # keyed: decoded, then dropped
        # [API key (none here), message]: the client library's framing.
        sock.send_multipart([b"", encode(ClientAbort("never-sent"))])
        for msg in bad_requests.values():
            sock.send_multipart([b"", encode(msg)])
        sock.send_multipart([b"", encode(ClientStatsRequest("stats"))])
        replies: dict[str, list[Any]] = {}
        while len(replies) < len(bad_requests) + 1:
            assert sock.poll(30_000), f"no reply; got {sorted(replies)}\n{s.log}"
            reply = msgspec.msgpack.decode(sock.recv())
            replies[reply[1]] = reply                     # [tag, request_id, ...]
    finally:
        ctx.destroy(linger=0)
    for request_id in bad_requests:                       # each got an error reply
        tag, _, *fields = replies[request_id]
        assert tag == "ClientOutput" and "invalid" in fields, (request_id, replies[request_id])
    assert replies["stats"][0] == "ClientStats"
    assert_healthy(s, expected)


def test_garbage_to_engine_input_socket(healthy) -> None:
    s, expected = healthy
    address = arg_value(s.engine_core(), "--input-address")
    assert address.startswith("ipc://")
    bogus = [                                             # the right types, nonsense inside
        EngineRequest("bogus-1", [], SamplingParams()),
        EngineRequest("bogus-2", [2**63 - 1], SamplingParams()),
        EngineRequest("bogus-3", [1, 2], SamplingParams(max_tokens=10**9)),
        Abort(["no-such-request"]),
        GetTimings(-1),
    ]
    messages = [*GARBAGE, [encode(StepResult([], []))], *[[encode(m)] for m in bogus]]
    push_garbage(address, messages)
    assert_healthy(s, expected, while_running=lambda: push_garbage(address, messages))


def test_garbage_to_worker_result_socket(healthy) -> None:
    """Workers' plans come from EngineCore's PUB socket, which no outsider can publish into;
    their results go to EngineCore's PULL socket, which anyone can push garbage into."""
    s, expected = healthy
    [worker] = s.workers()
    address = arg_value(worker, "--result-address")
    assert address.startswith("ipc://")
    messages = [*GARBAGE, [encode(EngineRequest("x", [1], SamplingParams()))],
                [encode(WorkerReady(7, 1))], [encode(Pong(0, 12345))]]
    push_garbage(address, messages)                      # read while waiting for a step
    assert_healthy(s, expected, while_running=lambda: push_garbage(address, messages))


# --- 7: LLM shutdown and garbage collection ------------------------------------------------

def test_llm_shutdown_leaves_no_process(default_model: str, llm_tag: str) -> None:
    llm, engine, workers = _start_llm(default_model, llm_tag)
    assert len(llm.generate(PROMPT, SHORT, use_tqdm=False)[0].token_ids) == SHORT.max_tokens
    start = time.monotonic()
    llm.shutdown()
    report("LLM.shutdown()", time.monotonic() - start)
    assert all(exited(p) for p in (engine, *workers))    # gone when shutdown() returns
    assert not tagged_processes(llm_tag)
    assert not our_zombies([engine, *workers])
    llm.shutdown()                                        # a second call is harmless
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPT, SHORT, use_tqdm=False)


@pytest.mark.parametrize("how", ["refcount", "cycle"])
def test_llm_garbage_collected_leaves_no_process(default_model: str, llm_tag: str,
                                                 how: str) -> None:
    """Dropped, or collected by the cycle collector (an LLM in a reference cycle, e.g. held
    by a frame of a stored traceback): either way the processes go, and nothing hangs."""
    llm, engine, workers = _start_llm(default_model, llm_tag)
    if how == "cycle":
        llm.cycle = llm                                   # type: ignore[attr-defined]
    ref = weakref.ref(llm)
    start = time.monotonic()
    del llm
    thread, outcome = in_thread(gc.collect)
    assert outcome_of(thread, outcome, STOP_BOUND, "gc.collect()")[0] == "returned"
    assert ref() is None
    survivors = wait_exited([engine, *workers], STOP_BOUND)
    assert not survivors, [cmdline_of(p) for p in survivors]
    report(f"LLM garbage-collected ({how}) -> processes gone", time.monotonic() - start)
    assert not tagged_processes(llm_tag)
    assert not our_zombies([engine, *workers])
