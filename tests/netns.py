"""Two "nodes" on one host: two Linux network namespaces joined by a veth pair.

Each namespace is held by a `sleep` started with `unshare --net`; commands enter it with
`nsenter --net=/proc/PID/ns/net`. Killing the holders removes both namespaces, and the veth pair
with them: nothing outlives the test (no named namespace in /run/netns, no interface left in
the host's namespace). Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN), `unshare`, `nsenter`, `ip`.
"""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import time
import uuid


class Unavailable(Exception):
    """Network namespaces cannot be made here; the message says why."""


class NamespacePair:
    def __init__(self) -> None:
        missing = [t for t in ("unshare", "nsenter", "ip") if shutil.which(t) is None]
        if missing:
            raise Unavailable(f"{', '.join(missing)} not found")
        tag = uuid.uuid4().hex[:6]
        self.links = [f"kv{tag}a", f"kv{tag}b"]          # <= 15 characters
        subnet = f"10.231.{random.randint(1, 254)}"
        self.ips = [f"{subnet}.1", f"{subnet}.2"]
        self.holders: list[subprocess.Popen] = []
        try:
            for _ in range(2):
                self.holders.append(subprocess.Popen(["unshare", "--net", "sleep", "3600"],
                                                     stderr=subprocess.PIPE))
            self._wait_unshared()
            self._run(["ip", "link", "add", self.links[0], "type", "veth", "peer", "name",
                       self.links[1]])
            for i in range(2):
                self._run(["ip", "link", "set", self.links[i], "netns", str(self.holders[i].pid)])
                self._run([*self.enter(i), "ip", "link", "set", "lo", "up"])
                self._run([*self.enter(i), "ip", "addr", "add", f"{self.ips[i]}/24", "dev",
                           self.links[i]])
                self._run([*self.enter(i), "ip", "link", "set", self.links[i], "up"])
        except BaseException:
            self.close()
            raise

    def _wait_unshared(self) -> None:
        ours = os.readlink("/proc/self/ns/net")
        deadline = time.monotonic() + 5
        for h in self.holders:
            while True:
                if h.poll() is not None:
                    assert h.stderr is not None
                    raise Unavailable(f"unshare --net failed: {h.stderr.read().decode().strip()}")
                try:
                    if os.readlink(f"/proc/{h.pid}/ns/net") != ours:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise Unavailable("unshare --net did not create a namespace in 5 s")
                time.sleep(0.02)

    @staticmethod
    def _run(cmd: list[str]) -> None:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise Unavailable(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")

    def enter(self, i: int) -> list[str]:
        """The command prefix that runs a command in namespace i."""
        return ["nsenter", f"--net=/proc/{self.holders[i].pid}/ns/net", "--"]

    def set_link(self, i: int, state: str) -> None:
        """Take namespace i's end of the veth pair "down" (cut the wire) or "up"."""
        self._run([*self.enter(i), "ip", "link", "set", self.links[i], state])

    def close(self) -> None:
        for h in self.holders:
            h.kill()
            h.wait(10)
        # Only if setup stopped before moving it: an interface left in the host's namespace.
        subprocess.run(["ip", "link", "del", self.links[0]], capture_output=True)
