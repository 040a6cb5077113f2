"""`python -m torchqkit export SOURCE --gguf OUT.gguf [--requantize]`: write a model in another format.

SOURCE is a torchqkit checkpoint directory (what ``save_pretrained`` writes) or a ``.gguf`` file. The targets are
one mutually exclusive group: each is an entry of ``TARGETS`` (its flag, help text and the function that writes
it), so a new format is one more entry.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["add_export_parser", "ExportTarget", "TARGETS"]


@dataclass(frozen=True)
class ExportTarget:
    flag: str                                    # "--gguf"
    metavar: str
    help: str
    write: Callable[[object, Path, argparse.Namespace], object]  # (model, destination, args) -> printable report


def _write_gguf(model, destination: Path, args: argparse.Namespace):
    import torchqkit
    return torchqkit.save_gguf(model, destination, _tokenizer(args), requantize=args.requantize,
                               progress=False if args.quiet else None)


def _tokenizer(args: argparse.Namespace):
    """--tokenizer: a .gguf file to copy it from, or a transformers tokenizer folder; else the SOURCE's own."""
    where = args.tokenizer
    if where is None:
        source = Path(args.source)
        if source.is_dir() and any((source / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
            where = source
        else:
            return None  # a model read from a .gguf carries its file's tokenizer
    if Path(where).suffix == ".gguf":
        return Path(where)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(where))


TARGETS = (
    ExportTarget("--gguf", "OUT.gguf", "a llama.cpp GGUF file: quantized weights in the GGUF block type that holds "
                                       "them exactly (torchqkit.save_gguf)", _write_gguf),
)


def _load(source: str):
    import torchqkit
    path = Path(source)
    if path.is_dir():
        return torchqkit.from_pretrained(path, progress=False)
    if path.suffix == ".gguf":
        return torchqkit.from_gguf(path, progress=False)
    raise ValueError(f"{source}: SOURCE must be a torchqkit checkpoint directory (save_pretrained) or a .gguf file")


def _run_export(args: argparse.Namespace) -> int:
    """Exit 0: written; 1: the model has weights the target can't hold (nothing written); 2: the source, the
    destination or the tokenizer can't be used."""
    import torchqkit
    target = next(t for t in TARGETS if getattr(args, _dest(t)) is not None)
    destination = Path(getattr(args, _dest(target)))
    try:
        model = _load(args.source)
        report = target.write(model, destination, args)
    except torchqkit.GGUFError as err:
        return _error(str(err), 1 if "no exact GGUF type" in str(err) else 2)
    except OSError as err:
        return _error(f"{err.filename or destination}: {err.strerror or err}", 2)
    except ValueError as err:  # CheckpointError and other refusals of the input
        return _error(str(err), 2)
    print(report)
    return 0


def _dest(target: ExportTarget) -> str:
    return target.flag.lstrip("-").replace("-", "_")


def _error(message: str, code: int) -> int:
    print(f"python -m torchqkit export: error: {' '.join(message.split())}", file=sys.stderr)
    return code


def add_export_parser(commands) -> None:
    parser = commands.add_parser(
        "export", help="write a torchqkit checkpoint or a GGUF file in another format (GGUF for llama.cpp)",
        description="Exit status: 0 written; 1 a weight has no exact form in the target (nothing written; see "
                    "--requantize); 2 the source, destination or tokenizer can't be used.")
    parser.add_argument("source", help="a torchqkit checkpoint directory (save_pretrained) or a .gguf file")
    targets = parser.add_mutually_exclusive_group(required=True)
    for t in TARGETS:
        targets.add_argument(t.flag, metavar=t.metavar, help=t.help)
    parser.add_argument("--requantize", action="store_true",
                        help="re-round weights the target can't hold exactly to its nearest type (the report says "
                             "which) instead of failing")
    parser.add_argument("--tokenizer", metavar="PATH", default=None,
                        help="GGUF: a .gguf file to copy the tokenizer from, or a transformers tokenizer folder "
                             "(default: the SOURCE's own)")
    parser.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    parser.set_defaults(run=_run_export)
