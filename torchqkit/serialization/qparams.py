"""The values a checkpoint's quantized weights are scaled by, checked before anything is loaded.

A NaN or Inf scale (or zero point, or float8 code; or an integer zero point outside the codes' range) loads
without complaint and turns every output that touches its block into NaN or garbage. ``check_qparams`` reads each
weight's scales and zero points (small: one per block) and asks the tensor itself what is wrong with them
(``AffineQuantizedTensor.qparams_problem``); the codes are read only where they are stored as floats, which
can be NaN (float8 elements), so loading reads everything else once.
"""
from __future__ import annotations

import torch

from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from .entries import INNER_SEP, entry_error

__all__ = ["check_qparams"]


def check_qparams(ckpt, skip=frozenset()) -> None:
    """Raise CheckpointError naming the file and tensor for the first weight whose scales, zero points or
    float codes can't be right. ``ckpt``: save_load._Checkpoint (headers already validated). ``skip``: weights
    checked elsewhere (a tensor-parallel rank checks the shard it reads, see dtensor_load.py)."""
    for name, attrs in ckpt.weights.items():
        if name in skip:
            continue
        tensors = dict.fromkeys(attrs["qlayout"].tensor_names)
        codes = False
        for inner in ckpt.inner[name]:
            stored = f"{name}{INNER_SEP}{inner}"
            reader = ckpt.readers[ckpt.where[stored]]
            if inner == "qdata" and not reader.dtype(stored).is_floating_point:
                # Integer codes can't poison outputs; a meta stand-in unpacks for free.
                tensors[inner] = torch.empty(reader.shape(stored), dtype=reader.dtype(stored), device="meta")
            else:
                tensors[inner] = reader.read(stored)
                codes = codes or inner == "qdata"
        problem = AffineQuantizedTensor(tensors, **attrs).qparams_problem(codes=codes)
        if problem is not None:
            path = ckpt.readers[ckpt.where[f"{name}{INNER_SEP}{ckpt.inner[name][0]}"]].path
            raise entry_error(path, name, f"{problem}: the file is corrupt or was not written by a quantizer; "
                                          f"loading it would give NaN or wrong outputs")
