"""Structured outputs (kvflow/core/grammar.py) on the real default model: every output obeys
its constraint, checked by an independent reference (jsonschema, re.fullmatch, the choice
list); unconstrained requests in the same batch give exactly what they give alone; preemption,
tensor parallelism, resumed requests and bad constraints behave."""
from __future__ import annotations

import json
import os
import re

import jsonschema
import numpy as np
import pytest
import torch

from cluster_helpers import serve_ready
from kvflow import LLM, Client, SamplingParams
from kvflow.config import make_engine_config
from kvflow.core.grammar import Grammar, StructuredOutputs
from kvflow.frontend.engine_client import InProcessEngine
from kvflow.frontend.tokenizer import Tokenizer
from kvflow.ipc.messages import EngineRequest, FinishReason
from kvflow.sampling_params import StructuredOutputsParams as Constraint
from kvflow.workers.sampler import Sampler, SamplingBatch

DTYPE = "float32"
SCHEMAS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "data",
                       "json_schemas.json")
PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                  "minItems": 1, "maxItems": 3}}}
SEEDS = (None, 1, 2)               # None: greedy


def variants(max_tokens: int, constraint: Constraint) -> list[SamplingParams]:
    """Greedy and seeded sampling with this constraint."""
    return [SamplingParams(temperature=0.0 if seed is None else 0.8, seed=seed,
                           max_tokens=max_tokens, structured_outputs=constraint)
            for seed in SEEDS]


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def llm(default_model: str):  # type: ignore[no-untyped-def]
    with LLM(default_model, dtype=DTYPE, kv_cache_memory_gb=0.3) as llm:
        yield llm


def load_schemas() -> list[dict]:
    with open(SCHEMAS) as f:
        return [s for s in json.load(f) if "llguidance" not in s.get("unsupported_in", [])]


def test_json_schemas_validate(llm: LLM) -> None:
    """Every schema of the benchmark set, greedy and two seeds: the text parses and
    validates, and the request ends because the object is complete."""
    entries = load_schemas()
    assert len(entries) >= 15
    convs, params, names = [], [], []
    for entry in entries:
        convs += [ask(entry["prompt"])] * len(SEEDS)
        params += variants(400, Constraint(json=entry["schema"]))
        names += [entry["name"]] * len(SEEDS)
    outs = llm.chat(convs, params, use_tqdm=False)
    for name, p, out in zip(names, params, outs):
        schema = p.structured_outputs.json          # type: ignore[union-attr]
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), schema,
                            format_checker=jsonschema.FormatChecker())


def test_regex_choice_and_grammars(llm: LLM) -> None:
    regexes = [r"\d{3}-\d{4}", r"(yes|no), because [a-z ]{5,40}\.",
               r"[A-Z][a-z]{1,10} [A-Z][a-z]{1,10}", r"#[0-9a-f]{6}"]
    choices = ["Paris", "London", "New York", "Tokyo"]
    gbnf = 'root ::= num "+" num ("+" num)? "=" num\nnum ::= [1-9] [0-9]?'
    lark = 'start: num "+" num ("+" num)? "=" num\nnum: /[1-9][0-9]?/'
    arith = re.compile(r"[1-9][0-9]?\+[1-9][0-9]?(\+[1-9][0-9]?)?=[1-9][0-9]?")
    convs, params, checks = [], [], []
    for rx in regexes:
        convs += [ask("Answer in the requested format: " + rx)] * len(SEEDS)
        params += variants(60, Constraint(regex=rx))
        checks += [lambda t, rx=rx: re.fullmatch(rx, t) is not None] * len(SEEDS)
    convs += [ask("Which city is the capital of France?")] * len(SEEDS)
    params += variants(20, Constraint(choice=choices))
    checks += [lambda t: t in choices] * len(SEEDS)
    for grammar in (gbnf, lark):
        convs += [ask("Write a sum of small numbers.")] * len(SEEDS)
        params += variants(40, Constraint(grammar=grammar))
        checks += [lambda t: arith.fullmatch(t) is not None] * len(SEEDS)
    outs = llm.chat(convs, params, use_tqdm=False)
    for p, out, check in zip(params, outs, checks):
        assert check(out.text), (p.structured_outputs, out.text, out.finish_reason)
    assert all(o.finish_reason == "stop" for o in outs)    # complete, not cut


