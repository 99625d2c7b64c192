"""The triton attention backend end to end, on CPU: same greedy tokens as the torch backend.

The engine runs in a subprocess with TRITON_INTERPRET=1 (it must be set before triton is
imported, and other tests may import it first); see triton_engine_check.py for the workload.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Not imported here: TRITON_INTERPRET must be set before kernels are decorated (kernels/conftest).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")

REPO_ROOT = Path(__file__).resolve().parents[1]
# Both backends compute in float32 over the same weights; only summation order differs.
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def results(tiny_models: dict[str, str]) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    script = Path(__file__).with_name("triton_engine_check.py")
    done = subprocess.run([sys.executable, str(script), tiny_models["llama"],
                           tiny_models["qwen3"]], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("arch, run", [("llama", "triton"), ("llama", "triton_static_decode"),
                                       ("qwen3", "triton")])
def test_triton_matches_torch(results: dict, tiny_models: dict[str, str], arch: str,
                              run: str) -> None:
    ref, ours = results[tiny_models[arch]]["torch"], results[tiny_models[arch]][run]
    assert ours["token_ids"] == ref["token_ids"]
    for ref_steps, our_steps in zip(ref["logprobs"], ours["logprobs"]):
        for ref_step, our_step in zip(ref_steps, our_steps):
            assert our_step.keys() == ref_step.keys()
            for token, logprob in our_step.items():
                assert logprob == pytest.approx(ref_step[token], abs=LOGPROB_ATOL)
