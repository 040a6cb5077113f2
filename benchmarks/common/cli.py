"""The options every group takes, and the run's setup they imply."""
from __future__ import annotations

import argparse

import torch

from .configs import check, split_names
from .records import Recorder


def parser(group: str, doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks {group}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes / a tiny model, a few repeats: a smoke run of "
                                                        "seconds that checks the code, not the figures")
    p.add_argument("--out", default=None,
                   help=f"JSON-lines file to append to (default benchmarks/results/{group}.jsonl)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    return p


def add_configs(p: argparse.ArgumentParser, default: list[str]) -> None:
    p.add_argument("--configs", default=",".join(default),
                   help="comma-separated preset names (python -m torchqkit presets / qk.presets.names()), "
                        "'<preset>+<change>' variants, or the float32 / bfloat16 baselines (default: %(default)s)")


def start(group: str, p: argparse.ArgumentParser, argv: list[str] | None, config_of=lambda name: name):
    """(args, recorder): parses argv, checks --configs against the presets (a clear error before any measurement)
    and sets the thread count. config_of: a --configs entry's config name (a group's own procedure suffixes off)."""
    args = p.parse_args(argv)
    if getattr(args, "configs", None) is not None:
        args.configs = split_names(args.configs)
        try:
            check([config_of(c) for c in args.configs])
        except ValueError as e:
            p.error(f"--configs: {e}")
    if args.threads:
        torch.set_num_threads(args.threads)
    return args, Recorder(group, args.out, argv)


def given(argv: list[str] | None, dest: str) -> bool:
    """Whether the command line set option `dest` (as --dest-with-dashes or --dest-with-dashes=VALUE)."""
    flag = "--" + dest.replace("_", "-")
    return any(a == flag or a.startswith(flag + "=") for a in argv or [])


def quick(args, argv: list[str] | None, **values) -> None:
    """--quick's sizes: each of `values` replaces its option's default, never a value the command line gave."""
    if args.quick:
        for dest, value in values.items():
            if not given(argv, dest):
                setattr(args, dest, value)
