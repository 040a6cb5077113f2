"""Every Triton GEMM (and the N:M sparse GEMV, the quantized KV attention) compiles for a real GPU target (sm80, sm90) on this GPU-less machine:
Triton's NVIDIA backend runs front end -> TTIR -> TTGIR -> LLVM -> PTX -> ptxas cubin without a device. The
interpreter tests (test_triton_kernels.py, test_nm_sparse.py) check the numbers; this checks that the same source is
valid compiled Triton (the interpreter accepts Python a GPU compile refuses, e.g. closures or non-constexpr globals),
and that ``tl.dot`` on float16 tiles becomes tensor-core MMA instructions.

The compile runs in a fresh process: TRITON_INTERPRET=1 (test/conftest.py) is read when kernels are decorated.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

P32, PU8, PI8, PI32, PF16, I32 = "*fp32", "*u8", "*i8", "*i32", "*fp16", "i32"
META = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "HAS_BIAS": True}


def _ints(*names):
    return {n: I32 for n in names}


# (case id, module, kernel, pointer / scalar signature, constexprs). float16 activations unless the case says fp32.
CASES = [
    ("int8_wo", "int8_weight_only", "_int8_wo_kernel",
     dict(x_ptr=PF16, w_ptr=PI8, scale_ptr=PF16, bias_ptr=PF16, out_ptr=PF16,
          **_ints("M", "N", "K", "GROUP", "stride_xm", "stride_wn", "stride_sn", "stride_om")),
     dict(META, DOT_PRECISION=None)),
    ("fp8_wo_e5m2", "float8_weight_only", "_fp8_wo_kernel",
     dict(x_ptr=PF16, q_ptr=PU8, scale_ptr=P32, bias_ptr=PF16, out_ptr=PF16,
          **_ints("M", "N", "K", "SCALE_BN", "SCALE_BK", "stride_xm", "stride_om")),
     dict(META, FMT=1, DOT_PRECISION=None)),
    ("int4_tiled_fp32", "int4_tiled_gemm", "_int4_tiled_gemm_kernel",
     dict(x_ptr=P32, q_ptr=PI32, sz_ptr=P32, bias_ptr=P32, out_ptr=P32,
          **_ints("M", "N", "K", "GROUP", "NUM_CHUNKS", "WORDS", "N8", "stride_xm", "stride_om")),
     dict(META, DOT_PRECISION="ieee")),
    ("nf4_double_quant", "nf4_weight_only", "_nf4_kernel",
     dict(x_ptr=PF16, q_ptr=PU8, absmax_ptr=PI8, dq_scale_ptr=P32, dq_offset_ptr=P32, bias_ptr=PF16, out_ptr=PF16,
          **_ints("M", "N", "K", "BLOCK_SIZE_Q", "stride_xm", "stride_om")),
     dict(META, DOUBLE_QUANT=True, DOT_PRECISION=None)),
    ("mxfp4", "mx_weight_only", "_mx_kernel",
     dict(x_ptr=PF16, q_ptr=PU8, scale_ptr=PU8, bias_ptr=PF16, out_ptr=PF16, **_ints("M", "N", "K", "stride_xm", "stride_om")),
     dict(META, ELEMENT=0, DOT_PRECISION=None)),
    ("nvfp4", "nvfp4_weight_only", "_nvfp4_kernel",
     dict(x_ptr=PF16, q_ptr=PU8, scale_ptr=PU8, global_ptr=P32, bias_ptr=PF16, out_ptr=PF16,
          **_ints("M", "N", "K", "stride_xm", "stride_om")),
     dict(META, DOT_PRECISION=None)),
    ("fp6_e3m2", "fp6_weight_only", "_fp6_kernel",
     dict(x_ptr=PF16, q_ptr=PU8, scale_ptr=PF16, bias_ptr=PF16, out_ptr=PF16,
          **_ints("M", "N", "K", "ROW_BYTES", "GROUPS", "GROUP", "stride_xm", "stride_om")),
     dict(META, EBITS=3, DOT_PRECISION=None)),
    ("intx3_int_zp", "intx_weight_only", "_intx_kernel",
     dict(x_ptr=PF16, q_ptr=PU8, scale_ptr=P32, zero_ptr=P32, bias_ptr=PF16, out_ptr=PF16,
          **_ints("M", "N", "K", "ROW_BYTES", "G", "GROUP", "BN", "stride_xm", "stride_om")),
     dict(META, BITS=3, SIGNED=True, DOMAIN=1, DOT_PRECISION=None)),
    ("ternary", "intx_weight_only", "_ternary_kernel",
     dict(x_ptr=PF16, planes_ptr=PU8, scale_ptr=P32, bias_ptr=PF16, out_ptr=PF16,
          **_ints("M", "N", "K", "ROW_BYTES", "G", "GROUP", "BN", "stride_xm", "stride_om")),
     dict(META, DOT_PRECISION=None)),
    ("nm_sparse_gemm_2of4_uint4_float_zp", "nm_sparse_weight_only", "_nm_gemm_kernel",
     dict(x_ptr=PF16, kept_ptr=PU8, pos_ptr=PU8, scale_ptr=P32, zero_ptr=P32, bias_ptr=PF16, out_ptr=PF16,
          **_ints("M", "N", "K", "KEPT_BYTES", "POS_BYTES", "G", "GROUP", "BN", "stride_xm", "stride_om")),
     dict(META, N_KEEP=2, M_BLOCK=4, BITS=4, PBITS=2, SIGNED=False, DOMAIN=2, DOT_PRECISION=None)),
    ("nm_sparse_gemv_4of8_int8", "nm_sparse_weight_only", "_nm_gemv_kernel",
     dict(x_ptr=PF16, kept_ptr=PI8, pos_ptr=PU8, scale_ptr=P32, zero_ptr=P32, part_ptr=P32,
          **_ints("M", "N", "K", "E", "KEPT_BYTES", "POS_BYTES", "G", "GROUP", "BN", "stride_xm")),
     dict(BLOCK_N=64, BLOCK_K=64, SPLIT_K=4, N_KEEP=4, M_BLOCK=8, BITS=8, PBITS=3, SIGNED=True, DOMAIN=0)),
    # attention over a quantized KV cache: int8 per-channel keys, int4 values, a bool mask; IEEE float32 dots
    ("quantized_kv_attention_int8_int4", "quantized_kv_attention", "_quantized_kv_attention_kernel",
     dict(q_ptr=P32, out_ptr=P32, mask_ptr=PU8, kc_ptr=PU8, ks_ptr=PF16, kz_ptr=PF16, kt_ptr=P32, kn_ptr="*i64",
          vc_ptr=PU8, vs_ptr=PF16, vz_ptr=PF16, vt_ptr=P32, vn_ptr="*i64", scale="fp32",
          **_ints("q_sb", "q_sh", "q_sl", "o_sb", "o_sh", "o_sl", "m_sb", "m_sh", "m_sl", "kc_sb", "kc_sh", "kc_ss",
                  "ks_sb", "ks_sh", "ks_ss", "kt_sb", "kt_sh", "kt_ss", "vc_sb", "vc_sh", "vc_ss", "vs_sb", "vs_sh",
                  "vs_ss", "vt_sb", "vt_sh", "vt_ss", "Hq", "Hkv", "Lq", "D", "Dv", "K_GROUP", "V_GROUP")),
     dict(K_FMT=10, K_PER_CHANNEL=True, V_FMT=11, MASK=1, BLOCK_R=16, BLOCK_N=32, BLOCK_D=64, BLOCK_DV=64)),
    ("fp8_rowwise", "float8_rowwise", "_fp8_rowwise_kernel",
     dict(a_ptr=PU8, b_ptr=PU8, sa_ptr=P32, sb_ptr=P32, bias_ptr=P32, out_ptr=P32, **_ints("M", "N", "K")),
     dict(META, A_FMT=0, B_FMT=1)),
]

_COMPILE = r'''
import importlib, json, sys
import torch
torch.cuda.get_device_capability = lambda *a: (8, 0)  # gpu_family() at import: there is no device to ask
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

results = {}
for name, module, kernel, signature, constexprs in json.loads(sys.argv[1]):
    fn = getattr(importlib.import_module(f"torchqkit.kernels.triton.{module}"), kernel)
    while not isinstance(fn, JITFunction):  # unwrap @triton.autotune
        fn = fn.fn
    sig = {arg: signature.get(arg, "constexpr") for arg in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    for arch in json.loads(sys.argv[2]):
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
        results[f"{name}-sm{arch}"] = {"cubin": len(compiled.asm["cubin"]), "mma": "mma" in compiled.asm["ptx"]}
print(json.dumps(results))
'''
ARCHS = [80, 90]


@pytest.fixture(scope="module")
def compiled():
    """Compile every case for every arch in one fresh process (importing torch once): {"case-smXX": result}."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # triton's current default, set to silence its deprecation warning
    proc = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(CASES), json.dumps(ARCHS)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif("nvidia" not in triton.backends.backends, reason="this triton has no NVIDIA backend to compile with")
@pytest.mark.parametrize("arch", ARCHS, ids=[f"sm{a}" for a in ARCHS])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_compiles_for_gpu(compiled, case, arch):
    out = compiled[f"{case[0]}-sm{arch}"]
    assert out["cubin"] > 10_000, out
    # float16 tiles go to tensor cores; float32 with input_precision="ieee" (the attention's dots too) is exact FMA,
    # no MMA; a split-K GEMV reduces with a multiply + sum, no tl.dot
    gemv = "SPLIT_K" in case[4]
    ieee = case[4].get("DOT_PRECISION") == "ieee" or case[0].startswith("quantized_kv_attention")
    assert out["mma"] == (not gemv and not ieee), out
