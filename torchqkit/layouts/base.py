"""Layout: how one AffineQuantizedTensor stores its codes and scales, and which ops it serves.

A layout is one file with a frozen dataclass (its knobs), ``supports`` (why it can't take a tensor,
or None), ``pack`` / ``unpack`` to and from the plain form (unpacked codes of the logical shape,
scale and zero point of the oracle's shapes), ``packed_specs`` (the shapes and dtypes ``pack`` stores, which
checkpoint loaders check files against), its ``routes`` (which op serves each linear case: routes.py), its
other op entries (slice), and ``@register_layout``.
Its packed bytes are device-independent: the same on CPU and CUDA.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F

from ..core.primitives import ZeroPointDomain, num_blocks, padded_shape
from .op_table import OpTable
from .routes import Route, quantized_linear
from .slicing import slice_quantized

__all__ = ["Layout", "WeightFormat", "PlainParts", "PackedSpec", "scale_specs", "register_layout", "layout_class", "all_layouts",
           "pad_features", "crop_features", "kernel_reach_problem"]


class PlainParts(NamedTuple):
    """The oracle's form: codes with the logical shape, scale/zero_point with shape // block_size, and for a layout
    that stores only some entries (NMSparseLayout) ``mask``: bool, the logical shape, True where an entry is stored.
    ``dequantize`` gives exactly 0 where ``mask`` is False (Note [Pruned entries read as zero], layouts/nm_sparse.py);
    a mask handed to ``pack`` says which entries to keep."""
    qdata: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    mask: torch.Tensor | None = None


class WeightFormat(NamedTuple):
    """What a layout is asked to store: the values ``supports``, ``packed_specs``, ``slice_multiple`` and ``pack``
    all read (``AffineQuantizedTensor.weight_format`` gives a tensor's). ``shape`` is the logical (unpadded) shape."""
    qdtype: object                      # core.qdtype.QDType
    block_size: tuple[int, ...]
    shape: tuple[int, ...]
    zero_point_domain: ZeroPointDomain

    @classmethod
    def of(cls, qdtype, block_size, shape, zero_point_domain) -> "WeightFormat":
        return cls(qdtype, tuple(int(b) for b in block_size), tuple(int(s) for s in shape),
                   ZeroPointDomain(zero_point_domain))


class PackedSpec(NamedTuple):
    """What one stored inner tensor must look like (see ``Layout.packed_specs``)."""
    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]


FLOAT32_MAX = torch.finfo(torch.float32).max


def kernel_reach_problem(layout, reach: float, what: str) -> str | None:
    """kernel_range_problem's message when ``reach`` (a bound on a kernel's float32 intermediate) passes float32."""
    if reach <= FLOAT32_MAX:
        return None
    return (f"{type(layout).__name__}'s kernels {what}; for this weight that reaches {reach:.3g}, past float32's "
            f"largest value ({FLOAT32_MAX:.3g}), so outputs would be inf. The weight's values are too large for this "
            f"layout: scale them down, use another layout (e.g. PlainLayout()), or leave this module out "
            f"(ModuleConfigs({{'<module name>': None, ...}}) keeps it in float).")


# Scales, float zero points: whatever float dtype quantization chose.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Integer-domain zero points: the code's storage dtype by default, wider on request.
INT_ZERO_POINT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32)


def scale_specs(shape, block_size, zero_point_domain, scale_dtypes=FLOAT_DTYPES) -> dict[str, PackedSpec]:
    """scale (and zero_point unless ZeroPointDomain.NONE) of the oracle's shape: ceil(shape / block_size)."""
    blocks = num_blocks(shape, block_size)
    specs = {"scale": PackedSpec(blocks, scale_dtypes)}
    zpd = ZeroPointDomain(zero_point_domain)
    if zpd is not ZeroPointDomain.NONE:
        specs["zero_point"] = PackedSpec(blocks, INT_ZERO_POINT_DTYPES if zpd is ZeroPointDomain.INT else FLOAT_DTYPES)
    return specs


