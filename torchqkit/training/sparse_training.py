"""prepare_sparse_ / convert_sparse_: N:M sparse training on the float model, then the sparse layout.

    qk.prepare_sparse_(model, qk.SparsityConfig(pattern=(2, 4)), start_step=100, update_every=50)
    train(model)                              # dense float weights; the forward uses them under N:M masks
    report = qk.convert_sparse_(model)        # NMSparseLayout (with the config's base codes, if any)

Note [Sparse training masks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each selected Linear keeps its dense float weight W (the optimizer's Parameter, the state-dict key ``weight``) and a
bool mask E; its forward computes ``F.linear(x, W * E)``. The backward is straight-through: W receives the gradient
of the masked weight at every entry, pruned ones included (so a pruned weight that would matter grows back and wins
its block at the next mask update), plus, with ``decay`` = lambda > 0, SR-STE's lambda * (1 - E) * W that pulls the
pruned weights towards 0 (Zhou et al., 2021). E is all ones (dense training) before ``start_step``; at
``start_step`` and every ``update_every`` steps after it, E becomes the N largest |W| of every block of M (the
magnitude mask ``quantize_`` would keep). A step is one forward of the prepared model in training mode with
gradients enabled (count micro-batches: with gradient accumulation over k micro-batches, multiply the step
arguments by k). Evaluation forwards use the current mask and don't count.

Note [Sparse quantization-aware training]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``prepare_qat_`` on a sparse-prepared model trains the kept values towards the SparsityConfig's ``base`` as well:
the forward fake-quantizes the masked weight exactly as ``convert_sparse_`` will store it in NMSparseLayout (scales
and zero points chosen on the masked weight with each pruned entry filled by a kept value of its block, Note
[Sparse qparams]; the layout's stored scales), and the pruned entries are exactly 0. Gradients stay
straight-through at every entry, pruned ones included (the exact zeros are subtracted outside autograd), so masks
keep moving while the kept values learn the grid. Before ``start_step`` the dense weight is fake-quantized with the
same recipe. ``convert_sparse_`` then stores weights that dequantize to the last training forward's fake-quantized
weights bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..algorithms.nm_masks import fill_pruned
from ..api.configs.sparsity import SparsityConfig
from ..api.quantize import plan_quantize, quantize_
from ..api.quantize_weight import UnsupportedWeight
from ..api.report import QuantizationReport
from ..api.sparsify import sparse_recipe
from ..layouts.nm_format import nm_mask
from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from .fake_quantize import WeightFakeQuantizer, fake_quantize_activation
from .fake_quantized_linear import FakeQuantizedLinear

__all__ = ["prepare_sparse_", "convert_sparse_", "SparseTrainingLinear"]


@dataclass
class _Schedule:
    """The step counter one prepared model shares among its layers (Note [Sparse training masks])."""
    start_step: int
    update_every: int
    step: int = -1  # the current training forward's index; -1 before the first

    def active(self) -> bool:
        return self.step >= self.start_step

    def updates_now(self) -> bool:
        return self.active() and (self.step - self.start_step) % self.update_every == 0


@dataclass
class SparseTrainingState:
    config: SparsityConfig
    original_class: type
    schedule: _Schedule
    decay: float
    mask: torch.Tensor | None = None    # None: dense (before start_step)
    updated_at: int = field(default=-1)
    quantizer: WeightFakeQuantizer | None = None  # prepare_qat_ on top: Note [Sparse quantization-aware training]


class _MaskedWeight(torch.autograd.Function):
    """W * E forward; straight-through backward, plus SR-STE's decay on the pruned entries."""

    @staticmethod
    def forward(ctx, weight, mask, decay):
        ctx.save_for_backward(weight, mask)
        ctx.decay = decay
        return weight * mask

    @staticmethod
    def backward(ctx, grad):
        weight, mask = ctx.saved_tensors
        if ctx.decay:
            grad = grad + ctx.decay * (~mask) * weight
        return grad, None, None


