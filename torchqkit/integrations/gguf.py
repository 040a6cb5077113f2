"""from_gguf: a llama.cpp GGUF file to a transformers model whose Linear weights (and expert stacks) are torchqkit
layouts.

    model = qk.from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")     # Q4_1 Linears -> int4 g32 tiled, bit for bit
    print(model.torchqkit_report)                                # what each tensor became, bytes before/after

The GGUF's quantized blocks go straight into layouts (gguf_blocks.py has the type mapping): no float copy
of a quantized weight is ever made, and the codes are the file's own. The model skeleton is built on the
meta device from the GGUF's metadata (transformers reads it), its non-persistent buffers are computed as
torchqkit.from_pretrained does, and each tensor is read from the memory-mapped file one at a time. Tensor
types torchqkit has no layout for (IQ*, TQ*, MXFP4, ...) are dequantized to float32 with one warning
naming each tensor and type. Quantized embeddings stay quantized (an nn.Embedding on an AffineQuantizedTensor
gathers and dequantizes only the rows it looks up), and a tied lm_head shares that same quantized weight, as
in the file: SmolLM2's Q8_0 embedding is then read as int8 by the lm_head, not as 113 MB of float32.

Needs the ``gguf`` and ``transformers`` packages (``pip install "torchqkit[gguf]"``); the tokenizer loads with
``transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)``.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..api.quantize import patch_extra_repr
from ..api.report import LayerReport, QuantizationReport
from ..files.open_checked import open_regular_file
from ..progress import ProgressLine, progress_enabled
from ..layouts.base import WeightFormat
from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from .gguf_blocks import BLOCK_FORMATS, decode_blocks
from .gguf_checks import check_hyperparameters, check_tensor_ranges
from .gguf_experts import ExpertSlot, expert_slots, is_moe_file, load_expert_stack, moe_config

__all__ = ["from_gguf", "GGUFError", "SUPPORTED_ARCHITECTURES", "open_gguf_reader", "gguf_to_hf_names",
           "gguf_dependencies"]

# Architectures whose GGUF tensor names and q/k row order transformers maps to a LLaMA-style model.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3moe")  # llama with llama.expert_count: Mixtral
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class GGUFError(ValueError):
    """A GGUF file torchqkit can't import, or a model it can't export; the message says what and what to do.

    Raised by ``from_gguf``: a malformed or truncated file, tensor records that point outside it, hyperparameters
    that don't fit the architecture, or a tensor that can't be decoded. Everything is checked before the model is
    built where possible. Raised by ``save_gguf`` before anything is written: a tensor with no exact GGUF type
    (the message names the tensor, its layout and the options), an architecture or tokenizer it can't write.
    A ``ValueError``.

    Example:
        ```python
        import torchqkit as qk
        try:
            model = qk.from_gguf("model-Q4_0.gguf")
        except qk.GGUFError as e:
            print("can't import:", e)
        ```
    """


def from_gguf(path, *, progress: bool | None = None) -> nn.Module:
    """Load a GGUF file (llama.cpp's format) as a transformers causal LM, Linear weights quantized as stored.

    The model is built on the meta device from the file's hyperparameters, and each tensor is read once: Linear
    and embedding weights in block formats torchqkit has a layout for become ``AffineQuantizedTensor``s holding
    the same codes and scales, F32 / F16 / BF16 tensors are loaded as float32, and other tensors are dequantized
    to float32 (with a warning). Mixture-of-experts files (``qwen3moe``, and ``llama`` with
    ``llama.expert_count``: Mixtral) give a ``Qwen3MoeForCausalLM`` / ``MixtralForCausalLM`` whose ``ffn_*_exps``
    tensors become (E, N, K) expert stacks, gate and up joined into ``gate_up_proj``. The returned model has
    ``torchqkit_report``, a ``QuantizationReport`` with one entry per imported tensor. Needs the
    ``gguf`` and ``transformers`` packages (``pip install "torchqkit[gguf]"``).

    Args:
        path (str | os.PathLike): the ``.gguf`` file.
        progress (bool | None): a progress line on stderr per tensor read; None (default): when stderr is a
            terminal. Keyword-only.

    Returns:
        transformers.PreTrainedModel: the causal LM, in eval mode.

    Raises:
        GGUFError: a file torchqkit can't import (malformed, unsupported architecture or hyperparameters, a tensor
            that can't be decoded).
        ImportError: ``gguf`` or ``transformers`` is not installed.

    Example:
        ```python
        import torchqkit as qk
        model = qk.from_gguf("SmolLM2-135M-Q4_0.gguf")
        print(model.torchqkit_report)
        ```
    """
    gguf, transformers = gguf_dependencies()
    path = Path(path)
    reader = _open_reader(gguf, path)  # Note [Checked GGUF files], 1: tensor records
    arch = _architecture(reader, path)
    tensors = {t.name: tuple(int(s) for s in reversed(t.shape.tolist())) for t in reader.tensors}
    check_hyperparameters(lambda key: _field(reader, key), tensors, arch, path, GGUFError)  # 2: before building
    if is_moe_file(lambda key: _field(reader, key), arch):  # Note [GGUF expert tensors]
        config = moe_config(lambda key: _field(reader, key), arch, tensors, transformers)
    else:
        config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    names = gguf_to_hf_names(gguf, model, arch)
    plan = _plan(reader, names, model, path)  # every check before any tensor is read
    _materialize_buffers(model)
    entries, pending = [], {}
    bar = ProgressLine(f"from_gguf {path.name}", len(plan), "tensors", enabled=progress_enabled(progress))
    for i, (tensor, hf_name) in enumerate(plan):
        bar.update(i, tensor.name)
        try:
            if isinstance(hf_name, ExpertSlot):  # loaded once all its GGUF tensors (gate and up) are read
                parts = pending.setdefault(hf_name.hf_name, [None] * hf_name.count)
                parts[hf_name.index] = tensor
                if all(t is not None for t in parts):
                    entries.append(load_expert_stack(model, hf_name.hf_name, pending.pop(hf_name.hf_name), path,
                                                     GGUFError))
            else:
                entries.append(_load_tensor(model, tensor, hf_name, arch, config, path))
        except GGUFError:
            raise
        except (ValueError, RuntimeError, IndexError) as e:  # gguf-py's and the decoders' own errors
            raise GGUFError(f"{path}: tensor {tensor.name!r} ({tensor.tensor_type.name}) can't be decoded: "
                            f"{type(e).__name__}: {e}") from None
    bar.update(len(plan))
    bar.close()
    model.tie_weights()
    _check_nothing_left_on_meta(model, path)
    fallback = [e for e in entries if e.status == "kept" and e.config.startswith("dequantized")]
    if fallback:
        warnings.warn(f"torchqkit.from_gguf: {len(fallback)} tensor(s) of types torchqkit has no layout for were "
                      f"dequantized to float32: " + "; ".join(f"{e.fqn} ({e.reason})" for e in fallback[:8])
                      + (" ..." if len(fallback) > 8 else ""), stacklevel=2)
    model.torchqkit_report = QuantizationReport(entries)
    model.torchqkit_gguf_source = str(path)  # save_gguf copies this file's tokenizer
    return model.eval()


def gguf_dependencies():
    try:
        import gguf
        import transformers
    except ImportError as e:
        raise ImportError(f"torchqkit.from_gguf needs the gguf and transformers packages ({e.name} is missing): "
                          f'pip install "torchqkit[gguf]"') from None
    return gguf, transformers


def open_gguf_reader(path):
    """gguf-py's reader on a GGUF file, every tensor record checked (``GGUFError`` otherwise)."""
    gguf, _ = gguf_dependencies()
    return _open_reader(gguf, Path(path))


def _open_reader(gguf, path):
    """gguf-py's reader on ``path`` (opened by the rule for every file torchqkit reads), with every tensor record
    checked before gguf-py builds a view of its bytes (Note [Checked GGUF files])."""

    class CheckedReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            check_tensor_ranges(gguf, fields, int(start_offs), int(self.alignment), len(self.data), path, GGUFError)
            super()._build_tensors(start_offs, fields)

    with open_regular_file(path, GGUFError, "GGUF file") as f:  # the memory map keeps its own reference
        try:
            return CheckedReader(f)
        except GGUFError:
            raise
        except Exception as e:  # gguf raises ValueError / IndexError / struct.error / OSError for non-GGUF bytes
            raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    value = f.parts[f.data[0]]
    return bytes(value).decode("utf-8") if value.dtype == np.uint8 else value.tolist()[0]


def _architecture(reader, path) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported by torchqkit.from_gguf (supported: "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)}); load it with transformers' own GGUF loader "
                        f"(from_pretrained(..., gguf_file=...)), which dequantizes to float")
    return arch


def gguf_to_hf_names(gguf, model, arch) -> dict[str, str | ExpertSlot]:
    """GGUF tensor name -> the model's parameter name, from gguf-py's own table of each architecture's names; a
    MoE expert tensor -> its ExpertSlot (the Parameter and its share of rows, Note [GGUF expert tensors])."""
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    table = gguf.get_tensor_name_map(arch_id, model.config.num_hidden_layers)
    names = {}
    for hf_name, _ in model.named_parameters(remove_duplicate=False):
        base, _, suffix = hf_name.rpartition(".")
        gguf_base = table.get_name(base)
        if gguf_base is not None:
            names[f"{gguf_base}.{suffix}"] = hf_name
    names.update(expert_slots(table, model))
    return names


def _plan(reader, names, model, path):
    params = dict(model.named_parameters(remove_duplicate=False))
    plan, unknown = [], []
    for t in reader.tensors:
        hf_name = names.get(t.name)
        param = params.get(hf_name.hf_name if isinstance(hf_name, ExpertSlot) else hf_name)
        if param is None:
            unknown.append(t.name)
            continue
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # ggml lists ne0 (the contiguous K) first
        expected = tuple(param.shape)
        if isinstance(hf_name, ExpertSlot):  # gate and up each hold half of every expert's rows
            expected = (expected[0], expected[1] // hf_name.count, *expected[2:])
        if shape != expected:
            target = f"{hf_name.hf_name} (its share {hf_name.index + 1} of {hf_name.count})" if isinstance(
                hf_name, ExpertSlot) else hf_name
            raise GGUFError(f"{path}: tensor {t.name} has shape {shape} but {target} of the model the metadata "
                            f"describes is {expected}; the file's metadata and tensors disagree")
        plan.append((t, hf_name))
    if unknown:
        raise GGUFError(f"{path}: tensor(s) {unknown[:5]} map to no parameter of {type(model).__name__}; "
                        f"torchqkit.from_gguf imports {', '.join(SUPPORTED_ARCHITECTURES)} models only")
    return plan


def _materialize_buffers(model):
    from ..hf import materialize_non_persistent_buffers
    materialize_non_persistent_buffers(model)


def _load_tensor(model, tensor, hf_name, arch, config, path) -> LayerReport:
    module_name, _, attr = hf_name.rpartition(".")
    module = model.get_submodule(module_name)
    type_name = tensor.tensor_type.name
    with warnings.catch_warnings():  # the memory map is read-only and nothing here writes to it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(np.asarray(tensor.data))
    nbytes = int(tensor.n_bytes)
    shape = tuple(int(s) for s in reversed(tensor.shape.tolist()))
    rows = _qk_row_order(hf_name, shape[0], arch, config)
    if type_name in BLOCK_FORMATS and isinstance(module, (nn.Linear, nn.Embedding)) and attr == "weight":
        fmt, parts = decode_blocks(BLOCK_FORMATS[type_name], raw.reshape(shape[0], -1), shape[1])
        if rows is not None:
            parts = type(parts)(*(None if p is None else p[rows] for p in parts))
        wfmt = WeightFormat.of(fmt.qdtype, (1, fmt.group), parts.qdata.shape, fmt.zero_point_domain)
        layout = fmt.layout().for_weight(wfmt)
        tensors = layout.pack(parts, wfmt)
        weight = AffineQuantizedTensor(tensors, fmt.qdtype, (1, fmt.group), shape, torch.float32, layout,
                                       fmt.zero_point_domain)
        problem = weight.qparams_problem()  # Note [Checked GGUF files], 3: load_quantized's own check
        if problem is not None:
            raise GGUFError(f"{path}: tensor {tensor.name!r} ({type_name}): block scales or mins are NaN or Inf "
                            f"({problem}); the file is corrupt (llama.cpp would compute NaN from it)")
        module.weight = nn.Parameter(weight, requires_grad=False)
        if isinstance(module, nn.Linear):
            patch_extra_repr(module)
        return LayerReport(module_name, "quantized", f"gguf {type_name} -> {fmt.describe()}", "", nbytes,
                           weight.packed_nbytes())
    if type_name in _FLOAT_TYPES:
        value, how = raw.view(_FLOAT_TYPES[type_name]).reshape(shape).float(), f"{type_name} -> float32"
    else:
        from gguf.quants import dequantize
        value = torch.from_numpy(dequantize(np.asarray(tensor.data), tensor.tensor_type)).reshape(shape).float()
        how = f"dequantized {type_name} -> float32"
        if not bool(torch.isfinite(value).all()):  # its block scales are inside: check what they gave
            raise GGUFError(f"{path}: tensor {tensor.name!r} ({type_name}) dequantizes to NaN or Inf values: its "
                            f"block scales are not finite; the file is corrupt")
    if rows is not None:
        value = value[rows]
    setattr(module, attr, nn.Parameter(value.contiguous(), requires_grad=False))
    reason = f"{type_name}: no torchqkit layout for this GGUF type" if how.startswith("dequantized") else how
    return LayerReport(hf_name, "kept", how, reason, nbytes, value.numel() * value.element_size())


def _qk_row_order(hf_name, rows, arch, config):
    """llama.cpp's converter interleaves the rows of each LLaMA q / k head for its rotary layout; transformers'
    models want them back in halves. The same row order applies to codes and scales alike. None: unchanged."""
    if arch not in ("llama", "mistral"):
        return None
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    kind = next((k for k in heads if f".{k}." in hf_name), None)
    if kind is None:
        return None
    n_head = heads[kind]
    # transformers' row (head h, half a, i) is the file's row (h, i, a).
    return torch.arange(rows).reshape(n_head, rows // n_head // 2, 2).transpose(1, 2).reshape(rows)


def _check_nothing_left_on_meta(model, path):
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise GGUFError(f"{path}: the file has no tensor for {left[:5]}; it is not a complete "
                        f"{type(model).__name__} checkpoint")
