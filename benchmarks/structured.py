"""Structured outputs under load: 32 concurrent JSON-schema chat requests against the same 32
unconstrained, on kvflow's server and on llama.cpp's llama-server, in one run.

Workload: the schemas of benchmarks/data/json_schemas.json (those llguidance supports), drawn
round-robin, each request asking for its schema's object (the entry's prompt), temperature 0.7
with a per-request seed, streamed with usage. Constrained requests send
`response_format: {"type": "json_schema", ...}` with max_tokens 400 and end when the object is
complete. The unconstrained twin of each request then asks for exactly as many tokens as its
constrained run produced (`max_tokens` = that count, `ignore_eos`), so both runs generate the
same number of tokens from the same prompts: the throughput ratio is the cost of the masks.

Reported per engine and mode: output tok/s, TTFT p50/p99 (constrained TTFT includes compiling
the schema: each request's schema text is made unique, so no compile cache helps), the fraction
of constrained outputs that parse and validate (jsonschema), the ratio constrained /
unconstrained, and kvflow / llama-server constrained; plus the schema compile time of kvflow's
grammar engine (llguidance, no cache) over the schema set, p50/p99/max, on this CPU.

    python benchmarks/structured.py                      # kvflow (float32) and llama-server F32
    python benchmarks/structured.py --kvflow-only --concurrency 8
    python benchmarks/structured.py --llama-types F32 Q8_0

llama-server comes from ../shared/tools/llama-server.sh (LLAMA_SERVER_DIR); it gets --threads
= the CPUs and 32 slots.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import sys
import time
from typing import Any

import httpx
import jsonschema

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve import cpu_info, pct, server  # noqa: E402  (benchmarks/serve.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMAS = os.path.join(ROOT, "benchmarks", "data", "json_schemas.json")


def load_workload(n: int) -> list[dict[str, Any]]:
    with open(SCHEMAS) as f:
        entries = [e for e in json.load(f) if "llguidance" not in e.get("unsupported_in", [])]
    work = []
    for i in range(n):
        entry = entries[i % len(entries)]
        schema = copy.deepcopy(entry["schema"])
        schema["title"] = f"{entry['name']} #{i}"       # unique text: no compile cache hit
        work.append({"name": entry["name"], "schema": schema, "seed": i,
                     "messages": [{"role": "user", "content": entry["prompt"]}]})
    return work


async def send(client: httpx.AsyncClient, url: str, model: str, item: dict[str, Any],
               constrained: bool, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "messages": item["messages"], "temperature": 0.7, "seed": item["seed"],
        "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": item["schema"], "strict": True}}
    else:
        body["ignore_eos"] = True
    start = time.perf_counter()
    ttft, text, chunks, usage = None, [], 0, None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "error": (await r.aread()).decode()[:300]}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(piece)
                    chunks += 1
    n_out = (usage or {}).get("completion_tokens") or chunks
    return {"ok": True, "ttft": ttft or 0.0, "e2e": time.perf_counter() - start,
            "n_out": n_out, "text": "".join(text)}


async def run(url: str, work: list[dict[str, Any]], constrained: bool, lengths: list[int],
              concurrency: int, timeout: float) -> tuple[list[dict[str, Any]], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0),
                                 limits=limits) as client:
        model = ((await client.get(f"{url}/v1/models")).json().get("data") or [{}])[0].get(
            "id", "default")
        await send(client, url, model, work[0], False, 4)                     # warm-up
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> dict[str, Any]:
            async with gate:
                return await send(client, url, model, work[i], constrained, lengths[i])
        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(len(work))))
        return list(results), time.perf_counter() - start


def valid(item: dict[str, Any], result: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(result["text"]), item["schema"])
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def summary(engine: str, mode: str, work: list[dict[str, Any]], results: list[dict[str, Any]],
            duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.get("ok")]
    ttft = [r["ttft"] for r in ok]
    row = {"engine": engine, "mode": mode, "requests": len(results),
           "errors": len(results) - len(ok), "out_tok_s": sum(r["n_out"] for r in ok) / duration,
           "tokens": sum(r["n_out"] for r in ok), "duration_s": duration,
           "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
           "first_error": next((r["error"] for r in results if not r.get("ok")), "")}
    if mode == "json_schema":
        row["valid"] = sum(valid(w, r) for w, r in zip(work, results) if r.get("ok")) / len(work)
    return row


def compile_times(model: str, repeats: int) -> dict[str, float]:
    """kvflow's grammar engine (llguidance) on this CPU: a fresh compile of each schema (and
    its first mask), no cache, `repeats` times over the set."""
    from kvflow.core.grammar import GrammarCompiler
    from kvflow.frontend.model_files import resolve_model
    from kvflow.sampling_params import StructuredOutputsParams
    path = resolve_model(model)
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    work = load_workload(len(json.load(open(SCHEMAS))) * repeats)
    compiler = GrammarCompiler(path, vocab, (2,), timeout=60.0)
    start = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json={"type": "object"}))
    tokenizer_s = time.perf_counter() - start
    compiler.compile_seconds.clear()
    for item in work:
        compiler.compile(StructuredOutputsParams(json=item["schema"]))
    xs = compiler.compile_seconds
    return {"schemas": len(xs), "tokenizer_s": tokenizer_s, "p50_ms": 1e3 * pct(xs, 50),
            "p99_ms": 1e3 * pct(xs, 99), "max_ms": 1e3 * max(xs)}


def serve_args(args: argparse.Namespace) -> argparse.Namespace:
    """What benchmarks/serve.py's server() needs to start each engine."""
    return argparse.Namespace(model=args.model, concurrency=[args.concurrency],
                              prompt_len=(64, 128), output_len=(400, 400),
                              llama_threads=os.cpu_count() or 1, start_timeout=600)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--dtype", default="float32", help="kvflow's --dtype")
    p.add_argument("--llama-types", nargs="*", default=["F32"],
                   help="llama-server GGUF types to run (F32 BF16 F16 Q8_0)")
    p.add_argument("--kvflow-only", action="store_true")
    p.add_argument("--compile-repeats", type=int, default=5)
    p.add_argument("--request-timeout", type=float, default=1800)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    print(cpu_info())
    work = load_workload(args.num_requests)
    compile_row = compile_times(args.model, args.compile_repeats)
    print(f"llguidance compile (fresh, first mask included) over {compile_row['schemas']} "
          f"schemas: p50 {compile_row['p50_ms']:.2f} ms, p99 {compile_row['p99_ms']:.2f} ms, "
          f"max {compile_row['max_ms']:.2f} ms; tokenizer set-up once "
          f"{compile_row['tokenizer_s']:.2f} s", flush=True)
    engines = [f"kvflow-{args.dtype}"] + ([] if args.kvflow_only else
                                          [f"llamacpp-{t}" for t in args.llama_types])
    rows = []
    for engine in engines:
        with server(engine, serve_args(args)) as url:
            results, duration = asyncio.run(run(url, work, True, [400] * len(work),
                                                args.concurrency, args.request_timeout))
            rows.append(summary(engine, "json_schema", work, results, duration))
            lengths = [max(1, r.get("n_out", 1)) for r in results]
            results, duration = asyncio.run(run(url, work, False, lengths, args.concurrency,
                                                args.request_timeout))
            rows.append(summary(engine, "unconstrained", work, results, duration))
        print(f"  {engine}: done", file=sys.stderr, flush=True)
    print(f"\n{args.num_requests} chat requests, {args.concurrency} in flight; the "
          "unconstrained run generates as many tokens per request as the constrained one\n")
    print("| engine | mode | out tok/s | tokens | TTFT p50 ms | TTFT p99 ms | valid | errors |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        v = f"{100 * r['valid']:.0f}%" if "valid" in r else ""
        print(f"| {r['engine']} | {r['mode']} | {r['out_tok_s']:.1f} | {r['tokens']} | "
              f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {v} | {r['errors']} |")
    by = {(r["engine"], r["mode"]): r for r in rows}
    for engine in engines:
        c, u = by[(engine, "json_schema")], by[(engine, "unconstrained")]
        print(f"{engine}: constrained / unconstrained throughput = "
              f"{c['out_tok_s'] / u['out_tok_s']:.2f}x")
    kv = by[(engines[0], "json_schema")]
    for engine in engines[1:]:
        print(f"{engines[0]} / {engine}, constrained: "
              f"{kv['out_tok_s'] / by[(engine, 'json_schema')]['out_tok_s']:.2f}x")
    for r in rows:
        if r["first_error"]:
            print(f"{r['engine']} {r['mode']} first error: {r['first_error']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_info(), "compile": compile_row, "rows": rows}, f, indent=1)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
