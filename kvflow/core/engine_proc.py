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
import traceback

import zmq

from kvflow.config import EngineConfig
from kvflow.core.engine_core import EngineCore
from kvflow.core.executor import MultiprocExecutor
from kvflow.ipc.messages import (Abort, ChildFailed, EngineReady, EngineRequest, FromEngine,
                                 GetTimings, ResetPrefixCache, Shutdown, ToEngine)
from kvflow.ipc.process import child_args, startup_done
from kvflow.ipc.sockets import Channel, make_socket

logger = logging.getLogger(__name__)


class ParentGone(Exception):
    pass


class EngineCoreProc:
    def __init__(self, config: EngineConfig, input_address: str, output_address: str,
                 parent_fd: int, startup_timeout: float) -> None:
        self.ctx = zmq.Context()
        self.input = Channel[ToEngine](make_socket(self.ctx, zmq.PULL, input_address, False),
                                       ToEngine)
        self.output = Channel[FromEngine](make_socket(self.ctx, zmq.PUSH, output_address,
                                                      False), FromEngine)
        self.parent_fd = parent_fd
        self.executor = MultiprocExecutor(config, self.ctx, tempfile.mkdtemp(prefix="kvflow-"),
                                          startup_timeout)
        self.core = EngineCore(config, self.executor)
        self.poller = zmq.Poller()
        self.poller.register(self.input.sock, zmq.POLLIN)
        self.poller.register(parent_fd, zmq.POLLIN)
        for s in self.executor.sentinels:
            self.poller.register(s, zmq.POLLIN)
        self.running = True

    def run(self) -> None:
        startup_done()
        self.output.send(EngineReady(self.core.block_manager.num_blocks))
        while self.running:
            self.receive(block=not self.core.has_work())
            if self.running and self.core.has_work():
                self.emit()

    def receive(self, block: bool) -> None:
        """Apply every message waiting; when `block`, wait (in poll) for the first one."""
        ready = dict(self.poller.poll(None if block else 0))
        if self.parent_fd in ready:
            raise ParentGone()
        self.executor.check_alive()
        while self.running and self.input.poll(0):
            self.handle(self.input.recv())

    def handle(self, msg: object) -> None:
        if isinstance(msg, EngineRequest):
            self.core.add_request(msg)
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
        if outputs.outputs:
            self.output.send(outputs)

    def close(self) -> None:
        self.executor.shutdown()
        self.ctx.destroy(linger=0)


def main() -> None:
    parser = argparse.ArgumentParser(description="kvflow EngineCore process (started by the "
                                                 "frontend)")
    parser.add_argument("--input-address", required=True)
    parser.add_argument("--output-address", required=True)
    parser.add_argument("--startup-timeout", type=float, required=True)
    parser.add_argument("--log-level", type=int, required=True)
    args, config = child_args(parser)
    run_engine_core(config, args.input_address, args.output_address, args.parent_fd,
                    args.startup_timeout, args.log_level)


def run_engine_core(config: EngineConfig, input_address: str, output_address: str,
                    parent_fd: int, startup_timeout: float, log_level: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C is the launcher's to handle
    logging.basicConfig(level=log_level, format="%(asctime)s engine-core %(message)s")
    proc: EngineCoreProc | None = None
    ctx = zmq.Context()
    try:
        proc = EngineCoreProc(config, input_address, output_address, parent_fd,
                              startup_timeout)
        proc.run()
    except ParentGone:
        logger.warning("frontend is gone; shutting down")
    except Exception as e:
        logger.error("EngineCore failed: %s", e)
        out = make_socket(ctx, zmq.PUSH, output_address, bind=False)
        Channel[FromEngine](out, FromEngine).send(ChildFailed("EngineCore", _describe(e)))
        out.close(linger=1000)                       # give the news a moment to leave
    finally:
        if proc is not None:
            proc.close()
        ctx.destroy(linger=0)


def _describe(e: Exception) -> str:
    return str(e) if "failed:" in str(e) or "died" in str(e) else traceback.format_exc()


if __name__ == "__main__":
    main()
