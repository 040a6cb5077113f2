"""Which implementation serves each quantized op, and why.

Importing this package defines every ``torchqkit::`` custom op (one module each under ``ops/``, through
``registry.define_linear_op``: schema, fake, reference, autograd), then loads the C++ CPU extension
``torchqkit._C_cpu`` if setup.py built it. Without it every op still runs, on its reference, and ``status()``
says why. Which ops have a C++ kernel is read from the dispatcher, never listed by hand.

The extension picks its ISA level at run time (AMX, AVX-512 + AVX512-BF16, AVX-512 VNNI, AVX-VNNI, AVX2 + FMA, or
scalar); the environment variable ``TORCHQKIT_CPU_ISA=amx|avx512_bf16|avx512_vnni|avx_vnni|avx2|scalar`` forces
any level the CPU runs (read on every call); ``avx512_vnni`` then means AVX-512 without bf16 dot products, and
``amx`` the avx512_bf16 kernels with the weight-only prefill's bf16 panels on AMX tiles.
Op families without an AVX-VNNI kernel run their AVX2 kernel at that level, those without a bf16 kernel their
AVX-512 VNNI kernel at the AVX512-BF16 level, and their status names the level that runs and says so.
``TORCHQKIT_DISABLE_CPU_EXTENSION=1`` skips loading the extension (checks the reference-only install).
Where the extension should exist but doesn't load, importing warns once (KernelsMissingWarning, with the reason
and the rebuild command): see Note [Missing CPU kernels] in cpu_build.py.

GPU backends: the CUDA extension ``torchqkit._C_cuda`` (csrc/cuda, loaded when torch has CUDA and
setup.py built it) and the Triton kernels (``kernels/triton``, ``torchqkit_triton::`` ops, imported on first
use). ``choose_backend`` / ``linear_op`` pick the backend per op, device and KernelPreference; see
Note [Backend choice] at the end of this file.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os

import torch

from . import ops, reference  # noqa: F401  (ops: defines every op)
from .cpu_build import read_record
from .missing import KernelsMissingWarning, missing_kernels_note, missing_kernels_warned, warn_missing_kernels
from .registry import OPS, op_def
from .preference import KernelPreference

__all__ = ["status", "format_status", "cpu_backend", "choose_backend", "linear_op", "backend_status",
           "register_status_rows", "KernelPreference", "KERNEL_ACT_DTYPES", "CPU_EXTENSION_LOADED",
           "CPU_EXTENSION_REASON", "KernelsMissingWarning", "MISSING_KERNELS_NOTE", "missing_kernels_warned"]


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_extension(module: str, what: str, not_built: str) -> tuple[bool, str]:
    """(loaded, why): load the compiled library ``module`` (its kernels register on the torchqkit ops). Only the
    one in this package's own folder: an import hook (an editable install elsewhere) must not lend another
    checkout's build, compiled from other sources."""
    spec = importlib.machinery.PathFinder.find_spec(module, [_PACKAGE_DIR])
    if spec is None or spec.origin is None:
        return False, f"the {what} {module} is not built ({not_built})"
    try:
        torch.ops.load_library(spec.origin)
    except OSError as e:  # e.g. built against another torch: undefined symbols
        return False, f"loading {spec.origin} failed: {e}"
    return True, f"{what} {os.path.basename(spec.origin)} loaded"


# setup.py's record of why it didn't build the CPU extension, next to where the extension goes (or None)
_CPU_BUILD_RECORD = read_record(_PACKAGE_DIR)


def _load_cpu_extension() -> tuple[bool, str]:
    if os.environ.get("TORCHQKIT_DISABLE_CPU_EXTENSION") == "1":
        return False, "TORCHQKIT_DISABLE_CPU_EXTENSION=1 skipped the C++ CPU extension"
    why = (f"setup.py: {_CPU_BUILD_RECORD['reason']}" if _CPU_BUILD_RECORD
           else "setup.py could not compile it, or the package was installed without it; see the pip build log")
    return _load_extension("torchqkit._C_cpu", "C++ CPU extension", why)


CPU_EXTENSION_LOADED, CPU_EXTENSION_REASON = _load_cpu_extension()
MISSING_KERNELS_NOTE = missing_kernels_note(CPU_EXTENSION_LOADED, CPU_EXTENSION_REASON, _CPU_BUILD_RECORD)
warn_missing_kernels(MISSING_KERNELS_NOTE)

