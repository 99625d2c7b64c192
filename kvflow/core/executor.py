"""EngineCore's side of the workers: spawn one process per rank, broadcast plans, collect results.

Start-up: each worker reports WorkerReady (or ChildFailed) within a timeout while we watch
every process sentinel, so a worker that dies while starting is an error, never a hang. Then
Ping is published until every rank answers Pong: PUB/SUB drops messages sent before a
subscriber is connected, and this handshake guarantees no plan is lost that way.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections import deque
from typing import Callable, Mapping

import zmq

from kvflow.config import EngineConfig, ParallelConfig
from kvflow.ipc.auth import Authenticator, ClusterKeys
from kvflow.ipc.messages import (ChildFailed, FromNode, FromWorker, Heartbeat, Ping, Pong,
                                 Shutdown, StepMasks, StepPlan, StepResult, ToWorker,
                                 WorkerReady)
from kvflow.ipc.network import host_ip, tcp_address
from kvflow.ipc.process import Child
from kvflow.ipc.sockets import Channel, ipc_address, make_socket
from kvflow.workers import huge_pages

logger = logging.getLogger(__name__)


class WorkerFailure(RuntimeError):
    """A worker died or reported an error; EngineCore cannot go on."""


class StartupTimeout(WorkerFailure):
    pass


HEARTBEAT_INTERVAL = 0.5   # seconds between heartbeats, both ways, with each --headless node
HEARTBEAT_TIMEOUT = 3.0    # silence after which a node (or node 0) counts as gone
TICK = 1.0                 # while a step runs: how often EngineCore tells the frontend it lives


def bound_address(sock: zmq.Socket) -> str:
    """The address a socket bound (with its port when bound to "*")."""
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))


def bind_avoiding(ctx: zmq.Context, kind: int, address: str, keys: ClusterKeys | None,
                  avoid: int | None) -> zmq.Socket:
    """A socket bound to `address` (a "*" port: any free one) on a port other than `avoid`:
    the store's port, free until rank 0 binds it a moment later, so the system may offer
    it to us first."""
    sock = make_socket(ctx, kind, address, True, keys=keys)
    if avoid is not None and bound_address(sock).endswith(f":{avoid}"):
        other = bind_avoiding(ctx, kind, address, keys, avoid)   # while `sock` holds it
        sock.close(linger=0)
        return other
    return sock


def free_tcp_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, ctx: zmq.Context, run_dir: str) -> None:
        parallel = config.parallel
        self.size = parallel.tensor_parallel_size
        self.startup_timeout = parallel.startup_timeout
        # Several nodes: CURVE on every tcp socket, clients checked by a ZAP handler; one node
        # binds ipc:// paths in its private run_dir and needs neither.
        keys = ClusterKeys.load(parallel.cluster_secret_file) if parallel.nnodes > 1 else None
        self.auth = Authenticator(ctx, keys) if keys else None
        self.nodes = RemoteNodes(ctx, parallel, keys) if keys else None
        if self.nodes is None:
            plan_address = ipc_address("plans", run_dir)
            result_address = ipc_address("results", run_dir)
            dist_address = (tcp_address("127.0.0.1", parallel.master_port)
                            if parallel.master_port else free_tcp_address())
        else:                  # tcp on a free port of this node's address: other nodes connect
            plan_address = result_address = self.nodes.any_port
            dist_address = tcp_address(parallel.master_addr, parallel.store_port)
        avoid = parallel.store_port if self.nodes else None
        self.plans = Channel[ToWorker](bind_avoiding(ctx, zmq.PUB, plan_address, keys, avoid),
                                       ToWorker)
        self.results = Channel[FromWorker](bind_avoiding(ctx, zmq.PULL, result_address, keys,
                                                         avoid), FromWorker)
        plan_address, result_address = (bound_address(c.sock) for c in (self.plans,
                                                                         self.results))
        control = ["--control-address", self.nodes.address] if self.nodes else []
        if self.nodes:
            logger.info("EngineCore listens for the other nodes on %s (plans), %s (results), "
                        "%s (heartbeats); the store is at %s", plan_address, result_address,
                        self.nodes.address, dist_address)
        self.procs = [Child("kvflow.workers.worker_proc", f"worker {rank}", config, [
            "--rank", str(rank), "--plan-address", plan_address, "--result-address",
            result_address, "--dist-address", dist_address, *control,
            "--log-level", str(logging.getLogger().level)], env=huge_pages.worker_env(os.environ))
            for rank in parallel.node_ranks(0)]
        # Rank 0's results and everything watched, in one poller made once (a step waits
        # in it at least once).
        self._poller = zmq.Poller()
        for s in [self.results.sock, *self.watched]:
            self._poller.register(s, zmq.POLLIN)
        self.async_scheduling = False
        try:
            self.num_blocks = self._wait_ready(time.monotonic() + self.startup_timeout)
            self._handshake(time.monotonic() + self.startup_timeout)
        except BaseException:
            self.shutdown()                          # no worker outlives a failed start
            raise
        self.ipc_seconds = 0.0                       # round trip minus time inside rank 0
        self.num_steps = 0
        # Plans sent and not yet answered (two with async scheduling): when, and their tokens.
        self._sent: deque[tuple[float, int]] = deque()
        self._last_result = 0.0
        self.step_timeout = config.step_timeout
        self.seconds_per_token = 0.02                # the slowest recent step, per token
        self.on_wait: Callable[[], None] | None = None   # called every TICK while waiting

    @property
    def sentinels(self) -> list[int]:
        return [p.sentinel for p in self.procs]

    @property
    def watched(self) -> list[object]:
        """What EngineCore's poll must also wake for: worker exits, the nodes' messages."""
        return [*self.sentinels, *([self.nodes.control.sock] if self.nodes else [])]

    @property
    def poll_interval_ms(self) -> int | None:
        """How often an idle EngineCore must look at the nodes' heartbeats (None: never)."""
        return int(HEARTBEAT_INTERVAL * 1000) if self.nodes else None

    def _recv(self, deadline: float | None) -> object:
        """The next worker message, watching every worker's sentinel (and, with several nodes,
        their heartbeats) while waiting."""
        poller = self._poller
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self.nodes is not None:
                wait = HEARTBEAT_INTERVAL if wait is None else min(wait, HEARTBEAT_INTERVAL)
            ready = dict(poller.poll(None if wait is None else int(wait * 1000) + 1))
            if self.results.sock in ready:
                msg = self.results.recv()
                if isinstance(msg, ChildFailed):
                    raise WorkerFailure(f"{msg.who} failed:\n{msg.error}")
                if msg is not None:
                    return msg
                continue
            self.check_alive(ready)
            if deadline is not None and time.monotonic() >= deadline:
                raise StartupTimeout("timed out waiting for the workers")

    def check_alive(self, ready: Mapping[object, int] | None = None) -> None:
        """Raise WorkerFailure if a worker has exited, and service the nodes' heartbeats.
        `ready`: the result of a poll that includes every fd of `watched`, where a worker's
        exit shows (its pidfd turns readable and stays so): with it, the exit codes are read
        only then."""
        if ready is not None and self.nodes is None and not any(s in ready
                                                                for s in self.sentinels):
            return
        for rank, p in enumerate(self.procs):
            if p.exitcode is not None:
                raise WorkerFailure(f"worker {rank} (pid {p.pid}) died with exit code "
                                    f"{p.exitcode}")
        if self.nodes is not None:
            self.nodes.service()

    def _wait_ready(self, deadline: float) -> int:
        blocks: dict[int, int] = {}
        try:
            while len(blocks) < self.size:
                msg = self._recv(deadline)
                if isinstance(msg, WorkerReady):
                    blocks[msg.rank] = msg.num_blocks
                    if msg.rank == 0:        # what "auto" became: on where it found a GPU
                        self.async_scheduling = msg.async_scheduling
        except StartupTimeout:
            absent = self.nodes.not_joined() if self.nodes else ""
            missing = sorted(set(range(self.size)) - set(blocks))
            raise WorkerFailure(absent or f"ranks {missing} were not ready within the start-up "
                                          f"timeout ({self.startup_timeout:g} s)") from None
        return min(blocks.values())

    def _handshake(self, deadline: float) -> None:
        seen: set[int] = set()
        seq = 0
        while len(seen) < self.size:
            seq += 1
            self.plans.send(Ping(seq))
            if self.results.poll(50):
                msg = self.results.recv()
                if isinstance(msg, Pong):
                    seen.add(msg.rank)
            self.check_alive()
            if time.monotonic() > deadline:
                raise WorkerFailure("workers did not answer the start-up handshake")
        while self.results.poll(100):                # late Pongs of repeated Pings
            self.results.recv()

    def execute(self, plan: StepPlan, masks: Callable[[], bytes] | None = None
                ) -> StepResult:
        """Broadcast the plan and wait for rank 0's result; the constrained requests'
        bitmasks (`masks`) are computed while the workers run the forward, and follow the
        plan."""
        self.submit(plan)
        if masks is not None:
            self.send_masks(masks())
        return self.collect()

    def submit(self, plan: StepPlan) -> None:
        """Broadcast the plan (async scheduling: while the previous one runs; the workers
        queue it). Its StepMasks, if it has masked_ids, must follow before the next plan."""
        self.plans.send(plan)
        self._sent.append((time.monotonic(), max(1, sum(plan.num_scheduled_tokens))))

    def send_masks(self, bitmask: bytes) -> None:
        self.plans.send(StepMasks(bitmask))

    def collect(self) -> StepResult:
        """Rank 0's result of the oldest plan submitted and not collected. The watchdog: a
        step unfinished after step_timeout + 10 x its tokens x the slowest recent time per
        token (from when it could start: its submission or the previous result) counts as a
        hung worker (WorkerFailure); a long prefill is given time in proportion."""
        sent, tokens = self._sent.popleft()
        start = max(sent, self._last_result)
        limit = self.step_timeout + 10 * tokens * self.seconds_per_token
        deadline = start + limit
        while True:
            try:
                msg = self._recv(min(deadline, time.monotonic() + TICK))
            except StartupTimeout:
                if time.monotonic() >= deadline:
                    raise WorkerFailure(
                        f"a worker hung: a step of {tokens} tokens did not finish in "
                        f"{limit:.1f} s (--step-timeout {self.step_timeout:g} s + 10 x the "
                        f"tokens x {self.seconds_per_token * 1000:.1f} ms)") from None
                if self.on_wait is not None:
                    self.on_wait()
                continue
            if isinstance(msg, StepResult):
                break
        self._last_result = time.monotonic()
        elapsed = self._last_result - start
        self.seconds_per_token = max(elapsed / tokens, 0.9 * self.seconds_per_token, 1e-4)
        self.ipc_seconds += max(0.0, elapsed - msg.worker_seconds)
        self.num_steps += 1
        return msg

    def shutdown(self, grace: float = 3.0, restart: bool = False) -> None:
        """Tell every worker to stop; kill those not gone after `grace` seconds. `restart`:
        EngineCore failed and the frontend will start a new engine, which the --headless
        nodes are told to rejoin rather than exit."""
        try:
            self.plans.send(Shutdown())
            if self.nodes is not None:
                self.nodes.shutdown(restart)
                # Closed with a linger, so the context's teardown (linger 0) still lets these
                # last messages reach the other nodes.
                self.plans.sock.close(linger=1000)
        except zmq.ZMQError:
            pass
        deadline = time.monotonic() + grace
        poller = getattr(self, "_poller", None)
        for p in self.procs:
            if poller is not None and p.sentinel >= 0:
                with contextlib.suppress(KeyError):
                    poller.unregister(p.sentinel)        # stop() closes it
            p.stop(max(0.1, deadline - time.monotonic()))
        if self.auth is not None:
            self.auth.stop()
            self.auth = None


