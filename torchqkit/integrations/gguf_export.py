"""save_gguf: a llama / mistral / qwen2 / qwen3-moe / mixtral model, quantized by torchqkit or read by from_gguf, as a
llama.cpp GGUF file.

    report = qk.save_gguf(model, "model.gguf", tokenizer)   # every quantized weight in the GGUF type holding it
    print(report)                                            # per tensor: type written, source, exact or why not

Quantized weights keep their codes (gguf_encode.py: Note [Exact GGUF targets]); float tensors keep their values:
a 2-d tensor is F16 when every value is a float16 value (a float16 model, or an F16 tensor from_gguf read as
float32), else BF16 when every value is a bfloat16 value, else F32; 1-d tensors (norms, biases) are F32, the type
llama.cpp's norm and add kernels read. A tied lm_head is written once, as ``token_embd.weight``: llama.cpp
reads ``output.weight`` from it when the file has none. Every tensor is encoded and checked before the file is
opened; the file is written under a temporary name and renamed into place (Note [Atomic writes]).
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..files.atomic_write import (check_destination, fsync_directory, remove_stale_temps, replace_temp, temp_file,
                                  unlink_quietly)
from ..progress import ProgressLine, progress_enabled
from ..tensor.affine_quantized_tensor import AffineQuantizedTensor
from .gguf import GGUFError, gguf_dependencies, gguf_to_hf_names
from .gguf_experts import ExpertSlot
from .gguf_encode import BLOCK, encode_exact, requantize as requantize_float
from .gguf_metadata import add_architecture, add_tokenizer, architecture_of, tokenizer_source

__all__ = ["save_gguf", "GGUFExportReport", "GGUFTensorExport"]


@dataclass
class GGUFTensorExport:
    """One tensor of a GGUF export: what was written and whether it is exactly the model's.

    Args:
        name (str): the tensor's GGUF name (``blk.0.attn_q.weight``).
        source (str): the model's parameter name (``model.layers.0.self_attn.q_proj.weight``).
        gguf_type (str): the GGML type written (``Q4_1``, ``Q8_0``, ``F32``, ...).
        source_format (str): what the model holds: qdtype, block size, zero point and layout, or a float dtype.
        status (str): ``"exact"`` (the codes are the model's, scales rounded to float16 at most), ``"float"`` (a
            float tensor written in its own precision), or ``"requantized"`` (re-rounded, see ``note``).
        note (str): scales rounded to float16 and the largest weight change, or why the tensor was requantized.
        nbytes (int): bytes of the tensor's data in the file.
        scales_rounded (int): for ``"exact"`` tensors, how many of the source's scales and mins float16 changed
            (0: the dequantized values are the model's, bit for bit). Default 0.

    Example:
        ```python
        report = qk.save_gguf(model, "model.gguf", tokenizer)
        for t in report.tensors:
            print(t.name, t.gguf_type, t.status, t.note)
        ```
    """
    name: str
    source: str
    gguf_type: str
    source_format: str
    status: str
    note: str
    nbytes: int
    scales_rounded: int = 0


class GGUFExportReport:
    """What ``save_gguf`` wrote: one ``GGUFTensorExport`` per tensor, the architecture and the tokenizer.

    ``print(report)`` shows a table and a summary line; ``report[name]`` finds a tensor by GGUF or parameter name;
    ``exact`` / ``requantized`` / ``floats`` filter the tensors; ``types`` counts the GGML types written.

    Args:
        path (pathlib.Path): the file written.
        architecture (str): ``general.architecture`` of the file.
        tokenizer (str): where the tokenizer came from.
        tensors (list[GGUFTensorExport]): the tensors, in file order.

    Example:
        ```python
        report = qk.save_gguf(model, "model.gguf", tokenizer)
        print(report)
        assert not report.requantized and report.types["Q4_1"] == 210
        ```
    """

    def __init__(self, path: Path, architecture: str, tokenizer: str, tensors: list[GGUFTensorExport]):
        self.path, self.architecture, self.tokenizer, self.tensors = path, architecture, tokenizer, tensors

    def __getitem__(self, name: str) -> GGUFTensorExport:
        for t in self.tensors:
            if name in (t.name, t.source):
                return t
        raise KeyError(name)

    @property
    def exact(self) -> list[GGUFTensorExport]:
        return [t for t in self.tensors if t.status == "exact"]

    @property
    def requantized(self) -> list[GGUFTensorExport]:
        return [t for t in self.tensors if t.status == "requantized"]

    @property
    def floats(self) -> list[GGUFTensorExport]:
        return [t for t in self.tensors if t.status == "float"]

    @property
    def types(self) -> Counter:
        return Counter(t.gguf_type for t in self.tensors)

    def __str__(self) -> str:
        rows = [("gguf tensor", "type", "status", "source", "note")]
        rows += [(t.name, t.gguf_type, t.status, t.source_format, t.note) for t in self.tensors]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
        total = sum(t.nbytes for t in self.tensors)
        types = ", ".join(f"{n} {k}" for k, n in sorted(self.types.items()))
        lines.append(f"{self.path.name}: {self.architecture}, {len(self.tensors)} tensors ({types}), "
                     f"{len(self.exact)} exact, {len(self.requantized)} requantized, {len(self.floats)} float; "
                     f"{total} bytes of tensor data; {self.tokenizer}")
        return "\n".join(lines)

    __repr__ = __str__


def save_gguf(model: nn.Module, path, tokenizer=None, *, requantize: bool = False,
              progress: bool | None = None) -> GGUFExportReport:
    """Write a llama / mistral / qwen2 / Qwen3-MoE / Mixtral causal LM as a GGUF file llama.cpp loads, exactly.

    Each quantized weight (an ``AffineQuantizedTensor`` from ``quantize_``, ``from_gguf`` or a checkpoint) is
    written in the GGUF block type that holds its codes: int4 asymmetric (any group size that is a multiple of 32)
    -> Q4_1, symmetric -> Q4_0, int5 -> Q5_0 / Q5_1, int6 / int8 symmetric -> Q8_0, int2 / int3 -> Q4_0 / Q4_1.
    Scales and mins are float16 in the file: rounding them is the only change, and the report counts it per tensor.
    A weight no type holds exactly (NF4, float8, asymmetric int8, groups that are not whole 32-blocks, an AWQ input
    scale) raises before anything is written, unless ``requantize=True``. Float tensors keep their precision.
    ``qk.from_gguf(path)`` gives back the same codes and (float16) scales.

    Args:
        model (torch.nn.Module): a transformers ``LlamaForCausalLM``, ``MistralForCausalLM``,
            ``Qwen2ForCausalLM``, ``Qwen3MoeForCausalLM`` or ``MixtralForCausalLM``, quantized or not. Expert stacks
            (E, N, K) are written as llama.cpp's ``ffn_*_exps`` tensors, every expert in one type; Qwen3-MoE
            needs ``norm_topk_prob=True`` (llama.cpp always renormalizes the routing weights).
        path (str | os.PathLike): the ``.gguf`` file to write (replaced atomically if it exists).
        tokenizer (transformers.PreTrainedTokenizerBase | str | os.PathLike | None): a transformers tokenizer
            (BPE or SentencePiece), or the path of a ``.gguf`` file whose tokenizer is copied; None (default): the
            tokenizer of the GGUF file the model was loaded from (``qk.from_gguf``).
        requantize (bool): re-round weights that have no exact GGUF type to the nearest legacy type (by their bit
            width) with gguf-py's quantizer, instead of raising; the report marks them. Default False.
            Keyword-only.
        progress (bool | None): a progress line on stderr; None (default): when stderr is a terminal.
            Keyword-only.

    Returns:
        GGUFExportReport: per tensor, the GGUF type written, the source format and whether it is exact.

    Raises:
        GGUFError: an architecture, configuration or tokenizer that can't be exported, or a weight with no exact
            GGUF type (the message names each such tensor, its format and the options); nothing is written.
        ImportError: ``gguf`` or ``transformers`` is not installed.
        OSError: the file can't be written (any earlier file at ``path`` is left as it was).

    Example:
        ```python
        import torchqkit as qk
        qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=64))
        report = qk.save_gguf(model, "model-q4_1.gguf", tokenizer)
        print(report)
        ```
    """
    gguf, _ = gguf_dependencies()
    config = getattr(model, "config", None)
    if config is None:
        raise GGUFError(f"torchqkit.save_gguf: {type(model).__name__} has no transformers config; export a "
                        f"transformers causal LM (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                        f"Qwen3MoeForCausalLM, MixtralForCausalLM)")
    arch = architecture_of(config, GGUFError)
    source = tokenizer_source(tokenizer, model, GGUFError)
    plan = _plan(gguf, model, arch)
    bar = ProgressLine(f"save_gguf {Path(path).name}", len(plan), "tensors", enabled=progress_enabled(progress))
    encoded, refused, stacks = [], [], {}
    for i, (gguf_name, hf_name, param, slot) in enumerate(plan):
        bar.update(i, gguf_name)
        if slot is None:
            item = _encode(gguf_name, hf_name, param, requantize, arch, config)
        else:
            item = _encode_share(gguf_name, hf_name, param, slot, stacks, requantize, arch, config)
        if item is not None:
            (refused if isinstance(item, str) else encoded).append(item)
    bar.close()
    if refused:
        raise GGUFError(f"torchqkit.save_gguf: {len(refused)} weight(s) have no exact GGUF type, nothing was "
                        f"written: " + "; ".join(refused[:6]) + (" ..." if len(refused) > 6 else "")
                        + ". Options: quantize them with a format GGUF holds (Int4WeightOnlyConfig with a group size "
                        "that is a multiple of 32, IntxWeightOnlyConfig symmetric, Int8WeightOnlyConfig), leave them "
                        "in float, or pass requantize=True to re-round them to the nearest GGUF type")
    path = check_destination(Path(path))
    _write(gguf, path, arch, config, source, encoded, GGUFError)
    return GGUFExportReport(path, arch, source.describe(), [e[3] for e in encoded])


def _plan(gguf, model, arch):
    """(gguf name, parameter name, parameter, ExpertSlot or None) of every parameter once (a tied lm_head is the
    embedding); a fused gate_up_proj twice, one entry per GGUF tensor (Note [GGUF expert tensors])."""
    to_gguf = {}
    for g, hf in gguf_to_hf_names(gguf, model, arch).items():
        if isinstance(hf, ExpertSlot):  # gate and up of one fused Parameter: both, in row order
            to_gguf.setdefault(hf.hf_name, []).append((g, hf))
            to_gguf[hf.hf_name].sort(key=lambda item: item[1].index)
        else:
            to_gguf[hf] = [(g, None)]
    plan, unnamed = [], []
    for hf_name, param in model.named_parameters(remove_duplicate=True):
        targets = to_gguf.get(hf_name)
        if targets is None:
            unnamed.append(hf_name)
        else:
            plan += [(gguf_name, hf_name, param, slot) for gguf_name, slot in targets]
    if unnamed:
        raise GGUFError(f"torchqkit.save_gguf: parameter(s) {unnamed[:5]} of {type(model).__name__} have no GGUF "
                        f"tensor name in llama.cpp's {arch} architecture; nothing was written")
    return plan  # an lm_head that is not the embedding's Parameter is written as output.weight, tied config or not


def _describe(w) -> str:
    if isinstance(w, AffineQuantizedTensor):
        zp = w.zero_point_domain.value
        return f"{w.qdtype.name} block {list(w.block_size)} zero {zp} {type(w.qlayout).__name__}"
    return str(w.dtype).replace("torch.", "")


def _encode(gguf_name, hf_name, param, requantize, arch, config):
    """(gguf name, array, GGML type, report entry), or a one-line refusal naming the tensor."""
    import gguf
    rows = _file_row_order(hf_name, param.shape[0], arch, config)
    if not isinstance(param, AffineQuantizedTensor):
        value, type_name = _float_type(param.detach().cpu())
        if rows is not None:
            value = value[rows]
        data = value.contiguous().view(torch.int16).numpy().view(np.uint8) if type_name == "BF16" else (
            value.contiguous().numpy())
        note = "" if value.dtype == param.dtype else f"{_describe(param)} values written as {type_name} (all exact)"
        entry = GGUFTensorExport(gguf_name, hf_name, type_name, _describe(param), "float", note, data.nbytes)
        return gguf_name, data, gguf.GGMLQuantizationType[type_name], entry
    enc, why = encode_exact(param, gguf_name)
    if enc is not None:
        note = (f"{enc.rounded} of {enc.qparams} scales/mins rounded to float16, max |dw| {enc.max_abs_change:.3g}"
                if enc.rounded else "scales already float16: values identical")
        if param.act_quant is not None:
            note += "; its activation quantization is not carried (llama.cpp quantizes activations its own way)"
        data = enc.data if rows is None else enc.data[rows.numpy()]
        entry = GGUFTensorExport(gguf_name, hf_name, enc.type_name, _describe(param), "exact", note, data.nbytes,
                                 enc.rounded)
        return gguf_name, data, gguf.GGMLQuantizationType[enc.type_name], entry
    if not requantize:
        return f"{gguf_name} ({hf_name}, {_describe(param)}): {why}"
    value = param.dequantize(torch.float32).cpu()
    if rows is not None:
        value = value[rows]
    if value.shape[-1] % BLOCK:
        data, type_name, how = value.contiguous().numpy(), "F32", "dequantized to F32"
    else:
        type_name, data = requantize_float(value, param.qdtype.bits, param.zero_point_domain.value != "none")
        how = f"requantized to {type_name}"
    entry = GGUFTensorExport(gguf_name, hf_name, type_name, _describe(param), "requantized", f"{how}: {why}",
                             data.nbytes)
    return gguf_name, data, gguf.GGMLQuantizationType[type_name], entry


def _encode_share(gguf_name, hf_name, param, slot, stacks, requantize, arch, config):
    """One GGUF tensor of an expert Parameter: its share of every expert's rows, cut from the whole stack's
    encoding (encoded once; GGUF blocks lie within a row, so cutting rows re-rounds nothing). None: the stack was
    already refused under its first GGUF name. Note [GGUF expert tensors]."""
    whole = stacks.get(hf_name)
    if whole is None:
        whole = stacks[hf_name] = _encode(gguf_name, hf_name, param, requantize, arch, config)
    if isinstance(whole, str):
        return None if slot.index else whole
    _, data, ggml_type, entry = whole
    if slot.count > 1:
        data = np.ascontiguousarray(data[:, slot.rows(data.shape[1])])
    share = f"rows {slot.rows(param.shape[1]).start}..{slot.rows(param.shape[1]).stop - 1} of each expert"
    note = f"{share}; whole stack: {entry.note}" if slot.count > 1 and entry.note else (
        share if slot.count > 1 else entry.note)
    return gguf_name, data, ggml_type, replace(entry, name=gguf_name, note=note, nbytes=int(data.nbytes))


def _float_type(value: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The smallest float type that holds every value exactly: a 2-d tensor whose values are all float16 (or
    bfloat16) values is written as F16 (BF16), whatever dtype holds it (from_gguf reads F16 as float32); 1-d
    tensors are F32, the type llama.cpp's norm and bias kernels read."""
    if value.dim() >= 2:
        for dtype, name in ((torch.float16, "F16"), (torch.bfloat16, "BF16")):
            narrow = value.to(dtype)
            if value.dtype == dtype or torch.equal(narrow.to(value.dtype), value):
                return narrow, name
    return value.float(), "F32"


def _file_row_order(hf_name, rows, arch, config):
    """The inverse of from_gguf's q / k row order: llama.cpp's converter interleaves the two rotary halves of each
    LLaMA head (file row (h, i, a) is transformers' row (h, a, i)). None: rows stay as they are."""
    if arch != "llama":
        return None
    heads = {"q_proj": config.num_attention_heads, "k_proj": getattr(config, "num_key_value_heads", None)
             or config.num_attention_heads}
    kind = next((k for k in heads if f".{k}." in hf_name), None)
    if kind is None:
        return None
    n_head = heads[kind]
    return torch.arange(rows).reshape(n_head, 2, rows // n_head // 2).transpose(1, 2).reshape(rows)


def _write(gguf, path: Path, arch, config, source, encoded, error) -> None:
    remove_stale_temps(path.parent, [path.name])
    f, tmp = temp_file(path)
    f.close()  # gguf-py opens the path itself; the temporary stays locked (Note [Stale temporaries])
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        writer.add_name(str(getattr(config, "_name_or_path", "") or f"torchqkit {arch} export"))
        add_architecture(writer, config, arch, error)
        add_tokenizer(writer, source, int(config.vocab_size), error)
        quantized = Counter(e[3].gguf_type for e in encoded if e[3].status != "float")
        if quantized:
            main = quantized.most_common(1)[0][0]
            writer.add_file_type(int(gguf.LlamaFileType[f"MOSTLY_{main}"]))
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for name, data, ggml_type, _ in encoded:
            writer.add_tensor(name, data, raw_dtype=ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(tmp, "rb+") as done:  # the data on disk before the rename
            os.fsync(done.fileno())
        replace_temp(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise
    fsync_directory(path.parent)
