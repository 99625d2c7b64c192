"""Multi-node tensor parallelism: `launch.py serve --nnodes 2 --node-rank 0` plus
`launch.py serve --headless --node-rank 1`, as two processes on 127.0.0.1 and as two network
namespaces joined by a veth pair (each "node" with its own address and interface).

- TP=2 across the nodes gives the greedy tokens of TP=1 (in-process, float32, the same weights).
- A worker SIGKILLed on node 1 (or node 0's EngineCore) mid-stream: node 0 restarts the engine,
  the headless node rejoins it, and the stream completes with the tokens of an uninterrupted
  run; then the cluster serves on, and nothing of the first engine is left.
- With restarts off (--max-engine-restarts 0), a worker SIGKILLed on node 1 or the wire
  between the nodes cut: the request in flight fails with EngineDeadError within 5 s, and the
  engine's processes on both nodes exit (node 0's launcher stays up to tell clients why, as
  with one node: tests/test_cluster_faults.py).
- Node 0 stopped: the headless node exits 0 at once; SIGKILLed whole: the headless node tries
  to rejoin for its --startup-timeout, then exits 1.
- A node that never joins, an unreachable master, a wrong GLOO_SOCKET_IFNAME: a clear error
  within the start-up timeout, nothing left running.
- Security (every node shares a cluster secret): none given is refused up front; a peer without
  it can neither read a plan nor inject a result, a ChildFailed or a heartbeat, and the cluster
  serves on; a headless node with another secret is refused, and node 0 says so too; a
  ClusterInfo tampered with in the store is rejected.
"""
from __future__ import annotations

import os
import re
import secrets
import signal
import tempfile
import threading
import time
from typing import Any

import msgspec
import pytest
import zmq

from cluster_helpers import (ServeProcess, exited, free_port, is_module, tagged_processes,
                             wait_exited, WORKER_MODULE)
from kvflow import LLM, Client, EngineDeadError, SamplingParams
from kvflow.config import make_engine_config
from kvflow.core.executor import HEARTBEAT_TIMEOUT
from kvflow.ipc.auth import SECRET_VAR, Authenticator, ClusterKeys, SecretMismatch
from kvflow.ipc.messages import (ChildFailed, ClusterInfo, FromWorker, Heartbeat, Ping,
                                 StepResult, ToWorker)
from kvflow.ipc.sockets import Channel, ipc_address, make_socket
from kvflow.ipc.network import host_ip, interface_of
from kvflow.workers.headless import joined_config
from netns import NamespacePair, Unavailable

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
PROMPTS: list[Any] = ["Hello, my name is", "The capital of France is", [7] * 45]
DEATH_BOUND = 5.0
KV_GB = 0.05


@pytest.fixture(scope="module")
def tiny(tiny_models: dict[str, str]) -> str:
    return tiny_models["llama"]          # 4 heads, 2 KV heads: splits over 2 ranks


@pytest.fixture(scope="module")
def reference(tiny: str) -> list[list[int]]:
    with LLM(tiny, in_process=True, kv_cache_memory_gb=KV_GB, dtype="float32") as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture
def netns():
    try:
        pair = NamespacePair()
    except Unavailable as e:
        pytest.skip(f"two network namespaces cannot be made here: {e}")
    yield pair
    pair.close()


SECRET = secrets.token_hex(32)


def secret_file(directory: Any, secret: str) -> str:
    path = os.path.join(str(directory), f"secret-{secret[:8]}")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        print(secret, file=f)                  # with the newline `print` adds, as documented
    return path


