"""The EngineCore process: its main loop, readable in one screen.

receive (new requests, aborts, control) -> step (schedule, execute on the workers, update) ->
emit (one EngineOutputs per step). When idle it blocks in poll, never spins. It exits when told
to, when the frontend dies (EOF on the pipe whose write end the frontend holds), or when a
worker dies; in the last case it first tells the frontend why.
"""
from __future__ import annotations

import argparse
import logging
import signal
import tempfile
import time
import traceback

import zmq

from kvflow.config import EngineConfig
from kvflow.core.engine_core import EngineCore, StepFailure
from kvflow.core.executor import TICK, MultiprocExecutor, WorkerFailure
from kvflow.ipc.messages import (Abort, ChildFailed, EngineOutputs, EngineReady, EngineRequest,
                                 EngineRequests, FromEngine, GetTimings, ResetPrefixCache,
                                 Shutdown, ToEngine)
from kvflow.ipc.process import child_args, startup_done
from kvflow.ipc.sockets import Channel, make_socket

logger = logging.getLogger(__name__)


class ParentGone(Exception):
    pass


class EngineCoreProc:
    def __init__(self, config: EngineConfig, input_address: str, output_address: str,
                 parent_fd: int) -> None:
        self.ctx = zmq.Context()
        self.input = Channel[ToEngine](make_socket(self.ctx, zmq.PULL, input_address, False),
                                       ToEngine)
        self.output = Channel[FromEngine](make_socket(self.ctx, zmq.PUSH, output_address,
                                                      False), FromEngine)
        self.parent_fd = parent_fd
        self.executor = MultiprocExecutor(config, self.ctx, tempfile.mkdtemp(prefix="kvflow-"))
        self.core = EngineCore(config, self.executor)
        self.poller = zmq.Poller()
        self.poller.register(self.input.sock, zmq.POLLIN)
        self.poller.register(parent_fd, zmq.POLLIN)
        for s in self.executor.watched:
            self.poller.register(s, zmq.POLLIN)
        self.poller.register(self.core.structured.wakeup_fd, zmq.POLLIN)   # a compile ended
        self.running = True
        self.last_sent = time.monotonic()
        # While a step runs (a long prefill), say we live: the frontend's watchdog counts
        # EngineCore silent for --step-timeout as hung.
        self.executor.on_wait = self.heartbeat

    def heartbeat(self) -> None:
        self.output.send(EngineOutputs([], self.core.stats()))
        self.last_sent = time.monotonic()

    def run(self) -> None:
        startup_done()
        self.output.send(EngineReady(self.core.block_manager.num_blocks))
        while self.running:
            self.receive(block=not self.core.has_work())
            if self.running and self.core.has_work():
                self.emit()

    def receive(self, block: bool) -> None:
        """Apply every message waiting; when `block`, wait (in poll) for the first one."""
        ready = dict(self.poller.poll(self.executor.poll_interval_ms if block else 0))
        if self.parent_fd in ready:
            raise ParentGone()
        if self.core.structured.wakeup_fd in ready:
            self.core.structured.drain_wakeups()
            self.core.take_compiled()
        self.executor.check_alive(ready)
        while self.running and self.input.poll(0):
            self.handle(self.input.recv())

    def handle(self, msg: object) -> None:
        if isinstance(msg, EngineRequest):
            self.core.add_request(msg)
        elif isinstance(msg, EngineRequests):
            for request in msg.requests:
                self.core.add_request(request)
        elif isinstance(msg, Abort):
            self.core.abort(msg.request_ids)
        elif isinstance(msg, (ResetPrefixCache, GetTimings)):
            ex = self.executor
            self.output.send(self.core.utility(msg, {"ipc": ex.ipc_seconds,
                                                     "ipc_steps": ex.num_steps}))
        elif isinstance(msg, Shutdown):
            self.running = False

    def emit(self) -> None:
        outputs = self.core.step()
        if outputs.outputs or time.monotonic() - self.last_sent > TICK:
            self.output.send(outputs)
            self.last_sent = time.monotonic()

    def close(self, grace: float = 3.0, failed: bool = False) -> None:
        self.executor.shutdown(grace, restart=failed)
        self.ctx.destroy(linger=0)


def main() -> None:
    parser = argparse.ArgumentParser(description="kvflow EngineCore process (started by the "
                                                 "frontend)")
    parser.add_argument("--input-address", required=True)
    parser.add_argument("--output-address", required=True)
    parser.add_argument("--log-level", type=int, required=True)
    args, config = child_args(parser)
    run_engine_core(config, args.input_address, args.output_address, args.parent_fd,
                    args.log_level)


def run_engine_core(config: EngineConfig, input_address: str, output_address: str,
                    parent_fd: int, log_level: int) -> None:
    # Ctrl-C and SIGTERM are the launcher's to handle (it drains first, then stops us; a
    # SIGTERM sent to the whole group, as systemd does, must not cut the drain short).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s engine-core %(message)s")
    proc: EngineCoreProc | None = None
    failed = False
    grace = 3.0                  # for the workers to stop; short after a failure: a worker may
    ctx = zmq.Context()          # sit in a collective that never ends, and is then killed
    try:
        proc = EngineCoreProc(config, input_address, output_address, parent_fd)
        proc.run()
    except ParentGone:
        logger.warning("frontend is gone; shutting down")
    except Exception as e:
        logger.error("EngineCore failed: %s", e)
        out = make_socket(ctx, zmq.PUSH, output_address, bind=False)
        suspects = e.request_ids if isinstance(e, StepFailure) else []
        Channel[FromEngine](out, FromEngine).send(ChildFailed("EngineCore", _describe(e),
                                                              suspects))
        out.close(linger=1000)                       # give the news a moment to leave
        grace = 0.5
        failed = True            # the frontend restarts the engine: other nodes rejoin it
    finally:
        if proc is not None:
            proc.close(grace, failed)
        ctx.destroy(linger=0)


def _describe(e: Exception) -> str:
    """A worker's failure is its own message (it carries the worker's traceback if any);
    anything else, EngineCore's traceback."""
    return str(e) if isinstance(e, (WorkerFailure, StepFailure)) else traceback.format_exc()


if __name__ == "__main__":
    main()
