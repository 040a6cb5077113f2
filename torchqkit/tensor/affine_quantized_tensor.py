"""AffineQuantizedTensor: one torch.Tensor subclass for every quantized weight.

The outer tensor looks like the original float weight (shape, dtype). Inside it holds the layout's
packed tensors (names from ``layout.tensor_names``) plus hashable, JSON-able metadata.

Note [Op lookup]: ``F.linear`` is caught in ``__torch_function__`` (otherwise only aten.t + aten.addmm
reach us); every aten op is looked up first in the layout's own table (exact layout type), then in the
generic table of ``generic_ops.py``; an op in neither raises UnsupportedOpError, never a silent
dequantize-and-run.

Note [Transposed view]: ``t()`` never moves data. It flips ``transposed`` and swaps the outer shape,
so every layout gets transposition for free; ``mm(x, W.t())`` (the forward) is served by the layout's
linear, ``mm(grad, W)`` (linear's backward w.r.t. the input) by the dequantized weight.

See Note [Input scale]: an optional per-input-channel ``input_scale`` (K,) multiplies x before the layout's
kernel (AWQ / SmoothQuant scales that no previous op could absorb).
"""
from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

from ..core.primitives import ZeroPointDomain, dequantize_affine
from ..core.qdtype import QDType
from .activation import ActivationQuantSpec, KernelPreference, static_scale_problem
from ..layouts.base import WeightFormat
from .dispatch import EXPERT_OPS, GENERIC_OPS, UnsupportedOpError
from .experts import expert_view
from .fsdp import post_all_gather, pre_all_gather

__all__ = ["AffineQuantizedTensor", "INPUT_SCALE"]

_ATTRS = ("qdtype", "block_size", "logical_shape", "orig_dtype", "qlayout", "zero_point_domain",
          "act_quant", "kernel_preference", "transposed")

# Note [Input scale]
# ~~~~~~~~~~~~~~~~~~
# AWQ and SmoothQuant compute x W^T as (x / s)(W s)^T and fold 1 / s into the op that produces x (a norm, a
# Linear's rows). Where no such op exists (LLaMA's o_proj behind grouped KV heads, BERT's post-norm Linears,
# whose norm output is also the residual) the quantized weight keeps a = 1 / s itself: ``input_scale`` (K,),
# a float inner tensor next to the layout's, multiplied into x inside ``linear`` before the layout's kernel
# (so every kernel, layout and activation quantization sees x * a), while the codes hold W s. It is layer data
# like the codes: flattened for torch.compile, saved with the checkpoint, cut with a slice along K (sharding),
# moved by .to(). ``dequantize()`` returns the weight the Linear computes with, codes' weight * a (columns), so
# F.linear(x, w.dequantize()) stays the reference of w.linear(x). Layouts never see it: their ops run on the
# tensor without it and AffineQuantizedTensor puts it back (see _without_input_scale).
INPUT_SCALE = "input_scale"


