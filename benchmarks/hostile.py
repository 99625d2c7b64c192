"""Hostile traffic (issue 18): nothing one client sends can hurt anyone else.

Starts ONE `launch.py serve` (127.0.0.1 only, a free port, --api-key, no --client-address: HTTP
only) and runs two phases against it, back to back, in the same run:

  quiet    --concurrency good clients, each looping streamed POST /v1/completions (serve.py's
           client: seeded random token-id prompts of 32..256 tokens, 32..128 output tokens,
           ignore_eos, temperature 0) until --duration seconds have passed; a request started
           before the end runs to completion. Each request's TTFT and output tokens are kept.
  hostile  the same good clients (new prompts of the same distribution, so the prefix cache
           helps neither phase), while ONE extra task sends bad requests one after the other, as
           fast as they are answered (10 s timeout each), until the last good request of the
           phase has ended (not only --duration: the good clients are measured under attack
           throughout):
           top_k=2**63, seed=2**70, stop_token_ids=[2**70], a logit_bias of 49152 entries, a
           logit_bias key 2**70, max_tokens=2**70, n=10**8, n=20000, 5000 stop strings, 10000
           chat messages, a 5 MiB body (413), a 3-million-character prompt (3.5 MB, under the
           body limit), invalid UTF-8, JSON nested 100000 deep, no API key, a wrong model name,
           /tokenize of a 1-million-character text; and a second task holds up to 50 idle TCP
           connections open (reopening every 2 s those the server closed; all closed at the
           end). Every bad body is encoded before the phases start, so the client spends little
           CPU on it then (it still sends MBs per second: on a 2-core machine the client shares
           the server's cores).

Printed: the CPU and its ISA flags; per phase the good clients' output tok/s (their output
tokens / the phase's wall time), requests completed, errors, TTFT p50 and p99; the ratios
hostile/quiet of tok/s and TTFT p99; the hostile requests' status codes per kind; the 5xx seen
by anyone; whether the engine restarted (the server's child pids, EngineCore and the worker, at
the start of quiet vs the end of hostile, via psutil); the server process's RSS (and its whole
tree's) at the start of quiet, the end of quiet and the end of hostile; and each figure's
target: tok/s ratio >= 0.9, TTFT p99 ratio <= 2, zero 5xx, zero good-client errors, no restart,
RSS flat (end of hostile <= start of quiet + 10%). Exit status 1 when a target is missed or the
server failed. The server's log is kept (its path is printed) when it logged errors.

    .venv/bin/python benchmarks/hostile.py --duration 60
    .venv/bin/python benchmarks/hostile.py --duration 8 --concurrency 4 --kv-cache-memory-gb 0.2
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import httpx
import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from serve import VOCAB_RANGE, Request, Result, _healthy, cpu_info, pct, send, stop  # noqa: E402

PROMPT_LEN, OUTPUT_LEN = (32, 256), (32, 128)
HOSTILE_TIMEOUT = 10.0
IDLE_CONNECTIONS = 50
ISA_FLAGS = ("avx512f", "avx512_bf16", "avx512_vnni", "avx2")


# --- the server ----------------------------------------------------------------------------

@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    key: str
    log: str
    seen: list[psutil.Process] = field(default_factory=list)     # every child ever listed

    def tree(self) -> tuple[psutil.Process, list[psutil.Process]]:
        p = psutil.Process(self.proc.pid)
        kids = p.children(recursive=True)
        self.seen += kids
        return p, kids

    def child_pids(self) -> set[int]:
        return {c.pid for c in self.tree()[1]}

    def rss_mb(self) -> tuple[float, float]:
        """The frontend's RSS and its whole tree's (frontend, EngineCore, workers), MB."""
        p, kids = self.tree()
        own = p.memory_info().rss
        total = own
        for c in kids:
            with contextlib.suppress(psutil.Error):
                total += c.memory_info().rss
        return own / 2**20, total / 2**20


@contextlib.contextmanager
def server(args: argparse.Namespace) -> Iterator[Server]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    key = secrets.token_hex(16)
    cmd = [sys.executable, "launch.py", "serve", "--model", args.model, "--host", "127.0.0.1",
           "--port", str(port), "--api-key", key, "--dtype", args.dtype,
           "--max-model-len", str(args.max_model_len)]
    if args.kv_cache_memory_gb is not None:
        cmd += ["--kv-cache-memory-gb", str(args.kv_cache_memory_gb)]
    cmd += getattr(args, "extra_server_args", [])      # chaos.py's
    log = tempfile.NamedTemporaryFile(prefix="hostile-serve-", suffix=".log", delete=False)
    shown = " ".join(cmd[1:]).replace(key, "KEY")
    print(f"server: {shown}\nserver log: {log.name}", flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    srv = Server(proc, f"http://127.0.0.1:{port}", key, log.name)
    keep_log = True
    try:
        deadline = time.monotonic() + args.start_timeout
        while not (_serving(log.name) and _healthy(srv.url)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start (exit code {proc.poll()})")
            time.sleep(0.5)
        yield srv
        keep_log = bool(log_problems(log.name))
    except BaseException:
        with open(log.name, errors="replace") as f:
            tail = f.read().splitlines()[-40:]
        print(f"--- last lines of {log.name} (kept):\n" + "\n".join(tail), file=sys.stderr)
        raise
    finally:
        stop(proc)                     # SIGTERM to the process group, SIGKILL after 20 s
        _kill_leftovers(proc.pid, srv.seen)
        log.close()
        if not keep_log:
            os.unlink(log.name)


def _serving(log: str) -> bool:
    with open(log, errors="replace") as f:
        return "serving on" in f.read()


def _kill_leftovers(sid: int, seen: list[psutil.Process]) -> None:
    """Whatever outlived stop(): a child seen earlier, or one of the server's session that left
    its process group (psutil checks each process's start time, so no reused pid is hit)."""
    for p in [*seen, *psutil.process_iter()]:
        with contextlib.suppress(psutil.Error, OSError):
            if p.is_running() and (p in seen or os.getsid(p.pid) == sid):
                print(f"killing leftover server process {p.pid}", file=sys.stderr)
                p.kill()


def log_problems(log: str) -> list[str]:
    with open(log, errors="replace") as f:
        return [ln for ln in f.read().splitlines()
                if "Traceback" in ln or " ERROR " in ln or "CRITICAL" in ln or "restart" in ln]


# --- the good clients ----------------------------------------------------------------------

async def good_clients(client: httpx.AsyncClient, url: str, model: str, args: argparse.Namespace,
                       phase: str) -> tuple[list[Result], float]:
    """--concurrency loops of streamed completions until --duration has passed; the results and
    the wall time until the last one finished."""
    start = time.perf_counter()
    end = start + args.duration
    results: list[Result] = []

    async def loop(i: int) -> None:
        rng = random.Random(f"{args.seed}-{phase}-{i}")
        while time.perf_counter() < end:
            req = Request([rng.randrange(*VOCAB_RANGE) for _ in range(rng.randint(*PROMPT_LEN))],
                          rng.randint(*OUTPUT_LEN))
            results.append(await send(client, url, model, req))

    await asyncio.gather(*(loop(i) for i in range(args.concurrency)))
    return results, time.perf_counter() - start


def phase_row(results: list[Result], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    return dict(requests=len(ok), errors=len(results) - len(ok), wall=wall,
                tok_s=sum(r.n_out for r in ok) / wall, ttft_p50=1e3 * pct(ttft, 50),
                ttft_p99=1e3 * pct(ttft, 99), errors_seen=[r.error for r in results if not r.ok],
                five_xx=sum(r.error.startswith("HTTP 5") for r in results))


# --- the hostile client --------------------------------------------------------------------

@dataclass
class Bad:
    kind: str
    path: str
    body: bytes
    auth: bool = True
    expect: str = "4xx"


@dataclass
class HostileStats:
    statuses: dict[str, collections.Counter[str]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter))
    sent: int = 0
    idle_opened: int = 0
    idle_closed_by_server: int = 0
    idle_refused: int = 0
    seconds: float = 0.0
    message: dict[str, str] = field(default_factory=dict)    # the first answer per kind


def bad_requests(model: str) -> list[Bad]:
    def j(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False).encode()

    def comp(**kw: Any) -> bytes:
        return j({"model": model, "prompt": "Hello, my name is", "max_tokens": 16, **kw})

    big = 2**70
    # 3,000,000 characters, every sixth a two-byte one: 3.5 MB of UTF-8, under the 4 MiB limit.
    long_prompt = ("abcde\u00e9" * 500_000)
    words = " ".join(f"word{i % 9973}" for i in range(120_000))[:1_000_000]
    return [
        Bad("top_k=2**63", "/v1/completions", comp(top_k=2**63)),
        Bad("seed=2**70", "/v1/completions", comp(seed=big)),
        Bad("stop_token_ids=[2**70]", "/v1/completions", comp(stop_token_ids=[big])),
        Bad("logit_bias 49152 entries", "/v1/completions",
            comp(logit_bias={str(i): 1.0 for i in range(49152)})),
        Bad("logit_bias key 2**70", "/v1/completions", comp(logit_bias={str(big): 1.0})),
        Bad("max_tokens=2**70", "/v1/completions", comp(max_tokens=big)),
        Bad("n=10**8", "/v1/completions", comp(n=10**8)),
        Bad("n=20000", "/v1/completions", comp(n=20000)),
        Bad("5000 stop strings", "/v1/completions", comp(stop=[f"s{i}" for i in range(5000)])),
        Bad("10000 messages", "/v1/chat/completions",
            j({"model": model, "max_tokens": 16,
               "messages": [{"role": "user", "content": f"hi {i}"} for i in range(10000)]})),
        Bad("5 MiB body", "/v1/completions",
            comp(stop=None, user="x" * (5 * 2**20)), expect="413"),
        Bad("3M-char prompt (3.5 MB)", "/v1/completions", comp(prompt=long_prompt)),
        Bad("invalid UTF-8", "/v1/completions",
            b'{"model": "' + model.encode() + b'", "prompt": "\xff\xfe\xc3\x28\xa0", '
            b'"max_tokens": 16}'),
        Bad("JSON nested 100000 deep", "/v1/completions", b"[" * 100000 + b"]" * 100000),
        Bad("no API key", "/v1/completions", comp(), auth=False, expect="401"),
        Bad("wrong model", "/v1/completions", comp(model="no-such-model"), expect="404"),
        Bad("/tokenize 1M chars", "/tokenize", j({"model": model, "prompt": words})),
    ]


async def hostile_loop(url: str, key: str, bads: list[Bad], done: asyncio.Event,
                       stats: HostileStats, rate: float = 0.0) -> None:
    """The bad requests in turn, each as soon as the previous one is answered (or, with
    `rate`, at most `rate` a second), until `done`."""
    start = time.perf_counter()
    limits = httpx.Limits(max_connections=4, max_keepalive_connections=0)
    headers = {"Content-Type": "application/json"}
    async with httpx.AsyncClient(timeout=HOSTILE_TIMEOUT, limits=limits) as client:
        i = 0
        while not done.is_set():
            bad = bads[i % len(bads)]
            i += 1
            h = dict(headers, Authorization=f"Bearer {key}") if bad.auth else headers
            try:
                resp = await client.post(f"{url}{bad.path}", content=bad.body, headers=h)
                status = str(resp.status_code)
                with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                    stats.message.setdefault(bad.kind, resp.json()["error"]["message"])
            except httpx.TimeoutException:
                status = "timeout"
            except httpx.HTTPError as e:
                status = type(e).__name__
            stats.statuses[bad.kind][status] += 1
            stats.sent += 1
            if not status[0].isdigit():
                await asyncio.sleep(0.05)     # a dropped connection: no tight reconnect loop
            if rate > 0:
                await asyncio.sleep(max(0.0, start + stats.sent / rate - time.perf_counter()))
    stats.seconds = time.perf_counter() - start


async def idle_connections(url: str, done: asyncio.Event, stats: HostileStats) -> None:
    """Up to IDLE_CONNECTIONS TCP connections that never send a byte; every 2 s those the
    server closed are reopened. All are closed when the phase ends."""
    host, port = url.rsplit("/", 1)[1].split(":")
    open_: dict[int, asyncio.StreamWriter] = {}
    watchers: list[asyncio.Task[None]] = []
    n = 0

    async def watch(i: int, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(OSError):
            await reader.read(1)              # b"" when the server closes it
        if open_.pop(i, None) is not None:
            stats.idle_closed_by_server += 1

    try:
        while not done.is_set():
            while len(open_) < IDLE_CONNECTIONS:
                try:
                    reader, writer = await asyncio.open_connection(host, int(port))
                except OSError:
                    stats.idle_refused += 1
                    break
                n += 1
                open_[n] = writer
                stats.idle_opened += 1
                watchers.append(asyncio.create_task(watch(n, reader)))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), 2.0)
    finally:
        for w in list(open_.values()):
            w.close()
        open_.clear()
        for t in watchers:
            t.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)