# Note [fp32 prefill by sgemm] in csrc/cpu/registration.cpp
_FP32_PREFILL = ("MKL's sgemm runs near the FMA peak of Intel's two 512-bit pipes, the panels at about half; "
                 "TORCHQKIT_CPU_FP32_PREFILL=sgemm|panels forces a route")
# Note [fp32 panels at 256 bits] in csrc/cpu/sgemm_prefill.h
_FP32_PREFILL_256 = ("MKL's sgemm runs near the FMA peak on Intel CPUs, and at 0.8x these panels on AMD Zen 5; "
                     "TORCHQKIT_CPU_FP32_PREFILL=sgemm|panels forces a route")
_CPU_KERNEL_NOTES = {
    "torchqkit::linear_int8wo_plain": {
        "avx512_vnni": "M < 16: streams each weight row once (dot kernel); M >= 16: fp32 panels + 6x32 FMA tiles, "
                       "except from M = 48 on Intel CPUs: blocks of 512 rows dequantized to fp32, then ATen's fp32 "
                       "GEMM (" + _FP32_PREFILL + ")",
        "avx512_bf16": "M < 16: the avx512_vnni dot kernel (fp32; bf16 activations converted); M >= 16 with bf16 "
                       "activations (groups of whole 32-k steps or per channel): int8 codes as exact bf16 in k-pair "
                       "panels + 6x32 vdpbf16ps tiles, fp32 sums, the scale per segment; else the avx512_vnni kernels",
        "avx2": "M < 48: dot kernel (4 rows x 2 tokens, 8 lanes); M >= 48: rows dequantized to fp32 16 at a time "
                "into k-major panels + 6x16 FMA tiles, on Intel CPUs blocks of 512 rows dequantized to fp32, then "
                "ATen's fp32 GEMM (" + _FP32_PREFILL_256 + ")",
        "scalar": "plain loops (M >= 48: dequantized blocks + ATen's fp32 GEMM): the CPU has no AVX2+FMA, or "
                  "TORCHQKIT_CPU_ISA forced it",
    },
    "torchqkit::linear_int8da_int8_plain": {
        "avx512_vnni": "vpdpbusd (u8 = q + 128 times s8, corrected by row sums); M >= 8: packed panels, 6x32 tiles",
        "avx_vnni": "M < 16: the AVX2 dot kernel; M >= 16: int8 k-quad panels + 6x16 tiles of 256-bit vpdpbusd (VEX; "
                    "EVEX on ymm where only AVX-512 VNNI exists; Note [int8 x int8 prefill on AVX-VNNI])",
        "avx2": "exact int16 madd (vpmaddwd): M < 16 dot kernel; M >= 16 int16 k-pair panels + 6x16 tiles",
        "scalar": "plain loops: the CPU has no AVX2+FMA, or TORCHQKIT_CPU_ISA forced it",
    },
}


_LOWBIT_NOTES = {  # see Note [Low-bit decode] in csrc/cpu/linear_lowbit.cpp
    "avx512_vnni": "M <= 8 (nf4, mxfp4, float8) / 4 (intx): 16 weights per zmm decoded in registers (4 rows x 4 tokens); "
                   "up to M = 63: 32 x 1024 blocks decoded to fp32 (L2), then 4x4 dot tiles; M >= 64: 32-row k-major "
                   "panels + 6x32 FMA tiles, except from M = 128 on Intel CPUs: blocks of 512 rows decoded to fp32, "
                   "then ATen's fp32 GEMM (" + _FP32_PREFILL + ")",
    "avx512_bf16": "bf16 activations: levels decoded to bf16 (exact; nf4 levels rounded to bf16, Note [nf4 levels "
                   "in bf16]) and multiplied by vdpbf16ps with fp32 sums. Decode M (<= 8; intx <= 4): 32 weights per "
                   "vdpbf16ps in registers (tiles of up to 4 tokens) for nf4 / mxfp4 from M = 2 and intx at M = 4, "
                   "where it is faster; float8 / mxfp8 at every decode M, nf4 / mxfp4 at M = 1 and intx below 4 "
                   "convert x to fp32 for the avx512_vnni dot kernel (faster there: bf16_dot_wins in "
                   "csrc/cpu/linear_lowbit_ops.cpp). Larger M: 32-row bf16 k-pair panels + 6x32 vdpbf16ps tiles. "
                   "Groups of a size not a multiple of 32 and float16 activations run the avx512_vnni kernels (fp32)",
    "avx2": "8-lane decoders (AVX2 + FMA + F16C): in registers for M <= 8 (nf4, mxfp4, float8) / 4 (intx); larger M: "
            "rows decoded to fp32 16 at a time into k-major panels + 6x16 FMA tiles, on Intel CPUs fp32 blocks + dot "
            "tiles and from M = 128 blocks of 512 rows decoded to fp32, then ATen's fp32 GEMM ("
            + _FP32_PREFILL_256 + ")",
    "scalar": "plain loops: the CPU has no AVX2+FMA, or TORCHQKIT_CPU_ISA forced it",
}
_CPU_KERNEL_NOTES.update(dict.fromkeys(("torchqkit::linear_nf4wo", "torchqkit::linear_fp8wo", "torchqkit::linear_intxwo",
                                         "torchqkit::linear_mxwo"), _LOWBIT_NOTES))
