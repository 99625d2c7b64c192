"""One config tree, resolved (every "auto" decided) before any process starts, then frozen.

The structs are msgspec Structs so the resolved tree can travel to child processes as bytes.
Values only known at run time (how many KV blocks fit) travel back in a message instead.
"""
from __future__ import annotations

import json
import os

import msgspec

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "flash_attn")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = (None, "int8")
COPY_OPTIONS = ("auto", "on", "off")     # cpu_prefill_copy, cpu_one_row_copy
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8")
FLASH_ATTN_BLOCK_SIZE = 256        # flash-attn's paged KV API wants blocks of a multiple of this
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    path: str                      # a local HF folder: config.json, *.safetensors, tokenizer
    architecture: str
    dtype: str                     # or "auto": decided by the worker (workers/hardware.py)
    load_format: str               # "safetensors" | "dummy"
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    hf_config: dict                # config.json as read; workers build their modules from it


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    block_size: int
    enable_prefix_caching: bool
    # None: decided by each worker, which knows its device: on CPU a share of the free RAM
    # (auto_kv_cache_gb), on CUDA what gpu_memory_utilization leaves after a profiling run.
    kv_cache_memory_gb: float | None
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"    # "bfloat16": also under float32 arithmetic (CPU); "int8"


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    max_num_seqs: int
    max_num_batched_tokens: int
    # The next step is planned and sent while the current one runs (docs/design.md, "Async
    # scheduling"); the worker keeps the tokens it samples. None: on where the worker finds
    # a CUDA device (it says so in WorkerReady), off on CPU.
    async_scheduling: bool | None = None


