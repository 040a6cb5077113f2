"""What from_gguf checks in a GGUF file before it builds a model or decodes a tensor.

Note [Checked GGUF files]
~~~~~~~~~~~~~~~~~~~~~~~~~
A GGUF file is a header (metadata, then one info record per tensor: name, dims, type, offset) and a data
section. gguf-py trusts the records: two tensors may point at the same bytes, a type may claim more bytes than
the gap to the next tensor, and an absurd ``block_count`` or head count reaches transformers, which hangs
building a billion layers or divides by zero. from_gguf checks, in this order, and raises one GGUFError naming
the file and the tensor or metadata key:
  1. tensor records (``check_tensor_ranges``, before gguf-py builds a single tensor view): a known type, whole
     blocks, data inside the data section, offsets aligned to ``general.alignment``, no two tensors overlapping
     (llama.cpp's own reader requires the same);
  2. hyperparameters (``check_hyperparameters``, before the model is built): each a number of the right kind and
     range, and consistent with the tensors present (layer count, widths, head counts and head size);
  3. values (in gguf.py, as each tensor is decoded): block scales and mins finite, by the check load_quantized runs
     on torchqkit checkpoints (AffineQuantizedTensor.qparams_problem).
"""
from __future__ import annotations

import math
import re


__all__ = ["check_tensor_ranges", "check_hyperparameters", "MAX_LAYERS"]

MAX_LAYERS = 4096          # far above any released model (hundreds of layers); a bound, so a bad count fails fast
MAX_POSITIONS = 1 << 31
MAX_EXPERTS = 1 << 16      # released MoE models have up to a few hundred experts per layer


def check_tensor_ranges(gguf, fields, data_start: int, alignment: int, file_size: int, path, error) -> None:
    """Every tensor info record (gguf-py's ReaderFields) describes whole blocks of a known type lying inside the
    data section (``data_start`` .. ``file_size``), aligned, and overlapping no other tensor."""
    spans = []
    for field in fields:
        _, name_data, _, dims, raw_type, offset = field.parts
        name = bytes(name_data).decode("utf-8", errors="replace")[:200]
        where = f"{path}: tensor {name!r}"
        try:
            ggml_type = gguf.GGMLQuantizationType(int(raw_type[0]))
            block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise error(f"{where}: unknown GGML type {int(raw_type[0])}; the file is corrupt or newer than the "
                        f"installed gguf package understands") from None
        ne = [int(d) for d in dims]
        if not ne or any(d < 1 for d in ne):
            raise error(f"{where}: dims {ne} must all be positive")
        if ne[0] % block:
            raise error(f"{where}: {ggml_type.name} stores blocks of {block} along the first dim, which is {ne[0]}")
        n_bytes = math.prod(ne) // block * type_size
        begin = data_start + int(offset[0])
        end = begin + n_bytes
        if int(offset[0]) % alignment:
            raise error(f"{where}: data offset {int(offset[0])} is not a multiple of the file's alignment {alignment}")
        if end > file_size:
            raise error(f"{where}: its {n_bytes} bytes of {ggml_type.name} data ({begin}..{end}) run past the end "
                        f"of the file ({file_size} bytes): the file is truncated or its tensor records are wrong")
        spans.append((begin, end, name))
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise error(f"{path}: tensors {n0!r} ({b0}..{e0}) and {n1!r} ({b1}..{e1}) overlap: each tensor's "
                        f"data must have bytes of its own")