# --- the run -------------------------------------------------------------------------------

def cpu_seconds(srv: Server) -> tuple[float, float]:
    """CPU seconds so far of the server's frontend process and of this client process."""
    def used(p: psutil.Process) -> float:
        t = p.cpu_times()
        return t.user + t.system
    frontend, _ = srv.tree()
    return used(frontend), used(psutil.Process())


async def run(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0), limits=limits,
                                 headers={"Authorization": f"Bearer {srv.key}"}) as client:
        resp = await client.get(f"{srv.url}/v1/models")
        resp.raise_for_status()
        model = resp.json()["data"][0]["id"]
        warm = await send(client, srv.url, model, Request(list(range(1000, 1016)), 8))
        if not warm.ok:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        bads = bad_requests(model)
        out: dict[str, Any] = {"pids_before": srv.child_pids(), "rss": [srv.rss_mb()],
                               "cpu": [cpu_seconds(srv)]}

        print(f"quiet phase: {args.duration:g} s, {args.concurrency} clients", flush=True)
        out["quiet"] = phase_row(*await good_clients(client, srv.url, model, args, "quiet"))
        out["rss"].append(srv.rss_mb())
        out["cpu"].append(cpu_seconds(srv))

        print(f"hostile phase: {args.duration:g} s, {args.concurrency} clients + bad requests "
              f"+ {IDLE_CONNECTIONS} idle connections", flush=True)
        stats, done = HostileStats(), asyncio.Event()
        bad_task = asyncio.create_task(hostile_loop(srv.url, srv.key, bads, done, stats,
                                                    args.hostile_rate))
        idle_task = asyncio.create_task(idle_connections(srv.url, done, stats))
        try:
            out["hostile"] = phase_row(*await good_clients(client, srv.url, model, args,
                                                           "hostile"))
        finally:
            done.set()                 # the phase ends when the last good request has ended
            await asyncio.gather(bad_task, idle_task, return_exceptions=True)
        out["stats"] = stats
        out["rss"].append(srv.rss_mb())
        out["cpu"].append(cpu_seconds(srv))
        out["pids_after"] = srv.child_pids()
        out["healthy_after"] = (await client.get(f"{srv.url}/health")).status_code
        out["expect"] = {b.kind: b.expect for b in bads}
        return out


