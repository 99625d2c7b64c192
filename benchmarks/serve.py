"""Online serving: kvflow's OpenAI-compatible server vs llama.cpp's llama-server, same workload.

An async client (httpx, a new connection per request) streams POST /v1/completions with seeded
random token-id prompts (ids 1000..39999 of the 49152-token vocab: no special tokens), uniform
random prompt and output lengths, temperature 0, ignore_eos, max_tokens = the drawn output length,
stream_options.include_usage; in two modes: a fixed number of requests in flight (--concurrency)
and Poisson arrivals (--rates, requests/s, no cap on requests in flight). Each run has its own
prompts (the same for every engine), so no prefix cache helps across runs. Per run: requests/s,
output tokens/s (the usage chunk's completion_tokens, else the number of text chunks), TTFT
(request sent to first non-empty text chunk), TPOT ((e2e - TTFT) / (output tokens - 1)) and ITL
(gaps between non-empty text chunks), p50 and p99, failed requests, and the requests that did not
get exactly max_tokens tokens (len!=max). Exit status 1 when an engine failed.

Each server is started by the script (output to a temp log, kept and shown on failure), waited for
(GET /health == 200), warmed up with one request, measured, and stopped (its process group):

    python launch.py serve --model default --host 127.0.0.1 --port P [--dtype float32|bfloat16]
    $LLAMA_SERVER_DIR/llama-server -m $LLAMA_SERVER_DIR/smollm2-T.gguf -t CPUS -np 32 -c 32768 \\
        --host 127.0.0.1 --port P    # T: F32 BF16 F16 Q8_0, from ../shared/tools/llama-server.sh

    python benchmarks/serve.py                                     # all engines, c=1 8 32, rates 2 8
    python benchmarks/serve.py --engines llamacpp-F32 --concurrency 1 8 --rates --num-requests 8
    python benchmarks/serve.py --url http://127.0.0.1:8000 --label kvflow-mine --json out.json
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = ["kvflow-float32", "kvflow-bfloat16", "llamacpp-F32", "llamacpp-BF16", "llamacpp-F16",
           "llamacpp-Q8_0"]
VOCAB_RANGE = (1000, 40000)


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    arrival: float = 0.0            # seconds after the run's start (Poisson mode)


@dataclass
class Result:
    max_tokens: int
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    n_out: int = 0
    finish_reason: str = ""
    error: str = ""
    itl: list[float] = field(default_factory=list)


def make_requests(args: argparse.Namespace, n: int, key: str, rate: float = 0.0) -> list[Request]:
    rng = random.Random(f"{args.seed}-{key}")
    reqs = [Request([rng.randrange(*VOCAB_RANGE) for _ in range(rng.randint(*args.prompt_len))],
                    rng.randint(*args.output_len)) for _ in range(n)]
    t = 0.0
    for r in reqs[1:] if rate else []:
        t += rng.expovariate(rate)
        r.arrival = t
    return reqs


async def send(client: httpx.AsyncClient, url: str, model: str, req: Request) -> Result:
    """One streamed completion; timings from the SSE lines as they arrive."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res, usage, chunks, last = Result(req.max_tokens), None, 0, 0.0
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return res
            async for line in resp.aiter_lines():
                if line.startswith("error:"):           # llama-server's SSE error event
                    res.error = line[6:].strip()[:300]
                    return res
                if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                    continue
                now, chunk = time.perf_counter(), json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])[:300]
                    return res
                for choice in chunk.get("choices") or []:
                    res.finish_reason = choice.get("finish_reason") or res.finish_reason
                    if choice.get("text"):
                        if chunks == 0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        chunks, last = chunks + 1, now
                usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
        res.e2e = time.perf_counter() - start
        res.n_out = usage if usage is not None else chunks
        res.ok = chunks > 0
        res.error = "" if res.ok else "no text in the answer"
    except Exception as e:  # noqa: BLE001 - counted as an error of this request
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_concurrency(client: httpx.AsyncClient, url: str, model: str, reqs: list[Request],
                          concurrency: int) -> list[Result]:
    todo, results = iter(reqs), []

    async def worker() -> None:
        for req in todo:
            results.append(await send(client, url, model, req))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def run_poisson(client: httpx.AsyncClient, url: str, model: str,
                      reqs: list[Request]) -> list[Result]:
    start, tasks = time.perf_counter(), []
    for req in reqs:
        await asyncio.sleep(max(0.0, start + req.arrival - time.perf_counter()))
        tasks.append(asyncio.create_task(send(client, url, model, req)))
    return list(await asyncio.gather(*tasks))


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs, k = sorted(xs), (len(xs) - 1) * q / 100
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def summarize(engine: str, mode: str, results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft, itl = [r.ttft for r in ok], [x for r in ok for x in r.itl]
    tpot = [(r.e2e - r.ttft) / (r.n_out - 1) for r in ok if r.n_out > 1]
    row: dict[str, Any] = dict(
        engine=engine, mode=mode, requests=len(results), errors=len(results) - len(ok),
        wrong_len=sum(r.n_out != r.max_tokens for r in ok), duration_s=duration,
        req_s=len(ok) / duration, out_tok_s=sum(r.n_out for r in ok) / duration,
        finish_reasons=sorted({r.finish_reason for r in ok}),
        first_error=next((r.error for r in results if not r.ok), ""))
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        row[f"{name}_p50_ms"], row[f"{name}_p99_ms"] = 1e3 * pct(xs, 50), 1e3 * pct(xs, 99)
    row["per_request"] = [{k: v for k, v in asdict(r).items() if k != "itl"} for r in results]
    return row


# A new connection per request: llama-server (cpp-httplib) closes a kept-alive connection
# after 5 requests, and a request sent on it just then fails with RemoteProtocolError.
NO_KEEPALIVE = httpx.Limits(max_connections=None, max_keepalive_connections=0)


async def bench(engine: str, url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=10.0),
                                 limits=NO_KEEPALIVE) as client:
        models = (await client.get(f"{url}/v1/models")).json().get("data") or [{}]
        model = models[0].get("id", "default")
        warm = await send(client, url, model, Request(list(range(1000, 1016)), 8))
        if not warm.ok:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        runs = [(f"c={c}", make_requests(args, args.num_requests or (8 if c == 1 else 64), f"c{c}"),
                 c) for c in args.concurrency]
        runs += [(f"rate={r:g}", make_requests(args, args.num_requests or 64, f"r{r}", r), 0)
                 for r in args.rates]
        rows = []
        for mode, reqs, c in runs:
            start = time.perf_counter()
            results = await (run_concurrency(client, url, model, reqs, c) if c
                             else run_poisson(client, url, model, reqs))
            rows.append(summarize(engine, mode, results, time.perf_counter() - start))
            print(f"  {engine} {mode}: {rows[-1]['out_tok_s']:.1f} out tok/s, "
                  f"{rows[-1]['errors']} errors", file=sys.stderr, flush=True)
        return rows


