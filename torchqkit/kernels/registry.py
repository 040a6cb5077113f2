"""The op registry: ``define_linear_op`` declares one ``torchqkit::`` custom op once, in its own module under
``kernels/ops/``: schema, fake (shapes and dtypes only), pure-PyTorch reference, autograd.

Backends register on that same op per dispatch key: the C++ CPU kernels (csrc/cpu, CPU key), the C++ CUDA
kernels (csrc/cuda, CUDA key) and the Triton kernels (kernels/triton, put on the CUDA key where no C++ CUDA
kernel exists). The reference is the CompositeExplicitAutograd kernel, so every op runs on every device even
when nothing is built. ``OPS`` (every op, in definition order) is what the backend chooser, ``status()`` and the
tests read; nobody keeps a list by hand.

Autograd (every op with a ``weight`` decoder): d/dx through the decoded weight, ``grad @ W``; activation
rounding inside an op (int8 dynamic activations) is the identity (straight-through, as QAT does); the bias
gets its gradient; the stored weight never does (it is frozen: QLoRA trains adapters through it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["OpDef", "OPS", "define_op", "define_linear_op", "define_weight_only_op", "op_def"]


@dataclass(frozen=True)
class OpDef:
    name: str                   # "torchqkit::linear_nf4wo"
    reference: Callable         # same arguments as the schema; the definition every backend is tested against
    fake: Callable              # shapes and dtypes only (torch.compile / meta tensors); backends' ops reuse it
    weight: Callable | None     # (*weight args, k=K) -> float32 (N, K): the format's decoder; None: no autograd


OPS: dict[str, OpDef] = {}


def op_def(name: str) -> OpDef:
    try:
        return OPS[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; torchqkit ops: {list(OPS)}") from None


def define_linear_op(name: str, schema: str, *, reference: Callable, out_features: Callable,
                     weight: Callable | None = None, check: Callable | None = None,
                     out_dtype: Callable | None = None) -> OpDef:
    """Define ``name`` (first argument x (..., K), an optional ``bias`` argument after the weight's) with:
    out_features(x, *args) -> N and check(x, *args) (torch._check calls) for the fake; out_dtype(x, *args)
    when the output dtype isn't x's; reference as the CompositeExplicitAutograd kernel; weight (see module
    docstring) for the autograd formula."""
    short = name.split("::")[1]

    def fake(x, *args):
        if check is not None:
            check(x, *args)
        dtype = x.dtype if out_dtype is None else out_dtype(x, *args)
        return x.new_empty(*x.shape[:-1], out_features(x, *args), dtype=dtype)

    fake.__name__ = f"{short}_fake"
    define_op(name, schema, reference=reference, fake=fake)
    if weight is not None:
        arg_names = [a.name for a in getattr(torch.ops.torchqkit, short).default._schema.arguments]
        _register_weight_autograd(name, weight, arg_names.index("bias"))
    OPS[name] = OpDef(name, reference, fake, weight)
    return OPS[name]


def define_op(name: str, schema: str, *, reference: Callable, fake: Callable) -> OpDef:
    """Define ``name`` with its fake and its reference as the CompositeExplicitAutograd kernel; no autograd (an op
    that is not a linear, e.g. attention over a KV cache at inference)."""
    torch.library.define(name, schema)
    torch.library.register_fake(name)(fake)
    torch.library.impl(name, "CompositeExplicitAutograd", reference)
    OPS[name] = OpDef(name, reference, fake, None)
    return OPS[name]


def define_weight_only_op(name: str, schema: str, *, weight: Callable, out_features: Callable,
                          check: Callable | None = None) -> OpDef:
    """A weight-only linear (x, *weight args, bias): its reference is ``F.linear`` in float32 on the decoded weight,
    ``weight(*weight args, k=K)``, returned in x's dtype, so the decoder is the op's whole definition."""
    short = name.split("::")[1]
    bias_index = [a.name for a in torch._C.parse_schema(f"{short}{schema}").arguments].index("bias")

    def reference(x, *args):
        bias = args[bias_index - 1] if len(args) >= bias_index else None
        w = weight(*args[:bias_index - 1], k=x.shape[-1])
        return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)

    reference.__name__ = reference.__qualname__ = f"{short}_ref"
    return define_linear_op(name, schema, reference=reference, weight=weight, out_features=out_features, check=check)


def _register_weight_autograd(name: str, weight: Callable, bias_index: int) -> None:
    def setup_context(ctx, inputs, output):
        x, weight_args, bias = inputs[0], inputs[1:bias_index], inputs[bias_index]
        ctx.tensor_idx = [i for i, a in enumerate(weight_args) if isinstance(a, torch.Tensor)]
        ctx.save_for_backward(*(weight_args[i] for i in ctx.tensor_idx))
        ctx.weight_args = [None if i in ctx.tensor_idx else a for i, a in enumerate(weight_args)]
        ctx.k, ctx.x_dtype, ctx.bias_dtype = x.shape[-1], x.dtype, None if bias is None else bias.dtype

    def backward(ctx, grad):
        args = list(ctx.weight_args)
        for i, t in zip(ctx.tensor_idx, ctx.saved_tensors):
            args[i] = t
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad.float() @ weight(*args, k=ctx.k)).to(ctx.x_dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[bias_index]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).float().sum(0).to(ctx.bias_dtype)
        grads = [grad_x, *([None] * len(args)), grad_bias]
        return tuple(grads + [None] * (len(ctx.needs_input_grad) - len(grads)))

    torch.library.register_autograd(name, backward, setup_context=setup_context)
