"""A worker's threads and CPUs (kvflow/workers/cpu_threads.py): on fake sysfs/procfs trees
for the topologies and cgroup limits this machine lacks, and on the real cluster."""
from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from cluster_helpers import arg_value, is_module
from kvflow import LLM, SamplingParams
from kvflow.workers import cpu_threads
from kvflow.workers.cpu_threads import plan


def fake_machine(root: Path, cores: list[list[int]], mountinfo: list[str],
                 cgroup: list[str], files: dict[str, str]) -> Path:
    """`cores`: each physical core's CPUs (SMT siblings); `files`: cgroup files by path."""
    for core_id, cpus in enumerate(cores):
        for cpu in cpus:
            topo = root / f"sys/devices/system/cpu/cpu{cpu}/topology"
            topo.mkdir(parents=True)
            (topo / "physical_package_id").write_text("0\n")
            (topo / "core_id").write_text(f"{core_id}\n")
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/mountinfo").write_text("".join(line + "\n" for line in mountinfo))
    (root / "proc/self/cgroup").write_text("".join(line + "\n" for line in cgroup))
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


SMT_8 = [[0, 4], [1, 5], [2, 6], [3, 7]]        # 4 cores, 2 threads each
V2_MOUNT = "30 25 0:26 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw"


def test_one_thread_per_physical_core_split_between_ranks(tmp_path: Path) -> None:
    root = fake_machine(tmp_path, SMT_8, [V2_MOUNT], ["0::/"],
                        {"sys/fs/cgroup/cpu.max": "max 100000\n"})
    everything = set(range(8))
    alone = plan(root=str(root), affinity=everything)
    assert (alone.threads, alone.cpus) == (4, (0, 1, 2, 3))
    assert [plan(2, r, root=str(root), affinity=everything).cpus for r in (0, 1)] == [
        (0, 1), (2, 3)]
    # taskset / --cpuset-cpus: CPU 6 is core 2's sibling of CPU 2.
    assert plan(root=str(root), affinity={2, 3, 6}).cpus == (2, 3)


def test_the_tightest_cgroup_v2_limit_on_the_way_up(tmp_path: Path) -> None:
    """A Kubernetes pod's limit sits on the pod's cgroup, above the container's own."""
    root = fake_machine(tmp_path, SMT_8, [V2_MOUNT], ["0::/kubepods/pod1/ctr"], {
        "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "max 100000\n",
        "sys/fs/cgroup/kubepods/pod1/cpu.max": "250000 100000\n",
        "sys/fs/cgroup/kubepods/cpu.max": "max 100000\n"})
    assert cpu_threads.cgroup_cpu_limit(root) == 2.5
    limited = plan(root=str(root), affinity=set(range(8)))
    assert (limited.threads, limited.cpus) == (2, (0, 1))      # 2.5 CPUs: 2 threads
    assert "cgroup limit 2.5" in limited.reason
    assert [plan(2, r, root=str(root), affinity=set(range(8))).cpus for r in (0, 1)] == [
        (0,), (1,)]


def test_cgroup_v1_quota_in_a_containers_view(tmp_path: Path) -> None:
    """Docker on cgroup v1: the cpu controller is mounted at the container's own cgroup
    (the mount's root is /docker/<id>, which /proc/self/cgroup names too); --cpus=1.5."""
    mount = ("40 35 0:30 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro,nosuid - cgroup cgroup "
             "rw,cpu,cpuacct")
    root = fake_machine(tmp_path, [[0], [1], [2], [3]], [mount],
                        ["5:cpu,cpuacct:/docker/abc", "0::/"], {
                            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "150000\n",
                            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cpu_threads.cgroup_cpu_limit(root) == 1.5
    assert plan(root=str(root), affinity={0, 1, 2, 3}).cpus == (0,)


def test_no_limit_and_no_topology(tmp_path: Path) -> None:
    """No cgroup files, no topology in sysfs: every allowed CPU is a core; -1 is no quota."""
    mount = "40 35 0:30 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu"
    root = fake_machine(tmp_path, [], [mount], ["3:cpu:/"], {
        "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
        "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"})
    assert cpu_threads.cgroup_cpu_limit(root) is None
    assert plan(root=str(root), affinity={1, 3, 5}).cpus == (1, 3, 5)
    # More ranks than cores: each rank still gets one.
    assert [plan(4, r, root=str(root), affinity={1, 3}).cpus for r in range(4)] == [
        (1,), (3,), (1,), (3,)]


def test_this_machine() -> None:
    share = plan()
    assert 1 <= share.threads == len(share.cpus)
    assert set(share.cpus) <= os.sched_getaffinity(0)


def test_workers_bind_to_their_share(tiny_models: dict[str, str]) -> None:
    """TP=2 in worker processes, num_threads unset: each rank runs on its own share of the
    CPUs (both on the one CPU of a one-CPU machine), and the engine works."""
    with LLM(tiny_models["llama"], tensor_parallel_size=2, dtype="float32",
             kv_cache_memory_gb=0.05) as llm:
        workers = [p for p in psutil.Process().children(recursive=True)
                   if is_module(p, "kvflow.workers.worker_proc")]
        assert len(workers) == 2
        for p in workers:
            rank = int(arg_value(p, "--rank"))
            assert tuple(p.cpu_affinity()) == plan(2, rank).cpus
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].token_ids) == 4


def test_num_threads_must_be_positive(default_model: str) -> None:
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="num_threads"):
            LLM(default_model, num_threads=bad)                 # type: ignore[arg-type]
