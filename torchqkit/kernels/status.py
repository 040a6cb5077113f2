"""status(): one table of what serves every quantized linear and every custom op, and why. Rows come from the
layouts' declared routes (registered here by layouts/, above this package), from the C++ CPU kernels' own
descriptions (cpu_kernels.py), from the routes they measured (routes.py) and from the backend choice per device
(choice.py)."""
from __future__ import annotations

from . import loading
from .choice import choose_backend, usable_backends
from .cpu_kernels import cpu_backend
from .registry import OPS
from .routes import routes

__all__ = ["status", "format_status", "register_status_rows", "backend_status", "route_status"]

_STATUS_SOURCES: list = []  # callables returning status() rows, registered by the packages above (layouts/)


def register_status_rows(source) -> None:
    """Add ``source()`` (a list of rows: layout, linear, path, why) to what status() reports. layouts/ registers
    its routes here, so this package never imports the layouts above it."""
    _STATUS_SOURCES.append(source)


def backend_status(devices=("cpu", "cuda")) -> list[dict]:
    """One row per (op, device): what is registered and what KernelPreference.AUTO would use, and why."""
    rows = []
    for op in OPS:
        for dev in devices:
            backend, why = choose_backend(op, dev)
            rows.append({"layout": "(backend)", "linear": f"{op} on {dev}", "path": backend,
                         "why": f"usable: {', '.join(usable_backends(op, dev))}; {why}"})
    return rows


def status() -> list[dict]:
    """One row per (layout, linear case), then one per custom op: the path that serves it on CPU and why."""
    rows = [row for source in _STATUS_SOURCES for row in source()]
    for op in (loading.CPU_OPS if loading.CPU_EXTENSION_LOADED else tuple(OPS)):
        path, why = cpu_backend(op)
        rows.append({"layout": "(op)", "linear": op, "path": path, "why": why})
    rows += route_status()
    rows += backend_status()
    return rows


def route_status() -> list[dict]:
    """One row per case whose route the C++ CPU kernels measured (or loaded): the choice and the times."""
    rows = []
    for r in routes():
        times = ", ".join(f"{name} {us / 1000:.3g} ms" for name, us in r["median_us"].items())
        why = (f"loaded from a route table (kernels.load_routes)" if r["loaded"] else
               f"measured at the first call: {times} (median); unmeasured it takes {r['rule']}")
        rows.append({"layout": "(route)", "path": f"{r['site']}: {r['choice']}", "why": why,
                     "linear": f"{r['op']} {r['isa']} {r['dtype']} M {r['m']} N {r['n']} K {r['k']} "
                               f"threads {r['threads']}"})
    return rows


def format_status() -> str:
    rows = status()
    if not rows:
        return "no layouts registered"
    keys = ["layout", "linear", "path", "why"]
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in keys}
    lines = ["  ".join(k.ljust(widths[k]) for k in keys)]
    lines += ["  ".join(str(r[k]).ljust(widths[k]) for k in keys) for r in rows]
    return "\n".join(lines)