@pytest.fixture
def nodes(tmp_path: Any):
    """start(node_rank, model, master_addr, master_port, *args, secret=SECRET, **kw) ->
    ServeProcess (secret: the cluster secret, in a file given by --cluster-secret-file; None:
    no secret); every node's processes are killed at the end, whatever happened."""
    started: list[ServeProcess] = []

    def start(node_rank: int, model: str, master_addr: str, master_port: int, *args: str,
              secret: str | None = SECRET, **kw: Any) -> ServeProcess:
        flags = ["--tp", "2", "--nnodes", "2", "--node-rank", str(node_rank), "--master-addr",
                 master_addr, "--master-port", str(master_port), *args]
        if secret is not None:
            flags += ["--cluster-secret-file", secret_file(tmp_path, secret)]
        if node_rank:
            flags.append("--headless")
            kw.setdefault("zmq", False)
        else:
            flags += ["--dtype", "float32"]      # node 1 takes node 0's configuration
        s = ServeProcess(*flags, model=model, kv_cache_memory_gb=KV_GB, **kw)
        started.append(s)
        return s
    yield start
    for s in started:
        s.cleanup()


def generate(address: str) -> list[list[int]]:
    with Client(address, timeout=60) as c:
        return [c.generate(p, GREEDY).token_ids for p in PROMPTS]


class LongRequest:
    """One long streamed request in a thread; `outcome` is (exception or "finished", when)."""

    def __init__(self, address: str) -> None:
        self.outcome: list[tuple[Any, float]] = []
        self.streaming = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(address,), daemon=True)
        self.thread.start()
        assert self.streaming.wait(60), self.outcome

    def _run(self, address: str) -> None:
        try:
            with Client(address, timeout=60) as c:
                for _ in c.stream("Once upon a time", LONG):
                    self.streaming.set()
            self.outcome.append(("finished", time.monotonic()))
        except Exception as e:
            self.outcome.append((e, time.monotonic()))

    def result(self, timeout: float) -> tuple[Any, float]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the request still blocked after {timeout} s"
        return self.outcome[0]


def wait_for_log(s: ServeProcess, text: str, timeout: float, after: int = 0) -> None:
    """Until `text` is in s's log (from line `after` on)."""
    deadline = time.monotonic() + timeout
    while not any(text in line for line in s.lines[after:]):
        assert s.proc.poll() is None, f"exited while waiting for {text!r}:\n{s.log}"
        assert time.monotonic() < deadline, f"no {text!r} after {timeout} s:\n{s.log}"
        time.sleep(0.1)


def wait_exit(s: ServeProcess, timeout: float) -> int:
    try:
        return s.wait(timeout)
    except Exception:
        raise AssertionError(f"launch.py did not exit within {timeout} s:\n{s.log}") from None


def engine_side(node0: ServeProcess) -> list:
    """Node 0's processes but its launcher (which stays up by design)."""
    return node0.started[1:]


def assert_dead_quickly(request: LongRequest, killed_at: float, match: str) -> float:
    err, at = request.result(DEATH_BOUND + 10)
    assert isinstance(err, EngineDeadError), repr(err)
    assert re.search(match, str(err)), str(err)
    print(f"\n[latency] failure -> EngineDeadError on the client: {at - killed_at:.3f} s")
    assert at - killed_at < DEATH_BOUND
    return at


# --- configuration: no processes ------------------------------------------------------------

def test_layout_errors(tiny: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_VAR, SECRET)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must be a multiple of nnodes=4"):
        make_engine_config(tiny, tensor_parallel_size=2, nnodes=4)
    with pytest.raises(ValueError, match=r"node_rank=2 must be in \[0, nnodes=2\)"):
        make_engine_config(tiny, tensor_parallel_size=2, nnodes=2, node_rank=2)
    with pytest.raises(ValueError, match="startup_timeout=0 must be > 0"):
        make_engine_config(tiny, startup_timeout=0)
    config = make_engine_config(tiny, tensor_parallel_size=2, nnodes=2)
    assert config.parallel.master_port == 29501                # vLLM's default
    assert list(config.parallel.node_ranks(1)) == [1]
    four = make_engine_config(tiny, tensor_parallel_size=4, nnodes=2).parallel
    assert [four.local_rank(r) for r in range(4)] == [0, 1, 0, 1]     # cuda:0, cuda:1 per node
    assert list(four.node_ranks(1)) == [2, 3]
    assert make_engine_config(tiny).parallel.master_port is None  # one node: a free port
    with pytest.raises(ValueError, match="node_rank=1: only node 0 runs the engine.*--headless"):
        LLM(tiny, tensor_parallel_size=2, nnodes=2, node_rank=1)


