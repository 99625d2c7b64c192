"""How many threads a worker computes with, and on which CPUs (`plan`, then `bind`).

A worker's torch/OpenMP threads are compute-bound and meet at a barrier after every parallel
loop, so a thread more than the CPU time the worker really gets costs far more than a thread
less: the step waits for whichever thread was preempted or throttled. Under a one-CPU cgroup
limit, two threads made a one-request decode step 2-4x slower than one thread (this machine,
docs/design.md "CPU threads"). `os.cpu_count()`, the old default, counts every CPU of the
host, however few a container may use. So, as llama.cpp and vLLM's CPU backend do, a worker
takes by default:

- the CPUs this process may run on (its affinity: taskset, `docker --cpuset-cpus`, a
  Kubernetes static CPU policy);
- no more than the CPU time its cgroup grants (`docker --cpus`, a Kubernetes CPU limit:
  cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`, the tightest of its
  cgroup and their parents), rounded down, at least one;
- one thread per physical core (SMT siblings share one core's vector units);
- the node's tensor-parallel ranks split those cores, each rank its own consecutive share.

A worker in its own process binds itself to its share (one CPU of each of its cores); an
in-process engine only takes the count, the process being the user's. An explicit
`num_threads` is used as given, unbound.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple


@dataclass(frozen=True)
class CpuPlan:
    threads: int
    cpus: tuple[int, ...]        # one CPU of each core in this rank's share
    reason: str


def plan(ranks_per_node: int = 1, local_rank: int = 0, *, root: str = "/",
         affinity: set[int] | None = None) -> CpuPlan:
    """This rank's share. `root`, `affinity`: another filesystem root and CPU set (tests)."""
    allowed = sorted(os.sched_getaffinity(0) if affinity is None else affinity)
    cores = _physical_cores(allowed, Path(root))
    notes = [f"{len(cores)} physical cores of {len(allowed)} CPUs available"
             if len(cores) != len(allowed) else f"{len(allowed)} CPUs available"]
    quota = cgroup_cpu_limit(Path(root))
    if quota is not None and quota < len(cores):
        cores = cores[:max(1, math.floor(quota))]
        notes.append(f"cgroup limit {quota:g} CPUs")
    if ranks_per_node > 1:
        share = max(1, len(cores) // ranks_per_node)
        first = local_rank * share % len(cores)
        cores = cores[first:first + share]
        notes.append(f"rank {local_rank}'s share of {ranks_per_node}")
    cpus = tuple(core[0] for core in cores)
    return CpuPlan(len(cpus), cpus, f"{len(cpus)} thread{'s' * (len(cpus) > 1)} on CPU"
                                     f"{'s' * (len(cpus) > 1)} {_ranges(cpus)} "
                                     f"({'; '.join(notes)})")


def bind(cpus: tuple[int, ...]) -> None:
    """Every thread of this process onto `cpus` (threads made later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):   # a thread that ended meanwhile
            pass


def _physical_cores(cpus: list[int], root: Path) -> list[list[int]]:
    """The CPUs grouped by physical core (package, die, core), cores in order of their first
    CPU; a CPU whose topology sysfs does not tell is a core of its own."""
    cores: dict[tuple[str, ...], list[int]] = {}
    for cpu in cpus:
        topo = root / f"sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            key = tuple((topo / name).read_text().strip()
                        for name in ("physical_package_id", "die_id", "core_id")
                        if (topo / name).exists())
        except OSError:
            key = ()
        cores.setdefault(key if key else ("cpu", str(cpu)), []).append(cpu)
    return list(cores.values())


def cgroup_cpu_limit(root: Path = Path("/")) -> float | None:
    """The CPUs' worth of time this process's cgroups grant (the tightest of its cgroup and
    their parents, v2 and v1), or None where none limits it."""
    limits = []
    for mount in _cgroup_mounts(root):
        for directory in _own_cgroup_dirs(root, mount):
            limit = _limit_in(directory, mount.version)
            if limit is not None:
                limits.append(limit)
    return min(limits) if limits else None


class CgroupMount(NamedTuple):
    point: Path          # where it is mounted
    version: int         # 2, or 1 for cgroup v1's cpu controller
    root: str            # the cgroup mounted there: "/", or a container's own cgroup


def _cgroup_mounts(root: Path) -> list[CgroupMount]:
    """The cgroup2 mounts and cgroup v1's cpu controller's, from /proc/self/mountinfo."""
    mounts: list[CgroupMount] = []
    try:
        lines = (root / "proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return mounts
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        point = root / fields[4].lstrip("/")
        if rest[0] == "cgroup2":
            mounts.append(CgroupMount(point, 2, fields[3]))
        elif rest[0] == "cgroup" and "cpu" in rest[2].split(","):
            mounts.append(CgroupMount(point, 1, fields[3]))
    return mounts


def _own_cgroup_dirs(root: Path, mount: CgroupMount) -> list[Path]:
    """This process's cgroup directory under `mount` (/proc/self/cgroup's path, less the
    part the mount's root already is) and its parents up to the mount point."""
    path = None
    try:
        for line in (root / "proc/self/cgroup").read_text().splitlines():
            _, controllers, cgroup = line.split(":", 2)
            if (mount.version == 2 and controllers == "") or (
                    mount.version == 1 and "cpu" in controllers.split(",")):
                path = cgroup
    except (OSError, ValueError):
        return [mount.point]
    if path is None:
        return [mount.point]
    base = mount.root.rstrip("/")
    if base and (path + "/").startswith(base + "/"):
        path = path[len(base):]
    directory = mount.point / path.lstrip("/")
    dirs = [directory]
    while directory != mount.point and mount.point in directory.parents:
        directory = directory.parent
        dirs.append(directory)
    return dirs


def _limit_in(directory: Path, version: int) -> float | None:
    try:
        if version == 2:
            text_quota, text_period = (directory / "cpu.max").read_text().split()[:2]
            return None if text_quota == "max" else int(text_quota) / int(text_period)
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def _ranges(cpus: tuple[int, ...]) -> str:
    """(0, 1, 2, 3, 8) -> "0-3,8"."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