class ParallelConfig(msgspec.Struct, frozen=True, kw_only=True):
    tensor_parallel_size: int = 1
    # Several nodes (docs/deploy.md): tensor_parallel_size / nnodes ranks on each, node 0 runs
    # the frontend and EngineCore, the others are --headless. The torch.distributed store
    # listens on master_addr:master_port (None: a free local port; one node only).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    startup_timeout: float = 300.0     # seconds for every rank to load and join
    # Several nodes: the file holding the shared cluster secret (None: $KVFLOW_CLUSTER_SECRET).
    # Only the path travels (to children, and in ClusterInfo through the store); each process
    # reads the secret itself (kvflow/ipc/auth.py).
    cluster_secret_file: str | None = None

    @property
    def store_port(self) -> int:
        """master_port where the nodes meet (always decided when nnodes > 1)."""
        assert self.master_port is not None, "one node: the port is chosen at start-up"
        return self.master_port

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def local_rank(self, rank: int) -> int:
        """A rank's index on its own node (its GPU there: cuda:local_rank)."""
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Speculative decoding (kvflow/core/speculative.py): up to `num_speculative_tokens` drafts
    per request, proposed by EngineCore (ngram) or by a draft model in worker rank 0
    (draft_model, kvflow/workers/draft_model.py), verified by the target model in one step."""
    method: str                        # "ngram": prompt lookup; "draft_model": a smaller model
    num_speculative_tokens: int
    prompt_lookup_min: int = 0         # ngram: n-gram sizes tried, longest first
    prompt_lookup_max: int = 0
    draft: ModelConfig | None = None   # draft_model: the draft (same tokenizer as the target)
    # No drafts in a step with more running requests than this (the batch is compute-bound
    # there, and rejected drafts cost throughput); 0: never off.
    disable_by_batch_size: int = 0
    # A request whose recent drafts are accepted less often than this stops drafting for a
    # while (its drafts cost more than they bring).
    min_acceptance_rate: float = 0.2


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    seed: int
    attention_backend: str         # "auto" is resolved by the worker (it needs torch, CUDA)
    num_threads: int | None        # torch threads per worker; None: workers/cpu_threads.py
    device: str = "auto"           # "auto" -> cuda:rank when CUDA is available, else cpu
    enforce_eager: bool = False    # True: no CUDA graphs for decode steps
    quantization: str | None = None    # "int8": W8A8 linears on CPU (layers/linear.py)
    # CPU: oneDNN's own copy of the weights the gemv kernel holds in panels, for prompt-sized
    # products: "auto" (while it takes at most an eighth of the RAM available), "on", "off"
    # (layers/ops.py keep_copy); the 12-bit copy of the weights the decode steps of one to a
    # few requests read (1.5 bytes a parameter): "auto" (likewise), "on", "off"
    cpu_prefill_copy: str = "auto"
    cpu_one_row_copy: str = "auto"
    # Self-healing (kvflow/frontend/supervisor.py): a step unfinished after step_timeout
    # (+ a share scaled by its tokens) is a hung worker; EngineCore silent that long is hung;
    # the frontend restarts a dead or hung engine up to max_engine_restarts times in
    # RESTART_WINDOW seconds, resuming every unfinished request.
    step_timeout: float = 60.0
    max_engine_restarts: int = 3
    # Structured outputs (kvflow/core/grammar.py): a constraint not compiled within this many
    # seconds is refused (a 400), so no request waits on a pathological grammar.
    grammar_compile_timeout: float = 10.0
    speculative: SpeculativeConfig | None = None     # None: no speculative decoding


def cache_dir() -> str:
    """Where kvflow keeps what it builds once: the default model, the C kernels.
    `KVFLOW_CACHE` moves it (an empty value counts as unset)."""
    return os.environ.get("KVFLOW_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                           "kvflow")


def read_hf_config(path: str) -> dict:
    """Read config.json of a model folder, with a clear error when it is not a model."""
    if not os.path.isdir(path):
        raise ValueError(f"model={path!r}: no such directory (and not a known model name)")
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"model={path!r}: no config.json in the folder")
    with open(config_file) as f:
        return json.load(f)


def _check_model(path: str, hf: dict, load_format: str, what: str) -> str:
    """The architecture of a model folder (the target, or a draft model), checked."""
    if load_format != "dummy" and not any(name.endswith(".safetensors")
                                          for name in os.listdir(path)):
        raise ValueError(f"{what}={path!r}: no *.safetensors weights in the folder")
    arch = (hf.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{what}={path!r}: architecture {arch!r} is not one of "
                         f"{SUPPORTED_ARCHITECTURES}")
    return arch


def _eos_token_ids(path: str, hf: dict) -> tuple[int, ...]:
    """EOS ids from generation_config.json (which may list several) or config.json."""
    eos = hf.get("eos_token_id")
    gen_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_file):
        with open(gen_file) as f:
            eos = json.load(f).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _check_dtype(dtype: str) -> str:
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {('auto',) + DTYPES}")
    return dtype


def available_memory_bytes() -> int:
    """The RAM available now (Linux's MemAvailable), or 4 GiB where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 4 << 30


def auto_kv_cache_gb() -> float:
    """A safe share of the RAM available now: 10%, at most 2 GiB, at least 0.25 GiB."""
    return max(0.25, min(2.0, 0.1 * available_memory_bytes() / 2**30))


class EngineOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a user may set about an engine, in one place: `LLM(model, **options)`,
    `launch.py`'s flags (one per field, same name) and `make_engine_config` all take these.
    `None` and "auto" are decided by make_engine_config (or, for what needs the device, by the
    worker)."""
    tensor_parallel_size: int = 1
    dtype: str = "auto"                   # auto: CPU: bfloat16 where native, else float32
    #                                       on bfloat16 weights; CUDA: the checkpoint's
    #                                       (workers/hardware.py)
    seed: int = 0                         # of unseeded sampling
    max_model_len: int | None = None      # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    async_scheduling: bool | None = None  # plan step N+1 while step N runs; None: on
    #                                       where allowed (one rank, no speculation)
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_gb: float | None = None
    kv_cache_dtype: str = "auto"          # or "bfloat16", "int8" (worker.py _kv_dtype)
    load_format: str = "safetensors"      # or "dummy": random weights (benchmarks)
    attention_backend: str = "auto"
    num_threads: int | None = None        # None: workers/cpu_threads.py chooses, per node
    device: str = "auto"
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    quantization: str | None = None       # "int8": W8A8 linears, CPU only
    cpu_prefill_copy: str = "auto"        # or "on", "off": oneDNN's copy for prompts (CPU)
    cpu_one_row_copy: str = "auto"        # or "on", "off": 12-bit weights, few requests (CPU)
    nnodes: int = 1                       # multi-node tensor parallelism (docs/deploy.md)
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None        # None: a free port (one node), 29501 (several)
    startup_timeout: float = 300.0        # seconds for every rank (every node) to be ready
    step_timeout: float = 60.0            # a step unfinished after this (+ per token) hung
    max_engine_restarts: int = 3          # restarts within 10 minutes before giving up
    cluster_secret_file: str | None = None  # several nodes: the shared secret (or the env var)
    grammar_compile_timeout: float = 10.0  # structured outputs: seconds to compile one
    # Speculative decoding, vLLM's names (LLM(..., speculative_config={"method": "ngram",
    # "num_speculative_tokens": 4, ...}) sets these too): method None is off.
    speculative_method: str | None = None          # "ngram" | "draft_model"
    speculative_model: str | None = None           # draft_model: the draft's folder
    num_speculative_tokens: int | None = None      # None: 4
    prompt_lookup_min: int | None = None           # None: prompt_lookup_max if set, else 2
    prompt_lookup_max: int | None = None           # None: prompt_lookup_min if set, else 5
    speculative_disable_by_batch_size: int | None = None   # None: 8 (0: never off)


def make_engine_config(model_path: str, options: EngineOptions | None = None,
                       **overrides: object) -> EngineConfig:
    """Validate every user value and decide every "auto"; raises ValueError naming the field."""
    if "speculative_config" in overrides:       # vLLM's shape: LLM(..., speculative_config={})
        overrides.update(speculative_options(overrides.pop("speculative_config")))  # type: ignore[arg-type]
    try:
        o = msgspec.structs.replace(options or EngineOptions(), **overrides)
    except TypeError as e:                         # an option that does not exist: say which
        raise TypeError(f"{e}; the engine options are "
                        f"{', '.join(EngineOptions.__struct_fields__)}") from None
    hf = read_hf_config(model_path)
    if o.load_format not in ("safetensors", "dummy"):
        raise ValueError(f"load_format={o.load_format!r} must be 'safetensors' or 'dummy'")
    arch = _check_model(model_path, hf, o.load_format, "model")
    hf_max_len = int(hf.get("max_position_embeddings", 2048))
    max_model_len = o.max_model_len or hf_max_len
    _check_positive(tensor_parallel_size=o.tensor_parallel_size, max_model_len=max_model_len,
                    max_num_seqs=o.max_num_seqs, max_num_batched_tokens=o.max_num_batched_tokens,
                    block_size=o.block_size)
    if max_model_len > hf_max_len:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                         f"max_position_embeddings={hf_max_len}")
    if o.block_size & (o.block_size - 1):
        raise ValueError(f"block_size={o.block_size} must be a power of two")
    if o.kv_cache_memory_gb is not None and o.kv_cache_memory_gb <= 0:
        raise ValueError(f"kv_cache_memory_gb={o.kv_cache_memory_gb} must be > 0")
    if o.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={o.kv_cache_dtype!r} must be one of "
                         f"{KV_CACHE_DTYPES} (no fp8 KV cache; int8 is the CPU's 8-bit one)")
    _check_execution(o.attention_backend, o.device, o.block_size, o.gpu_memory_utilization)
    if o.kv_cache_dtype == "int8" and (o.device == "cuda"
                                       or o.attention_backend not in ("auto", "cpu")):
        raise ValueError(f"kv_cache_dtype='int8' needs the cpu attention backend (kvflow's C "
                         f"kernels on CPU); got device={o.device!r}, attention_backend="
                         f"{o.attention_backend!r}")
    for name in ("cpu_prefill_copy", "cpu_one_row_copy"):
        if getattr(o, name) not in COPY_OPTIONS:
            raise ValueError(f"{name}={getattr(o, name)!r} must be one of {COPY_OPTIONS}")
    if o.quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={o.quantization!r} must be one of {QUANTIZATIONS}")
    if o.quantization == "int8" and o.device == "cuda":
        raise ValueError("quantization='int8' runs on CPU (oneDNN's int8 GEMM), but "
                         "device='cuda'")
    if not isinstance(o.step_timeout, (int, float)) or not o.step_timeout > 0:
        raise ValueError(f"step_timeout={o.step_timeout!r} must be > 0 seconds")
    if (not isinstance(o.grammar_compile_timeout, (int, float))
            or not o.grammar_compile_timeout > 0):
        raise ValueError(f"grammar_compile_timeout={o.grammar_compile_timeout!r} must be > 0 "
                         "seconds")
    if not isinstance(o.max_engine_restarts, int) or o.max_engine_restarts < 0:
        raise ValueError(f"max_engine_restarts={o.max_engine_restarts!r} must be >= 0")
    _check_tp(hf, o.tensor_parallel_size)
    async_scheduling = _async_scheduling(o)
    if o.async_scheduling and o.tensor_parallel_size > 1:
        raise ValueError("async_scheduling=True needs tensor_parallel_size=1: the worker "
                         "that samples feeds its tokens to the next step itself, and other "
                         "ranks would not have them")
    if o.async_scheduling and o.speculative_method is not None:
        raise ValueError("async_scheduling=True cannot run with speculative decoding "
                         f"(speculative_method={o.speculative_method!r}): the next step "
                         "would need to know how many drafts were accepted")
    parallel = _parallel_config(o)
    model = ModelConfig(
        path=os.path.abspath(model_path), architecture=arch,
        dtype=_check_dtype(o.dtype), load_format=o.load_format,
        vocab_size=int(hf["vocab_size"]), max_model_len=max_model_len,
        eos_token_ids=_eos_token_ids(model_path, hf), hf_config=hf)
    speculative = _speculative_config(o, model)
    cache = CacheConfig(
        block_size=o.block_size, enable_prefix_caching=o.enable_prefix_caching,
        kv_cache_memory_gb=o.kv_cache_memory_gb, kv_cache_dtype=o.kv_cache_dtype,
        gpu_memory_utilization=float(o.gpu_memory_utilization))
    if o.num_threads is not None and (isinstance(o.num_threads, bool)
                                      or not isinstance(o.num_threads, int) or o.num_threads < 1):
        raise ValueError(f"num_threads={o.num_threads!r} must be a positive integer (or None: "
                         "one per physical core this process may use, split between ranks)")
    return EngineConfig(
        model=model, cache=cache,
        scheduler=SchedulerConfig(max_num_seqs=o.max_num_seqs,
                                  max_num_batched_tokens=o.max_num_batched_tokens,
                                  async_scheduling=async_scheduling),
        parallel=parallel,
        seed=o.seed, attention_backend=o.attention_backend, num_threads=o.num_threads,
        device=o.device,
        enforce_eager=bool(o.enforce_eager), quantization=o.quantization,
        cpu_prefill_copy=o.cpu_prefill_copy, cpu_one_row_copy=o.cpu_one_row_copy,
        step_timeout=float(o.step_timeout), max_engine_restarts=o.max_engine_restarts,
        grammar_compile_timeout=float(o.grammar_compile_timeout), speculative=speculative)


def _async_scheduling(o: EngineOptions) -> bool | None:
    """None ("auto"): on wherever nothing rules it out (one rank, no speculative decoding),
    CUDA and CPU alike; the worker reports it in WorkerReady. On CPU the overlap costs the
    forward a little (EngineCore's work competes with the worker's threads) and saves more:
    the 0.8-1.1 ms a step the worker waited for the next plan (docs/design.md)."""
    if o.async_scheduling is not None:
        return bool(o.async_scheduling)
    if o.tensor_parallel_size > 1 or o.speculative_method is not None:
        return False
    return None


SPECULATIVE_METHODS = ("ngram", "draft_model")
# vLLM's speculative_config keys -> EngineOptions fields.
SPECULATIVE_CONFIG_KEYS = {"method": "speculative_method",
                           "model": "speculative_model",
                           "num_speculative_tokens": "num_speculative_tokens",
                           "prompt_lookup_min": "prompt_lookup_min",
                           "prompt_lookup_max": "prompt_lookup_max",
                           "disable_by_batch_size": "speculative_disable_by_batch_size"}


def speculative_options(speculative_config: dict | None) -> dict:
    """vLLM's `speculative_config` dict as EngineOptions fields; unknown keys are refused."""
    if speculative_config is None:
        return {}
    if not isinstance(speculative_config, dict):
        raise ValueError(f"speculative_config={speculative_config!r} must be a dict such as "
                         "{'method': 'ngram', 'num_speculative_tokens': 4}")
    unknown = sorted(set(speculative_config) - set(SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown keys {unknown}; the keys are "
                         f"{sorted(SPECULATIVE_CONFIG_KEYS)}")
    return {SPECULATIVE_CONFIG_KEYS[k]: v for k, v in speculative_config.items()}


def _speculative_config(o: EngineOptions, target: ModelConfig) -> SpeculativeConfig | None:
    set_fields = {name: getattr(o, name) for name in SPECULATIVE_CONFIG_KEYS.values()
                  if name != "speculative_method" and getattr(o, name) is not None}
    method = o.speculative_method
    if method is None and o.speculative_model is not None:
        method = "draft_model"          # as vLLM: a draft model alone says the method
    if method is None:
        if set_fields:
            raise ValueError(f"{', '.join(set_fields)} set without speculative_method "
                             f"(one of {SPECULATIVE_METHODS})")
        return None
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_method={method!r} must be one of {SPECULATIVE_METHODS}")
    k = 4 if o.num_speculative_tokens is None else o.num_speculative_tokens
    _check_positive(num_speculative_tokens=k)
    if k > 16:
        raise ValueError(f"num_speculative_tokens={k} must be <= 16")
    off = o.speculative_disable_by_batch_size
    off = 8 if off is None else off
    if not isinstance(off, int) or off < 0:
        raise ValueError(f"speculative_disable_by_batch_size={off!r} must be >= 0 (0: never)")
    if method == "draft_model":
        lookup = [f for f in ("prompt_lookup_min", "prompt_lookup_max") if f in set_fields]
        if lookup:
            raise ValueError(f"{', '.join(lookup)} apply to speculative_method='ngram', not "
                             "'draft_model'")
        return SpeculativeConfig(method=method, num_speculative_tokens=k,
                                 disable_by_batch_size=off,
                                 draft=_draft_model_config(o.speculative_model, target))
    if o.speculative_model is not None:
        raise ValueError(f"speculative_model={o.speculative_model!r} is for "
                         "speculative_method='draft_model', not 'ngram'")
    low, high = o.prompt_lookup_min, o.prompt_lookup_max
    low, high = (low if low is not None else (high if high is not None else 2),
                 high if high is not None else (low if low is not None else 5))
    _check_positive(prompt_lookup_min=low, prompt_lookup_max=high)
    if high > 64:
        raise ValueError(f"prompt_lookup_max={high} must be <= 64")
    if low > high:
        raise ValueError(f"prompt_lookup_min={low} must be <= prompt_lookup_max={high}")
    return SpeculativeConfig(method=method, num_speculative_tokens=k, prompt_lookup_min=low,
                             prompt_lookup_max=high, disable_by_batch_size=off)


def _draft_model_config(path: str | None, target: ModelConfig) -> ModelConfig:
    """The draft model's config: a local folder (or "default") with the target's tokenizer
    (same vocabulary, token for token), long enough for max_model_len, run in the target's
    dtype (and weights format: dummy weights for a dummy target)."""
    if path is None:
        raise ValueError("speculative_method='draft_model' needs speculative_model (the "
                         "draft's folder)")
    from kvflow.frontend.model_files import resolve_model   # "default" -> its folder
    path = os.path.abspath(resolve_model(path))
    hf = read_hf_config(path)
    arch = _check_model(path, hf, target.load_format, "speculative_model")
    if int(hf["vocab_size"]) != target.vocab_size:
        raise ValueError(f"speculative_model={path!r}: vocab_size {hf['vocab_size']} differs "
                         f"from the target's {target.vocab_size} (the draft must share the "
                         "target's tokenizer)")
    draft_vocab, target_vocab = _vocab(path), _vocab(target.path)
    if draft_vocab is not None and target_vocab is not None and draft_vocab != target_vocab:
        raise ValueError(f"speculative_model={path!r}: its tokenizer.json's vocabulary "
                         "differs from the target's (the draft must share the tokenizer)")
    if int(hf.get("max_position_embeddings", 2048)) < target.max_model_len:
        raise ValueError(f"speculative_model={path!r}: max_position_embeddings "
                         f"{hf.get('max_position_embeddings', 2048)} < max_model_len="
                         f"{target.max_model_len}")
    return ModelConfig(path=path, architecture=arch, dtype=target.dtype,
                       load_format=target.load_format, vocab_size=target.vocab_size,
                       max_model_len=target.max_model_len,
                       eos_token_ids=target.eos_token_ids, hf_config=hf)


def _vocab(path: str) -> dict | None:
    """tokenizer.json's token -> id map (None when the folder has none)."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return (json.load(f).get("model") or {}).get("vocab")


def _check_execution(attention_backend: str, device: str, block_size: int,
                     gpu_memory_utilization: float) -> None:
    """What can be checked without torch; the worker checks the rest (CUDA, flash-attn)."""
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={attention_backend!r} must be one of "
                         f"{ATTENTION_BACKENDS}")
    if device not in DEVICES:
        raise ValueError(f"device={device!r} must be one of {DEVICES}")
    if attention_backend == "flash_attn" and device == "cpu":
        raise ValueError("attention_backend='flash_attn' needs CUDA, but device='cpu'")
    if attention_backend == "flash_attn" and block_size % FLASH_ATTN_BLOCK_SIZE:
        raise ValueError(f"attention_backend='flash_attn' needs block_size to be a multiple of "
                         f"{FLASH_ATTN_BLOCK_SIZE} (its paged KV API), got block_size={block_size}")
    if (not isinstance(gpu_memory_utilization, (int, float))
            or not 0 < gpu_memory_utilization <= 1):
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization!r} must be in (0, 1]")


def _check_tp(hf: dict, tp: int) -> None:
    """Fail before any process starts when the model cannot be split tp ways."""
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads", heads))
    inter = int(hf["intermediate_size"])
    if heads % tp or inter % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_attention_heads={heads} "
                         f"and intermediate_size={inter}")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_key_value_heads="
                         f"{kv_heads} or be a multiple of it (KV heads are then replicated)")


def _parallel_config(o: EngineOptions) -> ParallelConfig:
    tp, nnodes, node_rank = o.tensor_parallel_size, o.nnodes, o.node_rank
    _check_positive(nnodes=nnodes)
    if tp % nnodes:
        raise ValueError(f"tensor_parallel_size={tp} must be a multiple of nnodes={nnodes} "
                         "(every node runs the same number of ranks)")
    if not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank={node_rank!r} must be in [0, nnodes={nnodes})")
    port = o.master_port if o.master_port is not None or nnodes == 1 else 29501
    if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
        raise ValueError(f"master_port={port!r} must be a TCP port (1-65535)")
    if not o.master_addr:
        raise ValueError("master_addr must name node 0 (an IP address or a host name)")
    if not isinstance(o.startup_timeout, (int, float)) or not o.startup_timeout > 0:
        raise ValueError(f"startup_timeout={o.startup_timeout!r} must be > 0 seconds")
    secret_file = None
    if nnodes > 1:                 # refused up front without one, on every node
        from kvflow.ipc.auth import check_secret
        secret_file = check_secret(o.cluster_secret_file)
    return ParallelConfig(tensor_parallel_size=tp, nnodes=nnodes, node_rank=node_rank,
                          master_addr=o.master_addr, master_port=port,
                          startup_timeout=float(o.startup_timeout),
                          cluster_secret_file=secret_file)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
