"""The weight-bearing modules quantize_ serves, and how each one's weight becomes the 2-d (out, in) weight a
config quantizes and back. See Note [Weight-bearing modules].

Note [Weight-bearing modules]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every config quantizes a 2-d (out, in) weight with its groups along ``in``. Each module kind maps its own
Parameter to that and stores the quantized weight so that the module's unchanged ``forward`` runs it:
  nn.Linear         weight (out, in) as it is; ``F.linear`` runs the layout's linear.
  GPT-2's Conv1D    (transformers.pytorch_utils) ``x @ W + b`` with W stored (in, out): W^T (out, in) is
                    quantized and the module holds its transposed view ``q.t()`` (shape (in, out), no data moved,
                    Note [Transposed view]); ``addmm(b, x, q.t())`` is served by the layout's linear of ``q``.
  nn.Conv1d/Conv2d  1x1 kernels, groups=1 only: the weight (out, in, 1[, 1]) is quantized as (out, in) and the
                    module holds that 2-d weight; the convolution runs as the layout's linear on the channel
                    dim (tensor/conv.py). A k x k kernel or groups > 1 is refused with the reason (no quantized
                    im2col path exists); the report names the module.
  nn.Embedding      weight (num_embeddings, dim) as it is; only the rows a lookup needs are dequantized
                    (Note [Quantized embedding]). Quantized when ModuleConfigs names it or ``quantize_``'s
                    ``embeddings=`` covers it; a ``max_norm`` embedding (it renormalizes rows in place) is
                    refused.
A quantized 1x1 convolution's weight is 2-d: ``load_quantized`` puts it into a float (or meta) model's (out, in,
1[, 1]) conv weight; a plain ``load_state_dict`` needs a model quantized the same way first (it copies into the
quantized weight; the shapes differ from the float conv's).
Which modules are considered by default (``quantize_`` without ``filter_fn``): nn.Linear and GPT-2's Conv1D.
Convolutions are quantized when ``filter_fn`` selects them or ModuleConfigs names them; embeddings as above.
"""
from __future__ import annotations

import torch
from torch import nn

from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from .configs.base import QuantConfig
from .module_configs import ModuleConfigs

__all__ = ["is_gpt2_conv1d", "is_linear_like", "is_weight_module", "module_problem", "weight_to_quantize",
           "stored_weight", "with_embeddings", "SERVED_MODULES"]

SERVED_MODULES = ("nn.Linear, transformers' GPT-2 Conv1D, 1x1 nn.Conv1d / nn.Conv2d (groups=1) and nn.Embedding "
                  "(without max_norm)")


def is_gpt2_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2, GPT, ...), told by its class without importing transformers."""
    return any(c.__name__ == "Conv1D" and c.__module__.startswith("transformers.") for c in type(module).__mro__)


def is_linear_like(module: nn.Module) -> bool:
    """A module whose whole weight is read by every forward, like a Linear's (the ones read per decoded token)."""
    return isinstance(module, nn.Linear) or is_gpt2_conv1d(module) or _is_conv(module)


def is_weight_module(module: nn.Module) -> bool:
    """A module kind quantize_ can serve (before the per-module checks of ``module_problem``)."""
    return is_linear_like(module) or isinstance(module, nn.Embedding)


def _is_conv(module: nn.Module) -> bool:
    return isinstance(module, (nn.Conv1d, nn.Conv2d))


def module_problem(module: nn.Module, weight) -> str | None:
    """Why ``module`` (holding ``weight``) can't be quantized, or None."""
    if not is_weight_module(module):
        return f"{type(module).__name__} is not a module torchqkit quantizes; it serves {SERVED_MODULES}"
    if isinstance(weight, AffineQuantizedTensor):
        return "weight is already quantized"
    if not isinstance(weight, torch.Tensor):
        return f"{type(module).__name__} has no weight tensor"
    if weight.is_meta:
        return ("weight is on the meta device: load real weights first (or load a quantized checkpoint with "
                "load_state_dict(assign=True))")
    if _is_conv(module):
        return _conv_problem(module)
    if isinstance(module, nn.Embedding) and module.max_norm is not None:
        return (f"nn.Embedding with max_norm={module.max_norm} renormalizes its rows in place at every lookup, "
                f"which a quantized weight can't do; leave it float")
    return None


def _conv_problem(conv: nn.Conv1d | nn.Conv2d) -> str | None:
    if any(k != 1 for k in conv.kernel_size):
        return (f"{type(conv).__name__} with kernel_size {tuple(conv.kernel_size)}: torchqkit serves 1x1 "
                f"convolutions only (as a Linear on the channel dim; there is no quantized im2col path for "
                f"k x k kernels); leave it float (filter_fn / ModuleConfigs None)")
    if conv.groups != 1:
        return (f"{type(conv).__name__} with groups={conv.groups}: a grouped convolution is not one matmul "
                f"over the channels; torchqkit serves groups=1 only; leave it float")
    return None


def weight_to_quantize(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """The 2-d (out, in) float weight a config quantizes for ``module`` (Note [Weight-bearing modules])."""
    if is_gpt2_conv1d(module):
        return weight.t().contiguous()  # (in, out) -> (out, in): the groups run along in
    if _is_conv(module):
        return weight.reshape(weight.shape[0], weight.shape[1])  # (out, in, 1[, 1]) -> (out, in)
    return weight


def stored_weight(module: nn.Module, qweight: AffineQuantizedTensor) -> AffineQuantizedTensor:
    """What ``module`` holds for the quantized (out, in) ``qweight``: its transposed view for GPT-2's Conv1D."""
    return qweight.t() if is_gpt2_conv1d(module) else qweight


def with_embeddings(configs: ModuleConfigs, embeddings, modules: dict[str, nn.Module], holders: dict) -> ModuleConfigs:
    """``configs`` plus ``quantize_``'s ``embeddings=``: every standalone nn.Embedding (its weight held by no other
    module) that ``configs`` does not name exactly gets ``embeddings`` as an exact key. A tied embedding follows
    its output Linear (Note [Shared weights] in quantize.py) and is left out. None: ``configs`` unchanged."""
    if embeddings is None:
        return configs
    if not isinstance(embeddings, QuantConfig):
        raise TypeError(f"quantize_(embeddings=...) takes a QuantConfig for every standalone nn.Embedding (or "
                        f"None), got {type(embeddings).__name__}")
    exact = set(configs.exact_keys())
    added = {fqn: embeddings for fqn, m in modules.items()
             if isinstance(m, nn.Embedding) and fqn not in exact and id(m.weight) not in holders}
    if not added:
        return configs
    return ModuleConfigs({**added, **configs.configs})  # exact keys come first in lookup anyway
