"""Speculative decoding: kvflow's server with and without n-gram drafts, and llama.cpp's
llama-server with and without its own speculation, on the same prompts in one run.

Two workloads of chat requests (POST /v1/chat/completions, streamed, temperature 0, max_tokens
--max-tokens), each request sent once per engine and concurrency:
  * copy: the model is asked to repeat or lightly edit a given text (Python functions taken
    from this repository, paragraphs of its docs), where prompt lookup finds what comes next;
  * open: open questions (stories, explanations), where it rarely does.

Per engine, workload and concurrency (--concurrency, default 1 8 32): output tok/s (usage's
completion_tokens), TPOT p50 ((e2e - TTFT) / (tokens - 1)), and for kvflow the acceptance rate
(accepted / drafted tokens) and the mean tokens per verification (1 + accepted / verifications)
from its /metrics before and after the run; for llama-server the same from its per-request
`timings` (draft_n, draft_n_accepted) where it reports them. Ratios: each kvflow speculative
setting against kvflow without it, and against llama-server's speculative mode.

Engines (--engines):
  kvflow-off          launch.py serve --dtype DTYPE
  kvflow-ngram        ... --speculative-method ngram --num-speculative-tokens K
                          --speculative-disable-by-batch-size B
  kvflow-ngram-always ... the same with --speculative-disable-by-batch-size 0 (the rule off:
                          what the adaptive rule saves at high concurrency)
  kvflow-draft        ... --speculative-method draft_model --speculative-model DRAFT (--draft:
                          "skip", the default, is the target without its layers 10-19, built
                          once from the default model: SmolLM2 ships only in 135M here, so
                          no smaller same-tokenizer model exists; "self" is the target itself,
                          every draft accepted, which shows the method's cost; or a folder)
  llamacpp-off        llama-server -m smollm2-TYPE.gguf -t CPUS -np 32
  llamacpp-ngram      ... --spec-type ngram-simple --spec-ngram-simple-size-m K (its n-gram
                      lookup, the last --llama-ngram-n tokens matched in the history)
  llamacpp-draft      ... -md smollm2-Q4_1.gguf --spec-type draft-simple --spec-draft-n-max K
                      (its draft-model speculation; the Q4_1 file is the same model, quantized,
                      the cheapest same-tokenizer draft there is for the 135M model)

    python benchmarks/speculative.py                           # everything, c = 1 8 32
    python benchmarks/speculative.py --engines kvflow-off kvflow-ngram --concurrency 1
    python benchmarks/speculative.py --dtype float32 --llama-type F32

llama-server comes from ../shared/tools/llama-server.sh (LLAMA_SERVER_DIR).
"""
from __future__ import annotations

import argparse
import ast
import asyncio
import json
import os
import signal
import sys
import time
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve as serve_bench  # noqa: E402  (benchmarks/serve.py: server start/stop, pct, cpu)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = ["kvflow-off", "kvflow-ngram", "kvflow-ngram-always", "kvflow-draft",
           "llamacpp-off", "llamacpp-ngram", "llamacpp-draft"]
SKIPPED_LAYERS = range(10, 20)      # --draft skip: the target without these layers
OPEN_QUESTIONS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "What are the pros and cons of living in a big city?",
    "Describe your ideal weekend in detail.",
    "Why is the sky blue? Give a thorough answer.",
    "Write a letter to a friend about learning to cook.",
    "What would happen if the moon disappeared?",
    "Give advice to someone starting their first job.",
]


def copy_tasks(n: int) -> list[str]:
    """Functions of this repository (8-30 lines) to repeat or edit, and docs paragraphs."""
    sources = ["kvflow/core/block_manager.py", "kvflow/core/scheduler.py",
               "kvflow/workers/sampler.py", "kvflow/frontend/outputs.py"]
    functions = []
    for path in sources:
        text = open(os.path.join(ROOT, path)).read()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
                body = lines[node.lineno - 1:node.end_lineno]
                if 8 <= len(body) <= 30:
                    functions.append("\n".join(body))
    paragraphs = [p for p in open(os.path.join(ROOT, "docs", "design.md")).read().split("\n\n")
                  if 400 <= len(p) <= 1200]
    asks = ["Repeat this code exactly, adding a comment above each line that does something:",
            "Rename the variable names in this code to longer, clearer ones and print the "
            "whole result:",
            "Copy this code exactly:"]
    tasks = []
    for i in range(n):
        if i % 3 == 2 and paragraphs:
            tasks.append("Repeat this paragraph word for word, then stop:\n\n"
                         + paragraphs[i % len(paragraphs)])
        else:
            tasks.append(asks[i % len(asks)] + "\n\n" + functions[(7 * i) % len(functions)])
    return tasks


