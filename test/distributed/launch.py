"""Run a worker function in ``world`` processes with the gloo backend (one CPU machine) and collect results.

Each worker is ``fn(rank, world, *args) -> dict``; rank r's result is saved to a file the parent reads back, so
a test asserts on real numbers in the parent (with pytest's messages), and a worker that raises fails the test
with its traceback."""
from __future__ import annotations

import gc
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, out_dir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two processes on a 2-core machine
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        del result
        gc.collect()     # the worker's modules and DTensors, before the group they hold work objects of goes
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Under load a rank sometimes aborted after all of this, while the interpreter shut down ("terminate called
    # without an active exception": a C++ thread still joinable at exit), failing a test whose results were all
    # saved. The results are on disk and the group is destroyed, so the worker leaves without finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, *args, world: int = 2) -> list[dict]:
    """Results of ``fn(rank, world, *args)`` for every rank, in rank order."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(world, _free_port(), out_dir, fn, args), nprocs=world, join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