def isa_line() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
        return "ISA: " + ", ".join(f"{x} {'yes' if x in flags else 'no'}" for x in ISA_FLAGS)
    return "ISA: ?"


def report(out: dict[str, Any], log: str) -> bool:
    q, h, stats = out["quiet"], out["hostile"], out["stats"]
    checks: list[bool] = []

    def target(ok: bool) -> str:
        checks.append(ok)
        return "PASS" if ok else "FAIL"

    head = (f"{'phase':<9}{'requests':>9}{'errors':>7}{'5xx':>5}{'out tok/s':>11}"
            f"{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'wall s':>8}")
    print("\n" + head + "\n" + "-" * len(head))
    for name, r in (("quiet", q), ("hostile", h)):
        print(f"{name:<9}{r['requests']:>9}{r['errors']:>7}{r['five_xx']:>5}{r['tok_s']:>11.1f}"
              f"{r['ttft_p50']:>13.1f}{r['ttft_p99']:>13.1f}{r['wall']:>8.1f}")
    tok_ratio = h["tok_s"] / q["tok_s"] if q["tok_s"] else float("nan")
    ttft_ratio = h["ttft_p99"] / q["ttft_p99"] if q["ttft_p99"] else float("nan")
    print(f"\nhostile/quiet output tok/s: {tok_ratio:.3f}   target >= 0.90  "
          f"{target(tok_ratio >= 0.9)}")
    print(f"hostile/quiet TTFT p99:     {ttft_ratio:.3f}   target <= 2.00  "
          f"{target(ttft_ratio <= 2.0)}")

    print(f"\nhostile requests: {stats.sent} sent "
          f"in {stats.seconds:.1f} s ({stats.sent / max(stats.seconds, 1e-9):.1f}/s), "
          f"{HOSTILE_TIMEOUT:g} s timeout each")
    bad_5xx = 0
    for kind, counts in stats.statuses.items():
        bad_5xx += sum(n for s, n in counts.items() if s.startswith("5"))
        shown = "  ".join(f"{s}: {n}" for s, n in sorted(counts.items()))
        print(f"  {kind:<28} expect {out['expect'][kind]:<4} got  {shown:<14} "
              f"{stats.message.get(kind, '')[:70]!r}")
    print(f"  idle TCP connections: {stats.idle_opened} opened (at most {IDLE_CONNECTIONS} at "
          f"once), {stats.idle_closed_by_server} closed by the server, {stats.idle_refused} "
          f"failed to connect")

    five_xx = q["five_xx"] + h["five_xx"] + bad_5xx
    good_errors = q["errors"] + h["errors"]
    print(f"\n5xx seen by anyone: {five_xx}   target 0  {target(five_xx == 0)}")
    print(f"good-client errors: {good_errors}   target 0  {target(good_errors == 0)}")
    for e in (q["errors_seen"] + h["errors_seen"])[:5]:
        print(f"  {e}")
    before, after = out["pids_before"], out["pids_after"]
    restarted = before != after
    print(f"engine restarted: {'yes' if restarted else 'no'} (child pids before "
          f"{sorted(before)}, after {sorted(after)}; /health after: {out['healthy_after']})   "
          f"target no  {target(not restarted and out['healthy_after'] == 200)}")
    (c0, b0), (c1, b1), (c2, b2) = out["cpu"]
    sent = max(1, out["stats"].sent)
    print(f"CPU seconds, quiet / hostile phase: server frontend {c1 - c0:.1f} / {c2 - c1:.1f} "
          f"({1000 * ((c2 - c1) - (c1 - c0)) / sent:.2f} ms more per hostile request); this "
          f"client (good + hostile) {b1 - b0:.1f} / {b2 - b1:.1f} (all on the same "
          f"{os.cpu_count()} CPUs as the engine)")
    (f0, t0), (f1, t1), (f2, t2) = out["rss"]
    print(f"server RSS MB (frontend): start of quiet {f0:.0f}, end of quiet {f1:.0f}, end of "
          f"hostile {f2:.0f} ({100 * (f2 / f0 - 1):+.1f}%)   target flat (<= +10%)  "
          f"{target(f2 <= 1.1 * f0)}")
    print(f"server RSS MB (whole tree): start of quiet {t0:.0f}, end of quiet {t1:.0f}, end of "
          f"hostile {t2:.0f} ({100 * (t2 / t0 - 1):+.1f}%)")
    problems = log_problems(log)
    if problems:
        print(f"\nthe server logged {len(problems)} error lines ({log}, kept); the first:")
        for ln in problems[:10]:
            print(f"  {ln[:300]}")
    print(f"\n{'ALL TARGETS MET' if all(checks) else 'TARGETS MISSED'}")
    return all(checks)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=60.0,
                   help="seconds of each phase, quiet and hostile (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=16,
                   help="good streaming clients, in both phases (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the server's --dtype (default: %(default)s)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None,
                   help="the server's --kv-cache-memory-gb (default: the server's own)")
    p.add_argument("--max-model-len", type=int, default=1024,
                   help="the server's --max-model-len (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the good clients' workload")
    p.add_argument("--hostile-rate", type=float, default=0.0,
                   help="bad requests per second (0: each as soon as the previous one is "
                        "answered)")
    p.add_argument("--model", default="default", help="the server's --model (default: "
                   "%(default)s)")
    p.add_argument("--start-timeout", type=float, default=300.0,
                   help="seconds to wait for the server (default: %(default)s)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))      # run the finally blocks
    print(cpu_info())
    print(isa_line(), flush=True)
    try:
        with server(args) as srv:
            out = asyncio.run(run(srv, args))
            ok = report(out, srv.log)
    except Exception as e:  # noqa: BLE001 - reported; the server is stopped by then
        print(f"FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
