"""`python -m torchqkit quantize SRC DST --config NAME|JSON`: quantize_checkpoint from the command line
(the subparser torchqkit/cli.py adds next to `demo`)."""
import argparse
import sys
from pathlib import Path

from torchqkit.api import presets
from torchqkit.files.open_checked import open_regular_file
from torchqkit.files.strict_json import parse_json

__all__ = ["add_quantize_parser", "parse_config_arg"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def parse_config_arg(text: str):
    """A preset name (int8-wo, int4-wo-g128, ...: torchqkit.presets) or a JSON file: one config dict, or ModuleConfigs."""
    import torchqkit
    if text in presets.PRESETS:
        return presets.get(text)
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is neither a preset name ({', '.join(presets.PRESETS)}) "
                                         f"nor a JSON file")
    try:
        with open_regular_file(text, ValueError, "config file") as f:  # the rule for every file torchqkit reads
            data = parse_json(f.read(), text)  # errors name the file; never RecursionError
    except OSError as err:
        raise argparse.ArgumentTypeError(f"{text}: can't read ({err.strerror})") from None
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    try:
        if isinstance(data, dict) and "type" in data:
            return torchqkit.config_from_dict(data)
        return torchqkit.ModuleConfigs(data)
    except (ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(f"{text}: {err}") from None


def _run_quantize(args: argparse.Namespace) -> int:
    """Exit 0: written; 1: nothing quantized or --strict refused a layer (nothing written); 2: the source, the
    destination or a file can't be used. Errors are one line on stderr, never a traceback."""
    import torchqkit
    try:
        report = torchqkit.quantize_checkpoint(args.src, args.dst, args.config, max_shard_bytes=args.max_shard_bytes,
                                               strict=args.strict, progress=False if args.quiet else None,
                                               require_quantized=True)
    except torchqkit.QuantizationError as err:
        return _error(str(err), 1)
    except OSError as err:
        where = err.filename if err.filename is not None else args.dst
        return _error(f"{where}: {err.strerror or err}", 2)
    except ValueError as err:  # CheckpointError and any other refusal of the input
        return _error(str(err), 2)
    print(report)
    return 0


def _error(message: str, code: int) -> int:
    print(f"python -m torchqkit quantize: error: {' '.join(message.split())}", file=sys.stderr)
    return code


def add_quantize_parser(commands) -> None:
    parser = commands.add_parser(
        "quantize", help="quantize a float safetensors checkpoint into a torchqkit checkpoint, tensor by tensor",
        description="Linear weights are the 2-d '<module>.weight' tensors outside embeddings and GPT-2 Conv1D "
                    "weights (see torchqkit.quantize_checkpoint); load the result with torchqkit.load_quantized. "
                    "Exit status: 0 written; 1 nothing quantized or --strict refused a layer (nothing written); "
                    "2 the source, destination or config can't be used.")
    parser.add_argument("src", help="float checkpoint: .safetensors file, its .index.json, or a directory")
    parser.add_argument("dst", help="output .safetensors path (shards and an .index.json next to it if sharded)")
    parser.add_argument("--config", type=parse_config_arg, required=True, metavar="NAME|JSON",
                        help=f"preset name ({', '.join(presets.PRESETS)}) or a JSON file (a config dict or "
                             f"ModuleConfigs)")
    parser.add_argument("--max-shard-bytes", type=_positive_int, default=None, metavar="N",
                        help="shard the output past N bytes")
    parser.add_argument("--strict", action="store_true",
                        help="fail instead of keeping a weight that can't be quantized")
    parser.add_argument("--quiet", action="store_true", help="no progress bar on stderr (shown only when stderr is a terminal)")
    parser.set_defaults(run=_run_quantize)
