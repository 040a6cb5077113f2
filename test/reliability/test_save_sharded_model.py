"""Saving a model whose weights are DTensors (tensor parallel, FSDP2) says what to do instead of failing inside a
tensor op: a checkpoint holds whole tensors, so save before sharding, and load onto the sharded model."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import torchqkit as qk

from .models import mlp


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_saving_a_tensor_parallel_model_says_to_save_before_sharding(one_rank, tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    model = mlp(0)
    parallelize_module(model, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel()})
    with pytest.raises(TypeError, match=r"'0.weight' is a DTensor .*Save the quantized model before sharding"):
        qk.save_quantized(model, tmp_path / "tp.safetensors")
    assert not (tmp_path / "tp.safetensors").exists()