def test_headless_node_takes_node_0s_configuration(tiny_models: dict[str, str], tmp_path: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_VAR, SECRET)
    tiny = tiny_models["llama"]
    node0 = make_engine_config(tiny, tensor_parallel_size=2, nnodes=2, dtype="float32",
                               block_size=32, num_threads=1)
    mine = make_engine_config(tiny, tensor_parallel_size=2, nnodes=2, node_rank=1,
                              num_threads=2, cluster_secret_file=secret_file(tmp_path, SECRET))
    joined = joined_config(node0, mine)
    assert joined.model.dtype == "float32" and joined.cache.block_size == 32
    assert joined.num_threads == 2 and joined.parallel.node_rank == 1
    # Each node reads the secret from its own file (only the path is in the config).
    assert joined.parallel.cluster_secret_file == mine.parallel.cluster_secret_file
    with pytest.raises(ValueError, match="nnodes=1 on this node but 2 on node 0"):
        joined_config(node0, make_engine_config(tiny, tensor_parallel_size=2))
    with pytest.raises(ValueError, match="is not the model node 0 serves"):
        joined_config(make_engine_config(tiny_models["qwen3"], tensor_parallel_size=2, nnodes=2),
                      make_engine_config(tiny, tensor_parallel_size=2, nnodes=2, node_rank=1))


def test_node_address(monkeypatch: pytest.MonkeyPatch) -> None:
    assert host_ip("127.0.0.1", 29501) == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") is None                  # TEST-NET-1: nobody's
    monkeypatch.setenv("KVFLOW_HOST_IP", "192.0.2.1")
    assert host_ip("127.0.0.1", 29501) == "192.0.2.1"
    monkeypatch.delenv("KVFLOW_HOST_IP")
    with pytest.raises(ValueError, match="master_addr='no-such-host.invalid' does not resolve"):
        host_ip("no-such-host.invalid", 29501)


# --- security: no processes -----------------------------------------------------------------

def test_no_secret_refused(tiny: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_VAR, raising=False)
    how = r"secrets.token_hex\(32\).*--cluster-secret-file"
    with pytest.raises(ValueError, match=f"need a shared cluster secret, and none was given.*{how}"):
        make_engine_config(tiny, tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match=f"cannot be read.*{how}"):
        make_engine_config(tiny, tensor_parallel_size=2, nnodes=2,
                           cluster_secret_file=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="has 5 characters; it needs at least 16"):
        make_engine_config(tiny, tensor_parallel_size=2, nnodes=2,
                           cluster_secret_file=secret_file(tmp_path, "short"))
    monkeypatch.setenv(SECRET_VAR, SECRET)        # the environment variable serves as well
    assert make_engine_config(tiny, tensor_parallel_size=2,
                              nnodes=2).parallel.cluster_secret_file is None
    assert make_engine_config(tiny).parallel.cluster_secret_file is None   # one node: none


def test_one_node_sockets_are_private() -> None:
    """One node needs no secret: its engine sockets are ipc:// paths in a 0700 directory."""
    path = ipc_address("plans").removeprefix("ipc://")
    try:
        assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    finally:
        os.rmdir(os.path.dirname(path))
    run_dir = tempfile.mkdtemp(prefix="kvflow-")          # what MultiprocEngine makes
    try:
        assert os.stat(run_dir).st_mode & 0o777 == 0o700
    finally:
        os.rmdir(run_dir)


def test_cluster_info_signature(tiny: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_VAR, SECRET)
    config = make_engine_config(tiny, tensor_parallel_size=2, nnodes=2)
    data = msgspec.msgpack.encode(ClusterInfo("tcp://a:1", "tcp://a:2", "tcp://a:3", config))
    keys = ClusterKeys(SECRET.encode())
    blob = keys.sign(data)
    assert SECRET.encode() not in blob                   # the secret is not in the store
    assert keys.verify(blob) == data
    forged = blob.replace(b"tcp://a:1", b"tcp://x:1")    # EngineCore's address redirected
    assert forged != blob
    for bad in (forged, blob[:20], data, blob[:-1]):
        with pytest.raises(SecretMismatch):
            keys.verify(bad)
    with pytest.raises(SecretMismatch):                  # another cluster's secret
        ClusterKeys(secrets.token_hex(32).encode()).verify(blob)


