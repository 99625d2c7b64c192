"""Compile every kvflow Triton kernel for an sm90 GPU without having one.

The interpreter runs kernels as numpy code and lets through things the real compiler rejects
(constexpr misuse, type changes across loop iterations, bad tl.dot shapes). This script lowers each
kernel through Triton's CUDA pipeline down to a cubin (ptxas ships with Triton), so a CPU-only
machine still learns whether the kernels build. Run by test_gpu_compile.py in a subprocess,
because TRITON_INTERPRET must be unset when the kernels are decorated.
"""

import os
import sys

assert "TRITON_INTERPRET" not in os.environ, "run without TRITON_INTERPRET"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource  # noqa: E402

from kvflow.kernels import decode_attention, kv_store, prefill_attention  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(fn: triton.JITFunction, types: dict[str, str], constexprs: dict[str, object]) -> None:
    """`types` gives every runtime argument's Triton type; the rest must be in `constexprs`."""
    missing = [name for name in fn.arg_names if name not in types and name not in constexprs]
    assert not missing, f"{fn.__name__}: no type or value for {missing}"
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=TARGET)
    print(f"compiled {fn.__name__} {constexprs}")


def _attention_types(dt: str, arg_names: list[str]) -> dict[str, str]:
    """Types for both attention kernels' runtime arguments (a superset; extras are ignored)."""
    types = {name: f"*{dt}" for name in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    types.update({name: "*i32" for name in ("block_tables_ptr", "context_lens_ptr", "cu_seqlens_q_ptr")})
    types.update({name: "i32" for name in arg_names if name.startswith("stride_")})
    types.update(scale_log2="fp32", num_splits="i32", part_out_ptr="*fp32", part_lse_ptr="*fp32")
    return types


def compile_attention(dt: str) -> None:
    precision = "ieee" if dt == "fp32" else "tf32"
    decode = decode_attention._decode_kernel
    for split, num_heads, head_dim in ((False, 64, 128), (True, 24, 80)):  # GQA 8 / 3
        compile_kernel(decode, _attention_types(dt, decode.arg_names), dict(
            NUM_HEADS=num_heads, NUM_KV_HEADS=8, HEAD_DIM=head_dim, BLOCK_SIZE=16, SPLIT=split,
            PRECISION=precision, BLOCK_G=16, BLOCK_N=decode_attention.BLOCK_N, BLOCK_D=128))
    compile_kernel(decode_attention._merge_splits_kernel,
                   dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr=f"*{dt}", num_splits="i32"),
                   dict(HEAD_DIM=80, BLOCK_S=16, BLOCK_D=128))
    prefill = prefill_attention._prefill_kernel
    compile_kernel(prefill, _attention_types(dt, prefill.arg_names), dict(
        NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=256, PRECISION=precision,
        BLOCK_M=prefill_attention.BLOCK_M, BLOCK_N=prefill_attention.BLOCK_N, BLOCK_D=128))


def compile_elementwise(dt: str) -> None:
    compile_kernel(kv_store._store_kv_kernel, dict(
        key_ptr=f"*{dt}", value_ptr=f"*{dt}", k_cache_ptr=f"*{dt}", v_cache_ptr=f"*{dt}",
        slot_mapping_ptr="*i64", stride_kt="i32", stride_kh="i32", stride_vt="i32", stride_vh="i32",
    ), dict(NUM_KV_HEADS=3, HEAD_DIM=80, BLOCK_H=4, BLOCK_D=128))


if __name__ == "__main__":
    for dtype_name in sys.argv[1:] or ["bf16"]:
        compile_attention(dtype_name)
        compile_elementwise(dtype_name)
    print("all kernels compiled")
