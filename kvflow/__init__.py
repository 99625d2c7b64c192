"""kvflow: a compact LLM inference engine (paged KV cache, continuous batching, prefix caching)."""
__version__ = "0.1.0"

from kvflow.errors import EngineDeadError, EngineOverloadedError
from kvflow.frontend.client import AsyncClient, Client
from kvflow.frontend.llm import LLM
from kvflow.frontend.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StructuredOutputsParams", "Client",
           "AsyncClient", "EngineDeadError", "EngineOverloadedError"]
