"""The kernel routes chosen by measurement (Note [Routes chosen by measurement] in csrc/cpu/route_choice.cpp): what
each case took and the times that decided it, and a file that keeps them across processes.

Where an op has more than one exact route for a case (the float32 prefill's own fp32 panels or ATen's sgemm on
dequantized rows, the int4 decode's float32, int16-pair or bf16 kernel), the C++ CPU extension times each route the
first time the case runs and keeps the fastest for the process. ``routes()`` lists those choices; ``save_routes`` /
``load_routes`` keep them in a JSON file keyed by the CPU model and the torch, torchqkit and extension versions, so a
later process skips the measuring; a file written under any other key is not loaded. With
``TORCHQKIT_CPU_ROUTE_CACHE=<file>`` the table is loaded when torchqkit is imported and written back at exit.
``TORCHQKIT_CPU_ROUTES=rules`` turns the measuring off; ``TORCHQKIT_CPU_FP32_PREFILL=panels|sgemm`` and
``TORCHQKIT_CPU_INT4_DECODE=float|int16|bf16`` pin a choice wherever it can serve.
"""
from __future__ import annotations

import atexit
import hashlib
import importlib.util
import json
import os
import platform
import tempfile
import warnings

import torch

from . import loading

__all__ = ["routes", "clear_routes", "save_routes", "load_routes", "route_cache_key"]

CACHE_VARIABLE = "TORCHQKIT_CPU_ROUTE_CACHE"


def _extension_loaded() -> bool:
    return loading.CPU_EXTENSION_LOADED and hasattr(torch.ops.torchqkit_cpu, "routes")


def routes() -> list[dict]:
    """The routes the C++ CPU kernels chose so far in this process, one dict per case.

    Returns:
        list[dict]: per case ``op``, ``isa``, ``dtype``, ``m`` (the class of rows: "1", "2-3", "4-7", ...), ``n``,
        ``k``, ``extra`` (group size or format), ``threads``, ``bf16_precision``, the ``site`` of the choice
        (``"fp32_prefill"`` or ``"int4_decode"``), the ``choice`` kept, the ``rule`` (what it takes unmeasured),
        ``median_us`` per route timed, ``loaded`` (True when it came from ``load_routes``) and ``key``.
        Empty without the C++ CPU extension.

    Example:
        >>> import torch, torchqkit as qk
        >>> model = torch.nn.Sequential(torch.nn.Linear(256, 256))
        >>> _ = qk.quantize_(model, qk.Int4WeightOnlyConfig(group_size=32))
        >>> _ = model(torch.randn(1, 256))
        >>> [(r["site"], r["choice"]) for r in qk.kernels.routes()]  # doctest: +SKIP
        [('int4_decode', 'int16')]
    """
    if not _extension_loaded():
        return []
    return sorted(json.loads(torch.ops.torchqkit_cpu.routes()), key=lambda r: r["key"])


def clear_routes() -> None:
    """Forget every route chosen or loaded: the next call of each case measures again."""
    if _extension_loaded():
        torch.ops.torchqkit_cpu.clear_routes()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _extension_digest() -> str:
    """A digest of the loaded C++ CPU extension's file: a rebuild changes its kernels' speed."""
    origin = importlib.util.find_spec("torchqkit._C_cpu").origin
    with open(origin, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def route_cache_key() -> dict:
    """What a saved route table is valid for: the CPU model, torch's and torchqkit's versions, and a digest of the
    C++ CPU extension. ``load_routes`` refuses a file whose key differs in any of them."""
    from ..version import __version__
    return {"cpu": _cpu_model(), "torch": torch.__version__, "torchqkit": __version__,
            "extension": _extension_digest() if _extension_loaded() else None}


def save_routes(path: str | os.PathLike) -> int:
    """Write the routes measured in this process (``routes()``) to ``path`` as JSON, with ``route_cache_key()``.

    The file is written next to its destination first and then moved over it, so a failure leaves any earlier file
    as it was. Routes loaded from a file are written again; cases measured in both keep this process's choice.

    Args:
        path (str | os.PathLike): the JSON file to write.

    Returns:
        int: the number of cases written.

    Example:
        >>> import torchqkit as qk
        >>> qk.kernels.save_routes("routes.json")  # doctest: +SKIP
        3
    """
    table = routes()
    document = {"key": route_cache_key(), "routes": [{"key": r["key"], "site": r["site"], "choice": r["choice"],
                                                      "median_us": r["median_us"]} for r in table]}
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".routes-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(document, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return len(table)


def load_routes(path: str | os.PathLike) -> int:
    """Take the routes saved by ``save_routes`` in ``path``, if the file was written under this process's
    ``route_cache_key()``; the cases it holds then run their saved route without measuring.

    Args:
        path (str | os.PathLike): a file written by ``save_routes``.

    Returns:
        int: the number of cases loaded; 0 (with a warning naming what differs) when the file's key is not this
        process's: another CPU model, torch, torchqkit or extension build.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a route table (names the file and what is missing).

    Example:
        >>> import torchqkit as qk
        >>> qk.kernels.load_routes("routes.json")  # doctest: +SKIP
        3
    """
    path = os.fspath(path)
    with open(path) as f:
        try:
            document = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not a route table written by torchqkit.kernels.save_routes: {e}") from e
    if not isinstance(document, dict) or not {"key", "routes"} <= document.keys():
        raise ValueError(f"{path} is not a route table written by torchqkit.kernels.save_routes: it needs 'key' and "
                         f"'routes' at the top level")
    if not _extension_loaded():
        warnings.warn(f"torchqkit.kernels.load_routes({path!r}): the C++ CPU extension is not loaded "
                      f"({loading.CPU_EXTENSION_REASON}); nothing to route", stacklevel=2)
        return 0
    mine = route_cache_key()
    differs = [f"{name}: file {document['key'].get(name)!r}, here {mine[name]!r}" for name in mine
               if document["key"].get(name) != mine[name]]
    if differs:
        warnings.warn(f"torchqkit.kernels.load_routes({path!r}): not loaded, the table was measured under another key "
                      f"({'; '.join(differs)}); the cases will be measured again", stacklevel=2)
        return 0
    try:
        lines = "".join(f"{r['key']}\t{r['site']}\t{r['choice']}\n" for r in document["routes"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: every route needs 'key', 'site' and 'choice' ({e!r})") from e
    return int(torch.ops.torchqkit_cpu.add_routes(lines))


def _use_cache_file() -> None:
    """TORCHQKIT_CPU_ROUTE_CACHE: load the file now if it exists, write the table back at exit."""
    path = os.environ.get(CACHE_VARIABLE)
    if not path or not _extension_loaded():
        return
    if os.path.exists(path):
        try:
            load_routes(path)
        except (OSError, ValueError) as e:
            warnings.warn(f"{CACHE_VARIABLE}={path}: not loaded ({e}); the cases will be measured again", stacklevel=2)

    def write_back():
        try:
            save_routes(path)
        except OSError as e:
            warnings.warn(f"{CACHE_VARIABLE}={path}: could not write the route table ({e})", stacklevel=1)
    atexit.register(write_back)


_use_cache_file()
