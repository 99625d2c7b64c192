"""Decode steps in one C call (workers/fused_decode.py, kernels/cpu_decode.c) against the
model's own forward (layers/ and models/llama.py, which `enforce_eager=True` keeps): the
same greedy tokens in float32 on the default model (batches of one to eight, draft
verifications), on Qwen2 (q/k/v bias) and Qwen3 (q/k norms), under tensor parallelism 2, and
with int8 weights; and one step's hidden states close to the unfused forward's (also with an
int8 KV cache)."""
from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.workers.model_runner import ModelRunner

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):\n",
           "1, 2, 3, 5, 8, 13, 21,", "Write a haiku about the sea.",
           "SELECT name, COUNT(*) FROM orders WHERE", "Once upon a time,",
           "Translate to French: I would like a cup of coffee, please."]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def greedy(path: str, prompts: list, **options: object) -> list[list[int]]:
    with LLM(path, in_process=True, kv_cache_memory_gb=0.2, **options) as llm:
        assert (runner(llm).fused is None) == bool(options.get("enforce_eager"))
        batched = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts[:3]]
    return batched + alone


def runner(llm: LLM) -> ModelRunner:
    """The in-process engine's model runner."""
    from kvflow.frontend.engine_client import InProcessEngine
    assert isinstance(llm.engine, InProcessEngine)
    return llm.engine.worker.runner


def test_default_model_fused_equals_unfused(default_model: str) -> None:
    """Eight requests (steps of 8 tokens, then fewer as none finish early) and one alone."""
    fused = greedy(default_model, PROMPTS, dtype="float32")
    assert fused == greedy(default_model, PROMPTS, dtype="float32", enforce_eager=True)


def test_bf16_weights_under_float32_fused_equals_unfused(default_model: str,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """dtype="auto" on a CPU without bfloat16 arithmetic (flags faked): the fused step reads
    the bfloat16 copy of each weight, as the unfused gemv products do (oneDNN's float32 one
    above four rows holds the same values); its greedy steps take their tokens from the
    int8 copy of the LM head plus exact rows (workers/greedy_head.py), the unfused ones from
    the full LM head and the sampler."""
    monkeypatch.setenv("KVFLOW_CPU_FLAGS", "sse4_2 avx avx2 fma f16c bmi2")
    fused = greedy(default_model, PROMPTS)
    assert fused == greedy(default_model, PROMPTS, enforce_eager=True)


def test_draft_verification_steps_run_fused(default_model: str) -> None:
    """n-gram drafts: a request's token and its drafts (several rows) in one fused step give
    the unfused forward's tokens."""
    prompt = "Copy this code exactly:\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n"
    spec = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 0}
    outs = []
    for eager in (False, True):
        with LLM(default_model, in_process=True, dtype="float32", kv_cache_memory_gb=0.2,
                 speculative_config=spec, enforce_eager=eager) as llm:
            outs.append(llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40),
                                     use_tqdm=False)[0].token_ids)
            assert llm.last_stats.spec_num_accepted_tokens > 0
    assert outs[0] == outs[1]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_fused_equals_unfused(tiny_models: dict[str, str], arch: str) -> None:
    path = tiny_models[arch]
    assert greedy(path, PROMPTS[:4], dtype="float32") == greedy(path, PROMPTS[:4],
                                                                  dtype="float32",
                                                                  enforce_eager=True)


def test_tensor_parallel_2_fused_equals_unfused(default_model: str, tmp_path: str) -> None:
    """TP=2 in the real cluster: the fused sublayers' outputs are all-reduced between the C
    calls; tokens equal TP=1's unfused ones."""
    from model_helpers import make_tiny_model
    path = make_tiny_model(default_model, str(tmp_path), "llama", initializer_range=0.05)
    reference = greedy(path, PROMPTS[:4], dtype="float32", enforce_eager=True)
    with LLM(path, tensor_parallel_size=2, num_threads=1, dtype="float32",
             kv_cache_memory_gb=0.05) as llm:
        batched = [o.token_ids for o in llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)]
        alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS[:3]]
    assert batched + alone == reference


