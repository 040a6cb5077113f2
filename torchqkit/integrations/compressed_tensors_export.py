"""save_compressed_tensors: a torchqkit-quantized transformers model as a compressed-tensors checkpoint.

    qk.quantize_(model, qk.IntxWeightOnlyConfig(bits=4, granularity=qk.PerGroup(128), mapping="asymmetric"))
    print(qk.save_compressed_tensors(model, "out/"))   # out/config.json + out/model.safetensors

vLLM, SGLang and transformers (with the ``compressed-tensors`` package) load the directory without torchqkit.
Each quantized weight is written in its exact compressed-tensors form (compressed_tensors_schemes.py); weights
with the same scheme share one config group, whose ``targets`` are their module names; every other tensor is
written as it is, and Linear modules left in float are listed in ``ignore``. A mixture-of-experts model's expert
stacks are written as per-expert Linears under the names transformers' ``save_pretrained`` gives them, every other
tensor under its saved name too (Note [Expert stacks in compressed-tensors], compressed_tensors_experts.py).
Everything is checked before anything is written: one ValueError names every weight that has no exact form, its
layout, and the configs that have one. The two files are each written atomically (Note [Atomic saves] in
serialization/atomic.py), the tensors first.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from torch import nn

from ..files.atomic_write import atomic_write_bytes, fsync_directory, replace_temp
from ..serialization.safetensors_file import SafetensorsWriter
from ..api.expert_weights import expert_parameters
from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from .checkpoint_names import checkpoint_names
from .compressed_tensors_experts import PieceExport, piece_targets, plan_expert_pieces
from .compressed_tensors_schemes import MAPPABLE_CONFIGS, ct_scheme, ct_tensors

__all__ = ["save_compressed_tensors", "CompressedTensorsExport", "run_compressed_tensors_export"]


@dataclass
class CompressedTensorsExport:
    """What ``save_compressed_tensors`` wrote: the files, and one line per tensor (``print`` shows them as a table).

    Args:
        files (list[Path]): config.json and model.safetensors; default empty.
        tensors (list[tuple[str, str]]): (tensor name, what was written), e.g.
            ``("model.layers.0.mlp.up_proj.weight_packed", "pack-quantized int4 group 128 asymmetric, exact")``;
            float tensors as ``"torch.float32, as stored"``; default empty.

    Example:
        ```python
        import torchqkit as qk
        export = qk.save_compressed_tensors(model, "out/")
        print(export)                       # one line per tensor
        ```
    """
    files: list[Path] = field(default_factory=list)
    tensors: list[tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        width = max((len(n) for n, _ in self.tensors), default=0)
        lines = [f"{n:<{width}}  {what}" for n, what in self.tensors]
        return "\n".join(lines + [f"wrote {', '.join(str(f) for f in self.files)}"])


def save_compressed_tensors(model: nn.Module, directory) -> CompressedTensorsExport:
    """Write a torchqkit-quantized transformers model as a compressed-tensors checkpoint (what vLLM, SGLang and
    transformers' ``compressed-tensors`` quantizer load), every quantized weight bit for bit.

    int 2 / 4 / 8-bit weight-only weights with integer zero points (or none), per channel or per group, become
    ``pack-quantized``; int8 weights with int8 dynamic per-token activations ``int-quantized``; float8_e4m3fn
    weights (with or without float8 activations) ``float-quantized``; MXFP4 weight-only ``mxfp4-pack-quantized``;
    NVFP4 weight-only ``nvfp4-pack-quantized``.
    Other tensors are written as they are. Quantized expert stacks of a mixture-of-experts model (Qwen3-MoE,
    Mixtral, OLMoE, ...) become one Linear per expert and projection, named as transformers' ``save_pretrained``
    names them (``model.layers.0.mlp.experts.3.gate_proj``), which is how vLLM and SGLang read MoE checkpoints.

    Args:
        model (transformers.PreTrainedModel): the model, quantized with ``quantize_`` (a ``torch.compile``-wrapped
            model is unwrapped).
        directory (str | os.PathLike): the output directory, created if missing; its config.json and
            model.safetensors are replaced.

    Returns:
        CompressedTensorsExport: the files written and what each tensor became.

    Raises:
        TypeError: ``model`` is not a transformers ``PreTrainedModel``.
        ValueError: a quantized weight has no exact compressed-tensors form (one message names every such weight,
            its format and layout, and the configs that map; an expert stack by its first such expert Linear), the
            model's experts have no per-expert checkpoint form (transformers saves them fused, as for gpt-oss), the
            model has no quantized weight, or ``directory`` holds a sharded checkpoint's index. Nothing is written
            then.

    Example:
        ```python
        import torchqkit as qk
        qk.quantize_(model, qk.IntxWeightOnlyConfig(bits=4, granularity=qk.PerGroup(128), mapping="asymmetric"))
        print(qk.save_compressed_tensors(model, "out/"))
        ```
    """
    model = getattr(model, "_orig_mod", model)
    if not hasattr(model, "config") or not hasattr(model.config, "to_json_string"):
        raise TypeError(f"save_compressed_tensors takes a transformers PreTrainedModel, got {type(model).__name__}")
    plan = _plan(model)  # every check before anything is written
    directory = Path(directory)
    stale = directory / "model.safetensors.index.json"
    if stale.exists():  # a loader would find two checkpoints; deleting another save's shards is not ours to do
        raise ValueError(f"save_compressed_tensors: {stale} exists (a sharded checkpoint): remove it and its shards, "
                         f"or write to another directory; nothing was written")
    directory.mkdir(parents=True, exist_ok=True)
    export = CompressedTensorsExport()
    writer = SafetensorsWriter(directory / "model.safetensors")
    try:
        for name, tensor, what in _tensors(model, plan):
            writer.add(name, tensor)
            export.tensors.append((name, what))
        staged = writer.finish({"format": "pt"})
    except BaseException:
        writer.abort()
        raise
    replace_temp(staged, directory / "model.safetensors")
    fsync_directory(directory)
    hf_config = copy.deepcopy(model.config)
    hf_config.architectures = [type(model).__name__]
    hf_config.quantization_config = _quantization_config(model, plan)
    atomic_write_bytes(directory / "config.json", hf_config.to_json_string(use_diff=True).encode())
    export.files = [directory / "config.json", directory / "model.safetensors"]
    return export


class _Plan(NamedTuple):
    linears: dict[str, object]                 # Linear module name -> CTScheme
    experts: dict[str, list[PieceExport]]      # expert Parameter name -> its saved Linears
    renames: dict[str, str]                    # state-dict key -> saved key, where transformers' save renames


def _plan(model: nn.Module) -> _Plan:
    """What every quantized weight becomes; ValueError naming every one without an exact form."""
    plan, refused = {}, []
    for name, module in model.named_modules():
        w = getattr(module, "weight", None)
        if not isinstance(w, AffineQuantizedTensor):
            continue
        scheme = ct_scheme(w) if isinstance(module, nn.Linear) else f"a {type(module).__name__} weight (only Linear)"
        if getattr(module, "input_permutation", None) is not None:  # Note [Act-order weights], hub_import.py
            scheme = ("an act-order weight stored with permuted in_features (compressed-tensors >= 0.20 has no "
                      "g_idx to undo it)")
        if isinstance(scheme, str):
            refused.append(f"{name}.weight ({w.qdtype.name}, block_size {w.block_size}, zero point "
                           f"{w.zero_point_domain.value}, {w.qlayout!r}): {scheme}")
        else:
            plan[name] = scheme
    experts, renames = _plan_experts(model, refused)
    if refused:
        raise ValueError(f"save_compressed_tensors: {len(refused)} weight(s) have no exact compressed-tensors form, "
                         f"nothing was written:\n  " + "\n  ".join(refused) + f"\nOptions: {MAPPABLE_CONFIGS}")
    if not plan and not any(p.scheme is not None for pieces in experts.values() for p in pieces):
        raise ValueError("save_compressed_tensors: the model has no quantized weight; quantize it with "
                         "torchqkit.quantize_ first (a float model is saved with its own save_pretrained)")
    return _Plan(plan, experts, renames)


def _plan_experts(model: nn.Module, refused: list) -> tuple[dict, dict]:
    """Expert Parameters as the per-expert Linears transformers' save splits them into (Note [Expert stacks in
    compressed-tensors]), and the saved name of every other tensor; refusals appended to ``refused``."""
    params = expert_parameters(dict(model.named_modules()))
    if not params:
        return {}, {}  # no conversion to follow: every tensor under its own name
    stacks = {p.fqn: getattr(p.module, p.attr) for p in params}
    try:
        names = checkpoint_names(model, {key: tuple(t.shape) for key, *_, t in _written(model)}, set(stacks))
    except ValueError as e:
        refused.append(f"the expert Parameters ({', '.join(sorted(stacks)[:2])}, ...): {e}")
        return {}, {}
    experts = {}
    for fqn, stack in stacks.items():
        experts[fqn], bad = plan_expert_pieces(fqn, stack, names.pieces[fqn])
        refused.extend(bad)
    return experts, {k: v for k, v in names.renames.items() if k != v}


def _written(model: nn.Module):
    """(state-dict key, module name, module, attribute, tensor) of everything written: each tensor once (tied ones
    under their first name), persistent buffers only."""
    seen = set()
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for attr, p in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if id(p) in seen or attr in module._non_persistent_buffers_set:
                continue
            seen.add(id(p))
            yield prefix + attr, module_name, module, attr, p


def _describe(scheme) -> str:
    w = scheme.weights
    text = f"{scheme.format} {w['type']}{w['num_bits']} {w['strategy']}"
    if scheme.format == "mxfp4-pack-quantized":
        return text + " 32 (E8M0 scales), exact"
    if scheme.format == "nvfp4-pack-quantized":
        return text + " 16 (float8 e4m3 scales, float32 global scale), exact"
    text += f" {w['group_size']}" if "group_size" in w else ""
    text += "" if w["symmetric"] else " asymmetric"
    a = scheme.input_activations
    if a is not None:
        text += f", {'dynamic' if a['dynamic'] else 'static'} {a['type']}8 activations per {a['strategy']}"
    return text + ", exact"


def _tensors(model: nn.Module, plan: _Plan):
    """(saved name, tensor, description) of everything written."""
    for key, module_name, module, attr, p in _written(model):
        if key in plan.experts:
            for piece in plan.experts[key]:
                if piece.scheme is None:
                    yield f"{piece.module}.weight", piece.weight.contiguous(), f"{piece.weight.dtype}, as stored"
                    continue
                for suffix, t in ct_tensors(piece.weight, piece.scheme).items():
                    yield f"{piece.module}.{suffix}", t, _describe(piece.scheme)
            continue
        name = plan.renames.get(key, key)
        scheme = plan.linears.get(module_name) if attr == "weight" else None
        if scheme is not None:
            for suffix, t in ct_tensors(p, scheme).items():
                yield f"{name.removesuffix('weight')}{suffix}", t, _describe(scheme)
            continue
        if isinstance(p, AffineQuantizedTensor):  # _plan refused these already; a guard for subclasses
            raise ValueError(f"{key}: a quantized tensor outside a Linear weight")
        yield name, p.detach(), f"{p.dtype}, as stored"


def _quantization_config(model: nn.Module, plan: _Plan) -> dict:
    def saved(module_name: str) -> str:
        return plan.renames.get(f"{module_name}.weight", f"{module_name}.weight").removesuffix(".weight")

    targets = [(saved(name), scheme) for name, scheme in plan.linears.items()]
    ignore = [saved(n) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in plan.linears]
    for pieces in plan.experts.values():
        for target, scheme in piece_targets(pieces):
            if scheme is None:
                ignore.append(target)
            else:
                targets.append((target, scheme))
    groups, formats = {}, set()
    for target, scheme in targets:
        groups.setdefault(scheme.key(), (scheme, []))[1].append(target)
        formats.add(scheme.format)
    config_groups = {}
    for i, (scheme, names) in enumerate(groups.values()):
        config_groups[f"group_{i}"] = {"targets": names, "weights": scheme.weights,
                                       "input_activations": scheme.input_activations, "output_activations": None,
                                       "format": scheme.format}
    return {"quant_method": "compressed-tensors", "format": formats.pop() if len(formats) == 1 else "mixed-precision",
            "quantization_status": "compressed", "config_groups": config_groups, "ignore": ignore,
            "kv_cache_scheme": None}


def run_compressed_tensors_export(source, out) -> int:
    """``python -m torchqkit export SOURCE --compressed-tensors DIR``: load a checkpoint directory with
    ``torchqkit.from_pretrained`` and write it as compressed-tensors, printing what each tensor became. Returns 0;
    1 (reason on stderr, nothing written) when a weight has no exact form; 2 when the source can't be read."""
    import sys
    from ..hf import from_pretrained
    from ..serialization.safetensors_file import CheckpointError
    try:
        model = from_pretrained(source)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"torchqkit export: can't read {source}: {e}", file=sys.stderr)
        return 2
    try:
        print(save_compressed_tensors(model, out))
    except ValueError as e:
        print(f"torchqkit export: {e}", file=sys.stderr)
        return 1
    return 0
