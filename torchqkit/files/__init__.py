"""File utilities every layer may use (they sit below core/ in the layering): atomic writes and strict JSON."""
from .atomic_write import atomic_write_bytes
from .strict_json import parse_json

__all__ = ["atomic_write_bytes", "parse_json"]