def test_int8_fused_equals_unfused(default_model: str) -> None:
    """int8 as this CPU runs it: decode steps of at most four rows (eight with AVX512-VNNI
    but no AMX) are W8A16 on the gemv kernel in both paths (layers/linear.py Int8Linear),
    so fused and unfused (the same engine with its fused path taken away) give the same
    tokens, batched and alone."""
    from kvflow.workers.layers.linear import Int8Linear
    if Int8Linear.works() is not None:
        pytest.skip(f"int8 does not run here: {Int8Linear.works()}")
    tokens = []
    with LLM(default_model, in_process=True, dtype="float32", quantization="int8",
             kv_cache_memory_gb=0.2, enable_prefix_caching=False) as llm:
        run = runner(llm)
        fused = run.fused
        assert fused is not None
        for path in (fused, None):
            run.fused = path
            tokens.append([o.token_ids for o in llm.generate(PROMPTS[:4], GREEDY,
                                                             use_tqdm=False)]
                          + [llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].token_ids])
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("model,dtype", [("default", "float32"), ("qwen2", "bfloat16")])
def test_int8_without_vnni_steps_past_4_tokens_run_kvflows_gemm_fused(
        default_model: str, tiny_models: dict[str, str], model: str, dtype: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 as an AVX2 CPU runs it (flags faked): past four rows every linear multiplies
    7-bit weights by 8-bit activations on kvflow's GEMM (kernels/cpu_gemm_i8.c) in the model's
    forward and in the fused step alike, so steps of up to 32 tokens run fused and a
    20-request step gives the unfused hidden states: the same bits in float32 (and six
    requests the same greedy tokens), bfloat16's rounding with Qwen2's q/k/v biases."""
    from kvflow.kernels import cpu_ops
    from kvflow.workers.fused_decode import FusedDecode
    from kvflow.workers.layers.linear import Int8Linear
    if Int8Linear.works() is not None or not cpu_ops.i8_gemm_available():
        pytest.skip("int8 or kvflow's int8 GEMM does not run here")
    monkeypatch.setenv("KVFLOW_CPU_FLAGS", "sse4_2 avx avx2 fma f16c bmi2")
    path = default_model if model == "default" else tiny_models[model]
    # No prefix cache: the second run recomputes every prompt as the first did (a prefill
    # over cached keys sums in another order, and 8-bit activations can round the other way).
    with LLM(path, in_process=True, dtype=dtype, quantization="int8",
             kv_cache_memory_gb=0.2, enable_prefix_caching=False) as llm:
        run = runner(llm)
        assert run.fused is not None and run.fused.max_tokens == 32
        assert FusedDecode.gemv_rows(run.model) > 32
        assert run.model.model.layers[0].mlp.down_proj.prepared.own_gemm
        run.model(*step_inputs(run, [(40, 40)] * 20))
        step = step_inputs(run, [(1, 41)] * 20)
        fused = run.fused.forward(*step).clone()               # type: ignore[arg-type]
        unfused = run.model(*step)
        if dtype == "bfloat16":
            rel = (fused.float() - unfused.float()).norm(dim=1) / unfused.float().norm(dim=1)
            assert float(rel.max()) < 0.03, rel
            return
        assert torch.equal(fused, unfused)
        fused_tokens = [o.token_ids for o in llm.generate(PROMPTS[:6], GREEDY, use_tqdm=False)]
        run.fused = None
        unfused_tokens = [o.token_ids for o in llm.generate(PROMPTS[:6], GREEDY,
                                                            use_tqdm=False)]
    assert fused_tokens == unfused_tokens


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_step_matches_the_unfused_forward(default_model: str, dtype: torch.dtype,
                                              kv_cache_dtype: str) -> None:
    """Three requests prefilled with 40 tokens, then a step of two decodes and a three-token
    verification span straight through both paths: hidden states agree to the dtype's
    rounding (bfloat16: the unfused path is itself ~1% per row from float32). With an int8
    KV cache each path quantizes the step's new keys and values itself, and a value a few
    ulps from a rounding boundary may land a step apart: within 1% a row then."""
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    with LLM(default_model, in_process=True, dtype=name, kv_cache_memory_gb=0.2,
             kv_cache_dtype=kv_cache_dtype) as llm:
        run = runner(llm)
        assert run.fused is not None
        prefill = step_inputs(run, [(40, 40)] * 3)
        run.model(*prefill)
        step = step_inputs(run, [(1, 41), (1, 41), (3, 43)])
        fused = run.fused.forward(*step)                       # type: ignore[arg-type]
        unfused = run.model(*step)
    rel = (fused.float() - unfused.float()).norm(dim=1) / unfused.float().norm(dim=1)
    if dtype == torch.float32 and kv_cache_dtype == "auto":
        torch.testing.assert_close(fused, unfused, atol=2e-4, rtol=1e-4)
    elif dtype == torch.float32:
        assert float(rel.max()) < 0.01, rel
    else:
        assert float(rel.max()) < 0.03, rel


def step_inputs(run: ModelRunner, spans: list[tuple[int, int]]) -> tuple:
    """(input_ids, positions, metadata) for requests i = 0, 1, ... each in blocks 4i..4i+3,
    computing `n` tokens that end at context length `ctx`, for each (n, ctx)."""
    import numpy as np
    from kvflow.workers.attention import SeqSpan
    decodes, prefills, ids, pos, slots, row = [], [], [], [], [], 0
    for i, (n, ctx) in enumerate(spans):
        blocks = np.arange(4 * i, 4 * i + 4)
        p = np.arange(ctx - n, ctx)
        (decodes if n == 1 else prefills).append(SeqSpan(row, n, ctx, blocks))
        ids += [(200 + 37 * i + int(j)) % 49152 for j in p]
        pos.append(p)
        slots.append(blocks[p // 16] * 16 + p % 16)
        row += n
    meta = run.backend.build_metadata(np.concatenate(slots), decodes, prefills)
    return torch.tensor(ids), torch.from_numpy(np.concatenate(pos)), meta


@pytest.mark.parametrize("mode", ["bfloat16", "auto as AVX2", "float32"])
def test_steps_of_up_to_32_tokens_run_fused_where_the_gemv_kernel_takes_them(
        default_model: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps of up to 32 tokens run fused where every linear runs 32 rows on the gemv
    kernel in the model's forward too (8 elsewhere): bfloat16 on a CPU with AMX (the weights
    in AMX tiles) or with AVX512-BF16 (in pair panels), and bfloat16 weights under float32
    (in panels; dtype="auto" on an AVX2 CPU, flags faked); not float32. The panels take up
    to 64 rows beside oneDNN's copy (cpu_prefill_copy="on"), every row count without it. A
    20-request decode step through both paths agrees to bfloat16's rounding."""
    from kvflow.kernels import cpu_ops
    from kvflow.workers.fused_decode import FusedDecode
    from kvflow.workers.layers.linear import EVERY_ROW, OneDnnLinear
    if mode == "auto as AVX2":
        monkeypatch.setenv("KVFLOW_CPU_FLAGS", "sse4_2 avx avx2 fma f16c bmi2")
    amx = cpu_ops.gemv_amx_rows() > 0
    pairs = not amx and cpu_ops.pack_pairs(torch.zeros(32, 2, dtype=torch.bfloat16)) is not None
    wide = {"bfloat16": amx and OneDnnLinear.works(torch.bfloat16) or pairs,
            "auto as AVX2": True, "float32": False}[mode]
    dtype = "auto" if mode == "auto as AVX2" else mode
    with LLM(default_model, in_process=True, dtype=dtype, kv_cache_memory_gb=0.2,
             cpu_prefill_copy="on") as llm:
        run = runner(llm)
        assert run.fused is not None
        paneled = mode == "auto as AVX2" or (mode == "bfloat16" and pairs)
        copied = OneDnnLinear.works(torch.float32 if mode == "auto as AVX2" else torch.bfloat16)
        rows = (64 if copied else EVERY_ROW) if paneled else 32
        assert FusedDecode.gemv_rows(run.model) == (rows if wide else 4)
        assert run.fused.max_tokens == (32 if wide else 8)
        assert run.fused.fits(20) == wide
        run.model(*step_inputs(run, [(40, 40)] * 20))
        step = step_inputs(run, [(1, 41)] * 20)
        fused = run.fused.forward(*step)                       # type: ignore[arg-type]
        unfused = run.model(*step)
    rel = (fused.float() - unfused.float()).norm(dim=1) / unfused.float().norm(dim=1)
    assert float(rel.max()) < 0.03, rel


@pytest.mark.parametrize("isa, flags", [
    ("avx2", "sse4_2 avx avx2 fma f16c bmi2"),
    ("avx512", "sse4_2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni")],
    ids=["avx2", "avx512"])
def test_12_bit_panels_give_the_bfloat16_panels_tokens_and_logprobs(
        default_model: str, monkeypatch: pytest.MonkeyPatch, isa: str, flags: str) -> None:
    """dtype="auto" on an AVX2 CPU and on an AVX-512 CPU without BF16 (kvflow's kernels built
    for it, its flags faked), as it runs by default there: every paneled weight has its
    12-bit copy, which products of up to cpu_ops.panels12_rows() rows read (3 with AVX2, 4
    with AVX-512 vectors: a request alone, or four together, 4 rows a step, then 3, 2 and 1;
    fused steps and the unfused LM head); the greedy tokens and logprobs are those of the
    same engine without the copies (cpu_one_row_copy="off"), bit for bit."""
    from kvflow.kernels import cpu_ops
    from kvflow.workers.layers.linear import GemvWeight
    monkeypatch.setenv("KVFLOW_CPU_FLAGS", flags)
    monkeypatch.setattr(cpu_ops, "_state", {"lib": cpu_ops.load_isa(isa)})
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    outs = []
    for copies in (True, False):
        with LLM(default_model, in_process=True, kv_cache_memory_gb=0.2,
                 cpu_one_row_copy="on" if copies else "off") as llm:
            prepared = [m.prepared for m in runner(llm).model.modules()
                        if isinstance(getattr(m, "prepared", None), GemvWeight)]
            paneled = [p for p in prepared if p.layout == "panels"]
            assert len(paneled) == 4 * 30 + 1                  # 30 layers + LM head
            assert all((p.one_row is not None) == copies for p in paneled)
            # the "avx512" build of an AVX2-only CPU has AVX2 vectors: 3 rows there too
            wide = cpu_ops.library().gemv_panel_width() == 32
            assert cpu_ops.panels12_rows() == (4 if wide else 3)
            assert all(p.one_row_rows == cpu_ops.panels12_rows() for p in paneled if copies)
            assert runner(llm).fused is not None
            # together: steps of 4 rows, then 3, 2 and 1 as the shorter ones finish
            shrinking = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                        logprobs=3) for n in (24, 18, 12, 6)]
            outs.append([llm.generate([p], params, use_tqdm=False)[0] for p in PROMPTS[:3]]
                        + llm.generate(PROMPTS[:4], shrinking, use_tqdm=False))
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert [o.logprobs for o in outs[0]] == [o.logprobs for o in outs[1]]