def server_command(engine: str, port: int, args: argparse.Namespace) -> list[str]:
    kind, _, variant = engine.partition("-")
    if kind == "kvflow":
        dtype = [] if variant == "auto" else ["--dtype", variant]
        return [sys.executable, "launch.py", "serve", "--model", args.model, "--host",
                "127.0.0.1", "--port", str(port), *dtype]
    if kind == "llamacpp":
        d = os.path.expanduser(os.environ.get("LLAMA_SERVER_DIR",
                                              "~/.cache/kvflow-bench/llama.cpp"))
        slots = getattr(args, "llama_slots", None) or max([32, *args.concurrency])
        per_slot = max(1024, args.prompt_len[1] + args.output_len[1] + 64)
        return [os.path.join(d, "llama-server"), "-m", os.path.join(d, f"smollm2-{variant}.gguf"),
                "-t", str(args.llama_threads), "-np", str(slots), "-c", str(slots * per_slot),
                "--host", "127.0.0.1", "--port", str(port)]
    raise ValueError(f"unknown engine {engine!r} (kvflow-DTYPE or llamacpp-TYPE)")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group, SIGKILL to whatever is left of it after 20 s."""
    deadline = time.monotonic() + 20
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        while time.monotonic() < deadline:
            proc.poll()                        # reap the leader; then wait for its children
            os.killpg(proc.pid, 0)             # ProcessLookupError once the whole group is gone
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def server(engine: str, args: argparse.Namespace) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix=f"serve-{engine}-", suffix=".log", delete=False)
    print(f"{engine}: starting on port {port}, log {log.name}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(server_command(engine, port, args), cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + args.start_timeout
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{engine} did not become healthy (exit code {proc.poll()})")
            time.sleep(0.5)
        yield url
    except BaseException:
        stop(proc)
        with open(log.name, errors="replace") as f:
            tail = f.read().splitlines()[-40:]
        print(f"--- last lines of {log.name} (kept):\n" + "\n".join(tail), file=sys.stderr)
        raise
    else:
        os.unlink(log.name)
    finally:
        stop(proc)
        log.close()


def _healthy(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    return False


def cpu_info() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    except OSError:
        lines = open("/proc/cpuinfo").read().splitlines()
    get = lambda key: next((ln.split(":", 1)[1].strip() for ln in lines  # noqa: E731
                            if ln.lower().startswith(key)), "?")
    flags = [f for f in get("flags").split() if f.startswith(("avx512", "amx", "avx2"))]
    return f"CPU: {get('model name')}, {os.cpu_count()} CPUs; ISA: {' '.join(flags) or 'none'}"


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'engine':<18}{'mode':>9}{'req/s':>7}{'out tok/s':>10}{'TTFT p50/p99 ms':>18}"
            f"{'TPOT p50/p99 ms':>17}{'ITL p50/p99 ms':>17}{'errors':>7}{'len!=max':>9}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        pair = lambda k: f"{r[k + '_p50_ms']:.1f}/{r[k + '_p99_ms']:.1f}"  # noqa: E731
        print(f"{r['engine']:<18}{r['mode']:>9}{r['req_s']:>7.2f}{r['out_tok_s']:>10.1f}"
              f"{pair('ttft'):>18}{pair('tpot'):>17}{pair('itl'):>17}{r['errors']:>7}"
              f"{r['wrong_len']:>9}")


def print_ratios(rows: list[dict[str, Any]]) -> None:
    def best(prefix: str, mode: str, key: str, pick: Any) -> dict[str, Any] | None:
        cands = [r for r in rows if r["engine"].startswith(prefix) and r["mode"] == mode
                 and r["requests"] > r["errors"]]
        return pick(cands, key=lambda r: r[key]) if cands else None

    kv, ll = best("kvflow", "c=32", "out_tok_s", max), best("llamacpp", "c=32", "out_tok_s", max)
    if kv and ll:
        print(f"c=32 out tok/s: kvflow best ({kv['engine']}) {kv['out_tok_s']:.1f} / llama-server "
              f"best ({ll['engine']}) {ll['out_tok_s']:.1f} = {kv['out_tok_s'] / ll['out_tok_s']:.2f}x"
              f"\nc=32 TTFT p50 of those: kvflow {kv['ttft_p50_ms']:.0f} ms, llama-server "
              f"{ll['ttft_p50_ms']:.0f} ms (kvflow/llama = {kv['ttft_p50_ms'] / ll['ttft_p50_ms']:.2f})")
    kv, ll = best("kvflow", "c=1", "tpot_p50_ms", min), best("llamacpp", "c=1", "tpot_p50_ms", min)
    if kv and ll:
        print(f"c=1 TPOT p50: kvflow best ({kv['engine']}) {kv['tpot_p50_ms']:.1f} ms, llama-server "
              f"best ({ll['engine']}) {ll['tpot_p50_ms']:.1f} ms "
              f"(kvflow/llama = {kv['tpot_p50_ms'] / ll['tpot_p50_ms']:.2f})")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engines", nargs="+", default=ENGINES, metavar="ENGINE",
                   help="servers to start, one after the other: kvflow-{auto,float32,bfloat16,"
                        "float16} (launch.py serve --dtype) or llamacpp-{F32,BF16,F16,Q8_0} "
                        "(GGUF type, from $LLAMA_SERVER_DIR, default "
                        "~/.cache/kvflow-bench/llama.cpp)\n(default: %(default)s)")
    p.add_argument("--url", help="benchmark this running server instead (--engines is ignored)")
    p.add_argument("--label", default="url", help="the engine column for --url (start it with "
                   "kvflow or llamacpp to get it into the ratios)")
    p.add_argument("--concurrency", nargs="*", type=int, default=[1, 8, 32],
                   help="runs that keep this many requests in flight (default: %(default)s)")
    p.add_argument("--rates", nargs="*", type=float, default=[2.0, 8.0],
                   help="Poisson-arrival runs, requests/s (default: %(default)s; none: --rates)")
    p.add_argument("--num-requests", type=int, default=None, help="requests per run (default: "
                   "8 at concurrency 1, else 64)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="default", help="kvflow's --model (default: %(default)s)")
    p.add_argument("--llama-threads", type=int, default=os.cpu_count() or 1,
                   help="llama-server -t (default: all CPUs, %(default)s); -np is max(32, "
                        "concurrency), -c is -np x max(1024, max prompt + max output + 64)")
    p.add_argument("--start-timeout", type=float, default=180.0,
                   help="seconds to wait for GET /health == 200 (default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", metavar="PATH", help="also write the rows (and per-request numbers)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))      # run the finally blocks
    print(cpu_info(), flush=True)
    rows, failed = [], []
    for engine in [args.label] if args.url else args.engines:
        try:
            if args.url:
                rows += asyncio.run(bench(engine, args.url.rstrip("/"), args))
                continue
            with server(engine, args) as url:
                rows += asyncio.run(bench(engine, url, args))
        except Exception as e:  # noqa: BLE001 - report it, go on with the next engine
            print(f"{engine} FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            failed.append(engine)
    print_table(rows)
    print_ratios(rows)
    if failed:
        print(f"failed: {' '.join(failed)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_info(), "args": vars(args), "rows": rows, "failed": failed}, f,
                      indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
