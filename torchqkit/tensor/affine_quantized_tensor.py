"""AffineQuantizedTensor: one torch.Tensor subclass for every quantized weight.

The outer tensor looks like the original float weight (shape, dtype). Inside it holds the layout's
packed tensors (names from ``layout.tensor_names``) plus hashable, JSON-able metadata.

See Note [Op lookup]: ``F.linear`` is caught in ``__torch_function__`` (otherwise only aten.t + aten.addmm
reach us); every aten op is looked up first in the layout's own table (exact layout type), then in the
generic table of ``generic_ops.py``; an op in neither raises UnsupportedOpError, never a silent
dequantize-and-run.

See Note [Transposed view]: ``t()`` never moves data. It flips ``transposed`` and swaps the outer shape,
so every layout gets transposition for free; ``mm(x, W.t())`` (the forward) is served by the layout's
linear, ``mm(grad, W)`` (linear's backward w.r.t. the input) by the dequantized weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.primitives import ZeroPointDomain, dequantize_affine
from ..core.qdtype import QDType
from .activation import ActivationQuantSpec, KernelPreference
from .dispatch import GENERIC_OPS, UnsupportedOpError

__all__ = ["AffineQuantizedTensor"]

_ATTRS = ("qdtype", "block_size", "logical_shape", "orig_dtype", "qlayout", "zero_point_domain",
          "act_quant", "kernel_preference", "transposed")


class AffineQuantizedTensor(torch.Tensor):
    """Quantized weight. Fields:

    qdtype: QDType of the codes; block_size: tuple (one entry per dim of logical_shape);
    logical_shape: shape of the stored (untransposed) weight, e.g. (N, K) for a Linear;
    orig_dtype: outer dtype (dequantize() returns it); qlayout: Layout instance (``Tensor.layout`` is torch's own);
    zero_point_domain: ZeroPointDomain; act_quant: ActivationQuantSpec or None;
    kernel_preference: KernelPreference; transposed: bool, see Note [Transposed view].
    Inner tensors: whatever ``layout.tensor_names`` lists (plain: qdata, scale, zero_point).
    """

    @staticmethod
    def __new__(cls, tensors: dict, qdtype, block_size, logical_shape, orig_dtype, qlayout,
                zero_point_domain, act_quant=None, kernel_preference=KernelPreference.AUTO,
                transposed=False):
        shape = tuple(logical_shape)
        if transposed:
            shape = shape[::-1]
        first = next(t for t in tensors.values() if t is not None)
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=orig_dtype, device=first.device,
                                                   requires_grad=False)

    def __init__(self, tensors: dict, qdtype: QDType, block_size, logical_shape, orig_dtype, qlayout,
                 zero_point_domain, act_quant: ActivationQuantSpec | None = None,
                 kernel_preference=KernelPreference.AUTO, transposed=False):
        missing = [n for n in qlayout.tensor_names if n not in tensors]
        if missing or set(tensors) - set(qlayout.tensor_names):
            raise ValueError(f"{type(qlayout).__name__} stores tensors {qlayout.tensor_names}, got {sorted(tensors)}")
        for name in qlayout.tensor_names:
            setattr(self, name, tensors[name])
        self.qdtype = qdtype
        self.block_size = tuple(int(b) for b in block_size)
        self.logical_shape = tuple(int(s) for s in logical_shape)
        self.orig_dtype = orig_dtype
        self.qlayout = qlayout
        self.zero_point_domain = ZeroPointDomain(zero_point_domain)
        self.act_quant = act_quant
        self.kernel_preference = KernelPreference(kernel_preference)
        self.transposed = bool(transposed)

    # ------------------------------------------------------------------ structure
    def inner_tensors(self) -> dict:
        return {n: getattr(self, n) for n in self.qlayout.tensor_names}

    def attributes(self) -> dict:
        return {a: getattr(self, a) for a in _ATTRS}

    def with_changes(self, tensors: dict | None = None, **attrs) -> "AffineQuantizedTensor":
        """A new tensor with some inner tensors and/or attributes replaced."""
        new_tensors = self.inner_tensors()
        new_tensors.update(tensors or {})
        new_attrs = self.attributes()
        new_attrs.update(attrs)
        return AffineQuantizedTensor(new_tensors, **new_attrs)

    def map_tensors(self, fn, **attrs) -> "AffineQuantizedTensor":
        """Apply ``fn`` to every inner tensor (None stays None)."""
        return self.with_changes({n: (None if t is None else fn(t)) for n, t in self.inner_tensors().items()},
                                 **attrs)

    def __tensor_flatten__(self):
        names = [n for n in self.qlayout.tensor_names if getattr(self, n) is not None]
        return names, tuple(getattr(self, a) for a in _ATTRS)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        attrs = dict(zip(_ATTRS, ctx))
        tensors = {n: inner_tensors.get(n) for n in attrs["qlayout"].tensor_names}
        return AffineQuantizedTensor(tensors, **attrs)

    # ------------------------------------------------------------------ numerics
    def dequantize(self, output_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight this tensor stands for (outer shape), equal to the oracle's dequantization."""
        parts = self.qlayout.unpack(self)
        w = dequantize_affine(parts.qdata, self.qdtype, self.block_size, parts.scale, parts.zero_point,
                              zero_point_domain=self.zero_point_domain,
                              output_dtype=output_dtype or self.orig_dtype, name="weight")
        return w.t() if self.transposed else w

    def packed_nbytes(self) -> int:
        """Bytes the layout really stores (codes, scales, zero points, any padding)."""
        return sum(t.numel() * t.element_size() for t in self.inner_tensors().values() if t is not None)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, self, bias)`` through the layout's linear entry."""
        if self.transposed:
            # linear(x, W.t()) is x @ W: the backward orientation, see Note [Transposed view].
            return _matmul_dequantized(x, self, bias)
        fn = self.qlayout.ops.get(F.linear)
        if fn is None:
            raise UnsupportedOpError(F.linear, self.qlayout, self.qlayout.ops.fns)
        if self.act_quant is not None and x.requires_grad and torch.is_grad_enabled():
            return _StraightThroughActivation.apply(x, self, bias, fn)
        return fn(self, x, bias)

    # ------------------------------------------------------------------ torch hooks
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LINEAR_FUNCS:
            x, w, bias = _linear_args(args, kwargs)
            if isinstance(w, AffineQuantizedTensor) and not isinstance(x, AffineQuantizedTensor):
                return w.linear(x, bias)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self = next(a for a in (*args, *kwargs.values()) if isinstance(a, AffineQuantizedTensor))
        fn = self.qlayout.ops.get(func) or GENERIC_OPS.get(func)
        if fn is None:
            raise UnsupportedOpError(func, self.qlayout, {**GENERIC_OPS.fns, **self.qlayout.ops.fns})
        return fn(func, args, kwargs)

    def _stable_hash_for_caching(self) -> str:
        # See PLATFORM.md: the compile cache key ignores our Python dispatch code. Include the code
        # version (hash of torchqkit's sources) and every attribute that changes the traced graph.
        from .code_version import code_version
        attrs = ",".join(f"{a}={getattr(self, a)!r}" for a in _ATTRS)
        return f"torchqkit:{code_version()}:{attrs}"

    def __repr__(self) -> str:
        act = "None" if self.act_quant is None else f"'{self.act_quant}'"
        t = ", transposed=True" if self.transposed else ""
        return (f"AffineQuantizedTensor(qdtype={self.qdtype.name}, block_size={self.block_size}, "
                f"layout={self.qlayout}, shape={tuple(self.shape)}, dtype={self.orig_dtype}, "
                f"act_quant={act}, kernel={self.kernel_preference.value}{t})")


_LINEAR_FUNCS = (F.linear, torch.ops.aten.linear.default)


def _linear_args(args, kwargs):
    x = args[0] if args else kwargs["input"]
    w = args[1] if len(args) > 1 else kwargs["weight"]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    return x, w, bias


class _StraightThroughActivation(torch.autograd.Function):
    """Activation quantization has no useful derivative (rounding); training through it uses the
    straight-through estimator: d out / d x = W (dequantized), as if x had not been quantized."""

    @staticmethod
    def forward(ctx, x, w, bias, fn):
        ctx.w = w
        ctx.bias_shape = None if bias is None else bias.shape
        with torch.no_grad():
            return fn(w, x, bias)

    @staticmethod
    def backward(ctx, grad):
        grad_x = grad @ ctx.w.dequantize(grad.dtype)
        grad_bias = None if ctx.bias_shape is None else grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, None, grad_bias, None


def _matmul_dequantized(x, w: AffineQuantizedTensor, bias):
    """x @ W where W is a transposed view: only reached by linear's backward (mm(grad, W))."""
    out = torch.matmul(x, w.dequantize(x.dtype).t())
    return out if bias is None else out + bias