def test_12_bit_pair_panels_give_the_pair_panels_tokens_and_logprobs(
        default_model: str) -> None:
    """dtype="bfloat16" where the CPU multiplies bfloat16 (AVX512-BF16, no AMX; "auto" there):
    every pair-paneled weight has its 12-bit copy, which one-row products read (a request
    alone: fused steps and the LM head); the greedy tokens and logprobs are those of the
    same engine without the copies (cpu_one_row_copy="off"), bit for bit. A CPU without
    pair panels holds neither."""
    from kvflow.workers.layers import ops
    from kvflow.workers.layers.linear import GemvWeight
    here = ops.pair_panels()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    outs = []
    for copies in (True, False) if here else (True,):       # no pair panels: nothing to copy
        with LLM(default_model, in_process=True, kv_cache_memory_gb=0.2,
                 dtype="bfloat16", cpu_one_row_copy="on" if copies else "off") as llm:
            prepared = [m.prepared for m in runner(llm).model.modules()
                        if isinstance(getattr(m, "prepared", None), GemvWeight)]
            paired = [p for p in prepared if p.layout == "pairs"]
            assert len(paired) == (4 * 30 + 1 if here else 0)    # 30 layers + LM head
            assert all((p.one_row is not None) == copies for p in paired)
            assert runner(llm).fused is not None
            if here:
                outs.append([llm.generate([p], params, use_tqdm=False)[0]
                             for p in PROMPTS[:3]])
    if here:
        assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
        assert [o.logprobs for o in outs[0]] == [o.logprobs for o in outs[1]]