def magnitude_nm_mask(weight: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """The N:M magnitude mask of a (out, in) weight: in_features padded to whole blocks (never kept), then cut."""
    k = weight.shape[1]
    scores = weight.detach().abs().float()
    pad = -k % m
    if pad:
        scores = F.pad(scores, (0, pad), value=-1.0)
    return nm_mask(scores, n, m)[:, :k]


class SparseTrainingLinear(nn.Linear):
    """An ``nn.Linear`` trained under an N:M mask (Note [Sparse training masks]): its forward uses the dense weight
    times the current mask, with straight-through gradients.

    ``prepare_sparse_`` turns a Linear into one by changing its class in place (a subclass of the Linear's own class
    when it isn't ``nn.Linear`` itself), so the module keeps its identity, hooks, Parameters and state-dict keys;
    ``convert_sparse_`` changes the class back. Not normally built directly. ``isinstance(m,
    qk.SparseTrainingLinear)`` finds prepared layers; ``m.sparse.mask`` is the current mask (None while dense).

    Args:
        in_features (int): as ``nn.Linear``.
        out_features (int): as ``nn.Linear``.
        bias (bool): as ``nn.Linear``; default True.
        device (torch.device | None): as ``nn.Linear``; default None.
        dtype (torch.dtype | None): as ``nn.Linear``; default None.

    Example:
        ```python
        import torchqkit as qk
        qk.prepare_sparse_(model, qk.SparsityConfig(pattern=(2, 4)), start_step=0, update_every=10)
        masks = {n: m.sparse.mask for n, m in model.named_modules() if isinstance(m, qk.SparseTrainingLinear)}
        ```
    """
    sparse: SparseTrainingState

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = self.sparse
        schedule = state.schedule
        if self.training and torch.is_grad_enabled() and schedule.updates_now() and state.updated_at != schedule.step:
            n, m = state.config.pattern
            state.mask = magnitude_nm_mask(self.weight, n, m)
            state.updated_at = schedule.step
        if state.quantizer is not None and state.quantizer.recipe.act_quant is not None:  # e.g. int8 activations
            x = fake_quantize_activation(x, state.quantizer.recipe.act_quant, clipped=state.quantizer.clipped)
        if state.mask is None:
            weight = self.weight if state.quantizer is None else state.quantizer(self.weight)
            return F.linear(x, weight, self.bias)
        weight = _MaskedWeight.apply(self.weight, state.mask, state.decay)
        if state.quantizer is not None:
            filled = fill_pruned(weight.detach(), state.mask, state.config.pattern[1])
            fake = state.quantizer(weight, qparams_from=filled)
            weight = fake - (fake * ~state.mask).detach()  # pruned entries exactly 0, gradients unchanged
        return F.linear(x, weight, self.bias)


_CLASSES: dict[type, type] = {}


def _sparse_class(cls: type) -> type:
    if cls is nn.Linear:
        return SparseTrainingLinear
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"SparseTraining{cls.__name__}", (SparseTrainingLinear, cls), {})
    return _CLASSES[cls]


def _count_step(schedule: _Schedule):
    def hook(module, args, kwargs=None):
        if module.training and torch.is_grad_enabled():
            schedule.step += 1
    return hook


