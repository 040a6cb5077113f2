"""Expert parallelism (qk.parallelize_experts_) on tiny MoE models: 2 processes, gloo, 8 experts -> 4 per rank.

Each rank keeps half of every expert stack (a DTensor placed Shard(0) whose local tensor is an ordinary (4, N, K)
quantized stack holding half the packed bytes) and runs its layout's kernels on the tokens routed to its experts;
an all-reduce sums the two ranks' shares. The MoE block's output and the logits equal the single-process quantized
model's up to float32 summation order (one token's two experts summed in one process, or on two ranks and added by
the all-reduce): measured 0 for "eager" and "grouped_mm", at most 1 ulp-scale differences for "batched_mm" (4.7e-10
on block outputs of magnitude 1.4e-3; 1.2e-7 on logits of magnitude ~1). Asserted: block <= 1e-5 x its largest
magnitude, logits <= 1e-5 absolute (as the tensor-parallel tests)."""
import pytest

from .ep_workers import EP_CONFIGS, expert_parallel_suite
from .launch import run_distributed

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def suite():
    return run_distributed(expert_parallel_suite)


def _assert_close(r, what):
    assert r["names"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"], r["names"]
    for impl, d in r["diffs"].items():
        assert d["block_scale"] > 0, (what, impl)
        assert d["block"] <= 1e-5 * d["block_scale"], (what, impl, d)
        assert d["logits"] <= 1e-5, (what, impl, d)


@pytest.mark.parametrize("config", EP_CONFIGS)
def test_qwen3_moe_expert_parallel_equals_single_process(suite, config):
    for rank, results in enumerate(suite):
        r = results["qwen3_moe"][config]
        _assert_close(r, config)
        assert r["is_dtensor"] and r["placements"] == ["S(0)"] and r["global_shape"] == (8, 64, 64)
        assert r["local_type"] == "AffineQuantizedTensor" and r["local_shape"] == (4, 64, 64)
        assert r["num_experts"] == 4
        assert r["local_bytes"] * 2 == r["full"]["model.layers.0.mlp.experts.gate_up_proj"][1]  # half the bytes
        assert r["local_equals_whole"], (rank, config)  # rank r holds experts [4 r, 4 r + 4)
        assert r["select_diff"] == 0, r["select_diff"]   # w[e] of the shard: the same bytes, the same kernel
        assert r["from_local_shape"] == (8, 64, 64) and r["from_local_same"]


@pytest.mark.parametrize("case", ["float", "local_split", "mixtral", "olmoe", "gpt_oss"])
def test_other_models_and_local_split(suite, case):
    """Float experts; every rank cutting its own shard (src_data_rank=None); Mixtral (4 experts: 2 per rank),
    OLMoE, and gpt-oss (transposed stacks with (E, N) biases, sharded with them)."""
    for results in suite:
        r = results[case]
        _assert_close(r, case)
        assert r["is_dtensor"] and r["num_experts"] == {"mixtral": 2, "gpt_oss": 2}.get(case, 4)


def test_refusals_name_the_problem_and_leave_the_model_unchanged(suite):
    for results in suite:
        r = results["refusals"]
        assert "model.layers.0.mlp.experts: 5 experts don't split over 2 ranks" in r["uneven"]
        assert r["uneven_unchanged"]
        assert "into pieces of [3, 2]" in r["uneven_direct"] and "multiple of the world size" in r["uneven_direct"]
        for dim, part in ((1, "N"), (2, "K")):
            text = r[f"shard{dim}"]
            assert f"along dim {dim}: a stack shards along its expert dim only (Shard(0)" in text
            assert f"would split every expert's {part}" in text and "TensorCoreTiledLayout" in text
        assert "already expert-parallel" in r["twice"]
        assert "is for inference" in r["grad"] and "torch.no_grad()" in r["grad"]
