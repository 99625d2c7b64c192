"""A --headless node of a multi-node cluster: this node's workers, no frontend, no EngineCore.

    launch.py serve --headless --nnodes 2 --node-rank 1 --master-addr NODE0 --tp 2 --model M

1. Reach node 0's torch.distributed store (master_addr:master_port, hosted by worker rank 0)
   within the start-up timeout, and read what rank 0 put there: EngineCore's addresses and the
   configuration every rank must run (ClusterInfo), signed with a key derived from the cluster
   secret (kvflow/ipc/auth.py). A tag that does not verify means another secret: this node
   marks its refusal in the store (node 0's rank 0 watches for it, so both nodes fail at once)
   and exits. This node keeps only its model folder, thread count and secret file; a
   different model or --tp/--nnodes is an error, not a silent mismatch.
2. Start this node's ranks (tp / nnodes of them) as worker processes; they join the group,
   subscribe to EngineCore's plans and report to it like node 0's own workers.
3. Heartbeat with EngineCore every HEARTBEAT_INTERVAL. A worker here that dies is reported to
   EngineCore at once (ChildFailed). A Shutdown from EngineCore ends this node (exit 0), as
   do SIGTERM and SIGINT.
4. Rejoin. When the cluster fails (a worker here died, EngineCore fell silent for
   HEARTBEAT_TIMEOUT, or EngineCore said it failed: Shutdown(restart=True)), node 0's
   frontend restarts the engine (kvflow/frontend/supervisor.py) with a new store on the same
   --master-port and a new ClusterInfo. This node stops its workers (killed if inside a
   collective) and goes back to step 1: it waits for the new ClusterInfo (a new start_id: the
   old store may answer for a moment), checks it as on the first join and starts its ranks
   again. It tries for --startup-timeout seconds after node 0's engine went away, then exits
   1 so that a supervisor (Kubernetes) restarts it; with --max-engine-restarts 0 on node 0
   there is nothing to rejoin and it exits 1 at once.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from datetime import timedelta
from typing import Any

import msgspec
import zmq

from kvflow.config import EngineConfig
from kvflow.core.executor import HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT
from kvflow.ipc.auth import SECRET_VAR, ClusterKeys, SecretMismatch
from kvflow.ipc.messages import ChildFailed, ClusterInfo, Heartbeat, Shutdown, ToNode
from kvflow.ipc.network import tcp_address, wait_reachable
from kvflow.ipc.process import Child
from kvflow.ipc.sockets import Channel, make_socket
from kvflow.workers import huge_pages
from kvflow.workers.worker_proc import CLUSTER_INFO_KEY, REFUSED_KEY

logger = logging.getLogger(__name__)


def run_headless(local: EngineConfig) -> int:
    """Run this node until the cluster ends; the process's exit status."""
    p = local.parallel
    if p.nnodes < 2 or p.node_rank == 0:
        raise ValueError(f"--headless runs a node other than node 0 of several (--nnodes >= 2, "
                         f"--node-rank >= 1), not nnodes={p.nnodes} node_rank={p.node_rank}")
    keys = ClusterKeys.load(p.cluster_secret_file)
    stopping: list[str] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append("SIGTERM"))
    signal.signal(signal.SIGINT, lambda *_: stopping.append("SIGINT"))
    left_at: float | None = None          # when node 0's engine last went away
    previous = None                       # the start_id of the engine this node last joined
    joins = 0
    while True:
        deadline = (time.monotonic() if left_at is None else left_at) + p.startup_timeout
        found = _read_cluster_info(local, keys, deadline, previous, stopping)
        if found is None:
            logger.warning("node %d: %s received; stopping this node", p.node_rank, stopping[0])
            return 0
        store, info = found
        if joins:
            logger.warning("node %d: rejoining the restarted cluster (rejoin %d, %.1f s after "
                           "node 0's engine went away); EngineCore at %s", p.node_rank, joins,
                           time.monotonic() - (left_at or 0.0), info.control_address)
        status = _run_node(local, keys, store, info, stopping)
        if status is not None:
            return status
        left_at, previous = time.monotonic(), info.start_id
        joins += 1
        logger.warning("node %d: this node's workers are stopped; waiting up to %g s "
                       "(--startup-timeout) for node 0's restarted engine to rejoin it",
                       p.node_rank, p.startup_timeout)


