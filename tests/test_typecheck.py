"""The type checker over the packages that must stay fully typed (docs/design.md §5.10)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mypy_core_and_ipc() -> None:
    targets = ["kvflow/core", "kvflow/ipc", "kvflow/sampling_params.py", "kvflow/config.py",
               "kvflow/workers/headless.py", "kvflow/workers/worker_proc.py",
               "kvflow/frontend/supervisor.py"]
    done = subprocess.run([sys.executable, "-m", "mypy", *targets], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
