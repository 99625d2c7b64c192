"""2 MB pages for the CPU memory that every step streams: the KV cache (`advise`), the weights
the decode-shaped linears read (`move_decode_weights`), and, in worker processes, everything
malloc hands out (`worker_env`).

A decode step reads every weight once and every running request's K/V in block-sized pieces.
With 4 KB pages that stream crosses a page every 4 KB: each crossing a TLB miss (a page walk,
two-dimensional under a hypervisor), and the hardware prefetcher stops at every page end.
Linux backs memory with 2 MB pages where asked (`madvise(MADV_HUGEPAGE)`, honoured when
/sys/kernel/mm/transparent_hugepage/enabled is `madvise` or `always`); the weights torch
allocates while loading are not asked, so after loading they are copied into chunks of
memory that are. Measured (this Xeon, 2 threads, each pair alternated in one session): a
4 KB-page KV cache made decode attention ~6% slower; with the weights moved, one request's
TPOT in-process 12.3 -> 10.7 ms as an AVX2 CPU and 12.3 -> 11.8 natively, the 32-request
workload's decode steps ~9% faster as an AVX-512 CPU without BF16; the panels of the default
model's four decode linears x 90 layers, streamed layer by layer at one row (AVX2 build),
17.3 -> 19.5 GB/s. `benchmarks/cpu_kernels.py --gemv --huge-pages` streams copies of one
shape at a time, where the gain is smaller (0-9%).

The rest of a worker's memory (oneDNN's packed weights for prefill, activations) comes from
glibc's malloc, which since glibc 2.35 advises its own mappings when the tunable
`glibc.malloc.hugetlb=1` is set: worker processes start with it (`worker_env`; an older glibc
ignores it, and a user's own GLIBC_TUNABLES setting of it wins). Measured with it over the
above (same machine, AVX-512 without BF16, the 32-request workload in one process, two pairs):
prefill 8.56 -> 8.08 s, decode steps 7.41/7.22 -> 6.94/7.18 s. An in-process engine (the
user's own process) gets only the moved weights and the KV cache.

Imports no torch at module level: EngineCore, which starts the workers, never loads it.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import torch
    from torch import nn

logger = logging.getLogger(__name__)

PAGE = 2 << 20
CHUNK = 64 << 20            # bytes an arena asks for at a time (more for a larger tensor)
ALIGN = 64                  # each tensor on a cache line of its own


TUNABLE = "glibc.malloc.hugetlb=1"


def worker_env(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` for a worker process: GLIBC_TUNABLES with glibc's malloc asked to advise 2 MB
    pages for its mappings, unless the user set that tunable already."""
    env = dict(environ)
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    if not any(t.startswith("glibc.malloc.hugetlb=") for t in tunables):
        env["GLIBC_TUNABLES"] = ":".join([*tunables, TUNABLE])
    return env


def advise(tensor: torch.Tensor) -> bool:
    """Ask Linux to back a (not yet touched) CPU tensor's whole 2 MB pages with huge pages;
    True if it agreed. Linux only; where transparent huge pages are off ("never"), a no-op."""
    madvise = getattr(_libc(), "madvise", None)
    huge = getattr(mmap, "MADV_HUGEPAGE", None)
    if madvise is None or huge is None:
        return False
    start = -(-tensor.data_ptr() // PAGE) * PAGE
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // PAGE * PAGE
    if end <= start:
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), huge) == 0


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


class Arena:
    """Tensors copied into 2 MB-page chunks, one after another (64-byte aligned). `place`
    returns the copy, or the tensor itself where the kernel refused the advice."""

    def __init__(self) -> None:
        self.chunks: list[torch.Tensor] = []
        self.end = 0                            # the last chunk's advised end (offset)
        self.free = 0                           # bytes left before it
        self.refused = False

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch
        nbytes = tensor.numel() * tensor.element_size()
        if self.refused or tensor.device.type != "cpu" or nbytes == 0:
            return tensor
        if nbytes + ALIGN > self.free:
            chunk = torch.empty(max(CHUNK, nbytes + 2 * PAGE + ALIGN), dtype=torch.uint8)
            if not advise(chunk):
                self.refused = True
                return tensor
            # Only the chunk's whole 2 MB pages were advised: [first, last).
            first = -chunk.data_ptr() % PAGE
            last = (chunk.data_ptr() + chunk.numel()) // PAGE * PAGE - chunk.data_ptr()
            self.chunks.append(chunk)
            self.end, self.free = last, last - first
        chunk = self.chunks[-1]
        start = self.end - self.free
        start += -(chunk.data_ptr() + start) % ALIGN
        self.free = self.end - start - nbytes
        copy = chunk[start:start + nbytes].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        return copy

    @property
    def nbytes(self) -> int:
        return sum(chunk.numel() for chunk in self.chunks)


def move_decode_weights(model: nn.Module) -> int:
    """Every prepared weight the gemv kernel streams (layers/linear.py: GemvWeight.plain and
    .one_row, Int8Weight.rows; and the int8 GEMM's own panels, which decode steps of more
    rows stream, cpu_ops.I8Gemm) into huge-page memory; a module weight that shares the copy's
    storage (a tied LM head's, the embedding's) is pointed at the copy too. Returns the bytes moved
    (0 where Linux refused huge pages)."""
    import torch

    from kvflow.workers.layers.linear import GemvWeight, Int8Weight

    # The 12-bit copies (read by steps of up to GemvWeight.one_row_rows rows) in an arena of
    # their own, so that the panels every larger step streams lie together.
    arenas, moved = {"plain": Arena(), "rows": Arena(), "one_row": Arena(), "gemm": Arena()}, 0
    for module in model.modules():
        prepared: Any = getattr(module, "prepared", None)
        if isinstance(prepared, Int8Weight) and prepared.own_gemm:
            old = prepared.packed.packed
            new = arenas["gemm"].place(old)
            if new is not old:
                prepared = prepared._replace(packed=prepared.packed._replace(packed=new))
                module.prepared = prepared
                moved += old.numel() * old.element_size()
        if isinstance(prepared, GemvWeight):
            fields = ["plain"] + (["one_row"] if prepared.one_row is not None else [])
        elif isinstance(prepared, Int8Weight) and prepared.rows is not None:
            fields = ["rows"]
        else:
            continue
        for field in fields:
            old = getattr(prepared, field)
            new = arenas[field].place(old)
            if new is old:
                continue
            weight = getattr(module, "weight", None)
            if (isinstance(weight, torch.Tensor) and weight.numel()
                    and weight.untyped_storage().data_ptr() == old.untyped_storage().data_ptr()
                    and weight.shape == old.shape and weight.dtype == old.dtype):
                weight.data = new               # tied: the embedding reads the copy too
            prepared = prepared._replace(**{field: new})
            module.prepared = prepared
            moved += old.numel() * old.element_size()
    if moved:
        # The originals' memory, freed, mostly stays in malloc's heap (allocations under its
        # mmap threshold): hand it back, or the copies would add their size to the RSS.
        trim = getattr(_libc(), "malloc_trim", None)
        if trim is not None:
            trim(0)
        logger.info("%.0f MB of decode weights in 2 MB pages (%d MB asked for)",
                    moved / 1e6, sum(a.nbytes for a in arenas.values()) >> 20)
    return moved