def _run_node(local: EngineConfig, keys: ClusterKeys, store: Any, info: ClusterInfo,
              stopping: list[str]) -> int | None:
    """Join the cluster that `info` describes and run this node's ranks until it ends: the
    exit status, or None to rejoin (node 0's engine failed and its frontend restarts it)."""
    p = local.parallel
    ctx = zmq.Context()
    control = Channel[ToNode](make_socket(ctx, zmq.DEALER, info.control_address, bind=False,
                                          identity=f"node{p.node_rank}".encode(), keys=keys),
                              ToNode)
    children: list[Child] = []
    try:
        try:
            config = joined_config(info.config, local)
            # Claimed only once this node is known to fit: a node that failed above may be
            # started again with the same rank. (A restarted engine has a new store.)
            if store.add(f"kvflow/node/{p.node_rank}", 1) != 1:
                raise ValueError(f"node_rank={p.node_rank} has already joined this cluster: "
                                 "give every node its own --node-rank")
        except ValueError as e:                      # node 0 learns why at once, not at its
            control.send(ChildFailed(f"node {p.node_rank}", str(e)))     # start-up timeout
            time.sleep(0.2)
            raise
        ranks = list(p.node_ranks(p.node_rank))
        dist_address = tcp_address(p.master_addr, p.store_port)
        children = [Child("kvflow.workers.worker_proc", f"worker {rank}", config, [
            "--rank", str(rank), "--plan-address", info.plan_address, "--result-address",
            info.result_address, "--dist-address", dist_address,
            "--log-level", str(logging.getLogger().level)], env=huge_pages.worker_env(os.environ))
            for rank in ranks]
        logger.info("node %d: workers for ranks %s started; EngineCore at %s", p.node_rank,
                    ranks, info.control_address)
        status = _watch(control, children, ranks, p.node_rank, stopping)
        if status is None and config.max_engine_restarts == 0:
            logger.error("node %d: node 0 does not restart its engine (--max-engine-restarts "
                         "0): nothing to rejoin; exiting", p.node_rank)
            return 1
        return status
    finally:
        deadline = time.monotonic() + 1           # after a Shutdown they are already going;
        for child in children:                      # otherwise one may sit in a collective
            child.stop(max(0.1, deadline - time.monotonic()))
        ctx.destroy(linger=0)


def _read_cluster_info(local: EngineConfig, keys: ClusterKeys, deadline: float,
                       previous: str | None, stopping: list[str]
                       ) -> tuple[Any, ClusterInfo] | None:
    """Node 0's store (a client of it) and what rank 0 put there, verified, by `deadline`
    (None: a signal came first). `previous`: the start_id of the engine this node left; while
    its store still answers (node 0 has not yet stopped it), its info is not taken."""
    import torch.distributed as dist
    p = local.parallel
    while not stopping:
        # In short waits, so that SIGTERM/SIGINT are heard within a second or so; at least
        # one try even when importing torch took the whole timeout.
        left = max(0.1, deadline - time.monotonic())
        try:
            wait_reachable(p.master_addr, p.store_port, min(left, 1.0))
            store = dist.TCPStore(p.master_addr, p.store_port, is_master=False,
                                  timeout=timedelta(seconds=max(1.0, min(left, 5.0))),
                                  wait_for_workers=False)
            while not store.check([CLUSTER_INFO_KEY]):   # until rank 0 puts it there
                if stopping or time.monotonic() >= deadline:
                    raise TimeoutError(f"the store at {p.master_addr}:{p.store_port} answers "
                                       "but holds no ClusterInfo")
                time.sleep(0.25)
            data = store.get(CLUSTER_INFO_KEY)
        except Exception as e:                       # ours or torch's timeout/connection errors
            error = str(e)
        else:
            try:
                info = msgspec.msgpack.decode(keys.verify(data), type=ClusterInfo)
            except SecretMismatch as e:
                # EngineCore's sockets would refuse us: node 0 learns it through the store.
                store.set(REFUSED_KEY.format(node=p.node_rank), "cluster secret")
                raise RuntimeError(
                    f"node {p.node_rank} refused to join: the cluster secret differs from node "
                    f"0's (the ClusterInfo in node 0's store at {p.master_addr}:{p.store_port} "
                    f"does not verify: {e}); start every node with the same "
                    f"--cluster-secret-file (or {SECRET_VAR})") from None
            if previous is None or info.start_id != previous:
                return store, info
            error = "only the engine this node left answered (node 0 has not yet stopped it)"
        if time.monotonic() >= deadline:
            if previous is None:
                raise RuntimeError(
                    f"node {p.node_rank} could not reach node 0's store at {p.master_addr}:"
                    f"{p.store_port} within the start-up timeout ({p.startup_timeout:g} s): "
                    f"{error}; is node 0 started, and is --master-addr its address as seen "
                    "from here?")
            raise RuntimeError(
                f"node {p.node_rank} could not rejoin: node 0's engine did not come back at "
                f"{p.master_addr}:{p.store_port} within the start-up timeout "
                f"({p.startup_timeout:g} s) after it went away: {error}")
        if not stopping:
            time.sleep(0.5)
    return None


