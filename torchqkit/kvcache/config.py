"""KVCacheConfig: how a QuantizedKVCache stores keys and values."""
from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["KVCacheConfig", "KV_DTYPES"]

KV_DTYPES = ("int8", "int4", "float8_e4m3fn", "float8_e5m2")


@dataclass(frozen=True)
class KVCacheConfig:
    """How a `QuantizedKVCache` stores the keys and values of each layer.

    Keys and values are stored as codes with one float16 scale (and, for the integer formats, one float16 zero point:
    asymmetric min / max ranges) per group of `group_size` elements: per token, a group runs along the head dim of
    one position; per channel (keys only: key outliers sit in fixed channels, KIVI's finding), a group is one channel
    over `group_size` consecutive positions. The newest positions stay in float32: the last `residual_length` ones,
    and with per-channel keys also those of a key block that is not full yet.

    Args:
        dtype (str): the code format: ``"int8"`` (default), ``"int4"`` (two codes per byte), ``"float8_e4m3fn"`` or
            ``"float8_e5m2"`` (scaled float8, no zero point).
        key_granularity (str): ``"token"`` (default) or ``"channel"``.
        value_granularity (str): ``"token"`` (the only choice: values are mixed per position by the attention
            weights, so their error is per token).
        group_size (int): elements per scale; default 64. Per token it must divide the model's head dim.
        value_group_size (int | None): elements per scale of the values, when they should differ from the keys'
            (e.g. per-channel int4 keys in blocks of 64 positions, values in per-token groups of 16); default None:
            `group_size`. It must divide the head dim.
        residual_length (int): newest positions kept in float32; default 0 (every full group quantized at once).

    Raises:
        ValueError: an unknown dtype or granularity, or a group size / residual length that is not a positive /
            non-negative int.

    Example:
        ```python
        import torchqkit as qk
        int8 = qk.KVCacheConfig("int8")
        kivi = qk.KVCacheConfig("int4", key_granularity="channel", group_size=64, residual_length=64)
        int4 = qk.KVCacheConfig("int4", key_granularity="channel", value_group_size=16)  # finer value groups
        ```
    """

    dtype: str = "int8"
    key_granularity: str = "token"
    value_granularity: str = "token"
    group_size: int = 64
    residual_length: int = 0
    value_group_size: int | None = None

    def __post_init__(self):
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KVCacheConfig: dtype {self.dtype!r} is not one of {', '.join(KV_DTYPES)}")
        if self.key_granularity not in ("token", "channel"):
            raise ValueError(f"KVCacheConfig: key_granularity {self.key_granularity!r} is not 'token' or 'channel'")
        if self.value_granularity != "token":
            raise ValueError(f"KVCacheConfig: value_granularity {self.value_granularity!r}: values are quantized per "
                             f"token only (value_granularity='token')")
        for name, low in (("group_size", 1), ("residual_length", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"KVCacheConfig: {name} must be an int >= {low}, got {value!r}")
        v = self.value_group_size
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"KVCacheConfig: value_group_size must be an int >= 1 or None (the keys' group_size), "
                             f"got {v!r}")

    @property
    def key_per_channel(self) -> bool:
        return self.key_granularity == "channel"

    @property
    def value_group(self) -> int:
        """Elements per scale of the values (`value_group_size`, else `group_size`)."""
        return self.group_size if self.value_group_size is None else self.value_group_size

    def to_dict(self) -> dict:
        return asdict(self)
