"""float8 training: each matmul equals the product of float8-cast operands computed here with torch's own float8
casts (not the oracle), with e5m2 or e4m3 gradients; delayed scaling's history; static scales (given or calibrated),
their saturation and its report; torch.compile; short training runs of an MLP and of a small LLaMA with every recipe;
and the errors.

The ``device`` fixture runs the products on CPU (emulated) and on a GPU with float8 tensor cores (``torch._scaled_mm``,
``pytest -m gpu``), where only the float32 accumulation order differs from the float8 products computed here."""
from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchqkit as qk
from test.common import MLP

E4M3 = torch.float8_e4m3fn


def _cast(t, dtype, dim=None):
    """t cast to float8 with absmax scaling over all of t (dim=None) or along ``dim`` (one scale per other index),
    dequantized: what a float8 matmul multiplies."""
    fmax = torch.finfo(dtype).max
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = amax / fmax
    return (t / scale).clamp(-fmax, fmax).to(dtype).float() * scale


def _linear(n=48, k=32, bias=True, seed=0, device="cpu"):
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias).to(device)


def _randn(*shape, seed, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


# Emulated products sum in the order a CPU matmul does, _scaled_mm in its own: float32 rounding apart.
EXACT = {"cpu": dict(rtol=1e-6, atol=1e-6), "cuda": dict(rtol=1e-5, atol=1e-5)}


@pytest.mark.parametrize("grad_dtype", ["float8_e5m2", "float8_e4m3fn"], ids=["e5m2-grads", "e4m3-grads"])
@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_forward_and_both_gradients_are_float8_products(granularity, grad_dtype, device):
    lin = _linear(device=device)
    ref = _linear(device=device)
    qk.enable_float8_training_(lin, granularity=granularity, grad_dtype=grad_dtype, filter_fn=lambda m, f: True)
    G = getattr(torch, grad_dtype)  # the gradients' format, with their own absmax scales
    x = _randn(2, 5, 32, seed=1, device=device).requires_grad_()
    g = _randn(2, 5, 48, seed=2, device=device)
    y = lin(x)
    y.backward(g)
    rows = granularity == "row"
    x2, g2, w = x.detach().reshape(10, 32), g.reshape(10, 48), ref.weight.detach()
    # y = x W^T: x scaled per row (token), W per row (output channel); both along dims the product keeps.
    want_y = _cast(x2, E4M3, 1 if rows else None) @ _cast(w, E4M3, 1 if rows else None).t() + ref.bias.detach()
    want_gx = _cast(g2, G, 1 if rows else None) @ _cast(w, E4M3, 0 if rows else None)
    want_gw = _cast(g2.t(), G, 1 if rows else None) @ _cast(x2, E4M3, 0 if rows else None)
    torch.testing.assert_close(y.detach().reshape(10, 48), want_y, **EXACT[device])
    torch.testing.assert_close(x.grad.reshape(10, 32), want_gx, **EXACT[device])
    torch.testing.assert_close(lin.weight.grad, want_gw, **EXACT[device])
    torch.testing.assert_close(lin.bias.grad, g2.sum(0))
    # and float8 is not float32: the product differs from the float one by float8 rounding (~2^-4 relative)
    err = (y.detach().reshape(10, 48) - F.linear(x2, w, ref.bias.detach())).norm() / want_y.norm()
    assert 1e-3 < err < 0.1


def test_delayed_scaling_uses_the_amax_history_and_saturates():
    lin = _linear(bias=False)
    qk.enable_float8_training_(lin, "delayed", history_len=4, filter_fn=lambda m, f: True)
    x1 = torch.randn(8, 32, generator=torch.Generator().manual_seed(3))
    lin(x1).sum().backward()
    hist = lin.fp8_amax_history
    assert hist[0, 0] == x1.abs().max() and hist[1, 0] == lin.weight.detach().abs().max()
    assert hist[2, 0] == 1.0 and torch.equal(hist[:, 1:], torch.zeros(3, 3))  # grad of sum(): all ones
    # Step 2: x2 = 4 * x1 is scaled with step 1's amax, so everything beyond |x1|'s max saturates at 448 * scale.
    x2 = 4 * x1
    y2 = lin(x2)
    s = x1.abs().max() / 448
    xq = (x2 / s).clamp(-448, 448).to(E4M3).float() * s
    wq = _cast(lin.weight.detach(), E4M3)
    torch.testing.assert_close(y2.detach(), xq @ wq.t(), rtol=1e-6, atol=1e-6)
    assert hist[0, 0] == x2.abs().max() and hist[0, 1] == x1.abs().max()


def test_compiled_step_matches_eager(device):
    for recipe in ("dynamic", "delayed"):
        eager, compiled = MLP().to(device), MLP().to(device)
        compiled.load_state_dict(eager.state_dict())
        qk.enable_float8_training_(eager, recipe)
        qk.enable_float8_training_(compiled, recipe)
        loss_fn = lambda m, x: m(x).square().mean()  # noqa: E731
        x = _randn(4, 128, seed=0, device=device)
        a, b = loss_fn(eager, x), torch.compile(loss_fn, fullgraph=True)(compiled, x)
        a.backward()
        b.backward()
        torch.testing.assert_close(b, a, rtol=1e-6, atol=0)
        torch.testing.assert_close(compiled.up.weight.grad, eager.up.weight.grad, rtol=1e-5, atol=1e-8)


def test_short_training_run_tracks_float32(device):
    def train(fp8):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)).to(device)
        if fp8:
            qk.enable_float8_training_(model, "dynamic", granularity="row")
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(1)
        target = _randn(32, 16, seed=2, device=device) / 4
        losses = []
        for _ in range(60):
            x = torch.randn(64, 32, generator=gen).to(device)
            loss = (model(x) - x @ target).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    fp32, fp8 = train(False), train(True)
    assert fp32[-1] < 0.3 * fp32[0]  # it learns
    assert abs(fp8[-1] - fp32[-1]) <= 0.05 * fp32[-1]


