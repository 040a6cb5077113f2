"""FSDP2 QLoRA: ``fully_shard`` on a tiny LLaMA with frozen quantized base weights and LoRA adapters, 2 processes
(gloo). 20 AdamW steps give the single-process losses: each rank trains on half of every batch and FSDP2
averages the gradients, which is the full batch's mean up to float32 summation order. That rounding (~1e-7
relative on the first steps) grows as training goes on, as any two float32 runs that sum in different orders
do (Adam normalizes the updates, so tiny gradient differences become update differences): measured 1e-6 after
5 steps and 2e-4 after 20 with lr 1e-2, hence the tolerances below. The base weights travel as packed bytes and
each rank stores half of them."""
import pytest

from .fsdp_workers import BASE_CONFIGS, STEPS, fsdp_qlora
from .launch import run_distributed


@pytest.fixture(scope="module")
def results():
    return run_distributed(fsdp_qlora, list(BASE_CONFIGS))


@pytest.mark.parametrize("name", list(BASE_CONFIGS))
def test_losses_equal_single_process(results, name):
    for r in results:
        single, fsdp = r[name]["single"], r[name]["fsdp"]
        assert len(fsdp) == STEPS
        assert fsdp[0] == pytest.approx(single[0], rel=1e-6), (name, single, fsdp)  # the same forward
        assert fsdp[:5] == pytest.approx(single[:5], rel=2e-5), (name, single, fsdp)
        assert fsdp == pytest.approx(single, rel=1e-3), (name, single, fsdp)
        assert single[-1] < single[0] - 1.0  # the adapters really train


@pytest.mark.parametrize("name", list(BASE_CONFIGS))
def test_packed_bytes_are_gathered_and_sharded(results, name):
    for r in results:
        res = r[name]
        # Each rank keeps half of the quantized weights' packed storage.
        assert res["local_packed"] * 2 == pytest.approx(res["full_packed"], rel=0.01)
        # 14 quantized weights, gathered before each forward and again before each backward.
        assert len(res["gathers"]) >= 14 * STEPS
        for g in res["gathers"]:
            assert g["bytes"] <= g["local_packed"]      # what the shard stores, nothing dequantized
            assert g["bytes"] < g["float_bytes"] / 2   # int8 codes at most: < half of float32
            assert g["dtypes"][0] in ("torch.uint8", "torch.int8", "torch.int32"), g
