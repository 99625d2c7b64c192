"""The frontend's handle on an engine. In-process: EngineCore and one worker called directly
(same code paths as the cluster, minus the sockets), for debugging and fast tests."""
from __future__ import annotations

from kvflow.config import EngineConfig
from kvflow.ipc.messages import EngineOutputs, EngineRequest


class InProcessEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.tensor_parallel_size != 1:
            raise ValueError("in_process=True runs a single worker: tensor_parallel_size must "
                             f"be 1, not {config.parallel.tensor_parallel_size}")
        # Imported here: the torch side stays out of the frontend until an engine is built.
        from kvflow.core.engine_core import EngineCore
        from kvflow.workers.worker import Worker
        self.worker = Worker(config)
        self.core = EngineCore(config, self.worker)
        self.num_blocks = self.worker.num_blocks

    def add_requests(self, requests: list[EngineRequest]) -> None:
        for request in requests:
            self.core.add_request(request)

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort(request_ids)

    def step(self) -> EngineOutputs:
        return self.core.step()

    def has_work(self) -> bool:
        return self.core.has_work()

    def shutdown(self) -> None:
        self.core = None  # type: ignore[assignment]
        self.worker = None  # type: ignore[assignment]