def joined_config(node0: EngineConfig, local: EngineConfig) -> EngineConfig:
    """Node 0's configuration with this node's own model folder and thread count; an error
    when this node was started for another model or another layout."""
    mine, theirs = local.parallel, node0.parallel
    for name in ("tensor_parallel_size", "nnodes"):
        if getattr(mine, name) != getattr(theirs, name):
            raise ValueError(f"{name}={getattr(mine, name)} on this node but "
                             f"{getattr(theirs, name)} on node 0: start every node with the "
                             "same --tp and --nnodes")
    if local.model.hf_config != node0.model.hf_config:
        raise ValueError(f"model={local.model.path!r} on this node is not the model node 0 "
                         f"serves ({node0.model.path!r}): their config.json differ")
    return msgspec.structs.replace(
        node0, num_threads=local.num_threads,
        model=msgspec.structs.replace(node0.model, path=local.model.path),
        parallel=msgspec.structs.replace(theirs, node_rank=mine.node_rank,
                                         master_addr=mine.master_addr,
                                         startup_timeout=mine.startup_timeout,
                                         cluster_secret_file=mine.cluster_secret_file))


def _watch(control: Channel, children: list[Child], ranks: list[int], node_rank: int,
           stopping: list[str]) -> int | None:
    """Heartbeat with EngineCore and watch this node's workers: the exit status (0 after a
    Shutdown or a signal), or None when the cluster failed and node 0 restarts it."""
    poller = zmq.Poller()
    poller.register(control.sock, zmq.POLLIN)
    watching = {child.sentinel for child in children}
    for sentinel in watching:
        poller.register(sentinel, zmq.POLLIN)
    beat = msgspec.msgpack.encode(Heartbeat(node_rank))
    last_heard = time.monotonic()            # EngineCore exists: rank 0 published its info
    next_beat = 0.0
    while not stopping:
        now = time.monotonic()
        if now >= next_beat:
            control.sock.send(beat, zmq.NOBLOCK)
            next_beat = now + HEARTBEAT_INTERVAL
        poller.poll(int(max(0.0, next_beat - now) * 1000) + 1)
        while control.poll(0):
            msg = control.recv()
            if isinstance(msg, Heartbeat):
                last_heard = time.monotonic()
            elif isinstance(msg, Shutdown) and msg.restart:
                logger.error("node %d: EngineCore failed; stopping this node's workers",
                             node_rank)
                return None
            elif isinstance(msg, Shutdown):
                logger.info("node %d: EngineCore shut the cluster down", node_rank)
                return 0
        for rank, child in zip(ranks, children):
            if child.sentinel in watching and child.exitcode is not None:
                # 0: it was told to stop, or it told EngineCore itself why it failed; either
                # way EngineCore's Shutdown follows. Otherwise it died: say so at once.
                poller.unregister(child.sentinel)
                watching.discard(child.sentinel)
                if child.exitcode != 0:
                    error = (f"died with exit code {child.exitcode} (pid {child.pid}, "
                             f"node {node_rank})")
                    control.send(ChildFailed(f"worker {rank}", error))
                    logger.error("node %d: worker %d %s; leaving the cluster", node_rank,
                                 rank, error)
                    time.sleep(0.2)              # let the news leave before the socket closes
                    return None
        if time.monotonic() - last_heard > HEARTBEAT_TIMEOUT:
            logger.error("node %d: no heartbeat from EngineCore (node 0) for %.1f s: it is "
                         "gone or unreachable; stopping this node's workers", node_rank,
                         time.monotonic() - last_heard)
            return None
    logger.warning("node %d: %s received; stopping this node", node_rank, stopping[0])
    return 0
