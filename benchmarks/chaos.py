"""Chaos soak (issue 19): streaming load while the engine is killed again and again.

Starts one `launch.py serve` (127.0.0.1, a free port; hostile.py's server helper) and runs two
phases back to back on it, each --duration seconds of --concurrency clients looping streamed
/v1/completions (seeded random token-id prompts of 32..256 tokens, 32..128 output tokens,
ignore_eos, temperature 0):

  quiet   nothing else happens;
  chaos   a worker is SIGKILLed every --kill-every seconds, and EngineCore once, half-way
          through (instead of that worker kill).

Printed per phase: requests started, completed, errored (an HTTP error or an error event),
lost (accepted and never answered: a stream that ended without finishing, or timed out; must
be 0), output tok/s (output tokens / the phase's wall time); for every kill the time from
the kill to the first token any client received after the pause it caused (the restart as a
user sees it),
p50 and max, against the target: the model's load time (the server's own start-up, measured
here) + 5 s; the frontend's RSS after the warm-up, after quiet and after chaos (target: < 5%
growth); the server's kvflow:engine_restarts_total and kvflow:requests_resumed_total.

    .venv/bin/python benchmarks/chaos.py --duration 600 --kill-every 60     # the full soak
    .venv/bin/python benchmarks/chaos.py --duration 120 --kill-every 30     # a short one
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hostile import OUTPUT_LEN, PROMPT_LEN, VOCAB_RANGE, isa_line, server  # noqa: E402


@dataclass
class Outcome:
    status: str = "lost"          # completed | errored | lost
    tokens: int = 0


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any],
               token_times: list[float]) -> Outcome:
    """One streamed completion; every chunk's arrival time goes to `token_times`."""
    out = Outcome()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                out.status = "errored"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    out.status = "errored"
                    return out
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        token_times.append(time.monotonic())
                    if choice.get("finish_reason") in ("length", "stop"):
                        out.status = "completed"
                usage = chunk.get("usage") or {}
                out.tokens = usage.get("completion_tokens", out.tokens)
    except httpx.HTTPError:
        pass                              # a broken or timed-out stream: lost
    return out


async def phase(client: httpx.AsyncClient, url: str, model: str, args: argparse.Namespace,
                name: str, token_times: list[float]) -> tuple[list[Outcome], float]:
    start = time.monotonic()
    end = start + args.duration
    outcomes: list[Outcome] = []

    async def loop(i: int) -> None:
        rng = random.Random(f"{args.seed}-{name}-{i}")
        while time.monotonic() < end:
            body = {"model": model, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True},
                    "prompt": [rng.randrange(*VOCAB_RANGE)
                               for _ in range(rng.randint(*PROMPT_LEN))],
                    "max_tokens": rng.randint(*OUTPUT_LEN)}
            outcomes.append(await send(client, url, body, token_times))

    await asyncio.gather(*(loop(i) for i in range(args.concurrency)))
    return outcomes, time.monotonic() - start