def try_send(sock: zmq.Socket, msg: msgspec.Struct) -> None:
    """A stranger's send: queued while its connection tries a handshake; refused (zmq.Again)
    once a failed handshake has dropped the connection and the next attempt has not begun."""
    try:
        sock.send(msgspec.msgpack.encode(msg), zmq.NOBLOCK)
    except zmq.Again:
        pass


def test_curve_keeps_strangers_out() -> None:
    """EngineCore's three kinds of socket, in one process: the cluster's clients talk; a peer
    with no CURVE, with another secret's keys, or even knowing the server's public key but not
    the client's key, gets nothing and delivers nothing."""
    keys = ClusterKeys(SECRET.encode())
    other = ClusterKeys(secrets.token_hex(32).encode())
    ctx = zmq.Context()
    auth = Authenticator(ctx, keys)
    try:
        pub = make_socket(ctx, zmq.PUB, "tcp://127.0.0.1:*", True, keys=keys)
        pull = make_socket(ctx, zmq.PULL, "tcp://127.0.0.1:*", True, keys=keys)
        plan_at, result_at = (s.getsockopt_string(zmq.LAST_ENDPOINT) for s in (pub, pull))
        leaked = ClusterKeys(secrets.token_hex(32).encode())
        leaked.server_public = keys.server_public          # knows the server key only

        def peer(kind: int, address: str, peer_keys: ClusterKeys | None) -> zmq.Socket:
            return make_socket(ctx, kind, address, False, keys=peer_keys)

        strangers = [(peer(zmq.SUB, plan_at, k), peer(zmq.PUSH, result_at, k))
                     for k in (None, other, leaked)]
        sub, push = peer(zmq.SUB, plan_at, keys), peer(zmq.PUSH, result_at, keys)
        plans = Channel[ToWorker](pub, ToWorker)
        deadline = time.monotonic() + 10
        while not sub.poll(50):                            # PUB/SUB: wait until joined
            plans.send(Ping(1))
            assert time.monotonic() < deadline
        for _ in range(10):                                # they try for 0.5 s
            for _, stranger_push in strangers:
                try_send(stranger_push, ChildFailed("x", "forged"))
            time.sleep(0.05)
        plans.send(Ping(2))
        Channel[FromWorker](push, FromWorker).send(StepResult([], []))
        assert pull.poll(2000)
        assert isinstance(Channel[FromWorker](pull, FromWorker).recv(), StepResult)
        assert not pull.poll(300)                          # nothing forged came through
        for stranger_sub, _ in strangers:
            assert not stranger_sub.poll(0)                # and no plan reached a stranger
    finally:
        auth.stop()
        ctx.destroy(linger=0)


# --- two processes on 127.0.0.1 -------------------------------------------------------------

@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_loopback_two_nodes(nodes, tiny: str, reference: list[list[int]], how: str) -> None:
    port = free_port()
    node0 = nodes(0, tiny, "127.0.0.1", port)
    # Node 1 waits for node 0's engine at most this long, at start and after node 0 went away
    # (node 0's store is up soon after EngineCore binds its sockets).
    rejoin = 8
    wait_for_log(node0, "EngineCore listens for the other nodes", 60)
    node1 = nodes(1, tiny, "127.0.0.1", port, "--startup-timeout", str(rejoin))
    node0.wait_serving()
    assert generate(node0.address) == reference
    node1.started = node1.tree()
    assert len([p for p in node1.started if is_module(p, WORKER_MODULE)]) == 1
    # Node 0 goes away: stopped cleanly, or all its processes killed at once.
    gone_at = time.monotonic()
    if how == "sigterm":
        node0.signal(signal.SIGTERM)
        assert wait_exit(node0, 15) == 0, node0.log
        assert wait_exit(node1, 10) == 0, node1.log
        assert "EngineCore shut the cluster down" in node1.log
    else:                     # it tries to rejoin for its start-up timeout, then gives up
        os.killpg(node0.pid, signal.SIGKILL)
        assert wait_exit(node1, HEARTBEAT_TIMEOUT + rejoin + 5) == 1, node1.log
        assert "no heartbeat from EngineCore (node 0)" in node1.log
        assert ("error: node 1 could not rejoin: node 0's engine did not come back at "
                f"127.0.0.1:{port} within the start-up timeout ({rejoin} s)") in node1.log
        assert time.monotonic() - gone_at > HEARTBEAT_TIMEOUT + rejoin - 1
    print(f"\n[latency] node 0 {how} -> headless node exited: {time.monotonic() - gone_at:.2f} s")
    assert not wait_exited(node1.started, 5)
    assert not tagged_processes(node0.tag) and not tagged_processes(node1.tag)


