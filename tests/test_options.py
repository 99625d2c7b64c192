"""One options struct (EngineOptions) behind LLM, launch.py's flags and make_engine_config."""
from __future__ import annotations

import argparse
import importlib.util
import os

import pytest

from kvflow.config import EngineOptions, make_engine_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch():                                   # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("launch", os.path.join(REPO, "launch.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_option_is_a_launch_flag_with_the_same_default() -> None:
    launch = _launch()
    parser = argparse.ArgumentParser()
    launch.add_engine_args(parser)
    assert launch.engine_options(parser.parse_args([])) == EngineOptions()
    args = parser.parse_args(["--tp", "2", "--no-prefix-caching", "--num-threads", "3",
                              "--load-format", "dummy"])
    options = launch.engine_options(args)
    assert (options.tensor_parallel_size, options.enable_prefix_caching, options.num_threads,
            options.load_format) == (2, False, 3, "dummy")


def test_options_as_struct_or_keywords(default_model: str) -> None:
    by_struct = make_engine_config(default_model, EngineOptions(block_size=32, seed=5))
    by_keywords = make_engine_config(default_model, block_size=32, seed=5)
    assert by_struct == by_keywords and by_struct.cache.block_size == 32
    with pytest.raises(TypeError, match="no field 'tensor_paralel_size'.*tensor_parallel_size"):
        make_engine_config(default_model, tensor_paralel_size=2)