def prepare_sparse_(model: nn.Module, config: SparsityConfig, *, start_step: int = 0, update_every: int = 100,
                    decay: float = 0.0, filter_fn=None) -> list[str]:
    """Train ``model``'s Linear layers under N:M masks recomputed on a schedule, in place (Note [Sparse training
    masks]); ``convert_sparse_`` then stores them in ``NMSparseLayout``.

    Each selected Linear becomes a ``SparseTrainingLinear`` (its class changes; identity, hooks, Parameters and
    state-dict keys stay): dense until ``start_step``, then the magnitude N:M mask of its weight, recomputed every
    ``update_every`` steps, with straight-through gradients (and SR-STE's decay on pruned weights with ``decay``).

    Args:
        model (torch.nn.Module): the float model, changed in place.
        config (SparsityConfig): the pattern, and the ``base`` ``convert_sparse_`` quantizes the kept values with;
            its method must be ``"magnitude"`` (masks come from the trained weights, not calibration data).
        start_step (int): the first step trained sparse (>= 0); default 0. Keyword-only, as are the arguments below.
        update_every (int): steps between mask updates (>= 1); default 100.
        decay (float): SR-STE's lambda (>= 0): the pruned weights' gradient gains lambda * W; default 0.
        filter_fn (Callable[[nn.Module, str], bool] | None): ``filter_fn(module, fqn)`` selects the Linears; None
            (default): every ``nn.Linear`` but a model's output layer tied to its input embedding.

    Returns:
        list[str]: the names of the prepared layers.

    Raises:
        TypeError: ``config`` is not a ``SparsityConfig``.
        ValueError: a method other than ``"magnitude"``, a negative ``start_step`` / ``decay``, ``update_every`` < 1,
            a model with quantized weights, QAT-prepared or already sparse-prepared layers, a selected Linear whose
            weight an embedding shares, or no Linear selected (the model is unchanged).

    Example:
        ```python
        import torchqkit as qk
        qk.prepare_sparse_(model, qk.SparsityConfig(pattern=(2, 4)), start_step=200, update_every=50, decay=2e-4)
        train(model)
        qk.convert_sparse_(model)
        ```
    """
    if not isinstance(config, SparsityConfig):
        raise TypeError(f"prepare_sparse_ takes a SparsityConfig, got {type(config).__name__}")
    if config.method != "magnitude":
        raise ValueError(f"prepare_sparse_: SparsityConfig(method={config.method!r}) prunes from calibration data; "
                         f"sparse training recomputes masks from the trained weights (method='magnitude'). Train "
                         f"dense and prune with quantize_(model, SparsityConfig(method={config.method!r}), "
                         f"calibration_data=...) instead")
    if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
        raise ValueError(f"prepare_sparse_: start_step must be an int >= 0, got {start_step!r}")
    if isinstance(update_every, bool) or not isinstance(update_every, int) or update_every < 1:
        raise ValueError(f"prepare_sparse_: update_every must be an int >= 1, got {update_every!r}")
    if not isinstance(decay, (int, float)) or decay < 0:
        raise ValueError(f"prepare_sparse_: decay must be a number >= 0, got {decay!r}")
    tied = _tied_output_weights(model)
    chosen = []
    for fqn, module in model.named_modules():
        if isinstance(module, SparseTrainingLinear):
            raise ValueError(f"prepare_sparse_: {fqn} is sparse-prepared already; convert it first (the model is "
                             f"unchanged)")
        if isinstance(module, FakeQuantizedLinear):
            raise ValueError(f"prepare_sparse_: {fqn} is QAT-prepared; to train sparse and quantization-aware, start "
                             f"from the float model: prepare_sparse_(model, SparsityConfig(pattern, base=<config>)) "
                             f"first, then prepare_qat_(model, QATConfig(<the same config>)) (the model is unchanged)")
        weight = getattr(module, "weight", None)
        if isinstance(weight, AffineQuantizedTensor):
            raise ValueError(f"prepare_sparse_: {fqn}.weight is quantized; sparse training needs the float model "
                             f"(the model is unchanged)")
        if not isinstance(module, nn.Linear):
            continue
        if filter_fn is not None and not filter_fn(module, fqn):
            continue
        if id(module.weight) in tied:
            if filter_fn is None:
                continue
            raise ValueError(f"prepare_sparse_: {fqn}.weight is shared with an nn.Embedding (tied output layer): "
                             f"pruning it would prune the embedding too; untie it first (model.config."
                             f"tie_word_embeddings = False and give {fqn} its own weight) or leave it out of "
                             f"filter_fn (the model is unchanged)")
        chosen.append((fqn, module))
    if not chosen:
        raise ValueError("prepare_sparse_: no Linear layer was selected (check filter_fn); the model is unchanged")
    schedule = _Schedule(start_step, update_every)
    for fqn, module in chosen:
        module.sparse = SparseTrainingState(config, type(module), schedule, float(decay))
        module.__class__ = _sparse_class(type(module))
    model._torchqkit_sparse_step_hook = model.register_forward_pre_hook(_count_step(schedule))
    return [fqn for fqn, _ in chosen]