class AffineQuantizedTensor(torch.Tensor):
    """A quantized weight: one ``torch.Tensor`` subclass for every format and layout.

    ``quantize_`` puts one in place of each quantized Linear's weight. Outside it looks like the original float
    weight (shape, dtype); inside it holds the layout's packed tensors plus hashable, JSON-able metadata.
    ``F.linear`` runs the layout's linear kernel (quantizing the input first when ``act_quant`` is set); every
    other op is looked up in the layout's own op table, then in the generic one, and an op in neither raises
    ``UnsupportedOpError``: nothing is silently dequantized. ``t()`` never moves data (it flips ``transposed``).
    ``dequantize()`` returns the float weight (equal to the reference ``dequantize_affine``), ``packed_nbytes()``
    the bytes stored, ``qparams_problem()`` what can't be right about the stored values (or None).
    Build one with ``quantize_weight`` rather than by hand; the constructor takes the layout's packed tensors.

    Args:
        tensors (dict[str, torch.Tensor | None]): the layout's inner tensors, exactly the names in
            ``qlayout.tensor_names`` (plain: ``qdata``, ``scale``, ``zero_point``), plus an optional
            ``input_scale`` of shape (K,) that multiplies the input before the kernel (AWQ / SmoothQuant scales).
        qdtype (QDType): the codes' quantized dtype.
        block_size (tuple[int, ...]): elements per scale along each dimension of ``logical_shape``.
        logical_shape (tuple[int, ...]): shape of the stored (untransposed) weight, e.g. (N, K) for a Linear, or
            (E, N, K) for a stack of E experts (each inner tensor then has a leading expert dim).
        orig_dtype (torch.dtype): the outer dtype; ``dequantize()`` returns it.
        qlayout (Layout): the layout instance that packed ``tensors`` (``Tensor.layout`` is torch's own).
        zero_point_domain (ZeroPointDomain): where the zero point lives (a member or its value).
        act_quant (ActivationQuantSpec | None): how the linear quantizes its input; None (default): it doesn't.
        kernel_preference (KernelPreference): which implementation serves the ops; default
            ``KernelPreference.AUTO`` (a member or its value).
        transposed (bool): whether this is a transposed view of the stored weight; default False.

    Raises:
        ValueError: ``tensors`` doesn't hold exactly the layout's tensor names (and optionally ``input_scale``).

    Example:
        ```python
        import torch
        import torchqkit as qk
        w = qk.quantize_weight(torch.randn(16, 64), qk.qdtypes.int8, qk.PerRow(), qk.PlainLayout())
        assert isinstance(w, qk.AffineQuantizedTensor) and w.shape == (16, 64)
        y = torch.nn.functional.linear(torch.randn(2, 64), w)      # the layout's linear
        w_float = w.dequantize()                                    # float32, (16, 64)
        print(w.packed_nbytes(), w.qparams_problem())               # bytes stored, None
        ```
    """

    @staticmethod
    def __new__(cls, tensors: dict, qdtype, block_size, logical_shape, orig_dtype, qlayout,
                zero_point_domain, act_quant=None, kernel_preference=KernelPreference.AUTO,
                transposed=False):
        shape = tuple(logical_shape)
        if transposed:  # the last two dims swap; an expert stack (E, N, K) keeps E first
            shape = (*shape[:-2], shape[-1], shape[-2])
        first = next(t for t in tensors.values() if t is not None)
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=orig_dtype, device=first.device,
                                                   requires_grad=False)

    def __init__(self, tensors: dict, qdtype: QDType, block_size, logical_shape, orig_dtype, qlayout,
                 zero_point_domain, act_quant: ActivationQuantSpec | None = None,
                 kernel_preference=KernelPreference.AUTO, transposed=False):
        missing = [n for n in qlayout.tensor_names if n not in tensors]
        if missing or set(tensors) - {*qlayout.tensor_names, INPUT_SCALE}:
            raise ValueError(f"{type(qlayout).__name__} stores tensors {qlayout.tensor_names} (and an optional "
                             f"{INPUT_SCALE}), got {sorted(tensors)}")
        for name in qlayout.tensor_names:
            setattr(self, name, tensors[name])
        self.input_scale = tensors.get(INPUT_SCALE)
        if self.input_scale is not None:
            _check_input_scale(self.input_scale, logical_shape)
        if len(logical_shape) not in (2, 3):
            raise ValueError(f"a quantized weight is 2-d (N, K), or 3-d (E, N, K) for a stack of experts; got "
                             f"logical shape {tuple(logical_shape)}")  # see Note [Expert weights] in experts.py
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
        """The layout's inner tensors (None ones included), then ``input_scale`` when there is one."""
        tensors = {n: getattr(self, n) for n in self.qlayout.tensor_names}
        if self.input_scale is not None:
            tensors[INPUT_SCALE] = self.input_scale
        return tensors

    @property
    def weight_format(self) -> WeightFormat:
        """(qdtype, block_size, logical shape, zero point domain): what the layout's protocol reads."""
        return WeightFormat(self.qdtype, self.block_size, self.logical_shape, self.zero_point_domain)

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
        # No dict of inner tensors here: dynamo's guards call this for every quantized weight before a compiled
        # call that checks guards.
        names = [n for n in self.qlayout.tensor_names if getattr(self, n) is not None]
        if self.input_scale is not None:
            names.append(INPUT_SCALE)
        return names, tuple(getattr(self, a) for a in _ATTRS)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        attrs = dict(zip(_ATTRS, ctx))
        tensors = {n: inner_tensors.get(n) for n in attrs["qlayout"].tensor_names}
        if inner_tensors.get(INPUT_SCALE) is not None:
            tensors[INPUT_SCALE] = inner_tensors[INPUT_SCALE]
        return AffineQuantizedTensor(tensors, **attrs)

    # ------------------------------------------------------------------ numerics
    def dequantize(self, output_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight this tensor stands for (outer shape), equal to the oracle's dequantization."""
        if self.is_experts:  # Note [Expert weights]: each expert is an ordinary 2-d weight
            return torch.stack([expert_view(self, e).dequantize(output_dtype) for e in range(self.shape[0])])
        parts = self.qlayout.unpack(self)
        w = dequantize_affine(parts.qdata, self.qdtype, self.block_size, parts.scale, parts.zero_point,
                              zero_point_domain=self.zero_point_domain,
                              output_dtype=output_dtype or self.orig_dtype, name="weight")
        if parts.mask is not None:  # entries the layout doesn't store: Note [Pruned entries read as zero]
            w = torch.where(parts.mask, w, torch.zeros((), dtype=w.dtype, device=w.device))
        if self.input_scale is not None:  # the weight the Linear computes with, see Note [Input scale]
            w = (w.float() * self.input_scale.float()).to(w.dtype)
        return w.transpose(-2, -1) if self.transposed else w

    def qparams_problem(self, codes: bool = True) -> str | None:
        """What can't be right about the stored values, or None: a NaN / Inf in any floating inner tensor other
        than the codes (scales and zero points, the layout's padding included: kernels multiply padding by zero
        activations, and 0 * NaN is NaN), in the scales as unpacked (E8M0 bytes can encode NaN), an integer zero
        point outside the codes' range, a static activation scale (a divisor) that isn't finite and > 0.
        ``codes``: also NaN / Inf float codes (float8 elements). Weight scales only multiply, so zero and
        negative ones are valid encodings (GGUF's Q4_0 stores d = max / -8, negative whenever a block's extreme
        is positive; an all-zero block has d = 0) and pass. A qdata on the meta device is skipped, which lets a
        loader check everything else without reading the codes (serialization/qparams.py; ``__setstate__``)."""
        # A doctored pickle can hold anything here: unpickling skips ActivationQuantSpec.__post_init__.
        problem = None if self.act_quant is None else static_scale_problem(self.act_quant.static_scale)
        if problem is not None:
            return f"act_quant {problem}"
        if self.is_experts:
            return next((f"expert {e}: {p}" for e in range(self.shape[0])
                         if (p := expert_view(self, e).qparams_problem(codes)) is not None), None)
        for name, t in self.inner_tensors().items():
            if t is None or t.is_meta or not t.is_floating_point() or (name == "qdata" and not codes):
                continue
            bad = _nonfinite_count(t)
            if bad:
                return f"{name} has {bad} NaN/Inf value(s)"
        parts = self.qlayout.unpack(self)
        scale, zp = parts.scale, parts.zero_point
        if not torch.isfinite(scale).all():
            return f"scale has {int((~torch.isfinite(scale)).sum())} NaN/Inf value(s)"
        if zp is not None and not zp.is_floating_point() and zp.numel() and (
                zp.min() < self.qdtype.qmin or zp.max() > self.qdtype.qmax):
            return (f"zero_point outside the {self.qdtype.name} code range "
                    f"[{self.qdtype.qmin:g}, {self.qdtype.qmax:g}]")
        return None

    def __setstate__(self, state):
        # Unpickling (torch.load, weights_only included) rebuilds the tensor from its saved fields without
        # __init__: check the values as the safetensors loader does (serialization/qparams.py).
        torch._utils._set_obj_state(self, state)
        problem = self.qparams_problem()
        if problem is not None:
            raise ValueError(f"loading a quantized weight {tuple(self.shape)}: {problem}; the checkpoint is corrupt")

    @property
    def is_experts(self) -> bool:
        """True for a stack of expert weights (E, N, K): see Note [Expert weights] in tensor/experts.py."""
        return len(self.logical_shape) == 3

    def packed_nbytes(self) -> int:
        """Bytes the layout really stores (codes, scales, zero points, any padding)."""
        return sum(t.numel() * t.element_size() for t in self.inner_tensors().values() if t is not None)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, self, bias)`` through the layout's linear entry. Every path (F.linear, aten.linear,
        mm / addmm / matmul with ``W.t()``) comes here, so the input checks F.linear does live here once."""
        if self.is_experts:
            raise RuntimeError(f"F.linear takes a 2-d weight; this is a stack of {self.shape[0]} experts. Select "
                               f"one (w[e]: a 2-d quantized view) or use torch._grouped_mm / torch.bmm; weight: "
                               f"{self!r}")
        _check_linear_args(self, x, bias)
        if self.transposed:
            # linear(x, W.t()) is x @ W: the backward orientation, see Note [Transposed view].
            return _matmul_dequantized(x, self, bias)
        fn = self.qlayout.ops.get(F.linear)
        if fn is None:
            raise UnsupportedOpError(F.linear, self.qlayout, self.qlayout.ops.fns)
        if self.act_quant is not None and x.requires_grad and torch.is_grad_enabled():
            return _StraightThroughActivation.apply(x, self, bias, fn)
        return fn(self, _scaled_input(self, x), bias)

    # ---------------------------------------------------- FSDP2 (Note [FSDP2 all-gather of packed storage] in fsdp.py)
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return pre_all_gather(self, outer_size, None if mesh is None else mesh.size())

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return post_all_gather(self, all_gather_outputs, metadata, param_dtype, out=out)

    # ------------------------------------------------------------------ torch hooks
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LINEAR_FUNCS:
            x, w, bias = _linear_args(args, kwargs)
            if isinstance(w, AffineQuantizedTensor) and not isinstance(x, AffineQuantizedTensor):
                return w.linear(x, bias)
        elif func in _REQUIRES_GRAD_SETTERS and _wants_grad(func, args, kwargs):
            return _refuse_requires_grad(args[0], func)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default and not isinstance(args[0], AffineQuantizedTensor):
            raise RuntimeError(_COPY_INTO_FLOAT.format(dst=f"{args[0].dtype} tensor of shape {tuple(args[0].shape)}",
                                                       src=args[1]))
        self = _first_quantized((*args, *kwargs.values()))
        if self.input_scale is not None and func in self.qlayout.ops.fns:
            return _layout_op_with_input_scale(func, args, kwargs)
        if self.is_experts:  # the layout's ops take 2-d weights: an expert stack has its own table
            fn = EXPERT_OPS.get(func) or EXPERT_OPS.get(_op_qualname(func))
            if fn is None:
                if _decomposes(func):
                    return func.decompose(*args, **kwargs)
                raise UnsupportedOpError(func, f"{self.qlayout!r} (a stack of experts)", EXPERT_OPS.fns)
            return fn(func, args, kwargs)
        fn = self.qlayout.ops.get(func) or GENERIC_OPS.get(func)
        if fn is None:
            if _decomposes(func):
                return func.decompose(*args, **kwargs)
            raise UnsupportedOpError(func, self.qlayout, {**GENERIC_OPS.fns, **self.qlayout.ops.fns})
        return fn(func, args, kwargs)

    def _stable_hash_for_caching(self) -> str:
        # See docs/platform.md: the compile cache key ignores our Python dispatch code. Include the code
        # version (hash of torchqkit's sources) and every attribute that changes the traced graph.
        from .code_version import code_version
        attrs = ",".join(f"{a}={getattr(self, a)!r}" for a in _ATTRS)
        return f"torchqkit:{code_version()}:{attrs},input_scale={self.input_scale is not None}"

    def __repr__(self) -> str:
        act = "None" if self.act_quant is None else f"'{self.act_quant}'"
        t = ", transposed=True" if self.transposed else ""
        a = "" if self.input_scale is None else f", input_scale=({self.input_scale.shape[0]},)"
        return (f"AffineQuantizedTensor(qdtype={self.qdtype.name}, block_size={self.block_size}, "
                f"layout={self.qlayout}, shape={tuple(self.shape)}, dtype={self.orig_dtype}, "
                f"act_quant={act}, kernel={self.kernel_preference.value}{a}{t})")


_LINEAR_FUNCS = (F.linear, torch.ops.aten.linear.default)


def _op_qualname(func) -> str:
    """``"namespace::name"`` of an op overload: the key of ops from libraries torchqkit doesn't import (the
    transformers grouped-matmul fallback, see tensor/expert_ops.py)."""
    schema = getattr(func, "_schema", None)
    return "" if schema is None else schema.name


def _check_input_scale(a, logical_shape) -> None:
    k = logical_shape[-1]
    if not isinstance(a, torch.Tensor) or a.dim() != 1 or a.shape[0] != k or not a.is_floating_point():
        got = f"{a.dtype} tensor of shape {tuple(a.shape)}" if isinstance(a, torch.Tensor) else type(a).__name__
        raise ValueError(f"input_scale multiplies the {k} input features of a weight of shape {tuple(logical_shape)}: "
                         f"it must be a 1-d float tensor of {k} elements, got a {got}")


def _scaled_input(w: "AffineQuantizedTensor", x: torch.Tensor) -> torch.Tensor:
    return x if w.input_scale is None else x * w.input_scale.to(x.dtype)


def _layout_op_with_input_scale(func, args, kwargs):
    """A layout op (slice, ...) on a weight with an input_scale: the layout runs on the weight without it (it
    knows only its own tensors), and the result gets it back, cut the same way when the op cut K."""
    w = args[0]
    out = w.qlayout.ops.get(func)(func, (w.with_changes({INPUT_SCALE: None}), *args[1:]), kwargs)
    if not isinstance(out, AffineQuantizedTensor):
        raise NotImplementedError(f"{func} on a quantized weight with an input_scale returned "
                                  f"{type(out).__name__}; call .dequantize() first")
    scale = w.input_scale
    if out.logical_shape[-1] != w.logical_shape[-1]:
        if func is not torch.ops.aten.slice.Tensor:
            raise NotImplementedError(f"{func} changes in_features of a quantized weight with an input_scale, and "
                                      f"only aten.slice knows how to cut the scale with it; call .dequantize() first")
        start = args[2] if len(args) > 2 and args[2] is not None else 0
        k = w.logical_shape[-1]
        start = max(0, min(k, start + k if start < 0 else start))  # as aten.slice clamps (the layout checked it)
        scale = scale.narrow(0, start, out.logical_shape[-1])
    _check_input_scale(scale, out.logical_shape)
    out.input_scale = scale  # on the op's own result: keeps the aliasing it set up
    return out


def _first_quantized(args):
    """The first AffineQuantizedTensor among ``args``, looking into lists: collectives (c10d::scatter_, ...) take
    lists (of lists) of tensors."""
    for a in args:
        if isinstance(a, AffineQuantizedTensor):
            return a
        if isinstance(a, (list, tuple)):
            found = _first_quantized(a)
            if found is not None:
                return found
    return None


def _check_linear_args(w: AffineQuantizedTensor, x, bias) -> None:
    """What F.linear refuses, refused the same way (RuntimeError, F.linear's wording), before any kernel: the
    kernels pad K to their stored width, so a wrong in_features would otherwise run on zero padding or read
    past the row. Shapes are static under torch.compile, so this is a trace-time check (no graph break)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"linear(): input must be a Tensor, not {type(x).__name__}")
    # The plain attributes: w.shape on the subclass is a __torch_function__ round trip, on every call.
    shape = w.logical_shape[::-1] if w.transposed else w.logical_shape
    n, k = shape[0], shape[-1]
    if x.dim() == 0:
        raise RuntimeError("both arguments to linear need to be at least 1D, but they are 0D and 2D "
                           f"(weight: {w!r})")
    if not x.is_floating_point():
        raise RuntimeError(f"expected a floating-point input for a quantized linear, got {x.dtype} (a float "
                           f"nn.Linear refuses it too: mat1 and mat2 must have the same dtype). Convert the input, "
                           f"e.g. x.to({w.dtype}); weight: {w!r}")
    if x.shape[-1] != k:
        m = math.prod(x.shape[:-1])
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({m}x{x.shape[-1]} and {k}x{n}): the input "
                           f"has {x.shape[-1]} features, the quantized weight takes {k}; weight: {w!r}")
    if bias is not None and bias.dim() == 1 and bias.shape[0] != n:
        raise RuntimeError(f"bias of {bias.shape[0]} elements for a linear with {n} outputs; weight: {w!r}")