RESUMED = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def killed_mid_stream(node0: ServeProcess, node1: ServeProcess, reference: list[list[int]],
                      victim: str = "remote worker") -> None:
    """A request streamed twice: uninterrupted (the reference), then with node 1's worker (or
    node 0's EngineCore) SIGKILLed after its first tokens. Node 0 restarts the engine, node 1
    rejoins it, and the stream goes on with no error and the same tokens; then the cluster
    serves a new request, and no process of the first engine is left on either node."""
    prompt = "Once upon a time"
    with Client(node0.address, timeout=60) as c:
        expected = c.generate(prompt, RESUMED).token_ids
        node1.started = node1.tree()
        [worker] = [p for p in node1.started if is_module(p, WORKER_MODULE)]
        target = worker if victim == "remote worker" else node0.engine_core()
        first_engine = [*engine_side(node0), *node1.started[1:]]
        got: list[int] = []
        killed_at, before = 0.0, 0
        for delta in c.stream(prompt, RESUMED):
            got += delta.token_ids
            if not killed_at and len(got) >= 8:
                target.kill()
                killed_at, before = time.monotonic(), len(got)
        took = time.monotonic() - killed_at
    assert killed_at and before < len(expected)
    assert got == expected                           # resumed where it stopped, same tokens
    cause = "worker" if victim == "remote worker" else "engine_core"
    assert f"engine restarted ({cause})" in node0.log, node0.log
    assert "node 1: rejoining the restarted cluster (rejoin 1," in node1.log, node1.log
    if victim != "remote worker":                   # node 1 learnt it from the silence
        assert "no heartbeat from EngineCore (node 0)" in node1.log, node1.log
    assert not wait_exited(first_engine, 10), "a process of the first engine survived"
    print(f"\n[latency] SIGKILL {victim} after {before} tokens -> node 1 rejoined and the "
          f"stream completed ({len(got)} tokens) {took:.1f} s later")
    assert generate(node0.address) == reference       # and it serves on
    node0.signal(signal.SIGTERM)
    assert wait_exit(node0, 15) == 0, node0.log
    assert wait_exit(node1, 10) == 0, node1.log       # told, as before: no rejoin
    assert "EngineCore shut the cluster down" in node1.log


@pytest.mark.parametrize("victim", ["remote worker", "engine core"])
def test_loopback_killed_node_rejoins(nodes, tiny: str, reference: list[list[int]],
                                      victim: str) -> None:
    port = free_port()
    node0 = nodes(0, tiny, "127.0.0.1", port, "--startup-timeout", "30")
    node1 = nodes(1, tiny, "127.0.0.1", port, "--startup-timeout", "30")
    node0.wait_serving()
    killed_mid_stream(node0, node1, reference, victim)
    assert not tagged_processes(node0.tag) and not tagged_processes(node1.tag)


def test_node_that_never_joins(nodes, tiny: str) -> None:
    start = time.monotonic()
    node0 = nodes(0, tiny, "127.0.0.1", free_port(), "--startup-timeout", "6")
    assert wait_exit(node0, 60) != 0
    took = time.monotonic() - start
    assert ("error: EngineCore failed: node(s) [1] (ranks [1]) did not join within the "
            "start-up timeout (6 s): start `launch.py serve --headless") in node0.log, node0.log
    print(f"\n[latency] node 1 missing -> node 0's error after {took:.1f} s (timeout 6 s)")
    assert not tagged_processes(node0.tag)