def test_unconstrained_rows_unchanged_by_constrained_neighbours(llm: LLM) -> None:
    """The same unconstrained requests, alone and batched with constrained ones: exactly the
    same tokens (greedy and seeded)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "My favourite colour is"]
    plain = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=24,
                            ignore_eos=True)]
    alone = [o.token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    constrained = [SamplingParams(temperature=0.8, seed=3, max_tokens=60,
                                  structured_outputs=Constraint(json=PERSON)),
                   SamplingParams(temperature=0, max_tokens=30,
                                  structured_outputs=Constraint(regex=r"[a-z]+( [a-z]+)*\."))]
    mixed = llm.generate(["A person:"] + prompts + ["A sentence:"],
                         [constrained[0]] + plain + [constrained[1]], use_tqdm=False)
    assert [o.token_ids for o in mixed[1:4]] == alone
    # And the other way round: a seeded constrained request does not depend on its batch.
    single = llm.generate("A person:", constrained[0], use_tqdm=False)[0]
    assert single.token_ids == mixed[0].token_ids
    jsonschema.validate(json.loads(mixed[0].text), PERSON)
    assert re.fullmatch(r"[a-z]+( [a-z]+)*\.", mixed[4].text)


def test_bad_constraints_are_refused_and_the_engine_serves_on(llm: LLM) -> None:
    cases = [
        (Constraint(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
        (Constraint(json={"type": "string", "format": "no-such-format"}), "no-such-format"),
        (Constraint(json="{not json"), "not valid JSON"),
        (Constraint(regex="(unclosed"), "structured_outputs"),
        (Constraint(grammar="start: undefined_rule"), "undefined_rule"),
        (Constraint(regex="a", choice=["a"]), "exactly one of"),
        (Constraint(choice=[]), "choice"),
    ]
    for constraint, needle in cases:
        with pytest.raises(ValueError, match=re.escape(needle)):
            llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=constraint),
                         use_tqdm=False)
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.token_ids) == 4


def test_preemption_with_constrained_requests(default_model: str) -> None:
    """10 blocks of 16 tokens cannot hold six constrained requests at once: the scheduler
    preempts, and a preempted request's matcher state survives (outputs still validate)."""
    kv_gb = 10 * 737_280 / 2**30          # bytes per block: see test_engine_behaviour.py
    prompt = "Describe a person as JSON, with a long list of interesting details: " * 2
    with LLM(default_model, kv_cache_memory_gb=kv_gb, dtype=DTYPE) as llm:
        outs = llm.generate([prompt] * 6, [
            SamplingParams(temperature=0.8, seed=s, max_tokens=60,
                           structured_outputs=Constraint(json=PERSON)) for s in range(6)],
            use_tqdm=False)
        assert llm.last_stats.num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.text), PERSON)


def test_tensor_parallel_constrained(tiny_models: dict[str, str]) -> None:
    """TP=2 (a tiny random Llama with the default model's tokenizer: the default model's 9
    heads do not split in two): rank 0 samples under the masks the other rank never waits
    for; greedy and three seeds all give valid objects, whatever the random weights prefer."""
    compact = Constraint(json=PERSON, disable_any_whitespace=True)   # bounded length
    with LLM(tiny_models["llama"], tensor_parallel_size=2, dtype=DTYPE,
             kv_cache_memory_gb=0.05) as llm:
        outs = llm.generate(["A person as JSON:"] * 4, [
            SamplingParams(temperature=0.9 if s else 0.0, seed=s, max_tokens=300,
                           structured_outputs=compact) for s in range(4)], use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)


def test_compile_timeout_is_refused(default_model: str) -> None:
    """A constraint that does not compile within --grammar-compile-timeout is refused
    (naming the flag); unconstrained requests run."""
    with LLM(default_model, dtype=DTYPE, kv_cache_memory_gb=0.1, in_process=True,
             grammar_compile_timeout=1e-6) as llm:
        with pytest.raises(ValueError, match="grammar-compile-timeout"):
            llm.generate("x", SamplingParams(structured_outputs=Constraint(json=PERSON)),
                         use_tqdm=False)
        out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert len(out[0].token_ids) == 3


def run_engine(engine: InProcessEngine, requests: list[EngineRequest]) -> dict[str, list]:
    """Every request to its end: id -> (token ids, finish reason, error)."""
    engine.add_requests(requests)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    ends: dict[str, tuple] = {}
    while len(ends) < len(requests):
        outputs = engine.get_outputs()
        assert outputs is not None
        for delta in outputs.outputs:
            tokens[delta.request_id] += delta.new_token_ids
            if delta.finish_reason is not None:
                ends[delta.request_id] = (delta.finish_reason, delta.error)
    return {i: [tokens[i], *ends[i]] for i in tokens}


def test_resumed_request_continues_under_its_constraint(default_model: str) -> None:
    """A request resumed after an engine restart (EngineRequest.output_token_ids, kvflow's
    self-healing) has its matcher advanced over what it had produced: greedy goes on
    exactly as the uninterrupted run. Aborting a request while it compiles ends it."""
    config = make_engine_config(default_model, dtype=DTYPE, kv_cache_memory_gb=0.1)
    engine = InProcessEngine(config)
    prompt = Tokenizer(default_model).encode("Here is a person, as a JSON object: ")
    params = SamplingParams(temperature=0, max_tokens=120, structured_outputs=Constraint(
        json=PERSON, disable_any_whitespace=True))
    full, reason, error = run_engine(engine, [EngineRequest("a", prompt, params)])["a"]
    assert error is None and reason == FinishReason.STOP and len(full) > 8
    jsonschema.validate(json.loads(engine.core.structured.compiler.tokenizer.decode_str(full)),
                        PERSON)
    resumed = run_engine(engine, [EngineRequest("b", prompt, params, output_token_ids=full[:8])])
    assert resumed["b"][0] == full[8:]
    engine.add_requests([EngineRequest("c", prompt, params)])
    engine.abort(["c"])
    outputs = engine.get_outputs()
    assert outputs is not None
    assert [(d.request_id, d.finish_reason) for d in outputs.outputs] == [("c", "abort")]
    assert not engine.core.structured.compiling and not engine.core.has_work()