def test_report_status_and_skips():
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 10))
    with pytest.warns(UserWarning, match=r"1 layer\(s\) stay in float"):
        report = qk.enable_float8_training_(model)
    assert [(e.fqn, e.status) for e in report.entries] == [("0", "quantized"), ("1", "skipped")]
    assert "multiples of 16" in report["1"].reason and type(model[1]) is nn.Linear
    assert "float8 training (dynamic tensor scales, e4m3 forward, e5m2 gradients, matmul: emulated)" in repr(model[0])
    status = qk.float8_training_status()
    assert status["path"] == "emulated" and "cpu has no fast float8 matmul" in status["why"]


def test_errors_leave_the_model_unchanged():
    with pytest.raises(ValueError, match="delayed scaling keeps one amax history per tensor"):
        qk.enable_float8_training_(MLP(), "delayed", granularity="row")
    with pytest.raises(ValueError, match="recipe must be one of"):
        qk.enable_float8_training_(MLP(), "rowwise")
    model = MLP()
    qk.quantize_(model, qk.Int8WeightOnlyConfig(), filter_fn=lambda m, f: f == "down")
    with pytest.raises(ValueError, match=r"down\.weight is quantized .* float master weights"):
        qk.enable_float8_training_(model)
    assert type(model.up) is nn.Linear
    qat = MLP()
    qk.prepare_qat_(qat, qk.QATConfig(qk.Int8WeightOnlyConfig()))
    with pytest.raises(ValueError, match="up is prepared for QAT"):
        qk.enable_float8_training_(qat)


def test_delayed_state_saves_and_loads():
    a, b = MLP(), MLP()
    qk.enable_float8_training_(a, "delayed")
    qk.enable_float8_training_(b, "delayed")
    a(torch.randn(4, 128)).sum().backward()
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(b.up.fp8_amax_history, a.up.fp8_amax_history) and a.up.fp8_amax_history.any()


@pytest.mark.parametrize("m,k,n", [(10, 32, 48), (7, 20, 33)])
@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("dtypes", [("float8_e4m3fn", "float8_e4m3fn"), ("float8_e5m2", "float8_e4m3fn")],
                         ids=["e4m3-e4m3", "e5m2-e4m3"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32-out", "bf16-out"])
def test_tensor_core_product_pads_and_scales_like_the_emulation(m, k, n, granularity, dtypes, out_dtype, device):
    """Note [torch._scaled_mm's contract]: dims that aren't multiples of 16, e5m2 gradients and float32 outputs
    reach torch._scaled_mm in forms it accepts (on CPU its reference implementation checks the arithmetic; on a GPU
    the shapes and dtypes cuBLASLt / CUTLASS take) and equal the emulated product."""
    from torchqkit.core import qdtype
    from torchqkit.training.float8_matmul import cast_to_float8, scaled_mm_on_tensor_cores
    a_t, b_t = _randn(m, k, seed=3, device=device), _randn(k, n, seed=4, device=device)
    rows = granularity == "row"
    a = cast_to_float8(a_t, getattr(qdtype, dtypes[0]), (1, k) if rows else (m, k))
    b = cast_to_float8(b_t, getattr(qdtype, dtypes[1]), (k, 1) if rows else (k, n))
    got = scaled_mm_on_tensor_cores(a, b, out_dtype)
    want = a.dequantize() @ b.dequantize()
    assert got.shape == (m, n) and got.dtype == out_dtype
    tol = 2 ** -8 if out_dtype == torch.bfloat16 else 1e-6  # bf16: the output's own rounding
    assert (got.float() - want).abs().max() <= tol * want.abs().max()