def _tied_output_weights(model: nn.Module) -> set[int]:
    """ids of Linear weights an nn.Embedding holds too (a tied lm_head): pruning one would prune the embedding."""
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def convert_sparse_(model: nn.Module) -> QuantizationReport:
    """Store every layer ``prepare_sparse_`` prepared in ``NMSparseLayout`` with its config, and restore its class.

    Each weight is pruned with its current mask (the magnitude mask of the trained weight if training never reached
    ``start_step``) and quantized with the config's ``base`` (or kept as float values); the stored weights
    dequantize to the masked weights (exactly, without a base).

    Args:
        model (torch.nn.Module): a model prepared by ``prepare_sparse_`` (and trained).

    Returns:
        QuantizationReport: ``quantize_``'s report for the converted layers.

    Raises:
        ValueError: no layer of the model was prepared.
        QuantizationError: a prepared layer can't be stored; the model is left as prepared.

    Example:
        ```python
        import torchqkit as qk
        qk.prepare_sparse_(model, qk.SparsityConfig(pattern=(2, 4), base=qk.Int8WeightOnlyConfig()))
        train(model)
        report = qk.convert_sparse_(model)   # 2:4 kept values as int8 codes
        ```
    """
    prepared = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, SparseTrainingLinear)]
    if not prepared:
        raise ValueError("convert_sparse_: no layer of this model was prepared by prepare_sparse_")
    configs = {id(m.sparse.config) for _, m in prepared}
    config = prepared[0][1].sparse.config
    if len(configs) != 1:
        raise ValueError("convert_sparse_: layers were prepared with different SparsityConfigs; convert one "
                         "model preparation at a time")
    saved = [(m, m.weight.data, m.__class__) for _, m in prepared]
    names = {fqn for fqn, _ in prepared}
    try:
        for _, m in prepared:
            n, mm = m.sparse.config.pattern
            mask = m.sparse.mask if m.sparse.mask is not None else magnitude_nm_mask(m.weight, n, mm)
            m.weight.data = m.weight.data * mask
            m.__class__ = m.sparse.original_class
        report = quantize_(model, config, filter_fn=lambda module, fqn: fqn in names, strict=True)
    except Exception:
        for m, data, cls in saved:
            m.weight.data, m.__class__ = data, cls
        raise
    for _, m in prepared:
        del m.sparse  # the fake quantizer too, if prepare_qat_ added one
    hook = getattr(model, "_torchqkit_sparse_step_hook", None)
    if hook is not None:
        hook.remove()
        del model._torchqkit_sparse_step_hook
    return report


def prepare_sparse_qat(model: nn.Module, config, filter_fn=None) -> QuantizationReport:
    """``prepare_qat_(model, config)`` on a model ``prepare_sparse_`` prepared: its sparse-prepared layers (those
    ``filter_fn`` selects) also train through fake quantization towards the SparsityConfig's ``base``, which
    ``config.base`` must equal (Note [Sparse quantization-aware training]); other layers stay float, as
    ``convert_sparse_`` leaves them. Returns the report ``convert_sparse_`` would give. Nothing changes on error."""
    layers = [(fqn, m) for fqn, m in model.named_modules()
              if isinstance(m, SparseTrainingLinear) and (filter_fn is None or filter_fn(m, fqn))]
    if not layers:
        raise ValueError("prepare_qat_: filter_fn selects none of the model's sparse-prepared layers (the model is "
                         "unchanged)")
    sparsity = layers[0][1].sparse.config
    if sparsity.base is None:
        raise ValueError(f"prepare_qat_: {layers[0][0]} was prepared by prepare_sparse_ with "
                         f"SparsityConfig(base=None): its kept values stay float, so there is no format to train "
                         f"towards. Prepare the float "
                         f"model with prepare_sparse_(model, SparsityConfig({sparsity.pattern}, base=<config>)) (the "
                         f"model is unchanged)")
    if config.base != sparsity.base:
        raise ValueError(f"prepare_qat_: QATConfig({config.base.describe()}) differs from the base the sparse layers "
                         f"will be stored with, {sparsity.base.describe()} (SparsityConfig.base); pass "
                         f"QATConfig(<that config>) (the model is unchanged)")
    if config.stochastic_rounding:
        raise ValueError("prepare_qat_: stochastic_rounding is not available for sparse-prepared layers; use "
                         "QATConfig(..., stochastic_rounding=False) (the model is unchanged)")
    recipes = []
    for fqn, m in layers:
        if m.sparse.quantizer is not None:
            raise ValueError(f"prepare_qat_: {fqn} is already prepared for quantization-aware training (the model is "
                             f"unchanged)")
        try:
            recipes.append(sparse_recipe(sparsity, m.weight, f"{fqn}.weight"))
        except UnsupportedWeight as e:
            raise ValueError(f"prepare_qat_: {e} (the model is unchanged)") from None
    names = {fqn for fqn, _ in layers}
    report, _ = plan_quantize(model, sparsity, filter_fn=lambda module, fqn: fqn in names)
    for (fqn, m), recipe in zip(layers, recipes):
        m.sparse.quantizer = WeightFakeQuantizer(recipe, clipped=config.grad == "clipped_ste", name=f"{fqn}.weight")
    return report
