"""The low-bit weight-only columns of bench_linear.py (``--formats``): NF4, float8 and packed intx kernels
(torchqkit::linear_nf4wo / linear_fp8wo / linear_intxwo / linear_mxwo) next to fp32 F.linear, on the layouts' own bytes.

    python benchmarks/bench_linear.py --formats nf4,nf4dq,fp8,int3            # the lowbit table only
    python benchmarks/bench_linear.py --formats int8,nf4 --quick              # the int8 table, then nf4

Each cell: median ms with float32 activations; "GB/s (bw%)" counts the weight's stored bytes (codes + scales)
per call against the read bandwidth measured by the same run; "xf32" = fp32 F.linear time / kernel time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import torchqkit as qk
from torchqkit.core import qdtypes as Q

NF4, FP8, INTX = torch.ops.torchqkit.linear_nf4wo, torch.ops.torchqkit.linear_fp8wo, torch.ops.torchqkit.linear_intxwo
MX = torch.ops.torchqkit.linear_mxwo


def _intx(bits):
    return lambda w: qk.quantize_weight(w, getattr(Q, f"int{bits}"), qk.PerGroup(32), qk.PackedIntxLayout())


# name -> (weight from float weight, description)
FORMATS = {
    "nf4": (lambda w: qk.quantize_weight(w, Q.nf4, qk.PerGroup(64), qk.NF4Layout(64), scale_dtype=torch.float32),
            "nf4 b64"),
    "nf4dq": (lambda w: qk.quantize_weight(w, Q.nf4, qk.PerGroup(64), qk.NF4Layout(64, True), scale_dtype=torch.float32),
              "nf4 b64 double quant"),
    "fp8": (lambda w: qk.quantize_weight(w, Q.float8_e4m3fn, qk.PerRow(), qk.Float8Layout(), scale_dtype=torch.float32),
            "float8 e4m3fn per row"),
    "e5m2": (lambda w: qk.quantize_weight(w, Q.float8_e5m2, qk.PerRow(), qk.Float8Layout(), scale_dtype=torch.float32),
             "float8 e5m2 per row"),
    **{f"int{b}": (_intx(b), f"int{b} g32 symmetric, packed") for b in (2, 3, 4, 5, 6)},
    "mxfp4": (lambda w: qk.quantize_weight(w, Q.fp4_e2m1, qk.PerGroup(32), qk.MXLayout(), scale_rounding="power_of_two"),
              "MXFP4 (e2m1, E8M0 scale per 32)"),
    "mxfp8": (lambda w: qk.quantize_weight(w, Q.float8_e4m3fn, qk.PerGroup(32), qk.MXLayout(),
                                           scale_rounding="power_of_two"), "MXFP8 (e4m3, E8M0 scale per 32)"),
}


def call(w, x):
    """The op the weight's layout routes F.linear to, on its stored tensors (no Python dispatch in the timing)."""
    if isinstance(w.qlayout, qk.NF4Layout):
        return lambda: NF4(x, w.qdata, w.scale, w.scale_codes, w.scale_block_scale, w.scale_offset,
                           w.qlayout.block_size, None)
    if isinstance(w.qlayout, qk.Float8Layout):
        return lambda: FP8(x, w.qdata, w.scale, None)
    if isinstance(w.qlayout, qk.MXLayout):
        return lambda: MX(x, w.qdata, w.scale, None)
    return lambda: INTX(x, w.qdata, w.scale, w.zero_point, w.qdtype.bits, w.qdtype.signed, w.zero_point_domain.value,
                        None)


def stored_bytes(w) -> int:
    return sum(t.numel() * t.element_size() for t in w.inner_tensors().values() if t is not None)


def lowbit_table(shapes, ms, bw, names, bench, args):
    """Prints one table: rows (K, N, M), per format ms / GB/s (bw%) / xf32."""
    for name in names:
        print(f"  {name}: {FORMATS[name][1]}")
    head = ["    K     N    M", f"{'f32':>8}"]
    head += [f"{name + ' ms':>10}  {'GB/s (bw%)':>12}  {'xf32':>5}" for name in names]
    print("  ".join(head) + "    [ms, median; float32 activations]")
    for k, n in shapes:
        g = torch.Generator().manual_seed(0)
        w32 = torch.randn(n, k, generator=g) * 0.02
        weights = {name: FORMATS[name][0](w32) for name in names}
        for m in ms:
            x = torch.randn(m, k, generator=g)
            opts = dict(cold=m <= 8, min_reps=args.reps, budget_s=args.budget)
            t32 = bench(lambda w: F.linear(x, w), w32, **opts)
            cells = [f"{k:>5} {n:>5} {m:>4}", f"{t32 * 1e3:8.2f}"]
            for name in names:
                t = bench(lambda w: call(w, x)(), weights[name], **opts)
                gbs = stored_bytes(weights[name]) / t / 1e9
                cells.append(f"{t * 1e3:10.2f}  {gbs:5.1f} ({gbs / bw:4.0%})  {t32 / t:4.1f}x")
            print("  ".join(cells), flush=True)
