"""The frontend's handle on an engine: the same small interface for both modes.

- `MultiprocEngine`: EngineCore (which spawns one worker per rank) in a child process, over
  ZMQ; the frontend watches the child's sentinel, so a dead engine surfaces as
  EngineDeadError instead of a hang.
- `InProcessEngine`: EngineCore and one worker called directly (same code paths, no sockets),
  for debugging and fast tests.
"""
from __future__ import annotations

import logging
import select
import shutil
import tempfile
import threading
import time
import weakref

import msgspec
import zmq

from kvflow.config import EngineConfig
from kvflow.errors import EngineDeadError
from kvflow.ipc.messages import (Abort, ChildFailed, EngineOutputs, EngineReady, EngineRequest,
                                 EngineRequests, FromEngine, Shutdown, ToEngine, UtilityCall,
                                 UtilityResult)
from kvflow.ipc.process import Child
from kvflow.ipc.sockets import Channel, ipc_address, make_socket

logger = logging.getLogger(__name__)


class InProcessEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.tensor_parallel_size != 1:
            raise ValueError("in_process=True runs a single worker: tensor_parallel_size must "
                             f"be 1, not {config.parallel.tensor_parallel_size}")
        if config.scheduler.async_scheduling:
            raise ValueError("async_scheduling=True overlaps EngineCore with a worker process; "
                             "in_process=True runs both in one thread, one after the other")
        config = msgspec.structs.replace(config, scheduler=msgspec.structs.replace(
            config.scheduler, async_scheduling=False))
        # Imported here: the torch side stays out of the frontend until an engine is built.
        from kvflow.core.engine_core import EngineCore
        from kvflow.workers.worker import Worker
        self.worker = Worker(config)
        self.core = EngineCore(config, self.worker)
        self.num_blocks = self.worker.num_blocks

    def add_requests(self, requests: list[EngineRequest]) -> None:
        for request in requests:
            self.core.add_request(request)

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort(request_ids)

    def get_outputs(self, timeout: float | None = None) -> EngineOutputs | None:
        """Run one step (in-process there is nothing to wait for, but a compiling
        constrained request)."""
        if not self.core.has_work():
            self.core.structured.wait(timeout or 0.1)
        return self.core.step()

    def utility(self, call: UtilityCall) -> dict[str, float]:
        return self.core.utility(call).result

    def shutdown(self) -> None:
        pass


class MultiprocEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.node_rank != 0:
            raise ValueError(f"node_rank={config.parallel.node_rank}: only node 0 runs the "
                             "engine and serves requests; start the other nodes with "
                             "`launch.py serve --headless`")
        self.ctx = zmq.Context()
        self.run_dir = tempfile.mkdtemp(prefix="kvflow-")
        input_address = ipc_address("input", self.run_dir)
        output_address = ipc_address("output", self.run_dir)
        self.input = Channel[ToEngine](make_socket(self.ctx, zmq.PUSH, input_address, True),
                                       ToEngine)
        self.output = Channel[FromEngine](make_socket(self.ctx, zmq.PULL, output_address, True),
                                          FromEngine)
        self.proc = Child("kvflow.core.engine_proc", "EngineCore", config, [
            "--input-address", input_address, "--output-address", output_address,
            "--log-level", str(logging.getLogger().level)])
        self._exited = select.poll()            # EngineCore's pidfd: readable once it exits
        self._exited.register(self.proc.sentinel, select.POLLIN)
        self.dead: str | None = None
        self.dead_request_ids: list[str] = []   # the requests of the step it died in
        self._reaper: threading.Thread | None = None     # stopping it once it died
        self.last_heard = time.monotonic()      # the last message from EngineCore
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.ctx,
                                           [self.input.sock, self.output.sock], self.run_dir)
        # EngineCore gives up on its workers after the start-up timeout (loading, then the
        # handshake) and says why: wait longer, to hear it (its death is seen at once anyway).
        try:
            ready = self._wait_ready(time.monotonic() + 2 * config.parallel.startup_timeout + 30)
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = ready.num_blocks

    def _wait_ready(self, deadline: float) -> EngineReady:
        while True:
            msg = self._recv(max(0.0, deadline - time.monotonic()))
            if isinstance(msg, EngineReady):
                return msg
            if msg is None and time.monotonic() >= deadline:
                raise RuntimeError("the engine did not start in time")

    def _recv(self, timeout: float | None) -> object:
        """The next engine message, or None on timeout; raises EngineDeadError if it died."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        poller = zmq.Poller()
        poller.register(self.output.sock, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        ready = dict(poller.poll(None if timeout is None else int(timeout * 1000)))
        if self.output.sock in ready:
            msg = self.output.recv()
            self.last_heard = time.monotonic()
            if isinstance(msg, ChildFailed):
                self._die(f"{msg.who} failed: {msg.error}", msg.request_ids)
            return msg
        if self.proc.sentinel in ready:
            self._die(f"EngineCore (pid {self.proc.pid}) died with exit code "
                      f"{self.proc.exitcode}")
        return None

    def _die(self, reason: str, request_ids: list[str] | None = None) -> None:
        """Say it at once. EngineCore is reaped in a thread meanwhile (it may take seconds: a
        worker stuck in a collective is killed only after a grace period); the sockets stay
        for shutdown(), on the caller's thread."""
        self.dead = reason
        self.dead_request_ids = request_ids or []
        self._reaper = threading.Thread(target=self.proc.stop, args=(5,), daemon=True,
                                        name="kvflow-reap")
        self._reaper.start()
        raise EngineDeadError(reason, request_ids)

    def _send(self, msg: ToEngine) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        try:
            self.input.sock.send(self.input.encoder.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            # Only with no EngineCore connected (no HWM): it is gone, and a blocking send
            # would wait forever. Learn why from its last message or its exit.
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                self._recv(max(0.0, deadline - time.monotonic()))
            self._die(f"EngineCore (pid {self.proc.pid}) is not connected")

    def add_requests(self, requests: list[EngineRequest]) -> None:
        """In one message: EngineCore steps with all of them or none."""
        if requests:
            self._send(requests[0] if len(requests) == 1 else EngineRequests(requests))

    def abort(self, request_ids: list[str]) -> None:
        if self.dead is None:
            try:
                self._send(Abort(request_ids))
            except EngineDeadError:                  # nothing left to abort
                pass

    def get_outputs(self, timeout: float | None = None) -> EngineOutputs | None:
        msg = self._recv(timeout)
        return msg if isinstance(msg, EngineOutputs) else None

    def drain(self) -> list[EngineOutputs]:
        """Every EngineOutputs waiting now, without blocking; EngineDeadError if it died."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        found = []
        sock = self.output.sock
        while int(sock.get(zmq.EVENTS)) & zmq.POLLIN:    # cheaper than a zmq.Again each
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = self.output.decode(frames[-1])
            self.last_heard = time.monotonic()
            if isinstance(msg, ChildFailed):
                self._die(f"{msg.who} failed: {msg.error}", msg.request_ids)
            if isinstance(msg, EngineOutputs):
                found.append(msg)
        if self._exited.poll(0):
            self._die(f"EngineCore (pid {self.proc.pid}) died with exit code "
                      f"{self.proc.exitcode}")
        return found

    def utility(self, call: UtilityCall, timeout: float = 30.0) -> dict[str, float]:
        """Answer of a utility call (e.g. GetTimings(0)); outputs that arrive meanwhile are
        dropped, so call it only when no request is running."""
        self._send(call)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self._recv(max(0.0, deadline - time.monotonic()))
            if isinstance(msg, UtilityResult) and msg.call_id == call.call_id:
                return msg.result
        raise TimeoutError(f"{type(call).__name__} got no answer")

    @property
    def sentinel(self) -> int:
        return self.proc.sentinel

    def shutdown(self) -> None:
        if self.dead is None:
            try:
                self.input.sock.send(self.input.encoder.encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:                     # Again: EngineCore is already gone
                pass
        if self._reaper is not None:
            self._reaper.join(10)
        self._finalizer()


def _stop(proc: Child, ctx: zmq.Context, sockets: list[zmq.Socket], run_dir: str) -> None:
    """Stop EngineCore (it stops its workers): closing our pipe end tells it we are gone;
    wait, then kill. Also runs at garbage collection and interpreter exit."""
    proc.stop(5)
    # Closed by hand: collected in a reference cycle, the engine's sockets are no longer in
    # the context's weak set, and ctx.destroy() would then wait for them forever.
    for sock in sockets:
        sock.close(linger=0)
    ctx.destroy(linger=0)
    shutil.rmtree(run_dir, ignore_errors=True)
