"""Peak memory of quantize_checkpoint and load_quantized against the checkpoint sizes.

    python -m test.serialization.peak_memory [--layers 32] [--dim 1024]

writes a float32 checkpoint of ``layers`` Linear(dim, dim) (tensor by tensor), then in fresh processes
(1) quantize_checkpoint it to int8 weight-only and (2) load_quantized the result into a meta-device model.
Each child resets its peak RSS (``/proc/self/clear_refs``), reports its resident memory just before the call
and its peak (VmHWM, see ``peak_rss``) after: the difference is what the call itself needed at most. Both children first
build one tiny quantized Parameter, see the warm-up comment in ``_child``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MB = 1e6


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """VmHWM, the peak RSS of this process's memory map. ru_maxrss is the same number except that it also keeps
    the peak of the process image exec replaced: with vfork-based spawning that is the *parent's* peak (a whole
    pytest session), which /proc/self/clear_refs can't reset."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (Linux >= 4.0): VmHWM now covers only what follows


def _skeleton(layers: int, dim: int):
    import torch
    from torch import nn
    with torch.device("meta"):
        return nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])


def _child(mode: str, src: str, dst: str, layers: int, dim: int) -> None:
    import gc

    import torch
    import torchqkit as qk
    model = _skeleton(layers, dim) if mode == "load" else None
    # Warm-up: the first dispatch into an AffineQuantizedTensor imports torch's subclass machinery (sympy,
    # torch.distributed ...: about 40 MB of modules), a fixed cost of any process using quantized weights.
    torch.nn.Parameter(qk.quantize_weight(torch.randn(8, 32), qk.qdtypes.int8, qk.PerRow(), qk.PlainLayout()),
                       requires_grad=False)
    gc.collect()
    reset_peak_rss()
    before = rss_now()
    if mode == "quantize":
        qk.quantize_checkpoint(src, dst, qk.Int8WeightOnlyConfig(), progress=False)
    else:
        qk.load_quantized(model, dst)
        assert isinstance(model[0].weight, qk.AffineQuantizedTensor)
    print(json.dumps({"before": before, "peak": peak_rss()}))


def _write_float_checkpoint(path: Path, layers: int, dim: int) -> None:
    import torch

    from torchqkit.serialization.safetensors_file import SafetensorsWriter
    g = torch.Generator().manual_seed(0)
    writer = SafetensorsWriter(path)
    for i in range(layers):
        writer.add(f"{i}.weight", torch.randn(dim, dim, generator=g) * 0.02)
        writer.add(f"{i}.bias", torch.zeros(dim))
    writer.close({"format": "pt"})


def _run_child(*args) -> dict:
    proc = subprocess.run([sys.executable, "-m", "test.serialization.peak_memory", "--child", *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"delta": max(r["peak"] - r["before"], 0), **r}


def measure(folder: Path, layers: int = 32, dim: int = 1024) -> dict:
    """Sizes and peak increases in bytes: float checkpoint, quantized checkpoint, largest float tensor,
    quantize_checkpoint's peak increase, load_quantized's peak increase."""
    src, dst = folder / "float.safetensors", folder / "int8.safetensors"
    _write_float_checkpoint(src, layers, dim)
    quantize = _run_child("quantize", src, dst, layers, dim)
    load = _run_child("load", src, dst, layers, dim)
    return {"float_bytes": src.stat().st_size, "quantized_bytes": dst.stat().st_size, "largest_tensor": dim * dim * 4,
            "quantize_delta": quantize["delta"], "load_delta": load["delta"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--child", nargs=5, metavar=("MODE", "SRC", "DST", "LAYERS", "DIM"))
    args = p.parse_args()
    if args.child:
        mode, src, dst, layers, dim = args.child
        _child(mode, src, dst, int(layers), int(dim))
        return
    with tempfile.TemporaryDirectory() as d:
        r = measure(Path(d), args.layers, args.dim)
    print(f"float32 checkpoint {r['float_bytes'] / MB:.1f} MB ({args.layers} x Linear({args.dim}, {args.dim}), "
          f"largest tensor {r['largest_tensor'] / MB:.1f} MB) -> int8 checkpoint {r['quantized_bytes'] / MB:.1f} MB\n"
          f"quantize_checkpoint peak increase: {r['quantize_delta'] / MB:.1f} MB\n"
          f"load_quantized (meta model) peak increase: {r['load_delta'] / MB:.1f} MB")


if __name__ == "__main__":
    main()