_AVX2_AT_AVX_VNNI = "no AVX-VNNI kernel: its AVX2 kernel runs. "
_CPU_KERNEL_NOTES["torchqkit::linear_int4wo_tiled"] = {  # see csrc/cpu/linear_int4.cpp
    "avx512_vnni": "M < 32: tiled words streamed once per 4 tokens, nibbles -> fp32 by vpermps (dot kernel); "
                   "M >= 32: n-tiles dequantized to fp32 + the 6x32 FMA panel micro-kernel, except from M = 128 on "
                   "Intel CPUs: blocks of 512 rows dequantized to fp32 (permuted k order, x permuted to match), then "
                   "ATen's fp32 GEMM (" + _FP32_PREFILL + ")",
    "avx512_bf16": "bf16 activations: M < 32 (inner_k_tiles 8 or 4) nibble pairs made bf16 (128 + u) by one vpternlogd, "
                   "32 weights per vdpbf16ps, 4 tokens per pass (Note [int4 bf16 decode]); M >= 32 codes - 8 as "
                   "exact bf16 in natural-k-order panels + 6x32 vdpbf16ps tiles, group scales per segment, zero "
                   "points as sum_g xsum * z in fp32; float32 / float16 activations (and other tilings at M < 32): "
                   "the avx512_vnni kernels",
    "avx2": "dot kernel (8 words per ymm, 2 tokens per pass) up to M = 47; from M = 48 n-tiles dequantized to fp32 "
            "(permuted k order, x permuted to match) 16 rows at a time into k-major panels + 6x16 FMA tiles, on Intel "
            "CPUs from M = 16 blocks of 512 rows dequantized the same way, then ATen's fp32 GEMM ("
            + _FP32_PREFILL_256 + ")",
    "scalar": "plain loops (M >= 16: dequantized blocks + ATen's fp32 GEMM): the CPU has no AVX2+FMA, or "
              "TORCHQKIT_CPU_ISA forced it",
}
_CPU_KERNEL_NOTES["torchqkit::linear_int4wo_tiled"]["avx_vnni"] = (
    "M = 1 on inner_k_tiles 8 or 4: the activation of each chunk (128 / 64 k) split exactly into two int16 halves of a "
    "fixed-point value (29 bits and a sign), nibble pairs x int16 pairs by vpdpwssd (VEX; EVEX on ymm where only "
    "AVX-512 VNNI exists), float32-accurate, 15 instructions per 64 weights instead of 24 (Note [int4 decode on int16 "
    "pairs]; a chunk with Inf / NaN or below 2^-98 takes the AVX2 kernel); else the AVX2 kernels: "
    + _CPU_KERNEL_NOTES["torchqkit::linear_int4wo_tiled"]["avx2"])
