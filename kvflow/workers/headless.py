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
   EngineCore at once (ChildFailed); EngineCore silent for HEARTBEAT_TIMEOUT, or a Shutdown
   from it, ends this node: its workers are stopped (killed if inside a collective) and the
   process exits, 0 after a Shutdown, 1 otherwise, so a supervisor (Kubernetes) restarts it.
"""
from __future__ import annotations

import logging
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
from kvflow.workers.worker_proc import CLUSTER_INFO_KEY, REFUSED_KEY

logger = logging.getLogger(__name__)


def run_headless(local: EngineConfig) -> int:
    """Run this node until the cluster ends; the process's exit status."""
    p = local.parallel
    if p.nnodes < 2 or p.node_rank == 0:
        raise ValueError(f"--headless runs a node other than node 0 of several (--nnodes >= 2, "
                         f"--node-rank >= 1), not nnodes={p.nnodes} node_rank={p.node_rank}")
    keys = ClusterKeys.load(p.cluster_secret_file)
    store, info = _read_cluster_info(local, keys)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append("SIGTERM"))
    signal.signal(signal.SIGINT, lambda *_: stopping.append("SIGINT"))
    ctx = zmq.Context()
    control = Channel[ToNode](make_socket(ctx, zmq.DEALER, info.control_address, bind=False,
                                          identity=f"node{p.node_rank}".encode(), keys=keys),
                              ToNode)
    children: list[Child] = []
    try:
        try:
            config = joined_config(info.config, local)
            # Claimed only once this node is known to fit: a node that failed above may be
            # started again with the same rank.
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
            "--log-level", str(logging.getLogger().level)]) for rank in ranks]
        logger.info("node %d: workers for ranks %s started; EngineCore at %s", p.node_rank,
                    ranks, info.control_address)
        return _watch(control, children, ranks, p.node_rank, stopping)
    finally:
        deadline = time.monotonic() + 1           # after a Shutdown they are already going;
        for child in children:                      # otherwise one may sit in a collective
            child.stop(max(0.1, deadline - time.monotonic()))
        ctx.destroy(linger=0)


def _read_cluster_info(local: EngineConfig, keys: ClusterKeys) -> tuple[Any, ClusterInfo]:
    """Node 0's store (a client of it) and what rank 0 put there, verified, all within one
    start-up timeout."""
    import torch.distributed as dist
    p = local.parallel
    deadline = time.monotonic() + p.startup_timeout
    try:
        wait_reachable(p.master_addr, p.store_port, p.startup_timeout)
        left = max(1.0, deadline - time.monotonic())
        store = dist.TCPStore(p.master_addr, p.store_port, is_master=False,
                              timeout=timedelta(seconds=left), wait_for_workers=False)
        data = store.get(CLUSTER_INFO_KEY)           # waits for rank 0 to put it there
    except Exception as e:                           # ours or torch's timeout/connection errors
        raise RuntimeError(f"node {p.node_rank} could not reach node 0's store at "
                           f"{p.master_addr}:{p.store_port} within the start-up timeout "
                           f"({p.startup_timeout:g} s): {e}; is node 0 started, and is "
                           "--master-addr its address as seen from here?") from None
    try:
        return store, msgspec.msgpack.decode(keys.verify(data), type=ClusterInfo)
    except SecretMismatch as e:
        # EngineCore's sockets would refuse us: node 0 learns it through the store instead.
        store.set(REFUSED_KEY.format(node=p.node_rank), "cluster secret")
        raise RuntimeError(
            f"node {p.node_rank} refused to join: the cluster secret differs from node 0's "
            f"(the ClusterInfo in node 0's store at {p.master_addr}:{p.store_port} does not "
            f"verify: {e}); start every node with the same --cluster-secret-file (or "
            f"{SECRET_VAR})") from None


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
           stopping: list[str]) -> int:
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
                    return 1
        if time.monotonic() - last_heard > HEARTBEAT_TIMEOUT:
            logger.error("node %d: no heartbeat from EngineCore (node 0) for %.1f s: it is "
                         "gone or unreachable; stopping this node", node_rank,
                         time.monotonic() - last_heard)
            return 1
    logger.warning("node %d: %s received; stopping this node", node_rank, stopping[0])
    return 0
