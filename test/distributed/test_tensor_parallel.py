"""Tensor-parallel inference on a quantized LLaMA: 2 processes, gloo, ColwiseParallel / RowwiseParallel.

Each rank runs its layout's own kernel on its shard of the packed weight; logits equal the single-process
quantized model's up to float32 summation order (RowwiseParallel adds two partial products, one process sums
all of K in one kernel): max |diff| <= 1e-5 on logits of magnitude ~1."""
import pytest

from .launch import run_distributed
from .tp_workers import TP_CONFIGS, tensor_parallel_suite

WEIGHT_ONLY = [n for n in TP_CONFIGS if n != "int8_dynamic"]


@pytest.fixture(scope="module")
def suite():
    return run_distributed(tensor_parallel_suite)


@pytest.fixture(scope="module")
def tp_results(suite):
    return [r["scatter"] for r in suite]


@pytest.mark.parametrize("name", WEIGHT_ONLY)
def test_weight_only_layouts_equal_single_process(tp_results, name):
    for rank, results in enumerate(tp_results):
        r = results[name]
        assert r["local_type"] == "AffineQuantizedTensor", (rank, r)
        assert r["local_shape"] == (128, 256)  # q_proj (256, 256): half of N on each rank
        # Half the packed bytes of the weight (codes, scales and zero points sharded together).
        assert r["local_bytes"] * 2 == pytest.approx(r["full_bytes"], rel=0.02), r
        assert r["max_diff"] <= 1e-5, (rank, name, r)
        assert r["warnings"] == []


def test_dynamic_activation_row_shards_warn_and_stay_within_quantization_noise(tp_results):
    for results in tp_results:
        r = results["int8_dynamic"]
        assert any("activation scales over its own part of K" in w for w in r["warnings"])
        # Per-rank activation scales (finer than one process's): as close to the float model as one process.
        assert r["sqnr_tp"] >= r["sqnr_single"] - 1.0, r
        assert 0 < r["max_diff"] < 0.1, r


def test_local_split_without_scatter(suite):
    """src_data_rank=None: every rank already holds the quantized model and cuts its own shard."""
    for r in (s["local"] for s in suite):
        for name in ("int4_tiled", "nf4_double_quant"):
            assert r[name]["max_diff"] <= 1e-5, (name, r[name])


def test_illegal_cut_raises_naming_layout_dim_and_multiples(suite):
    for r in (s["illegal"] for s in suite):
        assert r["error"] is not None
        assert "TensorCoreTiledLayout" in r["error"] and "dim 0" in r["error"] and "multiples of 8" in r["error"]
        assert r["unchanged"]
