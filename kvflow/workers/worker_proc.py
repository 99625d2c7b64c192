"""A worker process: one tensor-parallel rank on the bus.

Receives step plans on a SUB socket (broadcast by EngineCore), runs them, and rank 0 pushes
the step result back. Ranks meet in torch.distributed through a TCPStore that rank 0 hosts
(on several nodes, at --master-addr:--master-port). Exits when told to, or at once when its
parent (EngineCore, or a --headless node's launcher) dies: the parent holds the write end of a
pipe whose read end is polled here, so EOF means orphaned.
Torch is imported inside the process, never by the module's importer.
"""
from __future__ import annotations

import argparse
import functools
import logging
import os
import secrets
import signal
import threading
import time
import traceback
from typing import NamedTuple

import msgspec
import zmq

from kvflow.config import EngineConfig
from kvflow.ipc.auth import ClusterKeys
from kvflow.ipc.messages import (ChildFailed, ClusterInfo, FromWorker, Ping, Pong, Shutdown,
                                 StepMasks, StepPlan, ToWorker, WorkerReady)
from kvflow.ipc.network import host_ip, interface_of
from kvflow.ipc.process import child_args, startup_done
from kvflow.ipc.sockets import Channel, make_socket

logger = logging.getLogger(__name__)
CLUSTER_INFO_KEY = "kvflow/cluster_info"      # ClusterInfo, signed (ClusterKeys.sign)
REFUSED_KEY = "kvflow/refused/{node}"          # set by a node whose secret differs (headless)


class JoinError(RuntimeError):
    """torch.distributed's rendezvous failed; the message says where and why."""


def main() -> None:
    parser = argparse.ArgumentParser(description="kvflow worker process (started by EngineCore, "
                                                 "or by a --headless node)")
    for name in ("--rank", "--log-level"):
        parser.add_argument(name, type=int, required=True)
    for name in ("--plan-address", "--result-address", "--dist-address"):
        parser.add_argument(name, required=True)
    parser.add_argument("--control-address", default="",
                        help="rank 0 of several nodes: EngineCore's socket for the nodes")
    args, config = child_args(parser)
    run_worker(config, args)
    # Nothing is left to flush, and the interpreter's teardown of a loaded model takes
    # seconds on a busy machine (while EngineCore waits, or nobody does): exit at once.
    os._exit(0)


def run_worker(config: EngineConfig, args: argparse.Namespace) -> None:
    rank = args.rank
    # Ctrl-C and SIGTERM are the launcher's to handle (it drains first, then stops us; a
    # SIGTERM sent to the whole group, as systemd does, must not cut the drain short).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s worker{rank} %(message)s")
    ctx = zmq.Context()
    parallel = config.parallel
    keys = ClusterKeys.load(parallel.cluster_secret_file) if parallel.nnodes > 1 else None
    plans = Channel[ToWorker](make_socket(ctx, zmq.SUB, args.plan_address, bind=False,
                                          keys=keys), ToWorker)
    results = Channel[FromWorker](make_socket(ctx, zmq.PUSH, args.result_address, bind=False,
                                              keys=keys), FromWorker)
    try:
        announce = None
        if rank == 0 and keys is not None:
            info = ClusterInfo(args.plan_address, args.result_address, args.control_address,
                               config, start_id=secrets.token_hex(8))
            announce = Announce(keys.sign(msgspec.msgpack.encode(info)),
                        RefusalWatch(ctx, args.result_address, keys, parallel.nnodes))
        worker = _start(config, rank, args.dist_address, announce)
    except Exception as e:
        # Said on this node's log too: with several nodes, EngineCore's is on another machine.
        error = str(e) if isinstance(e, JoinError) else traceback.format_exc()
        logger.error("start-up failed: %s", error)
        results.send(ChildFailed(f"worker {rank}", error))
        time.sleep(0.2)                              # let the message leave before we exit
        return
    results.send(WorkerReady(rank, worker.num_blocks, worker.async_scheduling))
    try:
        _loop(worker, rank, plans, results, args.parent_fd)
    except Exception:
        results.send(ChildFailed(f"worker {rank}", traceback.format_exc()))
        time.sleep(0.2)
    finally:
        ctx.destroy(linger=0)


def _start(config: EngineConfig, rank: int, dist_address: str,  # type: ignore[no-untyped-def]
           announce: Announce | None):
    from kvflow.workers.layers.parallel import TPGroup
    from kvflow.workers.worker import Worker, resolve_device
    parallel = config.parallel
    tp = TPGroup()
    if parallel.tensor_parallel_size > 1:
        # One GPU per rank of this node (cuda:local_rank) and NCCL between them; gloo on CPU.
        # The layers only see TPGroup either way.
        device = resolve_device(config.device, parallel.local_rank(rank))
        group = join_group(config, rank, dist_address, device, announce)
        tp = TPGroup(rank, parallel.tensor_parallel_size, group)
    return Worker(config, tp, own_process=True)


