"""Every public name has a docstring the API reference can render: a summary, an Example, and (for
functions and classes that take arguments) an Args section naming every parameter (Google style, as griffe
parses it)."""
from __future__ import annotations

import dataclasses
import enum
import inspect
import re
import types

import pytest

import torchqkit as qk
from torchqkit import presets, qdtypes

# Not checked here, each with why.
_EXCLUDED = {
    "__version__": "a string, not documented by a docstring",
    "kernels": "torchqkit.kernels documents itself (its docstrings are kept with the kernels)",
}

_MODULE_FUNCTIONS = {
    "presets.names": presets.names, "presets.get": presets.get,
    "qdtypes.qdtype_from_name": qdtypes.qdtype_from_name, "qdtypes.all_qdtypes": qdtypes.all_qdtypes,
    "qdtypes.QDType": qdtypes.QDType, "qdtypes.QKind": qdtypes.QKind,
}


def _documented():
    objects = {name: getattr(qk, name) for name in qk.__all__ if name not in _EXCLUDED}
    return {**objects, **_MODULE_FUNCTIONS}


_OBJECTS = _documented()


def _own_doc(obj) -> str:
    """The object's own docstring: not one inherited from a base class (nn.Linear's, Exception's), and not the
    signature text dataclasses write when a class has none."""
    if isinstance(obj, type):
        doc = obj.__dict__.get("__doc__")
        if doc and dataclasses.is_dataclass(obj) and doc.startswith(obj.__name__ + "("):
            return ""
        return inspect.cleandoc(doc) if doc else ""
    return inspect.cleandoc(obj.__doc__ or "")


_SECTION = re.compile(r"^(\w[\w ]*):\s*$")


def _section(doc: str, *titles: str) -> list[str] | None:
    """The lines of the first section titled one of ``titles`` (without the title), or None if there is none."""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip() in {t + ":" for t in titles} and not line.startswith(" "):
            body = []
            for following in lines[i + 1:]:
                if following.strip() and not following.startswith(" "):
                    break
                body.append(following)
            return body
    return None


def _items(body: list[str]) -> list[str]:
    """The lines at the section's own indentation: one per item (continuation lines are indented further)."""
    indents = [len(line) - len(line.lstrip()) for line in body if line.strip()]
    return [line for line in body if line.strip() and len(line) - len(line.lstrip()) == min(indents)]


_ITEM = re.compile(r"\s*\*{0,2}(\w+)\s*(\([^)]*\))?\s*:")


def _documented_names(body: list[str]) -> set[str]:
    """Names at the section's own indentation: ``name (type): ...`` or ``name: ...``."""
    return {m.group(1) for m in map(_ITEM.match, _items(body)) if m}


def _parameters(obj) -> list[str]:
    """Parameter names of a function, or of a class's constructor, without self, *args and **kwargs."""
    if isinstance(obj, type):
        if issubclass(obj, enum.Enum) or issubclass(obj, BaseException):
            return []
        init = obj.__dict__.get("__init__") or next(
            (c.__dict__["__init__"] for c in obj.__mro__ if "__init__" in c.__dict__), None)
        if init is None or init is object.__init__:
            return []
        try:
            sig = inspect.signature(init)
        except (TypeError, ValueError):
            return []
    else:
        sig = inspect.signature(obj)
    return [p.name for p in sig.parameters.values()
            if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


@pytest.mark.parametrize("name", sorted(_OBJECTS))
def test_public_name_has_a_docstring_with_an_example(name):
    doc = _own_doc(_OBJECTS[name])
    assert doc, f"{name} has no docstring of its own"
    assert _section(doc, "Example", "Examples") is not None, f"{name}: no Example: section"
    assert all(len(line) <= 120 for line in doc.splitlines()), f"{name}: a docstring line is over 120 characters"


@pytest.mark.parametrize("name", sorted(n for n, o in _OBJECTS.items() if not isinstance(o, types.ModuleType)))
def test_every_parameter_is_documented(name):
    obj = _OBJECTS[name]
    doc = _own_doc(obj)
    params = _parameters(obj)
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        assert _section(doc, "Attributes") is not None, f"{name}: an enum lists its members under Attributes:"
        members = _documented_names(_section(doc, "Attributes"))
        missing = [m for m in obj.__members__ if m not in members]
        assert not missing, f"{name}: members not under Attributes: {missing}"
        return
    if not isinstance(obj, type):
        assert _section(doc, "Returns", "Yields") is not None, f"{name}: no Returns: section"
    if not params:
        return
    body = _section(doc, "Args", "Arguments", "Parameters")
    assert body is not None, f"{name} takes {params} but has no Args: section"
    missing = [p for p in params if p not in _documented_names(body)]
    assert not missing, f"{name}: parameters not in Args: {missing}"
    # a continuation line at the item's indentation would be read as an item of its own
    strays = [line.strip() for line in _items(body) if not _ITEM.match(line)]
    assert not strays, f"{name}: lines in Args that are not 'name (type): description' items: {strays}"


def test_the_exclusions_are_public_names():
    assert set(_EXCLUDED) <= set(qk.__all__)