def test_node_with_another_model(nodes, tiny_models: dict[str, str]) -> None:
    """Node 1 started for another model: both nodes stop at once, saying so."""
    port = free_port()
    node0 = nodes(0, tiny_models["llama"], "127.0.0.1", port, "--startup-timeout", "60")
    node1 = nodes(1, tiny_models["qwen3"], "127.0.0.1", port, "--startup-timeout", "60")
    start = time.monotonic()
    assert wait_exit(node1, 60) == 1
    assert wait_exit(node0, 30) != 0
    assert "is not the model node 0 serves" in node1.log, node1.log
    assert "error: EngineCore failed: node 1 failed: model=" in node0.log, node0.log
    print(f"\n[latency] node 1 with another model -> both nodes' errors after "
          f"{time.monotonic() - start:.1f} s (start-up timeout 60 s)")
    assert not tagged_processes(node0.tag) and not tagged_processes(node1.tag)


def test_unreachable_master_loopback(nodes, tiny: str) -> None:
    port = free_port()                         # nothing listens there
    start = time.monotonic()
    node1 = nodes(1, tiny, "127.0.0.1", port, "--startup-timeout", "4")
    assert wait_exit(node1, 60) == 1
    assert (f"node 1 could not reach node 0's store at 127.0.0.1:{port} within the start-up "
            "timeout") in node1.log, node1.log
    print(f"\n[latency] unreachable master -> error after {time.monotonic() - start:.1f} s "
          "(timeout 4 s, plus start-up)")
    assert not tagged_processes(node1.tag)


def test_launch_without_secret_refused(nodes, tiny: str) -> None:
    """Both kinds of node refuse to start without a secret, before loading anything."""
    port = free_port()
    started = [nodes(0, tiny, "127.0.0.1", port, secret=None),
               nodes(1, tiny, "127.0.0.1", port, secret=None)]
    for s in started:
        assert wait_exit(s, 30) == 1, s.log
        assert "error: several nodes (nnodes > 1) need a shared cluster secret" in s.log, s.log
        assert "secrets.token_hex(32)" in s.log and "--cluster-secret-file" in s.log
        assert not tagged_processes(s.tag)


def engine_addresses(node0: ServeProcess) -> tuple[str, str, str]:
    """EngineCore's plan, result and control addresses, as it logs them."""
    found = re.search(r"EngineCore listens for the other nodes on (\S+) \(plans\), (\S+) "
                      r"\(results\), (\S+) \(heartbeats\)", node0.log)
    assert found, node0.log
    return found.group(1), found.group(2), found.group(3)


def test_loopback_stranger_cannot_read_inject_or_stop(nodes, tiny: str,
                                                      reference: list[list[int]]) -> None:
    """A process that knows EngineCore's addresses but not the secret, with no CURVE or with
    another secret's keys: it reads no plan while requests are served, and its forged
    StepResult, ChildFailed and heartbeat neither change an answer nor stop the cluster."""
    port = free_port()
    node0 = nodes(0, tiny, "127.0.0.1", port)
    node1 = nodes(1, tiny, "127.0.0.1", port)
    node0.wait_serving()
    plan_at, result_at, control_at = engine_addresses(node0)
    other = ClusterKeys(secrets.token_hex(32).encode())
    ctx = zmq.Context()
    try:
        subs, senders = [], []
        for keys in (None, other):
            subs.append(make_socket(ctx, zmq.SUB, plan_at, False, keys=keys))
            senders += [make_socket(ctx, zmq.PUSH, result_at, False, keys=keys),
                        make_socket(ctx, zmq.DEALER, control_at, False, keys=keys,
                                    identity=b"node1")]
        done = threading.Event()

        def inject() -> None:                         # keeps trying while requests run
            while not done.wait(0.05):
                for sock in senders:
                    for msg in (StepResult(["0"], [1]), ChildFailed("worker 1", "forged"),
                                Heartbeat(1)):
                        try_send(sock, msg)
        injector = threading.Thread(target=inject)
        injector.start()
        try:
            time.sleep(0.5)
            assert generate(node0.address) == reference   # plans were published meanwhile
            for sub in subs:
                assert not sub.poll(0), "a stranger received a plan"
            assert generate(node0.address) == reference   # still serving, still right
        finally:
            done.set()
            injector.join()
    finally:
        ctx.destroy(linger=0)
    assert not exited(node0.started[0]) and node1.proc.poll() is None
    assert "failed" not in node0.log, node0.log
    node0.signal(signal.SIGTERM)
    assert wait_exit(node0, 15) == 0, node0.log
    assert wait_exit(node1, 10) == 0, node1.log


