"""QAT under FSDP2: a tiny LLaMA prepared with int4 g32 fake quantization, fully_shard over 2 processes (gloo),
gives the single-process losses (each rank trains on half of every batch). The gradients differ from one
process's by float32 summation order only, but every weight trains here and fake quantization is a step
function: a weight that moves across a rounding boundary by 1e-7 changes its code, so the difference grows
faster than QLoRA's (test_fsdp_qlora.py): measured 6e-6 relative at step 3, 4e-4 at step 6."""
import pytest

from .fsdp_workers import QAT_STEPS, fsdp_qat
from .launch import run_distributed


def test_qat_losses_equal_single_process():
    for r in run_distributed(fsdp_qat):
        single, fsdp = r["single"], r["fsdp"]
        assert len(fsdp) == QAT_STEPS
        assert fsdp[0] == pytest.approx(single[0], rel=1e-6), (single, fsdp)  # the same fake-quantized forward
        assert fsdp[:3] == pytest.approx(single[:3], rel=5e-5), (single, fsdp)
        assert fsdp == pytest.approx(single, rel=2e-3), (single, fsdp)
        assert single[-1] < single[0] - 0.2  # it really trains
