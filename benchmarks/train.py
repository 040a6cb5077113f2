"""Training: QAT recovery of int4 quality on all-MiniLM-L6-v2 (train_qat.py), float8 training loss curves against
float32 (train_fp8.py), 2:4 sparse training (and with int4 QAT) against dense training and one-shot pruning
(train_sparse.py).

    python -m benchmarks train                                    # QAT int4 g32 / g64 300 steps; fp8 recipes 300 steps
    python -m benchmarks train --parts qat --qat-configs int4-wo-g64 --steps 100
    python -m benchmarks train --parts fp8 --recipes float32,fp8-dynamic-tensor --steps 100
    python -m benchmarks train --parts sparse --steps 300         # 2:4 sparse training rows
    python -m benchmarks train --quick                            # a few steps each (seconds)
"""
from __future__ import annotations

from .common import cli
from .common.configs import check, split_names

GROUP = "train"
PARTS = ("qat", "fp8", "sparse")


def main(argv=None) -> int:
    from .train_fp8 import RECIPES
    p = cli.parser(GROUP, __doc__)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--qat-configs", default="int4-wo-g32,int4-wo-g64", help="qat: presets (default %(default)s)")
    p.add_argument("--recipes", default=",".join(RECIPES), help=f"fp8: of {', '.join(RECIPES)}")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=None,
                   help="sentences (qat, default 16) / sequences (fp8, sparse: default 4)")
    p.add_argument("--lr", type=float, default=None, help="qat default 1e-4, fp8 and sparse default 2e-3")
    p.add_argument("--grad", choices=["ste", "clipped_ste"], default="ste", help="qat: the fake quantizer's gradient")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(threads=1)  # on a shared 2-vCPU host, 2 threads wait on each other
    args, rec = cli.start(GROUP, p, argv)
    parts = split_names(args.parts)
    if set(parts) - set(PARTS):
        p.error(f"--parts: unknown {sorted(set(parts) - set(PARTS))}; known: {', '.join(PARTS)}")
    try:
        args.qat_configs = check(split_names(args.qat_configs))
    except ValueError as e:
        p.error(f"--qat-configs: {e}")
    args.recipes = split_names(args.recipes)
    if set(args.recipes) - set(RECIPES):
        p.error(f"--recipes: unknown {sorted(set(args.recipes) - set(RECIPES))}; known: {', '.join(RECIPES)}")
    cli.quick(args, argv, steps=3, qat_configs=args.qat_configs[:1],
              recipes=["float32", "fp8-dynamic-tensor", "fp8-static-tensor-e4m3-grads"])
    if "qat" in parts:
        from . import train_qat
        train_qat.run(_with(args, batch=16, lr=1e-4), rec)
    if "fp8" in parts:
        from . import train_fp8
        train_fp8.run(_with(args, batch=4, lr=2e-3), rec)
    if "sparse" in parts:
        from . import train_sparse
        train_sparse.run(_with(args, batch=4, lr=2e-3), rec)
    rec.print_table()
    return 0


def _with(args, **defaults):
    """args with each of `defaults` filled in where the option was not given."""
    import argparse
    return argparse.Namespace(**{**vars(args), **{k: v for k, v in defaults.items() if getattr(args, k) is None}})