class RemoteNodes:
    """EngineCore's side of the --headless nodes: a ROUTER socket on this node's address; each
    node's launcher connects, and each heartbeat it sends is answered. A node that reports a
    dead worker, or falls silent for HEARTBEAT_TIMEOUT after joining, is a WorkerFailure, so
    requests fail within seconds even when a collective would hang (NCCL) or a node vanishes
    without closing its connections."""

    def __init__(self, ctx: zmq.Context, parallel: ParallelConfig, keys: ClusterKeys) -> None:
        self.parallel = parallel
        self.ip = host_ip(parallel.master_addr, parallel.store_port)
        self.any_port = tcp_address(self.ip, "*")
        self.control = Channel[FromNode](bind_avoiding(ctx, zmq.ROUTER, self.any_port, keys,
                                                       parallel.store_port), FromNode)
        self.address = bound_address(self.control.sock)
        self.last_seen: dict[int, float] = {}       # node rank -> when it last spoke
        self.identities: dict[int, bytes] = {}
        self._reply = self.control.encoder.encode(Heartbeat(0))

    def service(self) -> None:
        """Answer heartbeats; raise WorkerFailure for a failed or silent node."""
        while self.control.poll(0):
            frames = self.control.sock.recv_multipart()
            msg = self.control.decode(frames[-1])
            if isinstance(msg, ChildFailed):
                raise WorkerFailure(f"{msg.who} failed: {msg.error}")
            if isinstance(msg, Heartbeat) and 0 < msg.node_rank < self.parallel.nnodes:
                if msg.node_rank not in self.last_seen:
                    logger.info("node %d joined (ranks %s)", msg.node_rank,
                                list(self.parallel.node_ranks(msg.node_rank)))
                self.last_seen[msg.node_rank] = time.monotonic()
                self.identities[msg.node_rank] = frames[0]
                self.control.sock.send_multipart([frames[0], self._reply])
        now = time.monotonic()
        for node, seen in self.last_seen.items():
            if now - seen > HEARTBEAT_TIMEOUT:
                raise WorkerFailure(
                    f"node {node} (ranks {list(self.parallel.node_ranks(node))}) sent no "
                    f"heartbeat for {now - seen:.1f} s: it died or the network to it is down")

    def not_joined(self) -> str:
        """The start-up timeout's error when some nodes never joined ("" if all did)."""
        p = self.parallel
        absent = [n for n in range(1, p.nnodes) if n not in self.last_seen]
        if not absent:
            return ""
        ranks = [r for n in absent for r in p.node_ranks(n)]
        return (f"node(s) {absent} (ranks {ranks}) did not join within the start-up timeout "
                f"({p.startup_timeout:g} s): start `launch.py serve --headless --nnodes "
                f"{p.nnodes} --node-rank N --master-addr {p.master_addr} --master-port "
                f"{p.master_port} --tp {p.tensor_parallel_size} --cluster-secret-file ... "
                f"--model ...` on each; they must reach {p.master_addr}:{p.master_port} and "
                f"this node's {self.ip}, with node 0's cluster secret")

    def shutdown(self, restart: bool = False) -> None:
        data = self.control.encoder.encode(Shutdown(restart=restart))
        for identity in self.identities.values():
            self.control.sock.send_multipart([identity, data], zmq.NOBLOCK)
        self.control.sock.close(linger=1000)