async def send(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int
               ) -> dict[str, Any]:
    body = {"model": "default", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "timings_per_token": False}
    start, ttft, tokens, timings = time.perf_counter(), None, None, {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(str(chunk["error"])[:300])
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content") and ttft is None:
                    ttft = time.perf_counter() - start
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
            timings = chunk.get("timings") or timings
    e2e = time.perf_counter() - start
    return {"ttft": ttft or e2e, "e2e": e2e, "tokens": tokens or 0, "timings": timings}


async def run(url: str, prompts: list[str], concurrency: int, max_tokens: int
              ) -> tuple[list[dict[str, Any]], float]:
    todo, results = iter(prompts), []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0),
                                 limits=limits) as client:
        async def worker() -> None:
            for prompt in todo:
                results.append(await send(client, url, prompt, max_tokens))
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - start


def spec_metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("kvflow:spec_decode_num_") and "per_pos" not in line:
            name = line.split("{")[0].removeprefix("kvflow:spec_decode_num_")
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def command(engine: str, port: int, args: argparse.Namespace) -> list[str]:
    kind, _, mode = engine.partition("-")
    if kind == "kvflow":
        spec = {"off": [],
                "ngram": ["--speculative-method", "ngram"],
                "ngram-always": ["--speculative-method", "ngram"],
                "draft": ["--speculative-method", "draft_model", "--speculative-model",
                          draft_model(args.draft)]}[mode]
        if spec:
            off = 0 if mode == "ngram-always" else args.disable_by_batch_size
            spec += ["--num-speculative-tokens", str(args.k),
                     "--speculative-disable-by-batch-size", str(off)]
        return [sys.executable, "launch.py", "serve", "--model", "default", "--host",
                "127.0.0.1", "--port", str(port), "--served-model-name", "default",
                *(["--dtype", args.dtype] if args.dtype != "auto" else []), *spec]
    d = os.path.expanduser(os.environ.get("LLAMA_SERVER_DIR", "~/.cache/kvflow-bench/llama.cpp"))
    slots = max(32, *args.concurrency)
    spec = {"off": [],
            "ngram": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n",
                      str(args.llama_ngram_n), "--spec-ngram-simple-size-m", str(args.k)],
            "draft": ["-md", os.path.join(d, "smollm2-Q4_1.gguf"), "--spec-type", "draft-simple",
                      "--spec-draft-n-max", str(args.k), "--spec-draft-n-min", "0"]}[mode]
    return [os.path.join(d, "llama-server"), "-m", os.path.join(d, f"smollm2-{args.llama_type}"
                                                                  ".gguf"),
            "-t", str(os.cpu_count() or 1), "-np", str(slots), "-c", str(slots * 2048),
            "--host", "127.0.0.1", "--port", str(port), *spec]


def draft_model(choice: str) -> str:
    """--draft: "self" (the default model), "skip" (the default model without SKIPPED_LAYERS,
    written once next to it), or a folder."""
    from kvflow.frontend.model_files import ensure_default_model
    if choice == "self":
        return ensure_default_model()
    if choice != "skip":
        return choice
    source = ensure_default_model()
    out = source + "-skip" + "-".join(map(str, (SKIPPED_LAYERS.start, SKIPPED_LAYERS.stop)))
    if not os.path.isfile(os.path.join(out, "model.safetensors")):
        write_skipped(source, out, [i for i in range(30) if i not in SKIPPED_LAYERS])
    return out


