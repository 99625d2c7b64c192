"""Child processes of the cluster, started as `python -m MODULE` (never by re-importing the
user's main script, and with no pickle: the config travels as msgspec bytes on stdin).

Each child gets the read end of a pipe whose write end only its parent holds: when the parent
dies, for any reason, the child reads EOF and exits. The parent watches the child through a
pidfd, which becomes readable when the child exits; both fit in a zmq poll, so nobody spins.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import msgspec

from kvflow.config import EngineConfig


class Child:
    def __init__(self, module: str, name: str, config: EngineConfig, args: list[str]) -> None:
        self.name = name
        read_fd, self.parent_fd = os.pipe()
        cmd = [sys.executable, "-m", module, "--parent-fd", str(read_fd), *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, pass_fds=(read_fd,))
        os.close(read_fd)
        assert self.proc.stdin is not None
        self.proc.stdin.write(msgspec.msgpack.encode(config))
        self.proc.stdin.close()
        self.sentinel = os.pidfd_open(self.proc.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout: float) -> None:
        """Give a child that was asked to stop a moment, then close our pipe end (it sees its
        parent go), wait, and kill it if it is still there."""
        try:
            self.proc.wait(min(1.0, timeout))
        except subprocess.TimeoutExpired:
            pass
        if self.parent_fd >= 0:
            os.close(self.parent_fd)
            self.parent_fd = -1
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


def child_args(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, EngineConfig]:
    """In a child: its arguments, and the config its parent wrote on stdin."""
    parser.add_argument("--parent-fd", type=int, required=True)
    args = parser.parse_args()
    config = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=EngineConfig)
    return args, config
