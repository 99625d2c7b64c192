"""A worker process: one tensor-parallel rank on the bus.

Receives step plans on a SUB socket (broadcast by EngineCore), runs them, and rank 0 pushes
the step result back. Exits when told to, or at once when its parent (EngineCore) dies: the
parent holds the write end of a pipe whose read end is polled here, so EOF means orphaned.
Torch is imported inside the process, never by the module's importer.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import time
import traceback

import zmq

from kvflow.config import EngineConfig
from kvflow.ipc.messages import (ChildFailed, FromWorker, Ping, Pong, Shutdown, StepPlan,
                                 ToWorker, WorkerReady)
from kvflow.ipc.process import child_args, startup_done
from kvflow.ipc.sockets import Channel, make_socket

logger = logging.getLogger(__name__)


def main() -> None:
    parser = argparse.ArgumentParser(description="kvflow worker process (started by EngineCore)")
    for name in ("--rank", "--log-level"):
        parser.add_argument(name, type=int, required=True)
    for name in ("--plan-address", "--result-address", "--dist-address"):
        parser.add_argument(name, required=True)
    args, config = child_args(parser)
    run_worker(config, args.rank, args.plan_address, args.result_address, args.dist_address,
               args.parent_fd, args.log_level)
    # Nothing is left to flush, and the interpreter's teardown of a loaded model takes
    # seconds on a busy machine (while EngineCore waits, or nobody does): exit at once.
    os._exit(0)


def run_worker(config: EngineConfig, rank: int, plan_address: str, result_address: str,
               dist_address: str, parent_fd: int, log_level: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C is the launcher's to handle
    logging.basicConfig(level=log_level, format=f"%(asctime)s worker{rank} %(message)s")
    ctx = zmq.Context()
    plans = Channel[ToWorker](make_socket(ctx, zmq.SUB, plan_address, bind=False), ToWorker)
    results = Channel[FromWorker](make_socket(ctx, zmq.PUSH, result_address, bind=False),
                                  FromWorker)
    try:
        worker = _start(config, rank, dist_address)
    except Exception:
        results.send(ChildFailed(f"worker {rank}", traceback.format_exc()))
        time.sleep(0.2)                              # let the message leave before we exit
        return
    results.send(WorkerReady(rank, worker.num_blocks))
    try:
        _loop(worker, rank, plans, results, parent_fd)
    except Exception:
        results.send(ChildFailed(f"worker {rank}", traceback.format_exc()))
        time.sleep(0.2)
    finally:
        ctx.destroy(linger=0)


def _start(config: EngineConfig, rank: int, dist_address: str):  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    from kvflow.workers.layers.parallel import TPGroup
    from kvflow.workers.worker import Worker, resolve_device
    size = config.parallel.tensor_parallel_size
    tp = TPGroup()
    if size > 1:
        # One GPU per rank (cuda:rank, made current by resolve_device) and NCCL between them;
        # gloo on CPU. The layers only see TPGroup either way.
        device = resolve_device(config.device, rank)
        on_cuda = device.type == "cuda"
        dist.init_process_group("nccl" if on_cuda else "gloo", init_method=dist_address,
                                rank=rank, world_size=size, device_id=device if on_cuda else None)
        tp = TPGroup(rank, size, dist.group.WORLD)
    return Worker(config, tp)


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
            result = worker.execute(msg)
            result.worker_seconds = time.perf_counter() - start
            if rank == 0:
                results.send(result)


if __name__ == "__main__":
    main()