_CPU_KERNEL_NOTES["torchqkit::linear_int8da_int4_packed"] = {  # see Note [int8 x int4 decode] in csrc/cpu/int4_packed_dot.inc
    "avx512_vnni": "M < 12: vpdpbusd on low / high nibbles (128 k per zmm, exact int32 per lane, per-lane group "
                   "scales) against the per-call quantized, permuted activation, 4 tokens per pass; M >= 12: "
                   "nibbles expanded to int8 panels + 6x32 vpdpbusd tiles over panels of 4096 k, each block's "
                   "int32 sums folded into fp32 accumulators in registers",
    "avx_vnni": "M < 16: the 256-bit decode kernel with vpdpbusd (VEX; EVEX on ymm where only AVX-512 VNNI exists), "
                "2 tokens per pass; M >= 16: 16-row nibble panels x 6-token tiles (vpdpbusd) over panels of 4096 k, "
                "each block's int32 sums in registers, folded into fp32 once per block",
    "avx2": "M < 16: vpmaddubsw + vpmaddwd, unsigned nibbles x signed activation codes (64 k per ymm, exact int32 "
            "per lane) against the permuted activation, 2 tokens per pass; M >= 16: 16-row nibble panels x "
            "4-token tiles (vpmaddubsw int16 windows of 32 k, then vpmaddwd)",
    "scalar": "plain loops: the CPU has no AVX2+FMA, or TORCHQKIT_CPU_ISA forced it",
}
_CPU_KERNEL_NOTES["torchqkit::sdpa_over_filled_cache"] = {  # see Note [Filled-cache attention kernel] in csrc/cpu
    "avx512_vnni": "AVX-512 (16 lanes): K / V rows up to the last visible position only, the query heads of a kv "
                   "head in tiles of 4 rows, vectorized exp; bf16 / fp16 rows converted to fp32, float64 runs ATen's "
                   "sdpa over the same positions (with a warning)",
    "avx2": "AVX2 + FMA (8 lanes), the AVX-512 kernel's source: K / V rows up to the last visible position only; "
            "bf16 / fp16 rows converted to fp32, float64 runs ATen's sdpa over the same positions (with a warning)",
    "scalar": "plain loops over K / V rows up to the last visible position (the CPU has no AVX2+FMA, or "
              "TORCHQKIT_CPU_ISA forced it)",
}
for _notes in _CPU_KERNEL_NOTES.values():  # ops without an AVX-VNNI kernel say what serves that level
    _notes.setdefault("avx_vnni", _AVX2_AT_AVX_VNNI + _notes["avx2"])
# The amx level (csrc/cpu/amx_bf16_gemm.h): the ops with bf16 panels run them on AMX tiles, all else as avx512_bf16.
_AMX = ("amx: the avx512_bf16 kernels, but the prefill's bf16 panels multiply on AMX tiles (tdpbf16ps, blocks of "
        "32 tokens x 32 rows, fp32 sums, scales per segment: Note [bf16 panels on AMX]). ")
for _notes in _CPU_KERNEL_NOTES.values():
    if "avx512_bf16" in _notes:
        _notes["amx"] = _AMX + _notes["avx512_bf16"]
_CPU_KERNEL_NOTES["torchqkit::linear_int8da_int8_plain"]["amx"] = (
    "amx: M >= 8 the packed VNNI panels multiply on AMX-INT8 tiles (tdpbusd, 32 tokens x 32 rows, the codes packed "
    "per call; exact int32 sums, the same epilogue: Note [int8 panels on AMX]); below, the avx512_vnni dot kernel")
_CPU_KERNEL_NOTES["torchqkit::linear_int8da_int4_packed"]["amx"] = (
    "amx: M >= 16 with k blocks of whole 64-k steps (groups of 64 or more, or per channel) the expanded int8 panels "
    "multiply on AMX-INT8 tiles (tdpbusd, exact int32 sums, the same epilogue: Note [int8 panels on AMX]); groups "
    "of 32 and M < 16: the avx512_vnni kernels")
