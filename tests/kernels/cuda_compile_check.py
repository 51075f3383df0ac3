"""Compile every kernel for a CUDA target (sm_90) without a GPU; run as a script with TRITON_INTERPRET unset.

The interpreter is permissive (e.g. about types across branches); this catches what only the real
compiler rejects. Usage: ``python -m tests.kernels.cuda_compile_check [dtype ...]``; prints one line
per compiled kernel and exits non-zero on the first failure.
"""

from __future__ import annotations

import os
import sys

_TY = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _signature(kernel, ptrs: dict[str, str], floats: tuple[str, ...], constexprs: dict) -> dict[str, str]:
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptrs[name]
        else:
            sig[name] = "fp32" if name in floats else "i32"
    return sig


def compile_all(dtypes: list[str]) -> None:
    """Compile shrink, expand, the fused BGMV kernel, write_kv and attention for each activation dtype."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.lora_bgmv import _lora_bgmv_kernel
    from kernels.lora_expand import _lora_expand_kernel
    from kernels.lora_shrink import _lora_shrink_kernel
    from kernels.paged_attention import _attention_kernel, _write_kv_kernel

    target = GPUTarget("cuda", 90, 32)
    for dt in dtypes:
        t = _TY[dt]
        prec = "ieee" if t == "fp32" else "tf32"
        cases = [
            (
                _lora_shrink_kernel,
                {"x_ptr": t, "a_table_ptr": "i64", "out_ptr": "fp32"},
                (),
                {
                    "PAGE_RANK": 16,
                    "BLOCK_M": 16,
                    "BLOCK_N": 16,
                    "BLOCK_K": 128,
                    "SPLIT_K": 4,
                    "DOT_PRECISION": prec,
                },
            ),
            (
                _lora_shrink_kernel,
                {"x_ptr": t, "a_table_ptr": "i64", "out_ptr": "fp32"},
                (),
                {
                    "PAGE_RANK": 16,
                    "BLOCK_M": 64,
                    "BLOCK_N": 16,
                    "BLOCK_K": 64,
                    "SPLIT_K": 1,
                    "DOT_PRECISION": prec,
                },
            ),
            (
                _lora_expand_kernel,
                {"v_ptr": "fp32", "b_table_ptr": "i64", "scalings_ptr": "fp32", "y_ptr": t},
                (),
                {"PAGE_RANK": 16, "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 16, "DOT_PRECISION": prec},
            ),
            *(
                (
                    _lora_bgmv_kernel,
                    {
                        "x_ptr": t,
                        "a_table_ptr": "i64",
                        "b_table_ptr": "i64",
                        "scalings_ptr": "fp32",
                        "y_ptr": t,
                    },
                    (),
                    {"PAGE_RANK": 16, "BLOCK_M": m, "BLOCK_R": r, "BLOCK_K": k, "BLOCK_N": k},
                )
                for m, r, k in ((2, 16, 256), (8, 32, 32))  # bgmv_config's 1-2 row and 8-row tiles
            ),
            (
                _write_kv_kernel,
                {"key_ptr": t, "value_ptr": t, "k_cache_ptr": t, "v_cache_ptr": t, "slot_ptr": "i64"},
                (),
                {"BLOCK_H": 8, "BLOCK_D": 128},
            ),
        ]
        for decode in (True, False):
            cases.append(
                (
                    _attention_kernel,
                    {"q_ptr": t, "k_cache_ptr": t, "v_cache_ptr": t, "out_ptr": t},
                    ("scale",),
                    {
                        "GROUP": 4,
                        "BLOCK_M": 16 if decode else 64,
                        "BLOCK_N": 64,
                        "BLOCK_D": 128,
                        "DOT_PRECISION": prec,
                        "DECODE": decode,
                    },
                )
            )
        for kernel, ptrs, floats, constexprs in cases:
            ptr_types = {n: "*" + ptrs.get(n, "i32") for n in kernel.arg_names if n.endswith("_ptr")}
            sig = _signature(kernel, ptr_types, floats, constexprs)
            src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
            compiled = triton.compile(src, target=target, options={"num_warps": 4, "num_stages": 2})
            print(f"ok {kernel.fn.__name__} {dt} cubin={len(compiled.asm['cubin'])}B", flush=True)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("run with TRITON_INTERPRET unset: the interpreter does not compile")
    compile_all(sys.argv[1:] or ["bfloat16", "float32"])


if __name__ == "__main__":
    main()
