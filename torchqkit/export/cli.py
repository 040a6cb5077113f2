"""``python -m torchqkit export SOURCE --compressed-tensors DIR``: one subcommand, one target per run (a mutually
exclusive group, so each format adds its flag and its runner)."""
from __future__ import annotations

import argparse

from ..integrations.compressed_tensors_export import run_compressed_tensors_export

__all__ = ["add_export_parser"]


def add_export_parser(commands) -> None:
    parser = commands.add_parser(
        "export", help="write a torchqkit checkpoint in another tool's format",
        description="SOURCE is a directory torchqkit.save_pretrained wrote (or one torchqkit.from_pretrained "
                    "imports). Every quantized weight is written exactly or the export is refused before anything "
                    "is written. Exit status: 0 written; 1 a weight has no exact form in the target format; "
                    "2 the source can't be read.")
    parser.add_argument("source", help="checkpoint directory (config.json + model.safetensors)")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--compressed-tensors", metavar="DIR", dest="compressed_tensors",
                        help="a compressed-tensors checkpoint directory (vLLM, SGLang, transformers with "
                             "the compressed-tensors package)")
    parser.set_defaults(run=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    return run_compressed_tensors_export(args.source, args.compressed_tensors)
