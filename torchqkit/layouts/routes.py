"""Routes: which implementation serves ``F.linear`` for each case a layout stores, declared once per layout.

A layout lists its ``routes``, most specific first. ``quantized_linear`` (every layout's ``F.linear`` entry) takes
the first route whose ``applies(w, x)`` holds and whose activation dtypes include ``x.dtype``; no route matching
means the reference (dequantize, fake-quantize the activation, ``F.linear``). ``route_rows`` turns the same
declarations into the rows of ``torchqkit.kernels.status()``, so the report can't drift from the code.

Note [Kernel preference]
~~~~~~~~~~~~~~~~~~~~~~~~
- AUTO: a route's aten path (``aten``) if it has one, else its torchqkit op through ``torch.ops.torchqkit``: the
  dispatch key picks the backend (C++ CPU, C++ CUDA, Triton registered on the CUDA key, or the op's reference
  where nothing is built; ``status()`` says which and why). Cases no kernel takes run the reference, and
  ``status()`` lists them.
- REFERENCE: always the reference.
- TRITON / CUDA: exactly that backend of the route's torchqkit op (``kernels.linear_op``), or a RuntimeError naming
  the layout, the case, the op and the reason. Never a silent reference or another backend.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch
import torch.nn.functional as F

from ..core.qdtype import fp4_e2m1
from ..kernels import KERNEL_ACT_DTYPES, cpu_backend, linear_op
from ..kernels.ops import fake_quantize_activation as fake_quantize_op
from ..kernels.preference import KernelPreference

__all__ = ["Route", "GroupedRoute", "quantized_linear", "reference_linear", "route_for", "route_rows",
           "flatten_tokens", "in_dtype_of", "empty_linear", "fake_quantized_input", "kernel_fake_quantized_input",
           "on_fake_quantized_input",
           "grouped_on_fake_quantized_input"]


@dataclass(frozen=True)
class GroupedRoute:
    """A route's case for a stack of experts (E, N, K): rows ``[offs[g - 1], offs[g])`` of x through expert g, in one
    op call (Note [Grouped quantized linear] in tensor/grouped_linear.py).

    op:    the torchqkit grouped op ("torchqkit::grouped_linear_int4wo_tiled")
    call:  (fn, tensors, w, x, offs) -> y: runs ``fn`` on the stack's inner tensors (``tensors``: by name), where
           ``w`` is one expert (its 2-d fields: block size, logical shape, activation spec)
    """
    op: str
    call: Callable

    @cached_property
    def dispatched_op(self):
        return getattr(torch.ops.torchqkit, self.op.split("::")[1])


@dataclass(frozen=True)
class Route:
    """One case of a layout's linear and what serves it.

    case:       what the case is, for status() ("int4 weight-only, group-wise float zero point")
    applies:    (w, x) -> bool, cheap checks on the weight's fields (and x's dtype / device where they matter)
    op:         the torchqkit custom op serving it ("torchqkit::linear_nf4wo"), or None (aten path only)
    call:       (fn, w, x, bias) -> y: runs ``fn`` (any backend of ``op``: same schema) on the layout's tensors
    aten:       (w, x, bias) -> y: a torch path AUTO takes instead of ``op`` (e.g. ``torch._int_mm``)
    aten_name:  that path's name in status(); why: why it serves this case (status())
    act_dtypes: activation dtypes the route takes; other dtypes fall through to the next route
    grouped:    the op serving the case for a whole stack of experts at once, where there is one (GroupedRoute)
    """
    case: str
    applies: Callable
    op: str | None = None
    call: Callable | None = None
    aten: Callable | None = None
    aten_name: str = ""
    why: str = ""
    act_dtypes: tuple[torch.dtype, ...] = KERNEL_ACT_DTYPES
    grouped: GroupedRoute | None = None

    @cached_property
    def dispatched_op(self):
        """``torch.ops.torchqkit.<op>``, looked up once (every AUTO linear call goes through it)."""
        return getattr(torch.ops.torchqkit, self.op.split("::")[1])


def flatten_tokens(x: torch.Tensor) -> torch.Tensor:
    """(..., K) -> (M, K), row-major: kernels and torch._scaled_mm read rows at stride K, and under torch.compile
    inductor gives the activation's quantized codes the strides of the input it was handed (a transposed view's
    column-major ones), so every route flattens through here (a copy only for a non-contiguous input)."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def in_dtype_of(x: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` (a bias, a dequantized weight) in ``x``'s dtype: a quantized linear returns the input's dtype, as
    its kernels do, whatever dtype the layer's own tensors have."""
    return t if t is None or t.dtype == x.dtype else t.to(x.dtype)