# Note [Quantized weights are frozen]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# No gradient ever reaches the packed codes, so requires_grad=True on a quantized weight would let a training
# loop run and change nothing. Asking for it raises. One caller asks without meaning it: load_state_dict(...,
# assign=True) wraps every loaded tensor in nn.Parameter(t, requires_grad=<the replaced parameter's flag>), and a
# freshly built model's parameters all require grad; there the quantized weight simply stays frozen (as
# quantize_ leaves it). Gradients still flow to the input, so adapters (LoRA / QLoRA) train on top.
_REQUIRES_GRAD_SETTERS = (torch.Tensor.requires_grad_, torch.Tensor.requires_grad.__set__)
_FROZEN = ("quantized weights are frozen: no gradient reaches the packed codes, so requires_grad=True would train "
           "nothing. Train adapters on top (LoRA / QLoRA: gradients flow to the input), or quantization-aware "
           "training on the float model (torchqkit.prepare_qat_, then convert_qat_). nn.Parameter(w, requires_grad=False) wraps one; to unfreeze the other "
           "parameters, skip these: `for p in model.parameters(): p.requires_grad_(not isinstance(p, "
           "torchqkit.AffineQuantizedTensor))`")


def _wants_grad(func, args, kwargs) -> bool:
    if func == torch.Tensor.requires_grad_:
        return bool(args[1] if len(args) > 1 else kwargs.get("requires_grad", True))
    return bool(args[1])