def write_skipped(source: str, out: str, layers: list[int]) -> None:
    """A copy of the model at `source` with only `layers` (renumbered), same tokenizer."""
    import shutil
    from safetensors.torch import load_file, save_file
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = len(layers)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    index = {old: new for new, old in enumerate(layers)}
    tensors = {}
    for name in os.listdir(source):
        path = os.path.join(source, name)
        if name.endswith(".safetensors"):
            for key, value in load_file(path).items():
                if ".layers." in key:
                    head, rest = key.split(".layers.", 1)
                    i, tail = rest.split(".", 1)
                    if int(i) not in index:
                        continue
                    key = f"{head}.layers.{index[int(i)]}.{tail}"
                tensors[key] = value
        elif os.path.isfile(path) and name != "config.json":
            shutil.copy(path, out)
    save_file(tensors, os.path.join(out, "model.safetensors"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engines", nargs="+", default=ENGINES)
    p.add_argument("--workloads", nargs="+", default=["copy", "open"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=None,
                   help="requests per run (default: 6 at concurrency 1, else 2 x concurrency)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--k", type=int, default=4, help="draft tokens per step (both engines)")
    p.add_argument("--disable-by-batch-size", type=int, default=8,
                   help="kvflow-ngram's --speculative-disable-by-batch-size")
    p.add_argument("--dtype", default="auto", help="kvflow's --dtype (default: auto)")
    p.add_argument("--llama-type", default="F32", help="llama-server's GGUF type")
    p.add_argument("--llama-ngram-n", type=int, default=3,
                   help="llamacpp-ngram's --spec-ngram-simple-size-n (tokens matched)")
    p.add_argument("--draft", default="skip",
                   help="kvflow-draft's draft model: skip (default), self, or a folder")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(serve_bench.cpu_info(), flush=True)
    ns = argparse.Namespace(start_timeout=300.0)
    rows: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    for engine in args.engines:
        serve_bench.server_command = lambda e, port, _a: command(e, port, args)  # type: ignore
        try:
            run_engine(engine, args, ns, rows)
        except Exception as e:          # a peer that crashes must not lose the other rows
            failed[engine] = f"{type(e).__name__}: {e}"
            print(f"{engine} failed: {failed[engine]}", file=sys.stderr, flush=True)
    print_table(rows)
    for engine, why in failed.items():
        print(f"{engine}: no figures ({why})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def run_engine(engine: str, args: argparse.Namespace, ns: argparse.Namespace,
               rows: list[dict[str, Any]]) -> None:
    with serve_bench.server(engine, ns) as url:
        asyncio.run(run(url, ["Say hello."], 1, 8))                    # warm-up
        for workload in args.workloads:
            for c in args.concurrency:
                n = args.requests or (6 if c == 1 else 2 * c)
                prompts = (copy_tasks(n) if workload == "copy"
                           else [OPEN_QUESTIONS[i % len(OPEN_QUESTIONS)] for i in range(n)])
                before = spec_metrics(url) if engine.startswith("kvflow") else {}
                results, seconds = asyncio.run(run(url, prompts, c, args.max_tokens))
                after = spec_metrics(url) if engine.startswith("kvflow") else {}
                row = summarize(engine, workload, c, results, seconds, before, after)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)


def summarize(engine: str, workload: str, c: int, results: list[dict[str, Any]],
              seconds: float, before: dict[str, float], after: dict[str, float]
              ) -> dict[str, Any]:
    tokens = sum(r["tokens"] for r in results)
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    row: dict[str, Any] = {"engine": engine, "workload": workload, "c": c,
                           "requests": len(results), "tokens": tokens,
                           "out_tok_s": tokens / seconds,
                           "tpot_p50_ms": 1e3 * serve_bench.pct(tpot, 50)}
    if after:
        drafted = after.get("draft_tokens_total", 0) - before.get("draft_tokens_total", 0)
        accepted = (after.get("accepted_tokens_total", 0)
                    - before.get("accepted_tokens_total", 0))
        verifications = after.get("drafts_total", 0) - before.get("drafts_total", 0)
    else:
        drafted = sum(r["timings"].get("draft_n", 0) for r in results)
        accepted = sum(r["timings"].get("draft_n_accepted", 0) for r in results)
        verifications = 0
    row["acceptance"] = accepted / drafted if drafted else None
    row["tokens_per_verification"] = 1 + accepted / verifications if verifications else None
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'engine':<16}{'workload':>9}{'c':>4}{'out tok/s':>11}{'TPOT p50 ms':>13}"
            f"{'accept':>8}{'tok/verif':>10}{'vs off':>8}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        kind = r["engine"].split("-")[0]
        off = next((o for o in rows if o["engine"] == f"{kind}-off"
                    and o["workload"] == r["workload"] and o["c"] == r["c"]), None)
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        print(f"{r['engine']:<16}{r['workload']:>9}{r['c']:>4}{r['out_tok_s']:>11.1f}"
              f"{r['tpot_p50_ms']:>13.1f}{fmt(r['acceptance'], '.2f'):>8}"
              f"{fmt(r['tokens_per_verification'], '.2f'):>10}"
              f"{fmt(off and r['out_tok_s'] / off['out_tok_s'], '.2f'):>8}")
    for workload in sorted({r["workload"] for r in rows}):
        for c in sorted({r["c"] for r in rows}):
            at = [r for r in rows if r["workload"] == workload and r["c"] == c]
            for ours in (r for r in at if r["engine"].startswith("kvflow-")):
                for theirs in (r for r in at if r["engine"].startswith("llamacpp-")):
                    print(f"{workload} c={c}: {ours['engine']} / {theirs['engine']} out tok/s = "
                          f"{ours['out_tok_s'] / theirs['out_tok_s']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
