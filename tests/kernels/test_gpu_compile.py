import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the other tests compile and run every kernel")
def test_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    script = Path(__file__).with_name("gpu_compile_check.py")
    result = subprocess.run([sys.executable, str(script), "bf16", "fp32"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
