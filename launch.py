"""kvflow command line.

    python launch.py serve --model default --port 8000 [--client-address tcp://127.0.0.1:5555]
    python launch.py generate --model default "Write a haiku about the sea."

`serve` starts the cluster (this process is the frontend; EngineCore and one worker per
tensor-parallel rank are its children; with --nnodes, node 0's ranks, the others' ranks being
started on their nodes by `serve --headless`, see docs/deploy.md) and serves the OpenAI-compatible HTTP API (/v1/completions,
/v1/chat/completions, /v1/models, /health, /metrics, /tokenize, /detokenize, /version) and, with
--client-address, kvflow.Client / AsyncClient over ZMQ, until SIGINT or SIGTERM. `generate`
starts the same cluster for one prompt and streams the answer.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from typing import Any

logger = logging.getLogger("kvflow")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineOptions field (the dest is the field's name)."""
    parser.add_argument("--model", default="default",
                        help="a local HF folder (config.json, *.safetensors, tokenizer.json) or "
                             "'default' (SmolLM2-135M-Instruct, built on first use)")
    parser.add_argument("--tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=int,
                        default=1, help="tensor-parallel size")
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and KV cache dtype (auto: on CPU bfloat16 where the CPU has "
                             "AVX512-BF16 or AMX, else float32 arithmetic and KV cache on "
                             "weights rounded to bfloat16; on CUDA the checkpoint's)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="max prompt + output tokens per request (default: the model's)")
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="max requests running at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="token budget of one step (prefill chunks + decodes)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="plan and send each step while the previous one runs (EngineCore's "
                             "work overlaps the forward); a request admitted while a step runs "
                             "starts one step later; not with --tp > 1 or speculative decoding "
                             "(default: on with --tp 1 and no speculative decoding, CUDA and CPU)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching",
                        action="store_false", help="turn automatic prefix caching off")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=None,
                        help="KV cache size in GiB (default: on CPU 10%% of available RAM, "
                             "<= 2; on CUDA what --gpu-memory-utilization leaves)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        choices=["auto", "bfloat16", "int8"],
                        help="KV cache dtype (auto: bfloat16 on CPU wherever the weights are, "
                             "including --dtype auto on CPUs without AVX512-BF16/AMX, where "
                             "the arithmetic is float32; else --dtype's. bfloat16: also "
                             "under --dtype float32 on CPU, half the cache's bytes. int8: CPU "
                             "(cpu attention backend) only, each K/V row of a head in 8 bits "
                             "with its own scale: ~half a bfloat16 cache's bytes, so ~1.9x "
                             "the tokens in the same memory and decode attention reads half)")
    parser.add_argument("--load-format", default="safetensors",
                        choices=["safetensors", "dummy"],
                        help="dummy: random weights of the right shapes (benchmarks)")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads per worker, unbound (default: one per physical "
                             "core this process may use, within its cgroup's CPU limit, "
                             "split between the node's tensor-parallel ranks; a worker "
                             "process binds to its cores)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="where workers run (auto: cuda:RANK when CUDA is available)")
    parser.add_argument("--attention-backend", default="auto",
                        choices=["auto", "cpu", "torch", "triton", "flash_attn"],
                        help="paged attention implementation (auto: flash_attn on CUDA when "
                             "installed and --block-size is a multiple of 256, else triton "
                             "on CUDA; on CPU 'cpu', kvflow's C kernels, built once with "
                             "$CC or cc, else plain 'torch'; the choice is logged at "
                             "start-up)")
    parser.add_argument("--cpu-prefill-copy", default="auto", choices=["auto", "on", "off"],
                        help="CPU: whether oneDNN keeps its own copy of the weights that "
                             "kvflow's gemv kernel holds in panels (bfloat16 weights), for "
                             "prompt-sized products, a few percent faster there; it adds 4 "
                             "bytes a parameter under float32 arithmetic, 2 under bfloat16 "
                             "(auto: while it takes at most an eighth of the RAM available "
                             "at load, a rank's share of it; off: the panels take every "
                             "product)")
    parser.add_argument("--cpu-one-row-copy", default="auto", choices=["auto", "on", "off"],
                        help="CPU: whether the weights held in panels, pair panels or AMX "
                             "tiles get a second copy in 12 bits a weight (lossless, 1.5 "
                             "bytes a parameter), which the decode steps of one to a few "
                             "requests read (up to 4; beside AMX tiles 1): a tenth to a "
                             "fifth off one request's time a token (auto: while it takes at "
                             "most an eighth of the RAM available at load, a rank's share; "
                             "off saves the memory, and on an Intel Xeon was faster with 32 "
                             "requests in flight; int8 weights have no such copy)")
    parser.add_argument("--quantization", default=None, choices=["int8"],
                        help="int8: int8 linear weights on CPU (per output channel): "
                             "products of up to 4 rows (one user's decode steps; 8 on "
                             "AVX512-VNNI without AMX) weight-only, larger ones (prefills, "
                             "batches) W8A8 through kvflow's int8 GEMM where the CPU has "
                             "AVX512-VNNI but no AMX, else oneDNN's; on x86 without VNNI "
                             "W7A8 (7-bit weights) through kvflow's; default: none")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="on CUDA: no CUDA graphs for decode, no torch.compile; on "
                             "CPU: decode steps run the model's forward, not one C call")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of the GPU's memory kvflow may use (weights, activations, "
                             "KV cache) when --kv-cache-memory-gb is not given")
    parser.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    parser.add_argument("--nnodes", type=int, default=1,
                        help="nodes the tensor-parallel ranks are spread over (--tp / --nnodes "
                             "each); node 0 serves, the others run `serve --headless` "
                             "(docs/deploy.md)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index, 0 to "
                        "--nnodes - 1 (0: the node that serves)")
    parser.add_argument("--master-addr", default="127.0.0.1",
                        help="node 0's address as every node reaches it")
    parser.add_argument("--master-port", type=int, default=None,
                        help="node 0's port for the torch.distributed rendezvous (default: "
                             "29501 with several nodes, a free port with one)")
    parser.add_argument("--startup-timeout", type=float, default=300.0,
                        help="seconds for every rank on every node to load and join; then "
                             "start-up fails naming the ranks missing (also torch.distributed's "
                             "limit for one collective)")
    parser.add_argument("--step-timeout", type=float, default=60.0,
                        help="seconds after which an unfinished step (plus 10x its expected "
                             "time, from the steps before it) counts as a hung worker, and "
                             "EngineCore silent that long as hung: the engine is restarted")
    parser.add_argument("--max-engine-restarts", type=int, default=3,
                        help="restarts of a dead or hung engine (EngineCore or a worker) within "
                             "10 minutes, every unfinished request resumed; then the server "
                             "gives up and answers 503 (0: fail-stop, as vLLM)")
    parser.add_argument("--grammar-compile-timeout", type=float, default=10.0,
                        help="structured outputs: seconds to compile a request's constraint "
                             "(JSON schema, regex, choice, grammar); a slower one is refused "
                             "with a 400 naming it")
    spec = parser.add_argument_group(
        "speculative decoding", "several tokens per step for a few users, exactly the tokens "
        "the model gives without it (docs/design.md, 'Speculative decoding')")
    spec.add_argument("--speculative-method", default=None, choices=["ngram", "draft_model"],
                      help="ngram: prompt lookup, drafts copied from what followed the "
                           "request's last tokens earlier in its prompt or output; "
                           "draft_model: drafts from --speculative-model, run by worker rank 0 "
                           "(default: off; --speculative-model alone means draft_model)")
    spec.add_argument("--speculative-model", default=None,
                      help="draft_model: a smaller model's local folder (or 'default') with "
                           "the same tokenizer; it runs in the target's dtype with its own KV "
                           "cache")
    spec.add_argument("--num-speculative-tokens", type=positive_int, default=None,
                      help="drafts per request per step, at most 16 (default: 4)")
    spec.add_argument("--prompt-lookup-min", type=positive_int, default=None,
                      help="ngram: the shortest suffix looked up (default: --prompt-lookup-max "
                           "if given, else 2)")
    spec.add_argument("--prompt-lookup-max", type=positive_int, default=None,
                      help="ngram: the longest suffix looked up, tried first (default: "
                           "--prompt-lookup-min if given, else 5)")
    spec.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                      help="no drafts in a step with more running requests than this "
                           "(default: 8; 0: never off)")
    parser.add_argument("--cluster-secret-file", default=None,
                        help="several nodes: a file holding the secret every node shares "
                             "(default: $KVFLOW_CLUSTER_SECRET); it authenticates and encrypts "
                             "EngineCore's sockets and signs what node 0 puts in its store. "
                             "Make one with: python -c \"import secrets; "
                             "print(secrets.token_hex(32))\" > secret; chmod 600 secret")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def engine_options(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from kvflow.config import EngineOptions
    return EngineOptions(**{name: getattr(args, name)
                            for name in EngineOptions.__struct_fields__})


def start_cluster(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The frontend's pieces: config, tokenizer, the EngineCore child (with its workers)."""
    from kvflow.config import make_engine_config
    from kvflow.frontend.model_files import resolve_model
    from kvflow.frontend.processor import InputProcessor
    from kvflow.frontend.supervisor import SupervisedEngine
    from kvflow.frontend.tokenizer import Tokenizer
    path = resolve_model(args.model)
    config = make_engine_config(path, engine_options(args))
    tokenizer = Tokenizer(path)
    # serve restarts a dead engine in a thread (its event loop serves on meanwhile).
    engine = SupervisedEngine(config, restart_in_thread=args.command == "serve")
    logger.info("EngineCore and %d worker(s) ready: %d KV blocks of %d tokens",
                args.tensor_parallel_size,
                engine.num_blocks, config.cache.block_size)
    return engine, InputProcessor(config, tokenizer, engine.num_blocks)


def cmd_headless(args: argparse.Namespace) -> None:
    from kvflow.config import make_engine_config
    from kvflow.frontend.model_files import resolve_model
    from kvflow.workers.headless import run_headless
    config = make_engine_config(resolve_model(args.model), engine_options(args))
    sys.exit(run_headless(config))


def cmd_serve(args: argparse.Namespace) -> None:
    import asyncio

    if args.headless:
        return cmd_headless(args)

    from kvflow.frontend.api.api_server import ServeOptions, bind_http, serve
    run: Any = asyncio.run                 # uvloop where it exists (not on Windows)
    with contextlib.suppress(ImportError):
        import uvloop
        run = uvloop.run
    opts = ServeOptions(host=args.host, port=args.port, api_key=args.api_key,
                        model_name=args.served_model_name or args.model,
                        client_address=args.client_address,
                        max_waiting_requests=args.max_waiting_requests, max_n=args.max_n,
                        max_request_bytes=args.max_request_bytes,
                        max_connections=args.max_connections, http_timeout=args.http_timeout,
                        shutdown_timeout=args.shutdown_timeout,
                        auto_tool_parser=_auto_tool_parser(args))
    try:
        sockets = bind_http(args.host, args.port)   # before the cluster takes any free ports
    except OSError as e:
        sys.exit(f"error: {e}")
    engine, processor = start_cluster(args)
    processor.prepare_grammars()          # in the background: structured outputs are common
    try:
        run(serve(engine, processor, opts, sockets))
    finally:
        for sock in sockets:
            sock.close()
        engine.shutdown()
        logger.info("stopped")


def _auto_tool_parser(args: argparse.Namespace) -> str | None:
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        sys.exit("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
    return args.tool_call_parser if args.enable_auto_tool_choice else None


def cmd_generate(args: argparse.Namespace) -> None:
    import time

    from kvflow.ipc.messages import EngineRequest
    from kvflow.sampling_params import SamplingParams
    engine, processor = start_cluster(args)
    try:
        prompt = args.prompt
        if not args.raw:
            prompt = processor.render_chat([{"role": "user", "content": prompt}])
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                max_tokens=args.max_tokens)
        tracker = processor.make_tracker("0", prompt, params)
        engine.add_requests([EngineRequest("0", tracker.output.prompt_token_ids, params,
                                           time.time())])
        finished = False
        while not finished:
            outputs = engine.get_outputs()
            for delta in outputs.outputs if outputs else []:
                finished = finished or tracker.apply(delta, engine.abort)
                print(tracker.new_text(), end="", flush=True)
        print()
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="launch.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the cluster and serve the OpenAI-compatible "
                                         "HTTP API (and kvflow's ZMQ clients)")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP address to bind")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every HTTP path but "
                            "/health, /metrics and /version, and the key from kvflow clients "
                            "(--client-address)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients send and /v1/models lists (default: the "
                            "--model value)")
    serve.add_argument("--client-address", default=None,
                       help="also serve kvflow.Client / AsyncClient here (tcp://HOST:PORT or "
                            "ipc://PATH); off when not given")
    serve.add_argument("--max-waiting-requests", type=positive_int, default=None,
                       help="answer 503 (with Retry-After; kvflow clients: "
                            "EngineOverloadedError) at once when this many requests already "
                            "wait for the engine, each of n choices counting as one (default: "
                            "4 x --max-num-seqs)")
    serve.add_argument("--max-n", type=positive_int, default=None,
                       help="largest n (choices per prompt) a request may ask for (default: "
                            "--max-num-seqs)")
    serve.add_argument("--max-request-bytes", type=positive_int, default=4 * 2**20,
                       help="largest request body (HTTP: 413 beyond it, before it is read "
                            "whole) and kvflow client message (default: 4 MiB)")
    serve.add_argument("--max-connections", type=positive_int, default=1024,
                       help="open HTTP connections at most; beyond it a new connection is "
                            "closed at once (default: 1024)")
    serve.add_argument("--http-timeout", type=positive_float, default=30.0,
                       help="seconds an HTTP client has to send a whole request after "
                            "connecting or after its previous response; then the connection "
                            "is closed (default: 30)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM/SIGINT: refuse new requests (503), turn /health 503, "
                            "let requests in flight finish for up to this many seconds, then "
                            "abort the rest (finish_reason 'abort') and exit 0; a second "
                            "signal stops at once; 0: stop at once (default: 30)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="chat: let the model decide whether to call the request's tools "
                            "(tool_choice \"auto\", OpenAI's default when tools are given), "
                            "its calls parsed by --tool-call-parser; without it, \"auto\" is "
                            "a 400 (\"required\" and named functions always work)")
    serve.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                       help="how tool calls are read from the model's text with "
                            "--enable-auto-tool-choice: hermes = <tool_call>{\"name\", "
                            "\"arguments\"}</tool_call> (Hermes, Qwen2/3, and what templates "
                            "without tool support are prompted with)")
    serve.add_argument("--headless", action="store_true",
                       help="run only this node's workers (--node-rank >= 1), no HTTP server; "
                            "exits when node 0's engine stops or is gone")
    add_engine_args(serve)
    gen = sub.add_parser("generate", help="run one prompt and stream the answer")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as is, without the chat template")
    add_engine_args(gen)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("kvflow").setLevel(args.log_level)
    try:
        {"serve": cmd_serve, "generate": cmd_generate}[args.command](args)
    except (ValueError, RuntimeError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
