"""Child processes of the cluster, started as `python -m MODULE` (never by re-importing the
user's main script, and with no pickle: the config travels as msgspec bytes on stdin).

Each child gets the read end of a pipe whose write end only its parent holds: when the parent
dies, for any reason, the child reads EOF and exits. The parent watches the child through a
pidfd, which becomes readable when the child exits; both fit in a zmq poll, so nobody spins.
While a child starts up (loading weights, spawning workers) its main thread polls nothing, so a
daemon thread blocks on that pipe meanwhile and ends the child at once if the parent goes; once
the child's main loop runs (`startup_done()`), the loop handles it and cleans up.
"""
from __future__ import annotations

import argparse
import os
import select
import subprocess
import sys
import threading

import msgspec

from kvflow.config import EngineConfig


class Child:
    def __init__(self, module: str, name: str, config: EngineConfig, args: list[str],
                 env: dict[str, str] | None = None) -> None:
        """env: the child's environment (default: ours)."""
        self.name = name
        read_fd, self.parent_fd = os.pipe()
        cmd = [sys.executable, "-m", module, "--parent-fd", str(read_fd), *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, pass_fds=(read_fd,), env=env)
        os.close(read_fd)
        assert self.proc.stdin is not None
        self.proc.stdin.write(msgspec.msgpack.encode(config))
        self.proc.stdin.close()
        self.sentinel = os.pidfd_open(self.proc.pid)
        self._stopping = threading.Lock()      # stop() may be called from two threads

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout: float) -> None:
        """Give a child that was asked to stop a moment, then close our pipe end (it sees its
        parent go), wait, and kill it if it is still there."""
        with self._stopping:
            self._stop(timeout)

    def _wait(self, timeout: float) -> None:
        """Reap the child once it exits (its pidfd wakes us at once; Popen.wait(timeout) would
        poll); subprocess.TimeoutExpired if it is still running after `timeout`."""
        if self.sentinel >= 0:
            select.select([self.sentinel], [], [], timeout)
            timeout = 0
        self.proc.wait(timeout)

    def _stop(self, timeout: float) -> None:
        try:
            self._wait(min(1.0, timeout))
        except subprocess.TimeoutExpired:
            pass
        if self.parent_fd >= 0:
            os.close(self.parent_fd)
            self.parent_fd = -1
        try:
            self._wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


_started = threading.Event()


def child_args(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, EngineConfig]:
    """In a child: its arguments, and the config its parent wrote on stdin. Starts the
    start-up watch on the parent pipe."""
    parser.add_argument("--parent-fd", type=int, required=True)
    args = parser.parse_args()
    threading.Thread(target=_watch_parent, args=(args.parent_fd,), daemon=True,
                     name="kvflow-parent-watch").start()
    config = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=EngineConfig)
    return args, config


def startup_done() -> None:
    """The child's main loop now watches the parent pipe itself."""
    _started.set()


def _watch_parent(parent_fd: int) -> None:
    try:
        select.select([parent_fd], [], [])          # readable only at EOF: the parent is gone
    except (OSError, ValueError):
        return
    if not _started.is_set():
        os._exit(1)                                  # mid start-up: nothing worth cleaning
