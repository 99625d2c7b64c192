"""The cluster secret of a multi-node cluster, and what is derived from it.

With several nodes, EngineCore's plan (PUB), result (PULL) and node-control (ROUTER) sockets
listen on tcp, and worker rank 0 leaves ClusterInfo (EngineCore's addresses, the config) in
torch.distributed's TCPStore, which anyone who reaches it can read and write. Every node is
started with the same secret (`--cluster-secret-file PATH` or `KVFLOW_CLUSTER_SECRET`), from
which each process derives, with HKDF-SHA256 and a distinct label per use:

- a CURVE keypair for the binding side (EngineCore) and one for every connecting side (the
  workers of every node, the headless launchers). The binding sockets are CURVE servers and a
  ZAP handler (`Authenticator`) accepts only the client public key derived from the secret,
  so a peer without the secret can neither complete a handshake (read a plan, push a result,
  send ChildFailed) nor read what travels (CURVE encrypts every message);
- an HMAC-SHA256 key that signs ClusterInfo in the store (`sign` / `verify`).

The secret itself is never sent anywhere: the config carries only the file's path (None: the
environment variable), each process reads the secret where it runs, and nothing derived from
it but the HMAC tag is written to the store. One node needs none: its sockets are ipc:// paths
in a private (0700) temporary directory.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import time

import zmq
from zmq.utils import z85

logger = logging.getLogger(__name__)

SECRET_VAR = "KVFLOW_CLUSTER_SECRET"
MIN_SECRET_CHARS = 16
TAG_BYTES = 32                                  # HMAC-SHA256
HOW_TO = ("make one with `python -c \"import secrets; print(secrets.token_hex(32))\" > "
          "cluster.secret; chmod 600 cluster.secret`, copy it to every node and pass "
          f"--cluster-secret-file cluster.secret on each (or set {SECRET_VAR} to its content)")


class SecretMismatch(ValueError):
    """Something signed with another cluster secret (or not signed at all)."""


def check_secret(path: str | None) -> str | None:
    """At configuration time, on every node of several: a usable secret exists (in the file, or
    else in the environment), with ValueError saying how to make one. The absolute path of the
    file (None: the secret is in the environment)."""
    if not zmq.has("curve"):
        raise ValueError("several nodes need ZMQ's CURVE security, and this libzmq was built "
                         "without it (zmq.has('curve') is False): install pyzmq's wheel, which "
                         "bundles a libzmq with CURVE")
    if path:
        path = os.path.abspath(path)
    read_secret(path)
    if path and os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("cluster_secret_file=%r can be read by other users (mode %o): chmod 600 "
                       "it", path, stat.S_IMODE(os.stat(path).st_mode))
    return path


def read_secret(path: str | None) -> bytes:
    """The secret from `path` if given, else from $KVFLOW_CLUSTER_SECRET; surrounding
    whitespace (the newline `print` adds) is not part of it."""
    if path:
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as e:
            raise ValueError(f"cluster_secret_file={path!r} cannot be read: {e.strerror}; "
                             f"{HOW_TO}") from None
        where = f"cluster_secret_file={path!r}"
    else:
        secret = os.environ.get(SECRET_VAR, "").strip().encode()
        where = f"${SECRET_VAR}"
        if not secret:
            raise ValueError(f"several nodes (nnodes > 1) need a shared cluster secret, and none "
                             f"was given: {HOW_TO}")
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"the cluster secret in {where} has {len(secret)} characters; it needs "
                         f"at least {MIN_SECRET_CHARS} (random ones): {HOW_TO}")
    return secret


def _derive(secret: bytes, label: bytes) -> bytes:
    """HKDF-SHA256 (RFC 5869) of the secret, one 32-byte output per label."""
    prk = hmac.new(b"kvflow cluster secret v1", secret, hashlib.sha256).digest()
    return hmac.new(prk, label + b"\x01", hashlib.sha256).digest()


class ClusterKeys:
    """Everything derived from one cluster secret."""

    def __init__(self, secret: bytes) -> None:
        self.server_secret = z85.encode(_derive(secret, b"curve server"))
        self.server_public = zmq.curve_public(self.server_secret)
        self.client_secret = z85.encode(_derive(secret, b"curve client"))
        self.client_public = zmq.curve_public(self.client_secret)
        self._info_key = _derive(secret, b"cluster info hmac")

    @classmethod
    def load(cls, path: str | None) -> "ClusterKeys":
        return cls(read_secret(path))

    def secure(self, sock: zmq.Socket, server: bool) -> None:
        """CURVE on a socket before it binds (server) or connects (client)."""
        if server:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
        else:
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)

    def sign(self, data: bytes) -> bytes:
        """`data` with its tag in front, for the store."""
        return hmac.new(self._info_key, data, hashlib.sha256).digest() + data

    def verify(self, blob: bytes) -> bytes:
        """The data `sign` was given; SecretMismatch if the tag is not ours."""
        tag, data = blob[:TAG_BYTES], blob[TAG_BYTES:]
        expected = hmac.new(self._info_key, data, hashlib.sha256).digest()
        if len(tag) != TAG_BYTES or not hmac.compare_digest(tag, expected):
            raise SecretMismatch("its HMAC tag does not match this node's cluster secret")
        return data


class Authenticator:
    """The ZAP handler of a context whose sockets are CURVE servers: a client is let in only
    when its public key is the one derived from the cluster secret. (A client must also know
    the server's public key to start a handshake, itself derived from the secret; this check
    keeps a peer out even if that key were ever known.) Runs pyzmq's authenticator thread."""

    def __init__(self, ctx: zmq.Context, keys: ClusterKeys) -> None:
        from zmq.auth.thread import ThreadAuthenticator
        self._client = keys.client_public
        self._warned_at = -1e9
        self._thread = ThreadAuthenticator(ctx, log=logging.getLogger("kvflow.zap"))
        self._thread.start()
        self._thread.configure_curve_callback("*", credentials_provider=self)

    def callback(self, domain: str, client_key: bytes) -> bool:
        allowed = hmac.compare_digest(client_key, self._client)
        if not allowed and time.monotonic() - self._warned_at > 60:   # it retries: say it
            self._warned_at = time.monotonic()                          # once a minute
            logger.warning("refused a connection whose CURVE key is not the cluster's "
                           "(a peer without the cluster secret)")
        return allowed

    def stop(self) -> None:
        self._thread.stop()
