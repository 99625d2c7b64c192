"""Helpers for tests that run the real cluster (launch.py serve, or LLM's child processes).

- `ServeProcess`: `launch.py serve` on free ports (ZMQ `address`, HTTP `url`); `wait_serving()` waits for its "serving on"
  log line (or raises with the log if it exits first); `tree()` lists it and its descendants.
- Every process a test starts carries a unique tag in its environment (children inherit it),
  so `tagged_processes(tag)` finds them all, even those reparented after their parent died.
- `exited()` counts a zombie as exited: PID 1 on CI containers may never reap orphans.
- `kill_processes()` is the last line of cleanup: SIGKILL whatever is still there.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Iterable

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG_VAR = "KVFLOW_TEST_CLUSTER_TAG"
ENGINE_MODULE = "kvflow.core.engine_proc"
WORKER_MODULE = "kvflow.workers.worker_proc"


def new_tag() -> str:
    return uuid.uuid4().hex


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
            return low, high
    except (OSError, ValueError):
        return 32768, 60999                    # Linux's default


_handed_out: set[int] = set()


def free_port() -> int:
    """A port free now, from below the kernel's ephemeral range when there is room: a process
    the test starts binds its own sockets to "any free port" (EngineCore's node ports, the
    store's), which the kernel takes from that range, so it cannot take this one first between
    our check and the server's bind (port 0 would hand us a number from that same range).
    Never the same port twice in one test process (a server's HTTP and ZMQ ports, say)."""
    low, _ = _ephemeral_range()
    if low > 20000:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randrange(10000, low)
            if port in _handed_out:
                continue
            _handed_out.add(port)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_tcp_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def exited(p: psutil.Process) -> bool:
    """True once the process has exited (gone, or a zombie waiting to be reaped)."""
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_exited(procs: Iterable[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until every process exited or `timeout` passed; the survivors."""
    procs = list(procs)
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if not exited(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants (those that are still running)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return []


def is_module(p: psutil.Process, module: str) -> bool:
    line = cmdline(p)
    return any(a == "-m" and b == module for a, b in zip(line, line[1:]))


def arg_value(p: psutil.Process, name: str) -> str:
    """The value of a `--name value` argument in the process's command line."""
    line = cmdline(p)
    return line[line.index(name) + 1]


def tagged_processes(tag: str) -> list[psutil.Process]:
    """Every live (not exited) process whose environment carries `tag`."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(TAG_VAR) == tag and not exited(p):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def kill_processes(procs: Iterable[psutil.Process], timeout: float = 10.0) -> None:
    procs = list(procs)
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    wait_exited(procs, timeout)


def cpu_seconds(p: psutil.Process, interval: float) -> float:
    """CPU time `p` used during `interval` seconds (a busy loop uses about all of it)."""
    before = sum(p.cpu_times()[:2])
    time.sleep(interval)
    return sum(p.cpu_times()[:2]) - before


def zombie_children(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """Exited children that a live parent among `procs` has not reaped."""
    zombies = []
    for p in procs:
        if exited(p):
            continue
        try:
            zombies += [c for c in p.children() if c.status() == psutil.STATUS_ZOMBIE]
        except psutil.NoSuchProcess:
            continue
    return zombies


_FAILING_WORKER = """\
# Written by tests/cluster_helpers.py: worker rank 0 fails at start-up (a test fixture, so
# kvflow itself carries no test hook). Only worker processes are touched.
import sys
if sys.orig_argv[1:3] == ["-m", "kvflow.workers.worker_proc"]:
    from kvflow.workers import worker as _worker
    _init = _worker.Worker.__init__

    def _fail(self, config, tp=None, **kwargs):
        if tp is None or tp.rank == 0:
            raise RuntimeError("worker 0 failed at start-up on purpose (test fixture)")
        _init(self, config, tp, **kwargs)
    _worker.Worker.__init__ = _fail
"""


def failing_worker_env(directory: str) -> dict[str, str]:
    """Environment variables under which worker rank 0 fails at start-up: a sitecustomize
    module in `directory`, put first on PYTHONPATH (children inherit it)."""
    with open(os.path.join(directory, "sitecustomize.py"), "w") as f:
        f.write(_FAILING_WORKER)
    rest = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join([directory, rest] if rest else [directory])}


class ServeProcess:
    """`launch.py serve` in a new session, its log collected line by line."""

    def __init__(self, *args: str, model: str = "default", kv_cache_memory_gb: float = 0.1,
                 env: dict[str, str] | None = None, zmq: bool = True,
                 prefix: list[str] | None = None, address: str | None = None,
                 port: int | None = None) -> None:
        """`prefix`: a command that runs launch.py (e.g. nsenter into a network namespace);
        `address`: where kvflow clients connect (default: a free 127.0.0.1 port); `port`: the
        HTTP port (default: a free one)."""
        self.address = address or free_tcp_address()
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tag = new_tag()
        full_env = {**os.environ, **(env or {}), TAG_VAR: self.tag}
        cmd = [*(prefix or []), sys.executable, os.path.join(REPO, "launch.py"), "serve",
               *(["--client-address", self.address] if zmq else []),
               "--port", str(self.port), "--model", model, "--kv-cache-memory-gb", str(kv_cache_memory_gb),
               *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.started: list[psutil.Process] = []     # the tree right after start-up

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_serving(self, timeout: float = 120.0) -> None:
        """Until the "serving on" line; also records the process tree."""
        deadline = time.monotonic() + timeout
        while not any("serving on" in line for line in self.lines):
            if self.proc.poll() is not None:
                self._reader.join(5)
                raise RuntimeError(f"launch.py serve exited with {self.proc.returncode}:\n"
                                   f"{self.log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"launch.py serve did not start in {timeout} s:\n{self.log}")
            time.sleep(0.05)
        self.started = self.tree()

    def tree(self) -> list[psutil.Process]:
        return process_tree(self.pid)

    def engine_core(self) -> psutil.Process:
        [p] = [p for p in self.started if is_module(p, ENGINE_MODULE)]
        return p

    def workers(self) -> list[psutil.Process]:
        return [p for p in self.started if is_module(p, WORKER_MODULE)]

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(5)
        return rc

    def cleanup(self) -> None:
        """Kill whatever is left of this cluster (the tree at start-up, the tree now, and every
        tagged process) and reap the launcher."""
        kill_processes({*self.started, *self.tree(), *tagged_processes(self.tag)})
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._reader.join(5)

    def __enter__(self) -> "ServeProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def serve_ready(*args: str, **kw: object) -> ServeProcess:
    """`ServeProcess(*args, **kw)` once it serves; killed if it does not."""
    s = ServeProcess(*args, **kw)  # type: ignore[arg-type]
    try:
        s.wait_serving()
    except Exception:
        s.cleanup()
        raise
    return s


def send_signal_to_group(pid: int, sig: int = signal.SIGINT) -> None:
    """What Ctrl-C in a terminal does: the signal goes to the whole foreground process group."""
    os.killpg(os.getpgid(pid), sig)
