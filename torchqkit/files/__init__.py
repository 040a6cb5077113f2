"""File utilities every layer may use (they sit below core/ in the layering): atomic writes, checked opening of user files, strict JSON."""
from .atomic_write import atomic_write_bytes
from .open_checked import open_regular_file
from .strict_json import parse_json

__all__ = ["atomic_write_bytes", "open_regular_file", "parse_json"]
