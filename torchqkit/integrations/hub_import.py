"""GPTQ, AWQ and compressed-tensors checkpoint directories (as the Hub holds them) loaded into torchqkit layouts.

``torchqkit.from_pretrained`` calls ``load_hub_checkpoint`` when config.json's quantization_config names one of
these methods. The model skeleton is built on the meta device (as torchqkit.from_pretrained builds it), every
quantized Linear's tensors are decoded by its format (hub_formats.py, compressed_tensors_import.py) into codes,
scales and zero points that are packed into a torchqkit layout as they are: 2 / 4-bit codes into
``PackedIntxLayout`` (torchqkit's CPU intx kernel), int8 into ``PlainLayout``, float8 into ``Float8Layout``, MXFP4
into ``MXLayout``. A mixture-of-experts model's expert Parameters are read from the per-expert Linears
transformers' save_pretrained writes (Note [Checkpoint names of fused experts]), each expert's pieces joined along N
and the experts stacked (Note [Expert stacks in compressed-tensors]). Every other tensor is loaded as stored, under
its saved name. ``model.torchqkit_report`` says what each Linear and expert Parameter became.

Note [Act-order weights]
~~~~~~~~~~~~~~~~~~~~~~~~
GPTQ's act-order (desc_act) quantizes the inputs of a row in an order of its own, so group i holds the inputs k
with g_idx[k] == i, scattered along K. Sorting K by g_idx (stably) makes every group contiguous: with perm =
argsort(g_idx), W[:, perm] is an ordinary group-wise weight with the same codes and scales, and
y = x W^T = x[..., perm] W[:, perm]^T exactly. So such a Linear stores W[:, perm] and gathers its input by
``input_permutation`` (a buffer; a forward pre-hook applies it), and ``weight.dequantize()[:, argsort(perm)]``
is the checkpoint's weight bit for bit. The load report says so per Linear. When the groups are not all of
size g (no writer produces that), no permutation gives whole groups: that Linear is dequantized to float,
exactly, and the report says so. The buffer is saved with the model: torchqkit.save_pretrained writes it and a
model without the hook can't load it silently (check_against_model refuses the extra tensor).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..api.expert_weights import expert_parameters
from ..api.quantize import patch_extra_repr
from ..api.report import LayerReport, QuantizationReport
from ..core.primitives import ZeroPointDomain
from ..core.qdtype import QKind, fp4_e2m1
from ..hf import CHECKPOINT_IMPORTERS, materialize_non_persistent_buffers, read_config_json
from ..layouts.base import PlainParts, WeightFormat
from ..layouts.float8 import Float8Layout
from ..layouts.mx import MXLayout
from ..layouts.packed_intx import PackedIntxLayout
from ..layouts.plain import PlainLayout
from ..progress import ProgressLine, progress_enabled
from ..serialization.safetensors_file import CheckpointError, SafetensorsReader
from ..serialization.shard_index import read_index, resolve_checkpoint_path
from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from ..tensor.experts import stack_experts
from .checkpoint_names import checkpoint_names
from .hub_experts import join_rows
from .hub_formats import HUB_QUANT_METHODS, DecodedWeight, TensorProblem, parse_hub_format

__all__ = ["load_hub_checkpoint", "HUB_QUANT_METHODS", "gather_permuted_input", "register_importers"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class _Store:
    """The checkpoint's tensors across its files: validated headers, one reader per file."""

    def __init__(self, directory: Path):
        path = resolve_checkpoint_path(directory)
        self.readers = {}
        if path.name.endswith(".index.json"):
            files, weight_map, _ = read_index(path)
            try:
                for f in files:
                    self.readers[f] = SafetensorsReader(path.parent / f)
            except CheckpointError:
                self.close()  # the shards opened so far
                raise
            self.file_of = {}
            for name, f in weight_map.items():
                if name not in self.readers[f].entries:
                    self.close()
                    raise CheckpointError(f"{path}: the index puts tensor {name} in {f}, which doesn't hold it")
                self.file_of[name] = f
        else:
            self.readers = {path.name: SafetensorsReader(path)}
            self.file_of = {name: path.name for name in self.readers[path.name].names()}
        self.directory = path.parent

    def where(self, name: str) -> Path:
        return self.directory / self.file_of.get(name, next(iter(self.readers)))

    def check(self, name: str, shapes, dtypes) -> None:
        reader = self.readers[self.file_of[name]]
        shape, dtype = reader.shape(name), reader.dtype(name)
        shapes = shapes if isinstance(shapes, list) else [tuple(shapes)]
        if shape not in shapes or dtype not in dtypes:
            want = " or ".join(str(s) for s in shapes)
            raise CheckpointError(f"{self.where(name)}: tensor {name} is {dtype} {shape}; expected {want} "
                                  f"({', '.join(str(d) for d in dtypes)}) for this Linear and quantization_config")

    def read(self, name: str) -> torch.Tensor:
        return self.readers[self.file_of[name]].read(name)

    def close(self) -> None:
        for r in self.readers.values():
            r.close()


