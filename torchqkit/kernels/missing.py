"""The warning that the C++ CPU kernels this CPU should have are missing; see Note [Missing CPU kernels] in
cpu_build.py."""
from __future__ import annotations

import os
import warnings

from .cpu_build import REBUILD, SILENCE_ENV, cpu_has_kernels

__all__ = ["KernelsMissingWarning", "missing_kernels_note", "warn_missing_kernels", "missing_kernels_warned"]


class KernelsMissingWarning(UserWarning):
    """Warned once at ``import torchqkit`` when the C++ CPU kernels are not loaded on a CPU they are built for.

    Every quantized op then runs its pure-PyTorch reference, many times slower; the message gives the reason (the
    build failed, was skipped, or doesn't match this torch) and the command that rebuilds the kernels. Set
    ``TORCHQKIT_NO_KERNELS_WARNING=1`` to run that way without the warning.

    Example:
        ```python
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error", category=UserWarning)
            try:
                import torchqkit as qk
            except UserWarning as w:   # qk.KernelsMissingWarning: rebuild before measuring anything
                print(w)
        ```
    """


def missing_kernels_note(loaded: bool, reason: str, record: dict | None) -> str | None:
    """The warning's text, or None when nothing is missing or the absence was asked for. ``reason``: why the
    loader has no extension; ``record``: setup.py's build record (cpu_build.read_record), if any."""
    if loaded or not cpu_has_kernels():
        return None
    asked = (os.environ.get(SILENCE_ENV) == "1" or os.environ.get("TORCHQKIT_DISABLE_CPU_EXTENSION") == "1"
             or os.environ.get("TORCHQKIT_BUILD_CPU") == "0" or (record is not None and record["deliberate"]))
    if asked:
        return None
    return (f"torchqkit: the C++ CPU kernels are not loaded, so every quantized op runs its slow pure-PyTorch "
            f"reference: {reason}. Rebuild them with {REBUILD}; or set {SILENCE_ENV}=1 to run on the references "
            f"without this warning.")


_WARNED: list[bool] = []  # [whether the warning got past the warning filters], once it was issued


def warn_missing_kernels(note: str | None) -> None:
    """Issue KernelsMissingWarning once per process. Whether the filters let it through is kept, so the CLI
    prints the note itself only when Python didn't show it."""
    if note is None or _WARNED:
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn(note, KernelsMissingWarning, stacklevel=2)
    _WARNED.append(bool(caught))
    for w in caught:  # through the filters: show it as Python would have
        warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)


def missing_kernels_warned() -> bool:
    """Whether KernelsMissingWarning was issued and shown in this process."""
    return bool(_WARNED and _WARNED[0])
