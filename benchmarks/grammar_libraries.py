"""Which grammar engine for structured outputs: llguidance, xgrammar and outlines-core on the
default model's tokenizer, on this CPU (how kvflow chose llguidance; docs/design.md).

For each library, over the schemas of benchmarks/data/json_schemas.json:
  * set-up: building the library's view of the tokenizer (once per engine);
  * compile: a fresh compile of each schema with no cache (plus its first mask, where the
    library builds lazily), repeated --repeats times: p50 / p99 / max;
  * mask: walking each schema's valid instances (compact JSON, tokenized by the model's
    tokenizer), the time to compute the next-token bitmask and advance by the token, per
    token: p50 / p99;
  * coverage: the schemas it compiles, and the message of each it refuses (a refusal is the
    right answer for a keyword it cannot enforce; a schema that compiles but then rejects a
    valid instance counts as a failure, "rejects valid").

The libraries are imported if installed, so any environment runs what it has: kvflow's own
venv has llguidance only. For all three, make a venv beside it (torch pinned to the CPU wheel):

    python -m venv /tmp/gvenv && /tmp/gvenv/bin/pip install torch==2.13.0 && \\
        /tmp/gvenv/bin/pip install llguidance xgrammar outlines-core tokenizers transformers \\
        numpy torch==2.13.0
    PYTHONPATH=. /tmp/gvenv/bin/python benchmarks/grammar_libraries.py
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMAS = os.path.join(ROOT, "benchmarks", "data", "json_schemas.json")
MODEL = os.path.expanduser(os.environ.get(
    "KVFLOW_MODEL_DIR", os.path.join(os.environ.get("KVFLOW_CACHE") or "~/.cache/kvflow",
                                     "SmolLM2-135M-Instruct")))
VOCAB, EOS = 49152, 2


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


class Engine:
    """compile(schema) -> matcher, or raises; walk(matcher, ids) -> per-token seconds."""
    name = ""

    def compile(self, schema: dict) -> Any: ...

    def walk(self, matcher: Any, ids: list[int]) -> list[float] | None: ...


class Llguidance(Engine):
    name = "llguidance"

    def __init__(self) -> None:
        import llguidance as llg
        self.llg = llg
        with open(os.path.join(MODEL, "tokenizer.json")) as f:
            self.tok = llg.LLTokenizer(f.read(), n_vocab=VOCAB, eos_token=EOS)
        self.mask = np.zeros((1, (VOCAB + 31) // 32), dtype=np.int32)

    def compile(self, schema: dict) -> Any:
        m = self.llg.LLMatcher(self.tok, self.llg.LLMatcher.grammar_from_json_schema(schema),
                               log_level=0)
        if not m.is_error():
            m.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
            m.reset()
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def walk(self, m: Any, ids: list[int]) -> list[float] | None:
        times = []
        for t in ids:
            start = time.perf_counter()
            m.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
            ok = m.consume_token(t)
            times.append(time.perf_counter() - start)
            if not ok:
                return None
        return times if m.is_accepting() else None


class Xgrammar(Engine):
    name = "xgrammar"

    def __init__(self) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
        self.xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_file=os.path.join(MODEL, "tokenizer.json"))
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB,
                                                       stop_token_ids=[EOS])
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.mask = xgr.allocate_token_bitmask(1, self.info.vocab_size)

    def compile(self, schema: dict) -> Any:
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)
        m = self.xgr.GrammarMatcher(compiled)
        m.fill_next_token_bitmask(self.mask)
        return self.xgr.GrammarMatcher(compiled)

    def walk(self, m: Any, ids: list[int]) -> list[float] | None:
        times = []
        for t in ids:
            start = time.perf_counter()
            m.fill_next_token_bitmask(self.mask)
            ok = m.accept_token(t)
            times.append(time.perf_counter() - start)
            if not ok:
                return None
        return times if m.is_terminated() or m.accept_token(EOS) else None


class OutlinesCore(Engine):
    name = "outlines-core"

    def __init__(self) -> None:
        import outlines_core
        import torch
        from outlines_core.json_schema import build_regex_from_schema
        self.oc, self.regex = outlines_core, build_regex_from_schema
        with open(os.path.join(MODEL, "tokenizer.json")) as f:
            vocab = json.load(f)["model"]["vocab"]
        decode = _byte_decoder()
        tokens: dict[bytes, list[int]] = {}
        for text, i in vocab.items():
            if i != EOS and i < VOCAB:
                tokens.setdefault(bytes(decode[c] for c in text), []).append(i)
        self.vocab = outlines_core.Vocabulary(EOS, tokens)
        self.mask = torch.zeros((VOCAB + 31) // 32, dtype=torch.int32)

    def compile(self, schema: dict) -> Any:
        index = self.oc.Index(self.regex(json.dumps(schema)), self.vocab)
        return self.oc.Guide(index)

    def walk(self, g: Any, ids: list[int]) -> list[float] | None:
        times = []
        for t in ids:
            start = time.perf_counter()
            g.write_mask_into(self.mask.data_ptr(), self.mask.numel(), 4)
            try:
                g.advance(t)
            except Exception:
                return None
            times.append(time.perf_counter() - start)
        return times if g.is_finished() or EOS in g.get_tokens() else None


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def measure(make: Callable[[], Engine], entries: list[dict], ids: dict[str, list[list[int]]],
            repeats: int) -> dict[str, Any]:
    start = time.perf_counter()
    engine = make()
    setup = time.perf_counter() - start
    compiles: list[float] = []
    masks: list[float] = []
    refused, rejects = {}, []
    for entry in entries:
        for _ in range(repeats):
            start = time.perf_counter()
            try:
                engine.compile(entry["schema"])
            except Exception as e:                 # noqa: BLE001 (each library its own)
                refused[entry["name"]] = str(e).splitlines()[0][:90]
                break
            compiles.append(time.perf_counter() - start)
        if entry["name"] in refused:
            continue
        for instance_ids in ids[entry["name"]]:
            times = engine.walk(engine.compile(entry["schema"]), instance_ids)
            if times is None:
                rejects.append(entry["name"])
            else:
                masks.extend(times)
    return {"library": engine.name, "setup_s": setup, "compiled": len(entries) - len(refused),
            "schemas": len(entries), "compile_p50_ms": 1e3 * pct(compiles, 50),
            "compile_p99_ms": 1e3 * pct(compiles, 99),
            "compile_max_ms": 1e3 * max(compiles) if compiles else float("nan"),
            "mask_p50_us": 1e6 * pct(masks, 50), "mask_p99_us": 1e6 * pct(masks, 99),
            "refused": refused, "rejects_valid": sorted(set(rejects))}


def cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(ln.split(":", 1)[1].strip() for ln in out.splitlines()
                     if ln.startswith("Model name"))
        flags = next(ln.split(":", 1)[1].split() for ln in out.splitlines()
                     if ln.startswith("Flags"))
    except (OSError, StopIteration):
        return platform.processor()
    isa = [f for f in flags if f.startswith(("avx2", "avx512", "amx"))]
    return f"{model}, {os.cpu_count()} CPUs, {' '.join(isa)}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(os.path.join(MODEL, "tokenizer.json"))
    with open(SCHEMAS) as f:
        entries = json.load(f)
    ids = {e["name"]: [tokenizer.encode(json.dumps(v, separators=(",", ":"),
                                                   ensure_ascii=False)).ids
                       for v in e["valid"]] for e in entries}
    rows = []
    for make in (Llguidance, Xgrammar, OutlinesCore):
        try:
            rows.append(measure(make, entries, ids, args.repeats))
        except ImportError as e:
            print(f"{make.name}: not installed ({e})", file=sys.stderr)
    print(f"CPU: {cpu()}; {len(entries)} schemas, {args.repeats} compiles each\n")
    print("| library | tokenizer set-up s | compiled | compile p50 ms | p99 ms | max ms | "
          "mask+advance p50 µs | p99 µs | rejects a valid instance |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['library']} | {r['setup_s']:.2f} | {r['compiled']}/{r['schemas']} | "
              f"{r['compile_p50_ms']:.2f} | {r['compile_p99_ms']:.2f} | "
              f"{r['compile_max_ms']:.1f} | {r['mask_p50_us']:.0f} | {r['mask_p99_us']:.0f} | "
              f"{', '.join(r['rejects_valid']) or '-'} |")
    for r in rows:
        for name, why in r["refused"].items():
            print(f"{r['library']} refuses {name!r}: {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