def load_hub_checkpoint(directory, *, progress: bool | None = None) -> nn.Module:
    """A GPTQ / AWQ / compressed-tensors checkpoint directory as a transformers model on torchqkit layouts.
    CheckpointError naming the file and tensor for anything that doesn't fit; nothing is returned then."""
    import transformers
    directory = Path(directory)
    qc = read_config_json(directory)["quantization_config"]
    fmt = parse_hub_format(qc, f"{directory / 'config.json'}: quantization_config")
    hf_config = transformers.AutoConfig.from_pretrained(directory, trust_remote_code=False, local_files_only=True)
    archs = getattr(hf_config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise CheckpointError(f"{directory}/config.json: architectures {archs} names no transformers model class")
    with torch.device("meta"):
        model = cls(hf_config)
    store = _Store(directory)
    try:
        # every name, shape and dtype checked before any tensor is read
        plan, expert_plan, floats = _plan(model, fmt, store)
        weights, entries = _decode_all(plan, store, progress, fmt.name)
        values = {name: store.read(saved) for name, saved in floats}
        expert_values, expert_entries = _decode_experts(expert_plan, store)
        values.update(expert_values)
        entries.extend(expert_entries)
    finally:
        store.close()
    materialize_non_persistent_buffers(model)
    _assign(model, weights, values)
    model.tie_weights()
    model.torchqkit_report = QuantizationReport(entries)
    return model.eval()


def _plan(model: nn.Module, fmt, store: _Store):
    stored = set(store.file_of)
    names = _saved_names(model, stored)
    plan, quantized = [], set()
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        saved = names.linear(name)
        scheme = fmt.scheme_for(saved, module, stored)
        if scheme is None:
            continue
        tensors = _scheme_tensors(saved, scheme, module.out_features, module.in_features, fmt, store)
        plan.append((name, saved, module, scheme, tensors))
        quantized.add(f"{name}.weight")
    expert_plan = _plan_experts(names, fmt, store)
    floats = _float_tensors(model, quantized | set(expert_plan), names, store)
    used = {saved for _, saved in floats} | {full for *_, tensors in plan for full in tensors.values()}
    used |= {full for _, _, pieces in expert_plan.values() for _, _, tensors in pieces for full in tensors.values()}
    non_persistent = {n for n, _ in model.named_buffers()} - set(model.state_dict(keep_vars=True))
    extra = sorted(n for n in stored - used if n not in non_persistent and n not in _tied_names(model))
    if extra:
        raise CheckpointError(f"{store.where(extra[0])}: tensor {extra[0]} belongs to no tensor of "
                              f"{type(model).__name__} under {fmt.name} ({len(extra)} such tensor(s)); the "
                              f"checkpoint doesn't match its config.json")
    return plan, expert_plan, floats


def _scheme_tensors(saved: str, scheme, n: int, k: int, fmt, store: _Store) -> dict[str, str]:
    """suffix -> stored name of the tensors ``scheme`` keeps for the Linear saved as ``saved``, each checked."""
    tensors = {}
    for suffix, (shapes, dtypes) in scheme.tensor_shapes(n, k).items():
        key = suffix.rstrip("?")
        full = f"{saved}.{key}"
        if full not in store.file_of:
            if suffix.endswith("?"):
                continue
            raise CheckpointError(f"{store.where(full)}: tensor {full} is missing; {fmt.name} stores it for every "
                                  f"quantized Linear")
        store.check(full, shapes, dtypes)
        tensors[key] = full
    return tensors


class _Names:
    """Where the checkpoint keeps each of the model's tensors: its own name, or where transformers' save puts it
    (Note [Checkpoint names of fused experts]) when the model has expert Parameters."""

    def __init__(self, renames: dict, pieces: dict, stacks: dict, stored: set):
        self.renames, self.pieces, self.stacks, self.stored = renames, pieces, stacks, stored

    def key(self, name: str) -> str:
        saved = self.renames.get(name, name)
        return saved if saved in self.stored or name not in self.stored else name

    def linear(self, module_name: str) -> str:
        return self.key(f"{module_name}.weight").removesuffix(".weight")


def _saved_names(model: nn.Module, stored: set) -> _Names:
    params = expert_parameters(dict(model.named_modules()))
    stacks = {p.fqn: getattr(p.module, p.attr) for p in params if p.fqn not in stored}  # fused in the file: as is
    if not stacks:
        return _Names({}, {}, {}, stored)
    shapes = {k: tuple(t.shape) for k, t in model.state_dict(keep_vars=True).items()}
    try:
        names = checkpoint_names(model, shapes, set(stacks))
    except ValueError as e:
        raise CheckpointError(f"{type(model).__name__}: its expert Parameters ({sorted(stacks)[0]}, ...) are not in "
                              f"the checkpoint under their own names, and {e}") from None
    return _Names(names.renames, names.pieces, stacks, stored)


def _plan_experts(names: _Names, fmt, store: _Store) -> dict:
    """expert Parameter name -> (shape, quantized?, [(piece, scheme, suffix -> stored name)]): the per-expert
    Linears each expert Parameter is read from (Note [Expert stacks in compressed-tensors])."""
    out = {}
    for fqn, param in names.stacks.items():
        experts, n, k = param.shape
        pieces = []
        for piece in names.pieces[fqn]:
            rows = piece.end - piece.start
            stand_in = nn.Linear(k, rows, bias=False, device="meta")  # how the checkpoint's module looked
            scheme = fmt.scheme_for(piece.module, stand_in, names.stored)
            if scheme is None:
                full = f"{piece.module}.weight"
                if full not in store.file_of:
                    raise CheckpointError(f"{store.where(full)}: tensor {full} (rows [{piece.start}, {piece.end}) of "
                                          f"expert {piece.expert} of {fqn}) is missing")
                store.check(full, [(rows, k)], _FLOATS)
                pieces.append((piece, None, {"weight": full}))
            else:
                pieces.append((piece, scheme, _scheme_tensors(piece.module, scheme, rows, k, fmt, store)))
        floats = [p for p, scheme, _ in pieces if scheme is None]
        if floats and len(floats) < len(pieces):
            full = f"{floats[0].module}.weight"
            raise CheckpointError(f"{store.where(full)}: the Linears of {fqn} are partly quantized ({full} is float, "
                                  f"{len(pieces) - len(floats)} of {len(pieces)} are not); one expert Parameter holds "
                                  f"one format")
        out[fqn] = ((experts, n, k), not floats, pieces)
    return out


def _decode_experts(expert_plan: dict, store: _Store):
    """The stacks (or float (E, N, K) tensors) of every expert Parameter read from per-expert Linears, and their
    report entries."""
    values, entries = {}, []
    for fqn, ((experts, n, k), quantized, pieces) in expert_plan.items():
        by_expert = [[p for p in pieces if p[0].expert == e] for e in range(experts)]
        stored_bytes = 0
        if not quantized:
            rows = []
            for mine in by_expert:
                rows.append(torch.cat([store.read(t["weight"]) for _, _, t in mine]))
                stored_bytes += rows[-1].numel() * rows[-1].element_size()
            values[fqn] = torch.stack(rows)
            entries.append(LayerReport(fqn, "kept", f"float {values[fqn].dtype}",
                                       f"{experts} experts from {len(pieces)} Linears", stored_bytes, stored_bytes))
            continue
        weights, desc = [], None
        for e, mine in enumerate(by_expert):
            decoded = []
            for piece, scheme, tensors in mine:
                t = {key: store.read(full) for key, full in tensors.items()}
                stored_bytes += sum(v.numel() * v.element_size() for v in t.values())
                try:
                    decoded.append(scheme.decode(t, piece.end - piece.start, k))
                except TensorProblem as err:
                    full = f"{piece.module}.{err.suffix}"
                    raise CheckpointError(f"{store.where(full)}: tensor {full}: {err.what}") from None
            where = f"expert {e} of {fqn} ({', '.join(p.module for p, _, _ in mine)})"
            first = store.where(next(iter(mine[0][2].values())))
            try:
                joined = join_rows(decoded, [p.end - p.start for p, _, _ in mine], where)
            except ValueError as err:
                raise CheckpointError(f"{first}: {err}") from None
            try:
                weight, _, _ = build_weight(joined, n, k)
            except ValueError as err:  # build_weight's check of the decoded scales and zero points
                raise CheckpointError(f"{first}: {where}: {err}") from None
            weights.append(weight)
            desc = decoded[0].what
        stack = stack_experts(weights, fqn)
        entries.append(LayerReport(fqn, "quantized", f"{desc} -> {_describe(stack)}",
                                   f"{experts} experts of ({n}, {k}) from {len(pieces)} Linears", stored_bytes,
                                   stack.packed_nbytes()))
        values[fqn] = stack
    return values, entries


def _tied_names(model: nn.Module) -> set[str]:
    """Names of parameters that are the same Parameter as an earlier one (a tied lm_head)."""
    all_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return all_names - {n for n, _ in model.named_parameters()}


def _float_tensors(model: nn.Module, quantized: set, names: _Names, store: _Store) -> list[tuple[str, str]]:
    """(model name, stored name) of every other parameter and persistent buffer: its shape, a float dtype."""
    out, params = [], {n for n, _ in model.named_parameters()}
    shapes = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    for name in [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers() if n in shapes]:
        if name in quantized:
            continue
        saved = names.key(name)
        if saved not in store.file_of:
            if name.endswith(".weight") and name.rsplit(".", 1)[0] and _is_linear(model, name):
                raise CheckpointError(f"{store.where(saved)}: Linear {saved.rsplit('.', 1)[0]} has neither a float "
                                      f"weight nor the quantized tensors its quantization_config describes")
            raise CheckpointError(f"{store.where(saved)}: tensor {saved} is missing")
        is_param = name in params
        store.check(saved, [shapes[name]], _FLOATS if is_param else (store.readers[store.file_of[saved]].dtype(saved),))
        out.append((name, saved))
    return out


def _is_linear(model, name: str) -> bool:
    return isinstance(model.get_submodule(name.rsplit(".", 1)[0]), nn.Linear)


def _decode_all(plan, store: _Store, progress, what: str):
    weights, entries = {}, []
    bar = ProgressLine("from_pretrained", len(plan), "Linears", enabled=progress_enabled(progress))
    for i, (name, saved, module, scheme, tensors) in enumerate(plan):
        bar.update(i, name)
        t = {key: store.read(full) for key, full in tensors.items()}
        n, k = module.out_features, module.in_features
        try:
            decoded = scheme.decode(t, n, k)
            weight, perm, note = build_weight(decoded, n, k)
        except TensorProblem as e:
            full = f"{saved}.{e.suffix}"
            raise CheckpointError(f"{store.where(full)}: tensor {full}: {e.what}") from None
        except ValueError as e:  # build_weight's check of the decoded scales and zero points
            full = next(iter(tensors.values()))
            raise CheckpointError(f"{store.where(full)}: Linear {saved} ({', '.join(tensors)}): {e}") from None
        weights[name] = (weight, perm)
        stored_bytes = sum(v.numel() * v.element_size() for v in t.values())
        quantized = isinstance(weight, AffineQuantizedTensor)
        after = weight.packed_nbytes() if quantized else weight.numel() * weight.element_size()
        status = "quantized" if quantized else "kept"
        entries.append(LayerReport(name, status, f"{decoded.what} -> {_describe(weight)}", note, stored_bytes, after))
    bar.update(len(plan))
    bar.close()
    return weights, entries


def _describe(weight) -> str:
    if isinstance(weight, AffineQuantizedTensor):
        return f"{weight.qdtype.name} block {weight.block_size} {weight.qlayout!r}"
    return f"float {weight.dtype}"


def build_weight(d: DecodedWeight, n: int, k: int):
    """(weight, input permutation or None, note): the AffineQuantizedTensor holding ``d``'s codes and scales, or
    for act-order groups of unequal sizes the exact float weight (Note [Act-order weights])."""
    orig_dtype = d.dtype or d.scale.dtype
    codes, perm, note = d.codes, None, ""
    if d.g_idx is not None:
        g = d.block_size[1]
        groups = d.scale.shape[1]
        counts = torch.bincount(d.g_idx, minlength=groups).tolist()
        if counts != [min(g, k - i * g) for i in range(groups)]:
            zp = 0 if d.zero_point is None else d.zero_point[:, d.g_idx].float()
            w = ((codes.float() - zp) * d.scale[:, d.g_idx].float()).to(orig_dtype)
            return w, None, "act-order groups of unequal sizes: dequantized to float (exact), no layout fits"
        perm = torch.argsort(d.g_idx, stable=True)
        codes = codes[:, perm].contiguous()
        note = "act-order: in_features permuted by g_idx, input gathered by input_permutation (exact)"
    zpd = ZeroPointDomain.NONE if d.zero_point is None else ZeroPointDomain.INT
    if d.qdtype.kind is QKind.FLOAT8:
        layout = Float8Layout()
    elif d.qdtype is fp4_e2m1:
        layout = MXLayout()
    else:
        layout = PlainLayout() if d.qdtype.bits >= 8 else PackedIntxLayout()
    wfmt = WeightFormat.of(d.qdtype, d.block_size, (n, k), zpd)
    if d.stored is not None:
        layout, tensors = d.stored
    else:
        layout = layout.for_weight(wfmt)
        tensors = layout.pack(PlainParts(codes, d.scale.contiguous(), d.zero_point), wfmt)
    weight = AffineQuantizedTensor(tensors, d.qdtype, d.block_size, (n, k), orig_dtype, layout, zpd,
                                   act_quant=d.act_quant)
    problem = weight.qparams_problem()
    if problem is not None:
        raise ValueError(f"{problem}; the checkpoint is corrupt (its own loader would compute NaN or wrong values "
                         f"from it)")
    return weight, perm, note


def register_importers() -> None:
    """Make torchqkit.from_pretrained read these checkpoints (hf.py sits below integrations, so it keeps a table)."""
    for method in HUB_QUANT_METHODS:
        CHECKPOINT_IMPORTERS[method] = load_hub_checkpoint


def gather_permuted_input(module: nn.Module, args):
    """Forward pre-hook of an act-order Linear: its input's features in the stored weight's order."""
    return (args[0].index_select(-1, module.input_permutation), *args[1:])


def _assign(model: nn.Module, weights: dict, values: dict) -> None:
    for name, (weight, perm) in weights.items():
        module = model.get_submodule(name)
        module.weight = nn.Parameter(weight, requires_grad=False)
        if perm is not None:
            module.register_buffer("input_permutation", perm)
            module.register_forward_pre_hook(gather_permuted_input)
        if isinstance(weight, AffineQuantizedTensor):
            patch_extra_repr(module)
    for name, value in values.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if attr in module._parameters:
            module._parameters[attr] = nn.Parameter(value, requires_grad=False)
        else:
            module._buffers[attr] = value


register_importers()