def empty_linear(w, x: torch.Tensor) -> torch.Tensor:
    """F.linear of an input with no tokens: an empty (..., N) output in x's dtype, with no activation
    quantized (a 0-row tensor has no range to take a scale from) and no kernel launched."""
    return x.new_empty(*x.shape[:-1], w.logical_shape[0])


def fake_quantized_input(w, x: torch.Tensor) -> torch.Tensor:
    """``x`` quantized by the weight's ActivationQuantSpec and dequantized again (x itself without one): what the
    quantized matmul multiplies, in x's dtype and shape."""
    if w.act_quant is None:
        return x
    return w.act_quant.fake_quantize(flatten_tokens(x)).reshape(x.shape)


def reference_linear(w, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Dequantize the weight (and fake-quantize the activation when the weight carries an ActivationQuantSpec),
    then a float ``F.linear``: the definition every route's kernel is tested against."""
    return F.linear(fake_quantized_input(w, x), in_dtype_of(x, w.dequantize()), in_dtype_of(x, bias))


# Note [Activations fake-quantized before a weight-only kernel]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A product whose activation format has no integer / low-precision matmul on the device (float8, MXFP8 or NVFP4
# activations on a CPU, which no instruction multiplies; int4 codes on a GPU, where torchqkit has no integer kernel
# for them) is defined as F.linear(fake_quantize(x), dequantize(w))
# (reference_linear). Its routes compute exactly that with the layout's weight-only kernel in place of dequantize +
# F.linear: the activation is quantized and dequantized by the spec's own torch ops (the reference's code, so the
# codes are the reference's; fused into the graph under torch.compile), and the kernel reads the weight's bytes as
# stored. The result is the reference's product up to the kernel's float summation order, at the weight-only
# kernel's speed (it reads the same bytes), where dequantizing the whole weight per call cost ~1000x that at M = 1.

def _by_op(spec, x: torch.Tensor) -> bool:
    """Whether torchqkit::fake_quantize_activation computes ``spec``'s fake quantization of ``x``: float8 / NVFP4
    activations on a CPU. Routes run without autograd: training through an activation config takes the
    straight-through gradient around the whole linear (_StraightThroughActivation, tensor/affine_quantized_tensor)."""
    return spec is not None and x.device.type == "cpu" and fake_quantize_op.takes(spec)


def kernel_fake_quantized_input(w, x: torch.Tensor) -> torch.Tensor:
    """``fake_quantized_input(w, x)``, the same values, through torchqkit::fake_quantize_activation where it
    takes the case (Note [Activations fake-quantized before a weight-only kernel])."""
    if _by_op(w.act_quant, x):
        return fake_quantize_op.fake_quantize_activation(x, w.act_quant)  # (..., K): no reshapes around the op
    return fake_quantized_input(w, x)


def on_fake_quantized_input(call: Callable) -> Callable:
    """A Route ``call`` run on the fake-quantized input (Note [Activations fake-quantized before a weight-only
    kernel])."""
    return lambda fn, w, x, bias: call(fn, w, kernel_fake_quantized_input(w, x), bias)


def grouped_on_fake_quantized_input(call: Callable) -> Callable:
    """A GroupedRoute ``call`` run on the fake-quantized input, each expert's rows quantized as that expert's own
    linear quantizes them."""
    return lambda fn, tensors, w, x, offs: call(fn, tensors, w, _fake_quantized_groups(w, x, offs), offs)


def _fake_quantized_groups(w, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``[offs[g - 1], offs[g])`` of x fake-quantized as group g's linear does it: a scale per token (or token
    and group of features) or a static one is the same over the whole input; a dynamic per-tensor scale, and
    NVFP4's scale of the block scales, are taken over each group's rows."""
    spec = w.act_quant
    tensor_wide = spec is not None and (spec.qdtype is fp4_e2m1 or (spec.per_tensor and spec.static_scale is None))
    if not tensor_wide:
        return kernel_fake_quantized_input(w, x)
    # only float8 per tensor and NVFP4 scale over the whole input: the op's cases (its reference off the CPU)
    return fake_quantize_op.fake_quantize_activation(x, spec, offs)


def route_for(w, x: torch.Tensor) -> Route | None:
    """The route serving ``F.linear(x, w)``, or None (the reference)."""
    for route in type(w.qlayout).routes:
        if x.dtype in route.act_dtypes and route.applies(w, x):
            return route
    return None


def quantized_linear(w, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for any layout, following the weight's KernelPreference (Note [Kernel preference])."""
    pref = w.kernel_preference
    if x.shape[:-1].numel() == 0:
        return empty_linear(w, x)
    if pref is KernelPreference.REFERENCE:
        return reference_linear(w, x, bias)
    route = route_for(w, x)
    if pref is KernelPreference.AUTO:
        if route is None:
            return reference_linear(w, x, bias)
        if route.aten is not None:
            return route.aten(w, x, bias)
        return _call_op(route, route.dispatched_op, w, x, bias)
    where = f"{type(w.qlayout).__name__} weight {tuple(w.shape)} with {x.dtype} activations"
    if route is None or route.op is None:
        served = "the reference" if route is None else f"{route.aten_name} only ({route.case})"
        raise RuntimeError(f"{where}: KernelPreference.{pref.name} asks for the {pref.value} backend, but no torchqkit "
                           f"op serves this case; it runs on {served}. Use KernelPreference.AUTO or REFERENCE "
                           f"(torchqkit.kernels.status() lists each layout's cases).")
    try:
        fn = linear_op(route.op, x.device, pref)
    except RuntimeError as e:
        raise RuntimeError(f"{where} ({route.case}): {e}") from None
    return _call_op(route, fn, w, x, bias)


def _call_op(route: Route, fn, w, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``route.call(fn, ...)``, below the autograd keys when nothing needs a gradient (Note [Op calls without
    autograd])."""
    if (torch.compiler.is_compiling() or
            torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))):
        return route.call(fn, w, x, bias)
    with torch._C._AutoDispatchBelowAutograd():
        return route.call(fn, w, x, bias)


# Note [Op calls without autograd]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every torchqkit op has a Python autograd kernel (torch.library.register_autograd): each call enters Python at
# the Autograd key, finds that nothing needs a gradient, and redispatches to the backend: 5-8 us of CPU per call
# (benchmarks/RESULTS.md; HF generate runs ~200 of them per token of a 135M model). When no input
# needs a gradient, the call skips that key, as torch's own generated kernel does for its redispatch. Under
# torch.compile the op is left to the graph: inductor's wrapper calls it, and torch.inference_mode() is what
# takes the autograd keys out there (LeanDecoder decodes under it).


_REFERENCE_ROW = {"linear": "any other case, KernelPreference.REFERENCE, or activations not float32 / bfloat16 / "
                            "float16", "path": "reference",
                  "why": "dequantize + F.linear (fake-quantized activations): chosen explicitly / no kernel for it"}


def route_rows(layout_cls) -> list[dict]:
    """status() rows of one layout: a row per route (the backend serving it on CPU), then the reference row."""
    rows = []
    for route in layout_cls.routes:
        if route.aten is not None:
            path, why = route.aten_name, route.why
        else:
            backend, why = cpu_backend(route.op)
            path = f"{route.op} ({backend})"
        rows.append({"layout": layout_cls.name, "linear": route.case, "path": path, "why": why})
    return rows + [{"layout": layout_cls.name, **_REFERENCE_ROW}]
