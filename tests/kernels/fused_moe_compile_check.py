"""Compile the fused-MoE kernel for sm_90 without a GPU (both passes, decode and prefill tiles, bf16 and
fp32, with and without expert LoRA) and its expert-LoRA shrink; run as a script with TRITON_INTERPRET
unset, like `tests/kernels/cuda_compile_check.py`.

Usage: ``python -m tests.kernels.fused_moe_compile_check``; one line per compiled variant.
"""

from __future__ import annotations

import os


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("run with TRITON_INTERPRET unset: the interpreter does not compile")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.fused_moe import _fused_moe_kernel
    from kernels.moe_lora import _moe_lora_shrink_kernel
    from tests.kernels.cuda_compile_check import _signature

    target = GPUTarget("cuda", 90, 32)
    for t in ("bf16", "fp32"):
        ptrs = {n: f"*{t}" for n in ("a_ptr", "w_ptr")} | {"weights_ptr": "*fp32"}
        ptrs |= {n: "*i32" for n in ("sorted_ids_ptr", "block_experts_ptr", "num_padded_ptr")}
        ptrs |= {"lv_ptr": "*fp32", "lb_ptr": f"*{t}", "lpages_ptr": "*i32"}
        variants = [(s, m, lo) for s in (True, False) for m in (16, 64) for lo in (False, True)]
        for silu_mul, block_m, has_lora in variants:
            constexprs = {
                "BLOCK_M": block_m,
                "BLOCK_N": 64,
                "BLOCK_K": 64,
                "SILU_MUL": silu_mul,
                "MUL_WEIGHT": not silu_mul,
                "UPCAST": False,
                "DOT_PRECISION": "ieee" if t == "fp32" else "tf32",
                "HAS_LORA": has_lora,
                "BLOCK_R": 16,
            }
            ptrs["out_ptr"] = f"*{t}" if silu_mul else "*fp32"
            sig = _signature(_fused_moe_kernel, ptrs, (), constexprs)
            src = ASTSource(fn=_fused_moe_kernel, signature=sig, constexprs=constexprs)
            compiled = triton.compile(src, target=target, options={"num_warps": 4, "num_stages": 3})
            name = f"{'gate_up' if silu_mul else 'down'} m{block_m} {t}{' lora' if has_lora else ''}"
            print(f"ok fused_moe {name} cubin={len(compiled.asm['cubin'])}B", flush=True)
        shrink_ptrs = {"a_ptr": f"*{t}", "la_ptr": f"*{t}", "scale_ptr": "*fp32", "v_ptr": "*fp32"}
        shrink_ptrs |= {
            n: "*i32" for n in ("pages_ptr", "sorted_ids_ptr", "block_groups_ptr", "num_padded_ptr")
        }
        for block_m in (16, 64):
            constexprs = {
                "BLOCK_M": block_m,
                "BLOCK_R": 16,
                "BLOCK_K": 64,
                "UPCAST": False,
                "DOT_PRECISION": "ieee" if t == "fp32" else "tf32",
            }
            sig = _signature(_moe_lora_shrink_kernel, shrink_ptrs, (), constexprs)
            src = ASTSource(fn=_moe_lora_shrink_kernel, signature=sig, constexprs=constexprs)
            compiled = triton.compile(src, target=target, options={"num_warps": 4, "num_stages": 3})
            print(f"ok fused_moe_lora_shrink m{block_m} {t} cubin={len(compiled.asm['cubin'])}B", flush=True)


if __name__ == "__main__":
    main()
