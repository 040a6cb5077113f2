"""``python -m torchqkit export SOURCE --gguf OUT.gguf | --compressed-tensors DIR``: one subcommand, one target per
run. The targets are one mutually exclusive group built from ``TARGETS``: each entry is a flag, its help and the
function that runs it, so a new format is one more entry."""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..integrations.compressed_tensors_export import run_compressed_tensors_export

__all__ = ["add_export_parser", "ExportTarget", "TARGETS"]


@dataclass(frozen=True)
class ExportTarget:
    flag: str                                   # "--gguf"; the parsed value is args.<flag without dashes>
    metavar: str
    help: str
    run: Callable[[argparse.Namespace], int]    # the exit status


def _run_compressed_tensors(args: argparse.Namespace) -> int:
    return run_compressed_tensors_export(args.source, args.compressed_tensors)


def _run_gguf(args: argparse.Namespace) -> int:
    """Exit 0: written; 1: a weight has no exact GGUF type (nothing written); 2: the source, the destination or the
    tokenizer can't be used. Errors are one line on stderr."""
    import torchqkit
    try:
        source = Path(args.source)
        if source.is_dir():
            model = torchqkit.from_pretrained(source, progress=False)
        elif source.suffix == ".gguf":
            model = torchqkit.from_gguf(source, progress=False)
        else:
            return _error(f"{source}: SOURCE must be a checkpoint directory (save_pretrained) or a .gguf file", 2)
        report = torchqkit.save_gguf(model, args.gguf, _tokenizer(args), requantize=args.requantize,
                                     progress=False if args.quiet else None)
    except torchqkit.GGUFError as err:
        return _error(str(err), 1 if "no exact GGUF type" in str(err) else 2)
    except OSError as err:
        return _error(f"{err.filename or args.gguf}: {err.strerror or err}", 2)
    except ValueError as err:  # CheckpointError and other refusals of the input
        return _error(str(err), 2)
    print(report)
    return 0


def _tokenizer(args: argparse.Namespace):
    """--tokenizer: a .gguf file to copy it from, or a transformers tokenizer folder; else the SOURCE directory's own
    tokenizer files, or (None) the tokenizer of the .gguf SOURCE."""
    where = args.tokenizer
    if where is None:
        source = Path(args.source)
        if not (source.is_dir() and any((source / n).is_file() for n in ("tokenizer.json", "tokenizer.model"))):
            return None
        where = source
    if Path(where).suffix == ".gguf":
        return Path(where)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(where))


def _error(message: str, code: int) -> int:
    print(f"python -m torchqkit export: error: {' '.join(message.split())}", file=sys.stderr)
    return code


TARGETS = (
    ExportTarget("--gguf", "OUT.gguf", "a llama.cpp GGUF file: quantized weights in the GGUF block type that holds "
                                       "their codes (torchqkit.save_gguf); SOURCE may also be a .gguf file", _run_gguf),
    ExportTarget("--compressed-tensors", "DIR", "a compressed-tensors checkpoint directory (vLLM, SGLang, transformers "
                                                "with the compressed-tensors package)", _run_compressed_tensors),
)


def add_export_parser(commands) -> None:
    parser = commands.add_parser(
        "export", help="write a torchqkit checkpoint in another tool's format (GGUF, compressed-tensors)",
        description="SOURCE is a directory torchqkit.save_pretrained wrote (or one torchqkit.from_pretrained "
                    "imports); --gguf also takes a .gguf file. Every quantized weight is written exactly or the export "
                    "is refused before anything is written (--gguf --requantize re-rounds such weights instead). "
                    "Exit status: 0 written; 1 a weight has no exact form in the target format; 2 the source can't "
                    "be read.")
    parser.add_argument("source", help="checkpoint directory (config.json + model.safetensors), or a .gguf file")
    target = parser.add_mutually_exclusive_group(required=True)
    for t in TARGETS:
        target.add_argument(t.flag, metavar=t.metavar, help=t.help)
    gguf = parser.add_argument_group("--gguf options")
    gguf.add_argument("--requantize", action="store_true",
                      help="re-round weights with no exact GGUF type to the nearest one (the report says which) "
                           "instead of failing")
    gguf.add_argument("--tokenizer", metavar="PATH", default=None,
                      help="a .gguf file to copy the tokenizer from, or a transformers tokenizer folder (default: "
                           "SOURCE's own)")
    gguf.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    parser.set_defaults(run=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    target = next(t for t in TARGETS if getattr(args, t.flag.lstrip("-").replace("-", "_")) is not None)
    if target.flag != "--gguf" and (args.requantize or args.tokenizer):
        return _error(f"--requantize and --tokenizer apply to --gguf only, not {target.flag}", 2)
    return target.run(args)