def _refuse_requires_grad(w: AffineQuantizedTensor, func):
    caller = sys._getframe(2)  # 0: here, 1: __torch_function__, 2: whoever called requires_grad_ / the setter
    if (caller.f_code is torch.nn.Parameter.__new__.__code__ and caller.f_back is not None
            and caller.f_back.f_code is torch.nn.Module._load_from_state_dict.__code__):
        return w if func == torch.Tensor.requires_grad_ else None  # stays frozen, see the Note
    raise RuntimeError(f"{_FROZEN}. (weight: {w!r})")


_COPY_INTO_FLOAT = (
    "copy_ of a quantized weight into a float {dst}: it would have to dequantize, which torchqkit never does "
    "implicitly. A quantized state dict loads into a float model with load_state_dict(state, assign=True) (the "
    "model then holds the quantized weights), into a model quantized with the same config (torchqkit.quantize_), "
    "or with torchqkit.load_quantized for safetensors files. (source: {src!r})")


def _decomposes(func) -> bool:
    """``func`` has a CompositeImplicitAutograd kernel: outside torch.inference_mode it decomposes before reaching a
    subclass (``x @ w.t()`` arrives as aten.mm); inside it, where the autograd keys are off, it arrives whole, so
    the subclass runs that same decomposition."""
    return isinstance(func, torch._ops.OpOverload) and torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(), "CompositeImplicitAutograd")


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
            return fn(w, _scaled_input(w, x), bias)

    @staticmethod
    def backward(ctx, grad):
        grad_x = grad @ ctx.w.dequantize(grad.dtype)
        grad_bias = None if ctx.bias_shape is None else grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, None, grad_bias, None


def _matmul_dequantized(x, w: AffineQuantizedTensor, bias):
    """x @ W where W is a transposed view: only reached by linear's backward (mm(grad, W))."""
    out = torch.matmul(x, w.dequantize(x.dtype).t())
    return out if bias is None else out + bias


def _nonfinite_count(t: torch.Tensor, rows: int = 1 << 12) -> int:
    """NaN / Inf in a floating tensor. float8 has no isfinite kernel: it is checked as float16 (which holds every
    float8 value exactly), a few thousand rows at a time so the copy stays small."""
    if t.element_size() > 1:
        return int((~torch.isfinite(t)).sum())
    flat = t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)
    return sum(int((~torch.isfinite(flat[i:i + rows].to(torch.float16))).sum()) for i in range(0, flat.shape[0], rows))
