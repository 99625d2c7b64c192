"""EngineCore's side of the workers: spawn one process per rank, broadcast plans, collect results.

Start-up: each worker reports WorkerReady (or ChildFailed) within a timeout while we watch
every process sentinel, so a worker that dies while starting is an error, never a hang. Then
Ping is published until every rank answers Pong: PUB/SUB drops messages sent before a
subscriber is connected, and this handshake guarantees no plan is lost that way.
"""
from __future__ import annotations

import logging
import socket
import time

import zmq

from kvflow.config import EngineConfig
from kvflow.ipc.messages import (ChildFailed, FromWorker, Ping, Pong, Shutdown, StepPlan,
                                 StepResult, ToWorker, WorkerReady)
from kvflow.ipc.process import Child
from kvflow.ipc.sockets import Channel, ipc_address, make_socket

logger = logging.getLogger(__name__)


class WorkerFailure(RuntimeError):
    """A worker died or reported an error; EngineCore cannot go on."""


def free_tcp_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, ctx: zmq.Context, run_dir: str,
                 startup_timeout: float) -> None:
        self.size = config.parallel.tensor_parallel_size
        plan_address = ipc_address("plans", run_dir)
        result_address = ipc_address("results", run_dir)
        self.plans = Channel[ToWorker](make_socket(ctx, zmq.PUB, plan_address, True), ToWorker)
        self.results = Channel[FromWorker](make_socket(ctx, zmq.PULL, result_address, True),
                                           FromWorker)
        dist_address = free_tcp_address()
        self.procs = [Child("kvflow.workers.worker_proc", f"worker {rank}", config, [
            "--rank", str(rank), "--plan-address", plan_address, "--result-address",
            result_address, "--dist-address", dist_address,
            "--log-level", str(logging.getLogger().level)]) for rank in range(self.size)]
        try:
            self.num_blocks = self._wait_ready(time.monotonic() + startup_timeout)
            self._handshake(time.monotonic() + startup_timeout)
        except BaseException:
            self.shutdown()                          # no worker outlives a failed start
            raise
        self.ipc_seconds = 0.0                       # round trip minus time inside rank 0
        self.num_steps = 0

    @property
    def sentinels(self) -> list[int]:
        return [p.sentinel for p in self.procs]

    def _recv(self, deadline: float | None) -> object:
        """The next worker message, watching every worker's sentinel while waiting."""
        poller = zmq.Poller()
        poller.register(self.results.sock, zmq.POLLIN)
        for s in self.sentinels:
            poller.register(s, zmq.POLLIN)
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = dict(poller.poll(None if timeout is None else int(timeout * 1000) + 1))
            if self.results.sock in ready:
                msg = self.results.recv()
                if isinstance(msg, ChildFailed):
                    raise WorkerFailure(f"{msg.who} failed:\n{msg.error}")
                if msg is not None:
                    return msg
                continue
            self.check_alive()
            if deadline is not None and time.monotonic() >= deadline:
                raise WorkerFailure("timed out waiting for the workers")

    def check_alive(self) -> None:
        for rank, p in enumerate(self.procs):
            if p.exitcode is not None:
                raise WorkerFailure(f"worker {rank} (pid {p.pid}) died with exit code "
                                    f"{p.exitcode}")

    def _wait_ready(self, deadline: float) -> int:
        blocks: dict[int, int] = {}
        while len(blocks) < self.size:
            msg = self._recv(deadline)
            if isinstance(msg, WorkerReady):
                blocks[msg.rank] = msg.num_blocks
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

    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        self.plans.send(plan)
        while True:
            msg = self._recv(None)
            if isinstance(msg, StepResult):
                break
        self.ipc_seconds += time.perf_counter() - start - msg.worker_seconds
        self.num_steps += 1
        return msg

    def shutdown(self) -> None:
        try:
            self.plans.send(Shutdown())
        except zmq.ZMQError:
            pass
        deadline = time.monotonic() + 3
        for p in self.procs:
            p.stop(max(0.1, deadline - time.monotonic()))