def join_group(config: EngineConfig, rank: int, dist_address: str,  # type: ignore[no-untyped-def]
               device, announce: Announce | None):
    """torch.distributed over an explicit TCPStore that rank 0 hosts, so that every wait has
    the start-up timeout (gloo's default is 30 minutes). With several nodes, rank 0 also puts
    the signed ClusterInfo in the store (the headless nodes read it there) and watches it for
    nodes that refuse to join, and gloo is given the interface of this node's address unless
    GLOO_SOCKET_IFNAME says otherwise."""
    from datetime import timedelta

    import torch.distributed as dist
    parallel = config.parallel
    timeout = timedelta(seconds=parallel.startup_timeout)
    host, port = dist_address.removeprefix("tcp://").rsplit(":", 1)
    on_cuda = device.type == "cuda"
    where = f"the store at {host}:{port}"
    if parallel.nnodes > 1 and not on_cuda:
        where += choose_gloo_interface(parallel.master_addr, parallel.store_port)
    try:
        store = dist.TCPStore(host, int(port), is_master=rank == 0, timeout=timeout,
                              wait_for_workers=False)
        if announce is not None:
            store.set(CLUSTER_INFO_KEY, announce.signed_info)  # type: ignore[arg-type]
            announce.watch.start(host, int(port))
        dist.init_process_group("nccl" if on_cuda else "gloo", store=store, rank=rank,
                                world_size=parallel.tensor_parallel_size, timeout=timeout,
                                device_id=device if on_cuda else None)
    except Exception as e:
        raise JoinError(f"rank {rank} could not join the tensor-parallel group ({where}, "
                           f"start-up timeout {parallel.startup_timeout:g} s): {e}") from None
    finally:
        if announce is not None:
            announce.watch.stop()
    return dist.group.WORLD


class RefusalWatch:
    """While rank 0 waits for the other nodes' ranks: a headless node whose cluster secret
    differs cannot reach EngineCore's sockets to say why it will not join, so it marks
    REFUSED_KEY in the store instead; this thread, on its own connection to the store, turns
    that mark into a ChildFailed for EngineCore, and node 0 fails at once rather than at its
    start-up timeout. (The store is unauthenticated: the mark only stops a start-up, which
    anyone reaching the store can do anyway; its text is not trusted and not forwarded.)"""

    def __init__(self, ctx: zmq.Context, result_address: str, keys: ClusterKeys,
                 nnodes: int) -> None:
        self.ctx, self.result_address, self.keys, self.nnodes = ctx, result_address, keys, nnodes
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, host: str, port: int) -> None:
        self._thread = threading.Thread(target=self._run, args=(host, port), daemon=True,
                                        name="refusal-watch")
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(2)

    def _run(self, host: str, port: int) -> None:
        from datetime import timedelta

        import torch.distributed as dist
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10),
                                  wait_for_workers=False)
            while not self._done.wait(0.5):
                for node in range(1, self.nnodes):
                    if store.check([REFUSED_KEY.format(node=node)]):
                        self._report(node)
                        return
        except Exception as e:            # the store went away: the main thread will say so
            logger.debug("refusal watch ended: %s", e)

    def _report(self, node: int) -> None:
        error = (f"node {node} refused to join: the ClusterInfo this node signed did not "
                 "verify there, so its cluster secret differs from node 0's; start every node "
                 "with the same --cluster-secret-file (or KVFLOW_CLUSTER_SECRET)")
        logger.error("%s", error)
        sock = make_socket(self.ctx, zmq.PUSH, self.result_address, bind=False, keys=self.keys)
        Channel[FromWorker](sock, FromWorker).send(ChildFailed(f"node {node}", error))
        sock.close(linger=1000)


def choose_gloo_interface(master_addr: str, master_port: int) -> str:
    """Set GLOO_SOCKET_IFNAME to the interface of this node's address when unset; says which
    interface gloo uses, for error messages."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return f", GLOO_SOCKET_IFNAME={os.environ['GLOO_SOCKET_IFNAME']!r} (set by the user)"
    ip = host_ip(master_addr, master_port)
    name = interface_of(ip)
    if name is None:
        return f", no interface holds this node's address {ip}; set GLOO_SOCKET_IFNAME"
    os.environ["GLOO_SOCKET_IFNAME"] = name
    logger.info("gloo uses interface %s (%s); set GLOO_SOCKET_IFNAME to choose another",
                name, ip)
    return f", GLOO_SOCKET_IFNAME={name!r} (the interface of {ip})"


def _loop(worker, rank: int, plans: Channel, results: Channel,  # type: ignore[no-untyped-def]
          parent_fd: int) -> None:
    poller = zmq.Poller()
    poller.register(plans.sock, zmq.POLLIN)
    poller.register(parent_fd, zmq.POLLIN)
    startup_done()
    while True:
        ready = dict(poller.poll())                  # blocks: no spinning
        if parent_fd in ready:
            logger.warning("parent process is gone; exiting")
            return
        msg = plans.recv()
        if isinstance(msg, Shutdown):
            return
        if isinstance(msg, Ping):
            results.send(Pong(rank, msg.seq))
        elif isinstance(msg, StepPlan):
            start = time.perf_counter()
            masks = None
            if msg.masked_ids and rank == 0:      # they follow the plan (only rank 0 samples)
                masks = functools.partial(_recv_masks, poller, plans, parent_fd)
            result = worker.execute(msg, masks)
            result.worker_seconds = time.perf_counter() - start
            if result.error is not None and rank != 0:
                # Rank 0 may now wait in a collective this rank left: not recoverable.
                raise RuntimeError(f"rank {rank}'s step failed:\n{result.error}")
            if rank == 0:
                results.send(result)


def _recv_masks(poller: zmq.Poller, plans: Channel, parent_fd: int) -> bytes:
    """The StepMasks that follows a plan with masked_ids (EngineCore computes it while the
    forward runs)."""
    while True:
        ready = dict(poller.poll())
        if parent_fd in ready:
            raise RuntimeError("EngineCore is gone while a step waited for its masks")
        msg = plans.recv()
        if isinstance(msg, StepMasks):
            return msg.bitmask
        raise RuntimeError(f"expected the step's StepMasks, got {type(msg).__name__}")


class Announce(NamedTuple):
    """Rank 0's duties towards the other nodes while the group forms (several nodes only)."""
    signed_info: bytes             # ClusterInfo as the headless nodes read it from the store
    watch: RefusalWatch


if __name__ == "__main__":
    main()