_NO_BF16_KERNEL = "at the {} level this op has no bf16 dot-product kernel: its AVX-512 VNNI kernel runs"
KERNEL_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # activations the C++ kernels take
# Ops the C++ CPU extension registered a kernel for (status() lists them), read from the dispatcher.
_CPU_OPS = tuple(op for op in OPS if CPU_EXTENSION_LOADED and torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU"))


# Ops whose float32 activations take the bf16 prefill kernels under torch's "medium" fp32 matmul precision, and the
# M from which (Note [fp32 activations in bf16] in csrc/cpu/fp32_matmul_precision.h).
_FP32_IN_BF16_FROM = {"torchqkit::linear_int8wo_plain": "M >= 16", "torchqkit::linear_int4wo_tiled": "every M (M >= 32 at inner_k_tiles 2)",
                      **dict.fromkeys(("torchqkit::linear_nf4wo", "torchqkit::linear_fp8wo", "torchqkit::linear_mxwo"),
                                      "M > 8"), "torchqkit::linear_intxwo": "M > 4"}
# At the amx level float32 activations take the three planes from the prefill M of each op (nf4 never).
_FP32_PLANES_FROM = {**_FP32_IN_BF16_FROM, "torchqkit::linear_int4wo_tiled": "M >= 32"}


def _fp32_activations_note(op: str, isa: str) -> str:
    """Which kernels float32 activations take at the avx512_bf16 / amx level, as torch's fp32 matmul precision says
    now."""
    if torch.ops.torchqkit_cpu.fp32_takes_bf16():
        return (f" | float32 activations: {_FP32_IN_BF16_FROM[op]} in the bf16 kernels (x rounded to bf16 once), "
                f"because torch's fp32 matmul precision allows bf16 (set_float32_matmul_precision('medium') / "
                f"torch.backends.mkldnn.matmul.fp32_precision = 'bf16'); below that the fp32 kernels")
    if isa == "amx" and op != "torchqkit::linear_nf4wo":
        return (f" | float32 activations: {_FP32_PLANES_FROM[op]} the AMX prefill on x split into three bf16 planes "
                f"that sum to it exactly (3x the tile work, fp32 precision: Note [fp32 activations on AMX]; nf4 "
                f"excepted); below that the fp32 kernels")
    return (" | float32 activations: the fp32 kernels (torch's fp32 matmul precision is not 'medium' / mkldnn "
            "'bf16'; with it, the prefill would take the bf16 kernels)")


# The weight-only ops whose float32 prefill has two routes (Note [fp32 prefill by sgemm] in csrc/cpu/registration.cpp)
_FP32_PREFILL_OPS = ("torchqkit::linear_int8wo_plain", "torchqkit::linear_int4wo_tiled", "torchqkit::linear_nf4wo",
                     "torchqkit::linear_fp8wo", "torchqkit::linear_intxwo", "torchqkit::linear_mxwo")
_FP32_PREFILL_ROUTE = {"panels": "this project's fp32 panels", "sgemm": "ATen's sgemm on dequantized rows"}


def _fp32_prefill_note(op: str, isa: str) -> str:
    """Which GEMM the float32 prefill of ``op`` runs on at the selected level on this CPU (read per call, like the
    route itself)."""
    if op not in _FP32_PREFILL_OPS or not hasattr(torch.ops.torchqkit_cpu, "fp32_prefill_route"):
        return ""
    route = torch.ops.torchqkit_cpu.fp32_prefill_route()
    forced = os.environ.get("TORCHQKIT_CPU_FP32_PREFILL")
    how = ("the scalar level's only one" if isa == "scalar" else f"TORCHQKIT_CPU_FP32_PREFILL={forced}" if forced
           else "this CPU's default")
    return f" | float32 prefill here: {_FP32_PREFILL_ROUTE[route]} ({how})"


def cpu_backend(op: str) -> tuple[str, str]:
    """(backend, reason) serving custom op ``op`` (e.g. "torchqkit::linear_int8wo_plain") on CPU."""
    op_def(op)  # unknown ops raise, naming the known ones
    if not CPU_EXTENSION_LOADED:
        return "reference", CPU_EXTENSION_REASON
    if op not in _CPU_OPS:
        return "reference", "csrc/cpu has no kernel for this op: its pure-PyTorch reference runs on CPU"
    isa = torch.ops.torchqkit_cpu.isa()
    forced = os.environ.get("TORCHQKIT_CPU_ISA")
    why = f"forced by TORCHQKIT_CPU_ISA={forced}" if forced else "best level this CPU runs"
    notes = _CPU_KERNEL_NOTES[op]
    route = _fp32_prefill_note(op, isa)
    if isa in ("avx512_bf16", "amx") and isa not in notes:  # the level that really runs, named as such
        return "cpp avx512_vnni", f"{why}; {_NO_BF16_KERNEL.format(isa)}: {notes['avx512_vnni']}{route}"
    if isa in ("avx512_bf16", "amx") and op in _FP32_IN_BF16_FROM:
        return f"cpp {isa}", f"{why}; {notes[isa]}{_fp32_activations_note(op, isa)}{route}"
    return f"cpp {isa}", f"{why}; {notes[isa]}{route}"


_STATUS_SOURCES: list = []  # callables returning status() rows, registered by the packages above (layouts/)


def register_status_rows(source) -> None:
    """Add ``source()`` (a list of rows: layout, linear, path, why) to what status() reports. layouts/ registers
    its routes here, so this package never imports the layouts above it."""
    _STATUS_SOURCES.append(source)


def status() -> list[dict]:
    """One row per (layout, linear case), then one per custom op: the path that serves it on CPU and why."""
    rows = [row for source in _STATUS_SOURCES for row in source()]
    for op in (_CPU_OPS if CPU_EXTENSION_LOADED else tuple(OPS)):
        path, why = cpu_backend(op)
        rows.append({"layout": "(op)", "linear": op, "path": path, "why": why})
    rows += backend_status()
    return rows


def format_status() -> str:
    rows = status()
    if not rows:
        return "no layouts registered"
    keys = ["layout", "linear", "path", "why"]
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in keys}
    lines = ["  ".join(k.ljust(widths[k]) for k in keys)]
    lines += ["  ".join(str(r[k]).ljust(widths[k]) for k in keys) for r in rows]
    return "\n".join(lines)