def test_sampler_masks_only_the_constrained_rows() -> None:
    """The sampler's grammar masks: constrained rows sample only allowed tokens, the other
    rows' draws are bit-identical to a batch without masks, and a row whose min_tokens
    masked every allowed token (only EOS may come) still gets an allowed token."""
    torch.manual_seed(0)
    vocab = 100
    logits = torch.randn(4, vocab)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5),
              SamplingParams(temperature=1.0, seed=9), SamplingParams(min_tokens=2, seed=1)]
    positions = [0, 0, 0, 0]
    token_ids = [[1, 2]] * 4
    allowed = torch.zeros(2, vocab, dtype=torch.bool)
    allowed[0, [3, 50, 77]] = True          # row 0 (greedy)
    allowed[1, [0]] = True                  # row 3: only EOS (id 0), which min_tokens bans
    plain, _ = Sampler(0, eos_token_ids=[0])(logits, SamplingBatch(params, positions,
                                                                   token_ids))
    bias = torch.zeros(2, vocab).masked_fill_(~allowed, float("-inf"))
    masked, _ = Sampler(0, eos_token_ids=[0])(logits, SamplingBatch(
        params, positions, token_ids, masked_rows=[0, 3], mask_bias=bias))
    assert masked[1:3] == plain[1:3]
    assert masked[0] == max([3, 50, 77], key=lambda t: logits[0, t].item())
    assert masked[3] == 0


def test_a_failed_matcher_ends_its_request_with_an_error(default_model: str) -> None:
    """A matcher in error (a token its mask forbade, or a limit hit while computing a mask)
    gets a mask of EOS only, and `accept` stops the request with an error that says so."""
    config = make_engine_config(default_model, dtype=DTYPE)
    structured = StructuredOutputs(config.model.path, config.model.vocab_size,
                                   config.model.eos_token_ids, 10.0)
    tokenizer = Tokenizer(default_model)
    grammar = Grammar(structured.compiler.compile(Constraint(regex="[0-9]+")))
    digits = tokenizer.encode("42")
    assert [grammar.accept(t) for t in digits] == [False] * len(digits)
    assert grammar.accept(tokenizer.encode("x")[0]) and "failed" in (grammar.error or "")
    words = np.frombuffer(structured.fill_masks([grammar]), dtype=np.uint32)
    allowed = [t for t in range(len(words) * 32) if words[t // 32] >> (t % 32) & 1]
    assert allowed == list(config.model.eos_token_ids)
    structured.close()


def test_zmq_client_constraints(default_model: str) -> None:
    """kvflow's own client (ZMQ) carries the constraint in SamplingParams: a streamed
    constrained request validates, a refused one is a ValueError naming the keyword, and the
    server serves on."""
    s = serve_ready("--dtype", "float32", model=default_model, kv_cache_memory_gb=0.1,
                    zmq=True)
    try:
        with Client(s.address, timeout=120) as client:
            params = SamplingParams(temperature=0.7, seed=4, max_tokens=100,
                                    structured_outputs=Constraint(json=PERSON))
            text = "".join(d.text for d in client.stream("A person as JSON:", params))
            jsonschema.validate(json.loads(text), PERSON)
            with pytest.raises(ValueError, match="uniqueItems"):
                client.generate("x", SamplingParams(structured_outputs=Constraint(
                    json={"type": "array", "uniqueItems": True})))
            out = client.generate("Yes or no?", SamplingParams(
                temperature=0, max_tokens=5, structured_outputs=Constraint(choice=["yes", "no"])))
            assert out.text in ("yes", "no")
    finally:
        s.cleanup()


def test_json_whitespace_options(llm: LLM) -> None:
    """By default JSON may be pretty-printed but never runs blank lines; with
    disable_any_whitespace it is compact; a whitespace_pattern replaces the default."""
    conv = ask("Describe a person as JSON, nicely indented.")
    default, compact, spaced = llm.chat([conv] * 3, [
        SamplingParams(temperature=0.8, seed=s, max_tokens=150, structured_outputs=c)
        for s, c in ((5, Constraint(json=PERSON)),
                     (5, Constraint(json=PERSON, disable_any_whitespace=True)),
                     (5, Constraint(json=PERSON, whitespace_pattern=" ?")))], use_tqdm=False)
    for out in (default, compact, spaced):
        jsonschema.validate(json.loads(out.text), PERSON)
    assert "\n\n" not in default.text
    assert compact.text == json.dumps(json.loads(compact.text), separators=(",", ":"),
                                      ensure_ascii=False)
    assert "\n" not in spaced.text and "  " not in spaced.text.replace('"', "")
