"""Decode steps on CPU in one C call: every decoder layer of a step of a few decoding
requests (one token each, or a drafting request's token and drafts) runs in
kvflow/kernels/cpu_decode.c (with tensor parallelism: one call before and one after each
all-reduce), instead of a dozen torch and ctypes calls per layer.

The CPU counterpart of CUDA graphs (workers/cuda_graphs.py): the same model, the same kernels
and roundings, minus the per-op overhead, used by the model runner for decode steps of at
most `max_tokens` tokens; larger steps and prefill chunks run the model's own forward.
`models/llama.py` stays the description of the model; this module reads the weights the
model loaded (the row-major weights its linears keep for the gemv kernel, layers/linear.py)
and its KV cache, and is tested token for token against the model's own forward
(tests/test_fused_decode.py).
"""
from __future__ import annotations

import ctypes
from typing import Any, cast

import torch

from kvflow.kernels import cpu_ops
from kvflow.workers.attention.cpu_backend import CpuMetadata
from kvflow.workers.kv_cache import KVCache
from kvflow.workers.layers.linear import Int8Weight, gemv_operands
from kvflow.workers.layers.parallel import TPGroup
from kvflow.workers.models.llama import LlamaDecoderLayer, LlamaForCausalLM

_ptr, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class _Linear(ctypes.Structure):
    _fields_ = [("w", _ptr), ("scales", _ptr), ("in_scale", _ptr), ("bias", _ptr),
                ("type", _i32), ("n", _i64), ("k", _i64), ("one_row", _ptr),
                ("one_row_type", _i32), ("one_row_rows", _i64), ("gemm", _ptr),
                ("gemm_comp", _ptr), ("gemm_scales", _ptr), ("gemv_rows", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("q_norm", _ptr), ("k_norm", _ptr),
                ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("k_cache", _ptr), ("v_cache", _ptr)]


_BUFFERS = ("h", "residual", "x", "qkv", "qn", "kn", "q", "k", "attn", "gate_up", "act")


class _Step(ctypes.Structure):
    _fields_ = [("dtype", _i32), ("first", _i32), ("kv_dtype", _i32),
                *[(name, _i64) for name in ("num_tokens", "hidden", "num_heads",
                                            "num_kv_heads", "head_dim", "inter", "num_slots",
                                            "block_size")],
                ("eps", _f32), ("scale", _f32),
                ("positions", _ptr), ("slots", _ptr), ("cos", _ptr), ("sin", _ptr),
                ("block_tables", _ptr), ("num_tables", _i64), ("max_blocks", _i64),
                ("table_rows", _ptr), ("context_lens", _ptr), ("q_rows", _ptr),
                *[(name, _ptr) for name in _BUFFERS], ("final_norm", _ptr), ("final_eps", _f32),
                ("xq", _ptr), ("xscales", _ptr)]


def _library() -> Any:
    lib = cpu_ops.library()
    assert lib is not None, cpu_ops.build_error()
    for name in ("decode_attention", "decode_mlp"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = [ctypes.POINTER(_Layer), ctypes.POINTER(_Step)]
    lib.decode_layers.restype = ctypes.c_int
    lib.decode_layers.argtypes = [ctypes.POINTER(_Layer), _i64, ctypes.POINTER(_Step)]
    lib.decode_final_norm.restype = ctypes.c_int
    lib.decode_final_norm.argtypes = [ctypes.POINTER(_Step)]
    return lib


def _own_gemm(prepared: Any) -> bool:
    return isinstance(prepared, Int8Weight) and prepared.own_gemm


class FusedDecode:
    """Built once after loading (`unusable` says why not, where it cannot run); then
    `forward(input_ids, positions, meta)` is the model's forward for decode-only steps."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, tp: TPGroup,
                 max_tokens: int) -> None:
        self.model = model
        self.tp = tp
        self.max_tokens = max_tokens
        self.lib = _library()
        layers = cast(list[LlamaDecoderLayer], list(model.model.layers))
        first = layers[0]
        attn = first.self_attn
        self.dtype = first.input_layernorm.weight.dtype
        self.shape = dict(hidden=first.input_layernorm.weight.shape[0],
                          num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
                          head_dim=attn.head_dim,
                          inter=first.mlp.gate_up_proj.out_sizes[0] // tp.size)
        self.eps, self.scale = first.input_layernorm.eps, attn.attn.scale
        self.final_norm = model.model.norm                        # run in the same call
        self.rotary = attn.rotary
        self.kv_cache = kv_cache
        self._keep: list[torch.Tensor] = []        # float32 biases the structs point into
        self.layers = (_Layer * len(layers))(*(self._layer(layer) for layer in layers))
        self._cache_ptr = 0                        # the KV cache the layers point into
        # By number of tokens (at most max_tokens): the step's struct and its buffers.
        self._steps: dict[int, tuple[_Step, dict[str, torch.Tensor]]] = {}

    @staticmethod
    def unusable(model: LlamaForCausalLM) -> str | None:
        """None when every layer can run fused, else why not."""
        for layer in cast(list[LlamaDecoderLayer], list(model.model.layers)):
            attn, mlp = layer.self_attn, layer.mlp
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if gemv_operands(linear.prepared) is None:
                    return f"the linear method {linear.method.name!r} keeps no row-major weight"
            if attn.o_proj.bias is not None or mlp.down_proj.bias is not None \
                    or mlp.gate_up_proj.bias is not None:
                return "biases outside q/k/v are not fused"
        return None

    @staticmethod
    def gemv_rows(model: LlamaForCausalLM) -> int:
        """Up to how many rows every fused linear runs as the model's own forward runs it:
        on the gemv kernel (LinearMethod.gemv_rows: 32 or more where the kernel is the faster
        up to there: AMX tiles, pair panels, bfloat16 weights under float32; else a few), or
        any number where past that the linear runs kvflow's int8 GEMM (int8 without AMX-INT8
        where the library's GEMM takes the weights), which this path calls too."""
        return min(1 << 30 if _own_gemm(m.prepared) else m.method.gemv_rows(m.prepared)
                   for layer in cast(list[LlamaDecoderLayer], list(model.model.layers))
                   for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                             layer.mlp.gate_up_proj, layer.mlp.down_proj))

    def _linear(self, module: Any) -> _Linear:
        operands = gemv_operands(module.prepared)
        assert operands is not None
        bias = None
        if module.bias is not None:              # padded to whole panels for i8_gemm
            bias = cpu_ops.pad16(module.bias.detach())
            self._keep.append(bias)
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        weight = operands.weight
        gemm = module.prepared.packed if _own_gemm(module.prepared) else None
        return _Linear(weight.data_ptr(), ptr(operands.scales), ptr(operands.in_scale),
                       ptr(bias), cpu_ops.gemv_type(weight, operands.layout), weight.shape[0],
                       weight.shape[1], ptr(operands.one_row),
                       cpu_ops.GEMV_LAYOUTS.get(operands.one_row_layout, 0),
                       operands.one_row_rows,
                       None if gemm is None else gemm.packed.data_ptr(),
                       None if gemm is None else gemm.comp.data_ptr(),
                       None if gemm is None else gemm.scales.data_ptr(),
                       module.method.gemv_rows(module.prepared))

    def _layer(self, layer: LlamaDecoderLayer) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm = attn.q_norm.weight.data_ptr() if attn.q_norm is not None else None
        k_norm = attn.k_norm.weight.data_ptr() if attn.k_norm is not None else None
        return _Layer(layer.input_layernorm.weight.data_ptr(),
                      layer.post_attention_layernorm.weight.data_ptr(), q_norm, k_norm,
                      self._linear(attn.qkv_proj), self._linear(attn.o_proj),
                      self._linear(mlp.gate_up_proj), self._linear(mlp.down_proj), None, None)

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: CpuMetadata) -> torch.Tensor:
        """The model's final hidden states [num_tokens, hidden] for a decode-only step."""
        h = self.model.model.embed_tokens(input_ids)               # [tokens, hidden]
        self._bind_caches()
        step, buffers = self._step(h, positions, meta)
        ref = ctypes.byref(step)
        if self.tp.size == 1:                      # the final norm too
            self._check(self.lib.decode_layers(self.layers, len(self.layers), ref))
        else:
            for i in range(len(self.layers)):
                layer = ctypes.byref(self.layers[i])
                self._check(self.lib.decode_attention(layer, ref))
                self.tp.all_reduce(buffers["h"])
                self._check(self.lib.decode_mlp(layer, ref))
                self.tp.all_reduce(buffers["h"])
            self._check(self.lib.decode_final_norm(ref))
        return buffers["x"]           # the final norm's output, in a buffer reused next step

    def _bind_caches(self) -> None:
        """The KV cache's tensors (allocated after this object is built)."""
        if self.kv_cache.tensor.data_ptr() == self._cache_ptr:
            return
        self._cache_ptr = self.kv_cache.tensor.data_ptr()
        self._steps.clear()                        # their num_slots and cache dtype
        for layer, (k_cache, v_cache) in zip(self.layers, self.kv_cache.layers):
            layer.k_cache, layer.v_cache = k_cache.data_ptr(), v_cache.data_ptr()

    def _step(self, h: torch.Tensor, positions: torch.Tensor, meta: CpuMetadata
              ) -> tuple[_Step, dict[str, torch.Tensor]]:
        """The step's struct: built once per step size (its buffers, shapes and the cache's),
        then only what changes each step is set."""
        t = h.shape[0]
        cached = self._steps.get(t)
        if cached is None:
            cached = self._steps[t] = self._new_step(t)
        step, buffers = cached
        buffers["h"].copy_(h)
        step.first = 1
        step.positions, step.slots = positions.data_ptr(), meta.slot_mapping.data_ptr()
        step.block_tables = meta.block_tables.data_ptr()
        step.num_tables, step.max_blocks = meta.block_tables.shape
        step.table_rows, step.context_lens = (meta.table_rows.data_ptr(),
                                              meta.context_lens.data_ptr())
        step.q_rows = meta.q_rows.data_ptr()
        # The tensors the struct points into live as long as `buffers` and `meta`.
        return step, buffers

    def _new_step(self, t: int) -> tuple[_Step, dict[str, torch.Tensor]]:
        s = self.shape
        d, nh, nkv = s["head_dim"], s["num_heads"], s["num_kv_heads"]
        widths = dict(h=s["hidden"], residual=s["hidden"], x=s["hidden"],
                      qkv=(nh + 2 * nkv) * d, qn=nh * d, kn=nkv * d, q=nh * d, k=nkv * d,
                      attn=nh * d, gate_up=2 * s["inter"], act=s["inter"])
        buffers = {name: torch.empty(t, width, dtype=self.dtype)
                   for name, width in widths.items()}
        buffers["xq"] = torch.empty(t, max(widths.values()), dtype=torch.uint8)
        buffers["xscales"] = torch.empty(t, dtype=torch.float32)
        k_cache = self.kv_cache.layers[0][0]
        step = _Step(dtype=cpu_ops.GEMV_TYPES[self.dtype], first=1,
                     kv_dtype=cpu_ops.GEMV_TYPES[k_cache.dtype], num_tokens=t,
                     hidden=s["hidden"], num_heads=nh, num_kv_heads=nkv, head_dim=d,
                     inter=s["inter"], num_slots=k_cache.shape[1],
                     block_size=self.kv_cache.backend.block_size, eps=self.eps,
                     scale=self.scale, cos=self.rotary.cos.data_ptr(),
                     sin=self.rotary.sin.data_ptr(),
                     final_norm=self.final_norm.weight.data_ptr(),
                     final_eps=self.final_norm.eps,
                     xq=buffers["xq"].data_ptr(), xscales=buffers["xscales"].data_ptr(),
                     **{name: buffers[name].data_ptr() for name in _BUFFERS})
        return step, buffers

    @staticmethod
    def _check(status: int) -> None:
        if status == 2:
            raise MemoryError("the fused decode step could not allocate scratch memory")
        if status == 3:
            raise IndexError("the fused decode step: a slot lies outside the KV cache")
        if status:
            raise IndexError(f"the fused decode step's attention failed ({status - 10}: "
                             "bad metadata or heads)")