def pad_features(x: torch.Tensor, stored_k: int) -> torch.Tensor:
    """``x`` (..., K) with zero features appended up to the stored (block-padded) K a kernel reads.

    A layout that pads K to whole groups (Note [Partial blocks], core/primitives.py) hands its kernels the
    padded codes; zero activations there make the padding contribute exactly nothing (padded codes are finite),
    so every backend computes the logical product without knowing about the padding. Costs one copy of x,
    only for weights whose in_features the group size doesn't divide."""
    k = x.shape[-1]
    return x if k == stored_k else F.pad(x, (0, stored_k - k))


def crop_features(y: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` output features of a kernel that ran on block-padded rows (float8 128 x 128 blocks)."""
    return y if y.shape[-1] == n else y[..., :n]


_LAYOUTS: dict[str, type["Layout"]] = {}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Base class of the storage layouts: how a quantized weight's codes, scales and zero points are packed.

    A layout is a frozen dataclass of its knobs, registered under a name (``"plain"``, ``"tensor_core_tiled"``,
    ``"packed_intx"``, ``"nf4"``, ``"float8"``, ``"mx"``) that configs accept in place of an instance. It says
    which weights it can store (``supports(fmt)`` returns why not, or None), packs the oracle's plain codes
    (``pack``) and unpacks them (``unpack``), and owns the op table and kernel routes of the tensors stored in it.
    ``to_dict()`` / ``Layout.from_dict(d)`` round-trip an instance through ``{"type": name, ...knobs}``. Pass one as
    a config's ``layout=`` or to ``quantize_weight``; subclass it (with ``@register_layout(name)``) to add a format.

    Example:
        ```python
        import torchqkit as qk
        layout = qk.PlainLayout()
        assert isinstance(layout, qk.Layout) and layout.name == "plain"
        d = qk.TensorCoreTiledLayout(inner_k_tiles=8).to_dict()   # {"type": "tensor_core_tiled", "inner_k_tiles": 8}
        assert qk.Layout.from_dict(d) == qk.TensorCoreTiledLayout(inner_k_tiles=8)
        ```
    """
    name: ClassVar[str] = ""
    ops: ClassVar[OpTable]
    # Names of the inner tensors this layout stores on the AffineQuantizedTensor; a layout may leave
    # an optional one (e.g. zero_point) as None.
    tensor_names: ClassVar[tuple[str, ...]] = ()
    # True when, for block_size[0] == 1, every inner tensor holds one row per weight row along dim 0 (codes,
    # scales, zero points), so any set of rows is an index_select of each: see ``gather_rows``.
    row_major: ClassVar[bool] = False
    # The cases its linear serves with a kernel, most specific first (routes.py); anything else: the reference.
    routes: ClassVar[tuple[Route, ...]] = ()
    # How its scales are rounded when a weight is quantized again in place (tensor/merge.py): None, or
    # "power_of_two" for a layout that stores only exponents.
    scale_rounding: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.ops = OpTable(cls.__name__)  # each layout its own table; never inherited
        cls.ops.implements(F.linear)(quantized_linear)  # one linear for every layout, driven by its routes
        cls.ops.implements(torch.ops.aten.slice.Tensor)(slice_quantized)  # one slice, cut by each layout's narrow

    def supports(self, fmt: WeightFormat) -> str | None:
        """Why this layout can't store such a tensor, or None if it can."""
        return None

    def kernel_range_problem(self, parts: PlainParts, fmt: WeightFormat, act_quant) -> str | None:
        """Why this layout's kernels could overflow float32 on these qparams for inputs of magnitude up to 1 where
        F.linear on the dequantized weight would not (an intermediate wider than the weight: a code offset, codes of
        an int8 activation before its scale), or None. Default: no such intermediate. See Note [Finite range] in
        core/primitives.py for the weight's own range."""
        return None

    def for_weight(self, fmt: WeightFormat) -> "Layout":
        """The layout a weight of this format is stored in: ``self``, or (a layout with knobs it picks per weight,
        e.g. TensorCoreTiledLayout's inner_k_tiles=None) a copy with them chosen. Whatever packs a weight packs it
        with this, and the quantized tensor records it."""
        return self

    def symmetric_2d_problem(self, fmt: WeightFormat, why_no_zero_point: str, block_k: int | None = None) -> str | None:
        """The checks supports() shares for codebook and float layouts: no zero point, a 2-d weight, and (when
        ``block_k`` is given) blocks of (1, block_k) along K."""
        name = type(self).__name__
        if ZeroPointDomain(fmt.zero_point_domain) is not ZeroPointDomain.NONE:
            return f"{name} stores {why_no_zero_point}: no zero point"
        if len(fmt.shape) != 2:
            return f"{name} stores 2-d (out_features, in_features) weights, got shape {tuple(fmt.shape)}"
        if block_k is not None and tuple(fmt.block_size) != (1, block_k):
            return (f"{self!r} needs blocks of (1, {block_k}) along K, got block_size {tuple(fmt.block_size)} for "
                    f"shape {tuple(fmt.shape)}")
        return None

    def slice_multiple(self, fmt: WeightFormat, dim: int) -> int:
        """Slices along ``dim`` (of the stored, untransposed shape) must start and end at multiples of this;
        an end at the dim's size is always allowed. Default: whole blocks, or 1 when the dim is a single
        block (which then shrinks with the slice). A layout that stores tiles or packed bytes returns a
        multiple of the block size that also cuts whole tiles / bytes, so every slice can alias storage."""
        block_size, shape = fmt.block_size, fmt.shape
        return 1 if block_size[dim] == shape[dim] else block_size[dim]

    def narrow(self, aqt, cut) -> tuple[dict, "Layout"]:
        """(inner tensors, layout) of the slice ``cut`` (a slicing.BlockSlice, already checked) of ``aqt``.
        Default: ``qdata`` narrowed by stored elements, every other tensor (scales, zero points) by blocks.
        A layout that packs codes or scales differently overrides this."""
        tensors = {name: (None if t is None else t.narrow(cut.dim, *(cut.stored if name == "qdata" else cut.blocks)))
                   for name, t in aqt.inner_tensors().items() if name in self.tensor_names}
        return tensors, self

    def stored_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """The scale ``unpack`` returns for a tensor whose oracle scale was ``scale``. Default: ``scale`` itself
        (stored exactly); a layout that stores scales lossily (NF4 double quantization) returns what it keeps."""
        return scale

    def gather_rows(self, aqt, rows: torch.Tensor) -> dict[str, torch.Tensor | None] | None:
        """The inner tensors of a weight made of rows ``rows`` (1-d int64, in order) of ``aqt``, or None when the
        layout can't pick rows independently (tiles of several rows, scales shared across rows). An embedding
        lookup uses it to dequantize exactly the rows it reads."""
        n = aqt.logical_shape[0]
        tensors = aqt.inner_tensors()
        if (not self.row_major or aqt.transposed or aqt.block_size[0] != 1
                or any(t is not None and (t.dim() == 0 or t.shape[0] != n) for t in tensors.values())):
            return None
        return {name: None if t is None else t.index_select(0, rows) for name, t in tensors.items()}

    def packed_specs(self, fmt: WeightFormat) -> dict[str, "PackedSpec"]:
        """Shape and allowed dtypes of every inner tensor ``pack`` stores (None ones left out) for a weight of
        logical ``shape``. Loaders check files against it, so a header can't lie about shapes. Default: one code per
        element in the qdtype's storage dtype, block-padded (Note [Partial blocks]), and the oracle's scale (and
        zero point); a layout that packs codes or scales differently overrides this."""
        qdtype, block_size, shape, zero_point_domain = fmt
        return {"qdata": PackedSpec(padded_shape(shape, block_size), (qdtype.storage_dtype,)),
                **scale_specs(shape, block_size, zero_point_domain)}

    def pack(self, parts: PlainParts, fmt: WeightFormat) -> dict[str, torch.Tensor | None]:
        raise NotImplementedError

    def unpack(self, aqt) -> PlainParts:
        raise NotImplementedError

    def to_dict(self) -> dict:
        return {"type": self.name, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}

    @staticmethod
    def from_dict(d: dict) -> "Layout":
        d = dict(d)
        cls = layout_class(d.pop("type"))
        return cls(**d)


def register_layout(name: str):
    def deco(cls):
        if name in _LAYOUTS:
            raise RuntimeError(f"layout name {name!r} registered twice")
        cls.name = name
        _LAYOUTS[name] = cls
        return cls
    return deco


def layout_class(name: str) -> type[Layout]:
    try:
        return _LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown layout {name!r}; known layouts: {sorted(_LAYOUTS)}") from None


def all_layouts() -> list[type[Layout]]:
    return list(_LAYOUTS.values())
