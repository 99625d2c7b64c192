"""2 MB pages for what decode steps stream (workers/huge_pages.py): the arena's copies are
exact, aligned and inside memory Linux was asked to back with huge pages (the `hg` flag of
the mapping in /proc/self/smaps); the engine's decode weights are moved there, a tied LM
head together with its embedding (one copy, not two); where Linux refuses, nothing moves.
Worker processes start with glibc's malloc tunable for huge pages (a user's setting kept),
and on this machine's glibc that tunable does advise malloc's large mappings."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.workers import huge_pages
from kvflow.workers.layers.linear import GemvWeight
from tests.cluster_helpers import is_module

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 5, 8,"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE_PAGES = THP.exists() and "[never]" not in THP.read_text()


def advised_ranges() -> list[tuple[int, int]]:
    """This process's mappings with the MADV_HUGEPAGE flag (`hg` in VmFlags)."""
    ranges, current = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            current = (start, end)
        elif head == "VmFlags:" and current is not None and "hg" in line.split()[1:]:
            ranges.append(current)
    return ranges


def in_advised(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return any(lo <= start and end <= hi for lo, hi in ranges)


@pytest.mark.skipif(not HUGE_PAGES, reason="transparent huge pages are off on this machine")
def test_arena_copies_are_exact_aligned_and_advised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "CHUNK", 4 << 20)      # several chunks, one oversized
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=gen), torch.randn(960, 576, generator=gen),
               torch.randn(1000, 1000, generator=gen).to(torch.bfloat16),
               torch.randint(-127, 128, (7, 33), generator=gen).to(torch.int8),
               torch.randn(1536, 1024, generator=gen)]                # 6 MB > CHUNK
    arena = huge_pages.Arena()
    copies = [arena.place(t) for t in tensors]
    ranges = advised_ranges()
    spans = []
    for t, c in zip(tensors, copies):
        assert c is not t and c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, t)
        assert c.data_ptr() % huge_pages.ALIGN == 0
        assert in_advised(c, ranges)
        spans.append((c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))          # no overlap
    assert len(arena.chunks) >= 3


def test_nothing_moves_where_linux_refuses(monkeypatch: pytest.MonkeyPatch,
                                           default_model: str) -> None:
    monkeypatch.setattr(huge_pages, "advise", lambda tensor: False)
    t = torch.randn(64, 64)
    assert huge_pages.Arena().place(t) is t
    with LLM(default_model, in_process=True, kv_cache_memory_gb=0.1) as llm:
        model = llm.engine.worker.model                              # type: ignore
        assert huge_pages.move_decode_weights(model) == 0


def gemv_weights(model: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.Tensor]]:
    return [(m, m.prepared.plain) for m in model.modules()
            if isinstance(getattr(m, "prepared", None), GemvWeight)]


@pytest.mark.skipif(not HUGE_PAGES, reason="transparent huge pages are off on this machine")
def test_engine_decode_weights_in_huge_pages_tied_head_once(default_model: str) -> None:
    """float32: the gemv kernel reads the loaded weights themselves, so the tied LM head's
    is the embedding's; both must read the one moved copy."""
    with LLM(default_model, in_process=True, kv_cache_memory_gb=0.1, dtype="float32") as llm:
        worker = llm.engine.worker                                   # type: ignore
        weights = gemv_weights(worker.model)
        ranges = advised_ranges()
        assert len(weights) == 4 * 30 + 1                            # 30 layers + LM head
        assert all(in_advised(w, ranges) for _, w in weights)
        head, embed = worker.model.lm_head, worker.model.model.embed_tokens
        assert head.weight is embed.weight
        assert embed.weight.data_ptr() == head.prepared.plain.data_ptr()
        moved = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    # The same model read from where torch loaded it: the same tokens and logprobs, bit for bit.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(huge_pages, "move_decode_weights", lambda model: 0)
        with LLM(default_model, in_process=True, kv_cache_memory_gb=0.1,
                 dtype="float32") as llm:
            kept = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in moved] == [o.token_ids for o in kept]
    assert [o.logprobs for o in moved] == [o.logprobs for o in kept]


def test_worker_env_adds_the_malloc_tunable_and_keeps_the_users() -> None:
    env = huge_pages.worker_env({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    mine = {"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}
    assert huge_pages.worker_env(mine)["GLIBC_TUNABLES"] == \
        "glibc.pthread.rseq=0:glibc.malloc.hugetlb=1"
    off = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert huge_pages.worker_env(off) == off


def test_worker_processes_start_with_the_tunable(tiny_models: dict[str, str]) -> None:
    with LLM(tiny_models["llama"], dtype="float32", kv_cache_memory_gb=0.05) as llm:
        workers = [p for p in psutil.Process().children(recursive=True)
                   if is_module(p, "kvflow.workers.worker_proc")]
        assert len(workers) == 1
        assert "glibc.malloc.hugetlb=1" in workers[0].environ()["GLIBC_TUNABLES"]
        out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2),
                           use_tqdm=False)
        assert len(out[0].token_ids) == 2
    assert "GLIBC_TUNABLES" not in os.environ or \
        "glibc.malloc.hugetlb=1" not in os.environ["GLIBC_TUNABLES"]       # ours untouched


GLIBC = tuple(int(x) for x in os.confstr("CS_GNU_LIBC_VERSION").split()[1].split(".")[:2])


@pytest.mark.skipif(not HUGE_PAGES or GLIBC < (2, 35),
                    reason="needs transparent huge pages and glibc >= 2.35")
def test_the_tunable_advises_mallocs_mappings() -> None:
    """A 64 MB torch tensor (malloc's own mmap) lies in an `hg` mapping with the tunable and
    not without it."""
    code = ("import torch, tests.test_huge_pages as t; x = torch.empty(64 << 20, "
            "dtype=torch.uint8); print(t.in_advised(x, t.advised_ranges()))")
    root = Path(__file__).resolve().parent.parent

    def run(env: dict[str, str]) -> str:
        done = subprocess.run([sys.executable, "-c", code], env=env, cwd=root,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()
    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    assert run(plain) == "False"
    assert run(huge_pages.worker_env(plain)) == "True"


@pytest.mark.skipif(not HUGE_PAGES, reason="transparent huge pages are off on this machine")
def test_moving_does_not_add_the_copies_to_the_resident_memory(default_model: str) -> None:
    """The originals' memory goes back to the system: moving 540 MB of float32 weights
    leaves the process's RSS within a fraction of that (without the trim: +540 MB)."""
    from unittest import mock
    move = huge_pages.move_decode_weights
    with mock.patch.object(huge_pages, "move_decode_weights", lambda model: 0), \
            LLM(default_model, in_process=True, kv_cache_memory_gb=0.05, dtype="float32",
                enforce_eager=True) as llm:
        before = psutil.Process().memory_info().rss
        moved = move(llm.engine.worker.model)                        # type: ignore
        grown = psutil.Process().memory_info().rss - before
    assert moved > 500e6
    assert grown < 0.2 * moved, (grown, moved)