def test_12_bit_pair_panels_beside_amx_tiles_give_the_pair_panels_tokens_and_logprobs(
        default_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """dtype="bfloat16" where AMX takes bfloat16 (its tiles faked: the kernel's AMX path
    never runs here, as every prompt is longer than its 32 rows and one request decodes one
    row a step): one-row products read the 12-bit pair-panel copy kept beside the tiles, and
    the fused steps give the tokens and logprobs of the model's own forward
    (`enforce_eager`) and of the pair-panel engine (no AMX, the same 12-bit copy; prompts of
    more than 64 tokens, on oneDNN in both), bit for bit; so do plain greedy requests, whose
    one-row steps the greedy head takes beside the tiles too. Needs a build with
    AVX512-BF16; elsewhere no copy is made beside the tiles and no greedy head is built."""
    import random
    from kvflow.kernels import cpu_ops
    from kvflow.workers.layers.linear import GemvWeight
    here = cpu_ops.pairs_available()               # AVX512-BF16 in this build
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(70, 120))]
               for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    outs = []
    for amx, eager in ((True, False), (True, True), (False, False)) if here else ((True, False),):
        with monkeypatch.context() as patch:
            patch.setattr(cpu_ops, "gemv_amx_rows", lambda: 32 if amx else 0)
            with LLM(default_model, in_process=True, kv_cache_memory_gb=0.2,
                     dtype="bfloat16", cpu_prefill_copy="on", enforce_eager=eager,
                     enable_prefix_caching=False) as llm:     # whole prompts each time
                run = runner(llm)
                prepared = [m.prepared for m in run.model.modules()
                            if isinstance(getattr(m, "prepared", None), GemvWeight)]
                assert run.greedy is None or here
                if not here:
                    assert all(p.one_row is None for p in prepared)
                    continue
                layout = [p for p in prepared if p.layout == ("amx" if amx else "pairs")]
                assert len(layout) == 4 * 30 + 1                    # 30 layers + LM head
                assert all(p.one_row is not None for p in layout)
                assert (run.fused is None) == eager            # eager: no fused step, no head
                assert eager or run.fused.max_tokens == 32     # type: ignore[union-attr]
                assert (run.greedy is None) == eager
                assert eager or run.greedy.max_rows == (1 if amx else 8)  # type: ignore[union-attr]
                outs.append([llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
                            + [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts])
    for other in outs[1:]:
        assert [o.token_ids for o in outs[0]] == [o.token_ids for o in other]
        assert [o.logprobs for o in outs[0]] == [o.logprobs for o in other]
    if here:
        tokens = [o.token_ids for o in outs[0]]      # the head's = the full logits' argmax
        assert tokens[3:] == tokens[:3]