async def killer(srv: Any, args: argparse.Namespace, kills: list[tuple[str, float]]) -> None:
    """A worker every --kill-every seconds; EngineCore once, at the kill nearest half-way."""
    n = max(1, int(args.duration // args.kill_every))
    core_at = n // 2
    for i in range(n):
        await asyncio.sleep(args.kill_every if i else args.kill_every / 2)
        _, kids = srv.tree()
        module = "kvflow.core.engine_proc" if i == core_at else "kvflow.workers.worker_proc"
        victims = [p for p in kids if module in " ".join(p.cmdline())]
        if victims:
            victims[0].kill()
            kills.append(("EngineCore" if i == core_at else "worker", time.monotonic()))


def first_token_after_restart(times: list[float], killed: float, gap: float = 1.0) -> float:
    """Seconds from a kill to the first token after the pause it caused: tokens the old
    engine had sent before it died may still arrive just after the kill, so the restart ends
    at the first token that follows a silence of more than `gap` seconds (the first token
    after the kill if there was no such silence)."""
    after = sorted(t for t in times if t > killed)
    previous = killed
    for t in after:
        if t - previous > gap:
            return t - killed
        previous = t
    return after[0] - killed if after else float("inf")


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def run(srv: Any, args: argparse.Namespace, load_seconds: float) -> bool:
    headers = {"Authorization": f"Bearer {srv.key}"}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=10),
                                 limits=limits, headers=headers) as client:
        model = (await client.get(f"{srv.url}/v1/models")).json()["data"][0]["id"]
        await send(client, srv.url, {"model": model, "prompt": [1000] * 16, "max_tokens": 8},
                   [])                                               # warm-up
        frontend = psutil.Process(srv.proc.pid)
        rss = [frontend.memory_info().rss / 2**20]
        times: list[float] = []
        quiet, quiet_wall = await phase(client, srv.url, model, args, "quiet", times)
        rss.append(frontend.memory_info().rss / 2**20)
        kills: list[tuple[str, float]] = []
        times = []
        chaos_task = asyncio.ensure_future(killer(srv, args, kills))
        chaos, chaos_wall = await phase(client, srv.url, model, args, "chaos", times)
        chaos_task.cancel()
        rss.append(frontend.memory_info().rss / 2**20)
        text = (await client.get(f"{srv.url}/metrics")).text

    print(f"\nCPU: {isa_line()}")
    print(f"{'phase':8} {'started':>8} {'completed':>9} {'errored':>8} {'lost':>5} "
          f"{'out tok/s':>10} {'wall s':>7}")
    for name, outs, wall in (("quiet", quiet, quiet_wall), ("chaos", chaos, chaos_wall)):
        count = {s: sum(o.status == s for o in outs) for s in ("completed", "errored", "lost")}
        print(f"{name:8} {len(outs):>8} {count['completed']:>9} {count['errored']:>8} "
              f"{count['lost']:>5} {sum(o.tokens for o in outs) / wall:>10.1f} {wall:>7.1f}")
    ratio = (sum(o.tokens for o in chaos) / chaos_wall) / max(
        1e-9, sum(o.tokens for o in quiet) / quiet_wall)
    print(f"chaos/quiet output tok/s: {ratio:.3f}")
    restarts = []
    for who, at in kills:
        restarts.append(first_token_after_restart(times, at))
        print(f"  {who:10} killed at +{at - kills[0][1]:6.1f} s -> first token after "
              f"{restarts[-1]:.1f} s")
    target = load_seconds + 5
    ok = True
    if restarts:
        p50, worst = statistics.median(restarts), max(restarts)
        ok = worst <= target
        print(f"kill -> first token: p50 {p50:.1f} s, max {worst:.1f} s   target <= load "
              f"{load_seconds:.1f} s + 5 s = {target:.1f} s  {'PASS' if ok else 'FAIL'}")
    lost = sum(o.status == "lost" for o in quiet + chaos)
    errored = sum(o.status == "errored" for o in chaos)
    print(f"lost: {lost}  target 0  {'PASS' if lost == 0 else 'FAIL'};  errored in chaos: "
          f"{errored}  target 0  {'PASS' if errored == 0 else 'FAIL'}")
    growth = 100 * (rss[2] / rss[0] - 1)
    print(f"frontend RSS MB: after warm-up {rss[0]:.0f}, after quiet {rss[1]:.0f}, after chaos "
          f"{rss[2]:.0f} ({growth:+.1f}%)  target < +5%  {'PASS' if growth < 5 else 'FAIL'}")
    print(f"kvflow:engine_restarts_total {metric(text, 'kvflow:engine_restarts_total'):.0f}, "
          f"kvflow:requests_resumed_total {metric(text, 'kvflow:requests_resumed_total'):.0f}")
    return ok and lost == 0 and errored == 0 and growth < 5


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds per phase")
    p.add_argument("--kill-every", type=float, default=60.0,
                   help="seconds between kills in the chaos phase")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--model", default="default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="a stream silent this long counts as lost")
    p.add_argument("--start-timeout", type=float, default=300.0)
    args = p.parse_args()
    # Enough restarts for the soak: one per kill, within any 10 minutes.
    args.extra_server_args = ["--max-engine-restarts",
                              str(int(args.duration // args.kill_every) + 2)]
    start = time.monotonic()
    with server(args) as srv:
        load_seconds = time.monotonic() - start
        print(f"server up in {load_seconds:.1f} s (the restart target's load time)")
        return 0 if asyncio.run(run(srv, args, load_seconds)) else 1


if __name__ == "__main__":
    sys.exit(main())