def test_loopback_wrong_secret(nodes, tiny: str) -> None:
    """A headless node with another secret: refused, and node 0 says why, both at once."""
    port = free_port()
    node0 = nodes(0, tiny, "127.0.0.1", port, "--startup-timeout", "60")
    node1 = nodes(1, tiny, "127.0.0.1", port, "--startup-timeout", "60",
                  secret=secrets.token_hex(32))
    start = time.monotonic()
    assert wait_exit(node1, 60) == 1
    assert wait_exit(node0, 30) != 0
    assert ("error: node 1 refused to join: the cluster secret differs from node 0's"
            in node1.log), node1.log
    assert ("error: EngineCore failed: node 1 failed:\nnode 1 refused to join: the ClusterInfo "
            "this node signed did not verify there, so its cluster secret differs from node "
            "0's") in node0.log, node0.log
    took = time.monotonic() - start
    print(f"\n[latency] wrong secret on node 1 -> both nodes' errors after {took:.1f} s "
          "(start-up timeout 60 s)")
    assert took < 30
    assert not tagged_processes(node0.tag) and not tagged_processes(node1.tag)


# --- two network namespaces, each with its own address ----------------------------------------

def start_pair(nodes, netns: NamespacePair, model: str, tmp_path: Any, *args: str,
               env1: dict[str, str] | None = None) -> tuple[ServeProcess, ServeProcess]:
    port = free_port()
    master = netns.ips[0]
    # Clients reach node 0 through a Unix socket: the file system is shared, the network not.
    node0 = nodes(0, model, master, port, *args, prefix=netns.enter(0),
                  address=f"ipc://{tmp_path}/client")
    node1 = nodes(1, model, master, port, *args, prefix=netns.enter(1), env=env1)
    return node0, node1


def test_namespaces_tp2_then_remote_worker_killed(nodes, netns: NamespacePair, tiny: str,
                                                  reference: list[list[int]],
                                                  tmp_path: Any) -> None:
    """Fail-stop (restarts off): the whole cluster ends, node 1 does not wait to rejoin."""
    node0, node1 = start_pair(nodes, netns, tiny, tmp_path, "--max-engine-restarts", "0")
    node0.wait_serving()
    assert generate(node0.address) == reference
    # Each node's gloo took the interface of its own address.
    assert f"gloo uses interface {netns.links[0]} ({netns.ips[0]})" in node0.log
    assert f"gloo uses interface {netns.links[1]} ({netns.ips[1]})" in node1.log

    node1.started = node1.tree()
    [remote_worker] = [p for p in node1.started if is_module(p, WORKER_MODULE)]
    request = LongRequest(node0.address)
    killed_at = time.monotonic()
    remote_worker.kill()
    # Node 1's report or rank 0's failed collective, whichever EngineCore sees first.
    assert_dead_quickly(request, killed_at,
                        r"worker 1 failed|worker 0's step failed with tensor parallelism")
    with Client(node0.address, timeout=DEATH_BOUND) as c, pytest.raises(EngineDeadError):
        c.generate("Hi", GREEDY)                     # a new request fails at once too
    survivors = wait_exited([*engine_side(node0), *node1.started],
                            max(0.0, killed_at + DEATH_BOUND - time.monotonic()))
    assert not survivors, [p.cmdline() for p in survivors]
    assert wait_exit(node1, 1) == 1
    assert "nothing to rejoin" in node1.log, node1.log
    print(f"\n[latency] SIGKILL remote worker -> every engine process on both nodes exited: "
          f"{time.monotonic() - killed_at:.2f} s")
    assert not exited(node0.started[0])              # node 0's launcher tells clients why
    node0.signal(signal.SIGTERM)
    assert wait_exit(node0, 15) == 0, node0.log
    assert not tagged_processes(node0.tag) and not tagged_processes(node1.tag)


