"""load_quantized onto a tensor-parallel LLaMA built on the meta device (2 processes, gloo): each rank reads only
its shard of every sharded tensor from the safetensors file, and the logits equal the single-process quantized
model's (up to RowwiseParallel's summation order, as in test_tensor_parallel.py)."""
import pytest

from .launch import run_distributed
from .load_workers import load_tensor_parallel

NAMES = ["int4_tiled", "nf4", "float8", "nf4_double_quant"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(load_tensor_parallel, str(tmp_path_factory.mktemp("tp_load")), NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_single_process(results, name):
    for r in results:
        assert r[name]["q_local"] == "AffineQuantizedTensor"
        assert not r[name]["q_requires_grad"]
        assert r[name]["max_diff"] <= 1e-5, r[name]


@pytest.mark.parametrize("name", ["int4_tiled", "nf4", "float8"])
def test_each_rank_reads_only_its_shard(results, name):
    for r in results:
        res = r[name]
        # Everything else (embedding, lm_head, norms) is replicated: every rank reads it whole.
        replicated = res["file_bytes"] - res["quantized_bytes"]
        assert res["bytes_read"] <= replicated + res["quantized_bytes"] / 2 + 16_384, res
        assert res["warnings"] == []


def test_double_quant_cut_inside_a_group_is_read_whole_and_said(results):
    # RowwiseParallel cuts K: the NF4 absmax of a K shard is rebuilt in float32 (Note [NF4 double quantization]).
    for r in results:
        assert any("computed from the whole weight" in w for w in r["nf4_double_quant"]["warnings"])