def _number(value, key, path, error, *, kind=int, low=None, high=None):
    ok = (isinstance(value, int) and not isinstance(value, bool)) if kind is int else (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))
    if not ok:
        raise error(f"{path}: metadata {key} = {str(value)[:60]}: must be a finite {kind.__name__}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise error(f"{path}: metadata {key} = {value}: must be {bounds}")
    return value


def check_hyperparameters(field, tensors: dict[str, tuple[int, ...]], arch: str, path, error) -> None:
    """The hyperparameters transformers builds the model from, against the tensors present (``tensors``: GGUF
    name -> shape in PyTorch order, (rows, K) for a matrix). ``field(key)`` reads one metadata value or None."""
    def need(key, **kw):
        value = field(f"{arch}.{key}")
        if value is None:
            raise error(f"{path}: metadata {arch}.{key} is missing; transformers needs it to build the model")
        return _number(value, f"{arch}.{key}", path, error, **kw)

    def shape(name, key):
        if name not in tensors:
            raise error(f"{path}: no tensor {name!r} to check metadata {arch}.{key} against: the file is not a "
                        f"complete {arch} model")
        return tensors[name]

    layers = need("block_count", low=1, high=MAX_LAYERS)
    present = sorted({int(m.group(1)) for n in tensors if (m := re.match(r"blk\.(\d+)\.", n))})
    if present != list(range(layers)):
        got = f"layers {present[0]}..{present[-1]} ({len(present)} of them)" if present else "no layer tensors"
        raise error(f"{path}: metadata {arch}.block_count = {layers}, but the file has tensors for {got}")
    hidden = need("embedding_length", low=1)
    embed = shape("token_embd.weight", "embedding_length")
    if embed[-1] != hidden:
        raise error(f"{path}: metadata {arch}.embedding_length = {hidden}, but token_embd.weight is {list(embed)}")
    vocab = field(f"{arch}.vocab_size")
    if vocab is not None and _number(vocab, f"{arch}.vocab_size", path, error, low=1) != embed[0]:
        raise error(f"{path}: metadata {arch}.vocab_size = {vocab}, but token_embd.weight has {embed[0]} rows")
    if "blk.0.ffn_up_exps.weight" in tensors or arch == "qwen3moe":
        _check_experts(need, shape, arch, path, error)
    else:
        ffn = need("feed_forward_length", low=1)
        up = shape("blk.0.ffn_up.weight", "feed_forward_length")
        if up[0] != ffn:
            raise error(f"{path}: metadata {arch}.feed_forward_length = {ffn}, but blk.0.ffn_up.weight is {list(up)}")
    heads = need("attention.head_count", low=1, high=hidden)
    kv_heads = field(f"{arch}.attention.head_count_kv")
    kv_heads = heads if kv_heads is None else _number(kv_heads, f"{arch}.attention.head_count_kv", path, error,
                                                      low=1, high=heads)
    if heads % kv_heads:
        raise error(f"{path}: metadata {arch}.attention.head_count = {heads} is not a multiple of "
                    f"{arch}.attention.head_count_kv = {kv_heads} (each KV head serves a whole group of query heads)")
    q, k = shape("blk.0.attn_q.weight", "attention.head_count"), shape("blk.0.attn_k.weight", "attention.head_count")
    head_dim = field(f"{arch}.rope.dimension_count") if arch != "qwen2" else None
    if head_dim is None:  # llama.cpp's converter writes the head size of Qwen3 models as key_length
        head_dim = field(f"{arch}.attention.key_length")
    if head_dim is None:
        if hidden % heads:
            raise error(f"{path}: metadata {arch}.embedding_length = {hidden} is not a multiple of "
                        f"{arch}.attention.head_count = {heads}, and no {arch}.rope.dimension_count gives the head size")
        head_dim = hidden // heads
    else:
        _number(head_dim, f"{arch}.rope.dimension_count", path, error, low=2)
    if q[0] != heads * head_dim or k[0] != kv_heads * head_dim:
        raise error(f"{path}: metadata says {heads} query and {kv_heads} KV heads of {head_dim}, but "
                    f"blk.0.attn_q.weight is {list(q)} and blk.0.attn_k.weight {list(k)}")
    if field(f"{arch}.context_length") is not None:
        _number(field(f"{arch}.context_length"), f"{arch}.context_length", path, error, low=1, high=MAX_POSITIONS)
    for key, low, high in (("attention.layer_norm_rms_epsilon", 0.0, 1.0), ("rope.freq_base", 1e-9, None)):
        value = field(f"{arch}.{key}")
        if value is not None:
            _number(value, f"{arch}.{key}", path, error, kind=float, low=low, high=high)



def _check_experts(need, shape, arch, path, error) -> None:
    """A MoE file (Note [GGUF expert tensors]): expert count, experts per token and expert width against
    blk.0.ffn_up_exps (E, I, H)."""
    experts = need("expert_count", low=1, high=MAX_EXPERTS)
    need("expert_used_count", low=1, high=experts)
    width_key = "expert_feed_forward_length" if arch == "qwen3moe" else "feed_forward_length"
    width = need(width_key, low=1)
    up = shape("blk.0.ffn_up_exps.weight", width_key)
    if len(up) != 3 or up[0] != experts or up[1] != width:
        raise error(f"{path}: metadata {arch}.expert_count = {experts} and {arch}.{width_key} = {width}, but "
                    f"blk.0.ffn_up_exps.weight is {list(up)} (experts, width, hidden)")
