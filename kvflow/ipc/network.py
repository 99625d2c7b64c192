"""Which address a node is known by, and which interface carries it (multi-node only).

A node's address is `KVFLOW_HOST_IP` when set, else the source address the kernel would use to
reach node 0 (a UDP socket "connected" to master_addr: a route lookup, no packet is sent).
Gloo picks its interface from the host name unless `GLOO_SOCKET_IFNAME` names one, and a host
name often resolves to an address another route owns (or none, in a container): so a worker
sets `GLOO_SOCKET_IFNAME` to the interface holding the node's address when the user did not.
"""
from __future__ import annotations

import fcntl
import os
import socket
import struct
import time

HOST_IP_VAR = "KVFLOW_HOST_IP"
_SIOCGIFADDR = 0x8915                 # Linux ioctl: an interface's IPv4 address


def host_ip(master_addr: str, master_port: int) -> str:
    """This node's address as the other nodes reach it."""
    if os.environ.get(HOST_IP_VAR):
        return os.environ[HOST_IP_VAR]
    try:
        target = socket.gethostbyname(master_addr)
    except OSError as e:
        raise ValueError(f"master_addr={master_addr!r} does not resolve: {e}") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target, master_port))
        except OSError as e:
            raise ValueError(f"no route from this node to master_addr={master_addr!r} "
                             f"({target}): {e}; set {HOST_IP_VAR} to this node's address"
                             ) from None
        return str(s.getsockname()[0])


def interface_of(ip: str) -> str | None:
    """The network interface that holds IPv4 address `ip` (None if none does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:                  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None


def tcp_address(ip: str, port: int | str) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def wait_reachable(host: str, port: int, timeout: float) -> None:
    """Until something accepts TCP connections at host:port; TimeoutError (with the last
    connection error) after `timeout` seconds. Retries: the other side may start later."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(2.0, left))).close()
            return
        except OSError as e:
            error = e
        if time.monotonic() + 0.5 >= deadline:
            raise TimeoutError(f"nothing answers at {host}:{port} after {timeout:g} s "
                               f"({error.strerror or error})")
        time.sleep(0.5)