def test_namespaces_remote_worker_killed_node_rejoins(nodes, netns: NamespacePair, tiny: str,
                                                      reference: list[list[int]],
                                                      tmp_path: Any) -> None:
    node0, node1 = start_pair(nodes, netns, tiny, tmp_path, "--startup-timeout", "30")
    node0.wait_serving()
    killed_mid_stream(node0, node1, reference)
    assert not tagged_processes(node0.tag) and not tagged_processes(node1.tag)


def test_namespaces_wire_cut(nodes, netns: NamespacePair, tiny: str, tmp_path: Any) -> None:
    """Fail-stop (restarts off); with restarts node 1 would try to rejoin."""
    node0, node1 = start_pair(nodes, netns, tiny, tmp_path, "--max-engine-restarts", "0")
    node0.wait_serving()
    node1.started = node1.tree()
    request = LongRequest(node0.address)
    cut_at = time.monotonic()
    netns.set_link(1, "down")                        # node 1 is unreachable, nobody died
    assert_dead_quickly(request, cut_at, r"node 1 \(ranks \[1\]\) sent no heartbeat")
    survivors = wait_exited(engine_side(node0), max(0.0, cut_at + DEATH_BOUND - time.monotonic()))
    assert not survivors, [p.cmdline() for p in survivors]
    # Node 1, cut off, hears nothing from node 0 and stops itself (its worker may sit in a
    # collective that never ends: it is killed).
    assert wait_exit(node1, HEARTBEAT_TIMEOUT + 8) == 1, node1.log
    assert "no heartbeat from EngineCore (node 0)" in node1.log
    assert not wait_exited(node1.started, 5)
    print(f"\n[latency] wire cut -> both nodes' engine processes exited: "
          f"{time.monotonic() - cut_at:.2f} s")
    node0.signal(signal.SIGTERM)
    assert wait_exit(node0, 15) == 0, node0.log


def test_namespaces_unreachable_master(nodes, netns: NamespacePair, tiny: str) -> None:
    wrong = netns.ips[0].rsplit(".", 1)[0] + ".99"   # on the wire's subnet, nobody there
    start = time.monotonic()
    node1 = nodes(1, tiny, wrong, free_port(), "--startup-timeout", "5", prefix=netns.enter(1))
    assert wait_exit(node1, 60) == 1
    assert f"node 1 could not reach node 0's store at {wrong}:" in node1.log, node1.log
    print(f"\n[latency] unreachable master -> error after {time.monotonic() - start:.1f} s")
    assert not tagged_processes(node1.tag)


def test_namespaces_wrong_interface(nodes, netns: NamespacePair, tiny: str,
                                    tmp_path: Any) -> None:
    node0, node1 = start_pair(nodes, netns, tiny, tmp_path, "--startup-timeout", "30",
                              env1={"GLOO_SOCKET_IFNAME": "kvnosuch0"})
    start = time.monotonic()
    assert wait_exit(node0, 60) != 0
    for log in (node0.log, node1.log):               # said on both nodes
        assert ("rank 1 could not join the tensor-parallel group (the store at "
                f"{netns.ips[0]}:") in log, log
        assert "GLOO_SOCKET_IFNAME='kvnosuch0' (set by the user)" in log
    wait_exit(node1, 10)
    print(f"\n[latency] wrong GLOO_SOCKET_IFNAME -> node 0's error after "
          f"{time.monotonic() - start:.1f} s")
    assert not tagged_processes(node0.tag) and not tagged_processes(node1.tag)