# ================================================================================================
# Backend choice: which implementation serves an op on a device, following a KernelPreference.
# See Note [Backend choice]. This is the only place that decides; layouts call ``linear_op(...)``.
# ================================================================================================
#
# Note [Backend choice]
# ~~~~~~~~~~~~~~~~~~~~~
# Backends of a torchqkit op, by the key that finds them:
#   "cuda"      C++ CUDA kernel (csrc/cuda, torchqkit._C_cuda) registered for the CUDA dispatch key
#   "cpu"       C++ CPU kernel (csrc/cpu, torchqkit._C_cpu) registered for the CPU dispatch key
#   "triton"    torchqkit_triton::<op> (kernels/triton/): on a GPU, or on CPU under TRITON_INTERPRET=1; a second
#               namespace only so TRITON can name it: Note [Why a torchqkit_triton namespace] in kernels/triton
#   "reference" the pure-PyTorch twin (reference.py), any device
# KernelPreference.AUTO takes the first available of _AUTO_ORDER[device type]; the interpreter is never
# chosen by AUTO (it is a test vehicle, orders of magnitude slower than the reference). TRITON, CUDA and
# REFERENCE name one backend: if it can't serve the op on that device, linear_op raises, saying why.

_AUTO_ORDER = {"cuda": ("cuda", "triton", "reference"), "cpu": ("cpu", "reference")}
_PREFERRED = {KernelPreference.CUDA: "cuda", KernelPreference.TRITON: "triton", KernelPreference.REFERENCE: "reference"}


def _load_cuda_extension() -> tuple[bool, str]:
    if torch.version.cuda is None:
        return False, "torch is a CPU build (torch.version.cuda is None): the CUDA extension can't exist"
    return _load_extension("torchqkit._C_cuda", "CUDA extension",
                           "setup.py builds it when torch has CUDA; see the pip build log")


