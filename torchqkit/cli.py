"""Command line: `python -m torchqkit <command>`. Each command adds its own subparser below."""

import argparse
import sys
from collections.abc import Sequence

from torchqkit import demo, kernels
from torchqkit.api import presets
from torchqkit.eval.cli import add_eval_parser
from torchqkit.export.cli import add_export_parser
from torchqkit.serialization.cli import add_quantize_parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _demo_config_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    try:
        demo.check_config_names(names)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    return names


def _run_demo(args: argparse.Namespace) -> int:
    return demo.print_demo(args.config or list(demo.MAIN_CONFIGS), args.repeats, args.limit)


def _add_demo_parser(commands) -> None:
    parser = commands.add_parser(
        "demo",
        help="quantize all-MiniLM-L6-v2 with each config; print size, accuracy and speed vs float32",
        description="Needs the demo extras: pip install \".[demo]\"",
    )
    parser.add_argument(
        "--config", type=_demo_config_names, metavar="NAMES",
        help=f"comma-separated preset names (default: {','.join(demo.MAIN_CONFIGS)}); presets: {', '.join(presets.names())}",
    )
    parser.add_argument(
        "--repeats", type=_positive_int, default=3, metavar="N",
        help="timed encodes per model; the median is reported (default: 3)",
    )
    parser.add_argument(
        "--limit", type=_positive_int, default=None, metavar="N",
        help="encode only the first N demo sentences (default: all)",
    )
    parser.set_defaults(run=_run_demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m torchqkit", description="torchqkit tools")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    _add_demo_parser(commands)
    add_quantize_parser(commands)
    add_eval_parser(commands)
    add_export_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Note [Missing CPU kernels] (kernels/cpu_build.py): say so even where warning filters hid the import warning
    if kernels.MISSING_KERNELS_NOTE and not kernels.missing_kernels_warned():
        print(kernels.MISSING_KERNELS_NOTE, file=sys.stderr)
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.run(args)
