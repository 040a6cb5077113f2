"""kernels.choose_backend / linear_op / status(): the one place that picks C++ CUDA, Triton, C++ CPU or the
reference for an op on a device, following the KernelPreference stored on the weight."""
from __future__ import annotations

import pytest
import torch

import torchqkit as qk
from torchqkit import kernels
from torchqkit.kernels.registry import OPS
from torchqkit.tensor.activation import KernelPreference


def test_preference_values_are_lowercase_and_shown_in_repr():
    assert [p.value for p in KernelPreference] == ["auto", "reference", "triton", "cuda"]
    lin = torch.nn.Linear(64, 8, bias=False)
    qk.quantize_(lin, qk.NF4WeightOnlyConfig(block_size=64, kernel_preference=KernelPreference.TRITON))
    assert "kernel=triton" in repr(lin.weight)


def test_triton_preference_on_cpu_runs_the_interpreted_kernel():
    """conftest.py sets TRITON_INTERPRET=1, so Triton serves CPU tensors when asked for by name."""
    assert kernels.choose_backend("torchqkit::linear_mxwo", "cpu", "triton") == ("triton", "KernelPreference.TRITON")
    assert kernels.linear_op("torchqkit::linear_mxwo", "cpu", KernelPreference.TRITON) is \
        torch.ops.torchqkit_triton.linear_mxwo


def test_auto_on_cpu_never_picks_the_interpreter():
    for op in OPS:
        backend, why = kernels.choose_backend(op, "cpu")
        assert backend in ("cpu", "reference"), (op, backend)
        if backend == "reference":
            assert "cpu:" in why  # the reason the C++ CPU kernel was passed over is spelled out


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU torch's explanation")
def test_auto_on_cuda_explains_every_skipped_backend():
    backend, why = kernels.choose_backend("torchqkit::linear_int4wo_tiled", "cuda")
    assert backend == "triton" or (backend == "reference" and "cuda: torch is a CPU build" in why)


@pytest.mark.parametrize("op,pref,device,match", [
    ("torchqkit::linear_fp8wo", "cuda", "cpu", "C\\+\\+ cuda kernels don't run on cpu"),
    ("torchqkit::linear_int8da_int8_plain", "triton", "cpu", "no Triton kernel for torchqkit::linear_int8da_int8_plain"),
    ("torchqkit::linear_mxwo", "cuda", "cuda", "no kernel for torchqkit::linear_mxwo|CPU build|is not built"),
])
def test_named_backend_that_cannot_serve_is_an_error_not_a_fallback(op, pref, device, match):
    with pytest.raises(RuntimeError, match=match):
        kernels.linear_op(op, device, pref)


def test_reference_preference_returns_the_pure_torch_twin():
    fn = kernels.linear_op("torchqkit::linear_int4wo_tiled", "cpu", KernelPreference.REFERENCE)
    assert fn is kernels.reference.linear_int4wo_tiled_ref


def test_unknown_op_is_rejected():
    with pytest.raises(ValueError, match="unknown op"):
        kernels.choose_backend("torchqkit::nope", "cpu")


def test_status_lists_every_op_on_every_device():
    rows = [r for r in kernels.status() if r["layout"] == "(backend)"]
    assert sorted(r["linear"] for r in rows) == sorted(f"{op} on {d}" for op in OPS for d in ("cpu", "cuda"))
    mx = next(r for r in rows if r["linear"] == "torchqkit::linear_mxwo on cpu")
    assert mx["path"] == "cpu" and "usable: cpu, triton, reference" in mx["why"]
    # An op without a C++ CPU kernel: the reference is the fastest usable one and the row says why.
    smm = next(r for r in rows if r["linear"] == "torchqkit::scaled_mm_fp8_rowwise on cpu")
    assert smm["path"] == "reference" and "usable: triton, reference" in smm["why"] and "no kernel" in smm["why"]


def test_every_triton_op_mirrors_a_torchqkit_op_schema():
    """Same arguments, so linear_op's callables are interchangeable (custom_op infers SymInt for int)."""
    module, _ = kernels.triton_backend()
    for op in module.TRITON_OPS:
        want = str(getattr(torch.ops.torchqkit, op.split("::")[1]).default._schema).split("(", 1)[1]
        got = str(getattr(torch.ops.torchqkit_triton, op.split("::")[1]).default._schema).split("(", 1)[1]
        assert got.replace("SymInt", "int") == want, op


def test_triton_kernels_go_behind_the_cuda_key_of_ops_without_a_cpp_cuda_kernel():
    """What a GPU machine does at import (kernels._register_triton_on_gpu), done here into a scratch library."""
    module, _ = kernels.triton_backend()
    lib = torch.library.Library("torchqkit", "IMPL")
    try:
        done = kernels.register_triton_for_cuda_key(module, lib)
        cpp_cuda = {op for op in kernels.CUDA_OPS if kernels.CUDA_EXTENSION_LOADED}
        assert sorted(done) == sorted(set(module.TRITON_OPS) - cpp_cuda)
        assert all(torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA") for op in done)
        # choose_backend still names the C++ CUDA backend only for ops csrc/cuda implements
        why = kernels._why_not("cuda", "torchqkit::linear_mxwo", "cuda")
        assert "csrc/cuda has no kernel" in why or "CPU build" in why or "is not built" in why
    finally:
        lib._destroy()
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("torchqkit::linear_mxwo", "CUDA")