CUDA_EXTENSION_LOADED, CUDA_EXTENSION_REASON = _load_cuda_extension()
# Ops csrc/cuda registered a kernel for, read from the dispatcher before any Triton kernel joins the CUDA key.
CUDA_OPS = tuple(op for op in OPS if CUDA_EXTENSION_LOADED and torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"))
_TRITON: list = []  # [module or None, reason], filled on first use (importing triton takes a while)


def triton_backend():
    """(torchqkit.kernels.triton or None, reason)."""
    if not _TRITON:
        if importlib.util.find_spec("triton") is None:
            _TRITON.extend([None, "triton is not installed (pip install triton)"])
        elif os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
            _TRITON.extend([None, "no GPU, and TRITON_INTERPRET=1 was not set before import: Triton can't run"])
        else:
            from . import triton as module
            how = "interpreter (TRITON_INTERPRET=1)" if module.INTERPRET else f"GPU family {module.gpu_family()}"
            _TRITON.extend([module, f"Triton kernel, {how}"])
    return _TRITON[0], _TRITON[1]


def register_triton_for_cuda_key(module, lib: torch.library.Library) -> list[str]:
    """Give each torchqkit op that has a Triton kernel but no C++ CUDA kernel its Triton kernel as the CUDA
    dispatch key's implementation (in ``lib``), so ``torch.ops.torchqkit.<op>`` on CUDA tensors runs what
    KernelPreference.AUTO promises (_AUTO_ORDER: C++ CUDA, then Triton). Returns the ops it registered."""
    done = []
    for op, triton_name in module.TRITON_OPS.items():
        if op in CUDA_OPS and torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"):
            continue  # the C++ CUDA kernel comes first
        lib.impl(op.split("::")[1], getattr(torch.ops.torchqkit_triton, triton_name.split("::")[1]), "CUDA")
        done.append(op)
    return done


_TRITON_LIB: list = []  # the torch.library.Library holding those registrations, while they live


def _register_triton_on_gpu() -> None:
    """On a machine with a GPU, import the Triton backend now and put it behind the CUDA key (see above)."""
    if not torch.cuda.is_available():
        return
    module, _ = triton_backend()
    if module is not None:
        _TRITON_LIB.append(torch.library.Library("torchqkit", "IMPL"))
        register_triton_for_cuda_key(module, _TRITON_LIB[0])


def _why_not(backend: str, op: str, device: str) -> str | None:
    """None if ``backend`` can serve ``op`` on ``device`` (a device type), else the reason it can't."""
    if backend == "reference":
        return None
    if backend == "triton":
        module, why = triton_backend()
        if module is None:
            return why
        if op not in module.TRITON_OPS:
            return f"no Triton kernel for {op} (Triton has {sorted(module.TRITON_OPS)})"
        if device != "cuda" and not (device == "cpu" and module.INTERPRET):
            return f"Triton runs on cuda, or on cpu under TRITON_INTERPRET=1; not on {device}"
        return None
    if backend != device:
        return f"the C++ {backend} kernels don't run on {device} tensors"
    loaded, why = (CUDA_EXTENSION_LOADED, CUDA_EXTENSION_REASON) if device == "cuda" else (CPU_EXTENSION_LOADED,
                                                                                          CPU_EXTENSION_REASON)
    if not loaded:
        return why
    if device == "cuda" and op not in CUDA_OPS:
        return f"csrc/cuda has no kernel for {op}"
    if not torch._C._dispatch_has_kernel_for_dispatch_key(op, device.upper()):
        return f"the C++ {device} extension has no kernel for {op}"
    return None


def choose_backend(op: str, device: str | torch.device, preference=KernelPreference.AUTO) -> tuple[str, str]:
    """(backend, why) for ``op`` on ``device`` under ``preference``; raises when a named backend can't serve."""
    op_def(op)  # unknown ops raise, naming the known ones
    dev = torch.device(device).type
    preference = KernelPreference(preference)
    if preference is not KernelPreference.AUTO:
        backend = _PREFERRED[preference]
        reason = _why_not(backend, op, dev)
        if reason is not None:
            raise RuntimeError(f"{op} on {dev}: KernelPreference.{preference.name} asks for the {backend} backend, "
                               f"but {reason}. Use KernelPreference.AUTO (status() shows what it picks) or REFERENCE.")
        return backend, f"KernelPreference.{preference.name}"
    skipped = []
    for backend in _AUTO_ORDER.get(dev, ("reference",)):
        reason = _why_not(backend, op, dev)
        if reason is None:
            return backend, "fastest available" + (f" ({'; '.join(skipped)})" if skipped else "")
        skipped.append(f"{backend}: {reason}")
    raise AssertionError("the reference always serves")  # invariant: "reference" ends every order


def linear_op(op: str, device, preference=KernelPreference.AUTO):
    """The callable that runs ``op`` (same arguments as its schema) on ``device`` under ``preference``."""
    backend, _ = choose_backend(op, device, preference)
    name = op.split("::")[1]
    if backend == "triton":
        return getattr(torch.ops.torchqkit_triton, name)
    if backend == "reference":
        return op_def(op).reference
    return getattr(torch.ops.torchqkit, name)  # the dispatch key picks the C++ kernel


def backend_status(devices=("cpu", "cuda")) -> list[dict]:
    """One row per (op, device): what is registered and what KernelPreference.AUTO would use, and why."""
    rows = []
    for op in OPS:
        for dev in devices:
            can = [b for b in ("cuda", "cpu", "triton", "reference") if _why_not(b, op, dev) is None]
            backend, why = choose_backend(op, dev)
            rows.append({"layout": "(backend)", "linear": f"{op} on {dev}", "path": backend,
                         "why": f"usable: {', '.join(can)}; {why}"})
    return rows


_register_triton_on_gpu()
