"""Decode steps replayed from CUDA graphs (docs/design.md §3).

A decode-only step launches the same few hundred small kernels every time, so on a GPU its cost
is launch overhead more than math. Graphs are captured once, at start-up, for a ladder of batch
sizes; a step with n requests replays the smallest captured size >= n, its extra rows padded:
token 0 at position 0, KV slot -1 (the KV store skips it), a context of one position in block 0
(finite garbage, never read back). Every graph reads its inputs from static device buffers,
filled each step from pinned host mirrors by non-blocking copies. Steps with prefills, more
requests than the largest size, or block tables wider than captured run eagerly.

The block tables are captured max_model_len wide, so the decode kernel's split-K choice (made
from shapes) and every pointer stay valid for any context the scheduler can send.

Off CUDA (tests, with the Triton interpreter) nothing is captured and `replay` runs the same
static-buffer step eagerly, so the padding and buffer logic is checked on CPU too.
"""
from __future__ import annotations

import numpy as np
import torch

from kvflow.workers.attention import AttentionBackend, AttentionMetadata, PagedBackend, SeqSpan
from kvflow.workers.models.llama import LlamaForCausalLM

MAX_GRAPH_BATCH = 512


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, then max_num_seqs itself (capped at 512): a step
    pads at most 15 rows (17 requests replay the 32 graph)."""
    top = min(MAX_GRAPH_BATCH, max_num_seqs)
    return [b for b in (1, 2, 4, 8) if b < top] + list(range(16, top, 16)) + [top]


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, max_num_seqs: int,
                 max_model_len: int, device: torch.device) -> None:
        assert isinstance(backend, PagedBackend), backend.name
        self.on_cuda = device.type == "cuda"
        self.model = model
        self.backend = backend
        self.batch_sizes = batch_size_ladder(max_num_seqs)
        self.max_batch = self.batch_sizes[-1]
        self.max_blocks = -(-max_model_len // backend.block_size)
        n, w = self.max_batch, self.max_blocks
        hidden_size = int(model.cfg["hidden_size"])
        # Static device inputs and output, shared by every graph (each uses a leading slice).
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, w, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(n, hidden_size, dtype=backend.dtype, device=device)
        # Pinned host mirrors, written with numpy and copied without blocking the host.
        self.host = {name: torch.zeros(t.shape, dtype=t.dtype, pin_memory=self.on_cuda)
                     for name, t in self._inputs().items()}
        self.host_np = {name: t.numpy() for name, t in self.host.items()}
        # Marks the last copy out of the host mirrors: they are not rewritten before it is done.
        self.copied = torch.cuda.Event() if self.on_cuda else None
        self.metadata: dict[int, AttentionMetadata] = {
            b: backend.decode_metadata(self.slot_mapping[:b], self.block_tables[:b],
                                       self.context_lens[:b]) for b in self.batch_sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "positions": self.positions,
                "slot_mapping": self.slot_mapping, "context_lens": self.context_lens,
                "block_tables": self.block_tables}

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest batch first, so the smaller graphs reuse its memory pool."""
        if not self.on_cuda:
            return
        pool = None
        for batch in reversed(self.batch_sizes):
            self._run(batch)         # warm-up: Triton / torch.compile build outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self._run(batch)
            pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize()

    def _run(self, batch: int) -> None:
        hidden = self.model(self.input_ids[:batch], self.positions[:batch],
                            self.metadata[batch])
        self.hidden[:batch] = hidden

    def fits(self, decodes: list[SeqSpan]) -> bool:
        """Whether a decode-only step can replay a graph."""
        if len(decodes) > self.max_batch:
            return False
        block_size = self.backend.block_size
        return max(-(-d.context_len // block_size) for d in decodes) <= self.max_blocks

    def load(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
             decodes: list[SeqSpan]) -> int:
        """Fill the static inputs for this step (rows in `decodes` order, padded); returns the
        captured batch size to replay."""
        n = len(decodes)
        batch = next(b for b in self.batch_sizes if b >= n)
        if self.copied is not None:
            self.copied.synchronize()
        h = self.host_np
        h["input_ids"][:n], h["input_ids"][n:batch] = input_ids, 0
        h["positions"][:n], h["positions"][n:batch] = positions, 0
        h["slot_mapping"][:n], h["slot_mapping"][n:batch] = slot_mapping, -1
        h["context_lens"][n:batch] = 1
        h["block_tables"][n:batch, 0] = 0
        block_size = self.backend.block_size
        for i, d in enumerate(decodes):
            num_blocks = -(-d.context_len // block_size)
            h["context_lens"][i] = d.context_len
            h["block_tables"][i, :num_blocks] = d.block_ids[:num_blocks]
        # Whole rows (contiguous, so the copy stays asynchronous); columns past a request's
        # blocks hold stale but valid ids that the kernels never read.
        for name, t in self._inputs().items():
            t[:batch].copy_(self.host[name][:batch], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        return batch

    def replay(self, batch: int) -> torch.Tensor:
        if self.on_cuda:
            self.graphs[batch].replay()
        else:
            self._run(batch)
        return self.hidden[:batch]                 # [batch, hidden_size]
