"""Attention over a quantized KV cache (``torchqkit::sdpa_quantized_kv_cache``): K and V read from their codes and
decoded in registers a block of positions at a time, never a float copy of the cache.

Note [Quantized KV attention in Triton]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
One program takes BLOCK_R query rows of one (batch, kv head): the G = Hq / Hkv query heads of its GQA group times
the Lq queries, flattened as the C++ kernel does (Note [Quantized KV attention kernel] in csrc/cpu), so the K / V
rows it decodes serve all of them. It walks the cached positions BLOCK_N at a time: each side's block is loaded as
codes (a byte per int8 / float8 code, a nibble per int4 code) with its float16 scales and zeros (per token: a scale
per group of the head dim; per channel, keys only: a scale per channel and block of ``group`` positions), decoded
to float32 as the op's reference does ((code - mid) * scale + zero, float8 bits * scale), and the rows from nq on
come from the float tail instead. Scores and the weighted values are ``tl.dot``s in IEEE float32 (TF32 would be
looser than the reference); an online softmax (running maximum and sum per row, the accumulator rescaled when the
maximum grows) gives softmax(q k^T * scale + mask) v. Hidden positions are -inf; a row that sees nothing gives 0,
as the C++ kernel; an additive mask's finite minimum counts as visible, as sdpa does. The counts (n, nq) are read by
the kernel from the cache's device tensors, so a decode step neither syncs with the host nor recompiles as the
cache grows. Without a mask the queries are causal at the end of the cache (query l sees positions up to n - Lq + l).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode import F8_E4M3FN, F8_E5M2, float8_to_f32
from .registration import register, traceable

# The code formats as the kernel's compile-time FMT (float8 ones are decode.py's FMT values).
# Globals a compiled kernel reads must be tl.constexpr (the interpreter doesn't check; test_gpu_compile.py does).
_INT8, _INT4 = tl.constexpr(10), tl.constexpr(11)
_FORMATS = {"int8": _INT8.value, "int4": _INT4.value, "float8_e4m3fn": F8_E4M3FN, "float8_e5m2": F8_E5M2}
_NO_MASK, _BOOL_MASK, _ADDITIVE_MASK = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _side_rows(codes_ptr, scale_ptr, zero_ptr, tail_ptr, b, kvh, offs_n, offs_d, n, nq, D, GROUP,
               c_sb, c_sh, c_ss, s_sb, s_sh, s_ss, t_sb, t_sh, t_ss,
               FMT: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """(BLOCK_N, BLOCK_D) float32 rows of one side at positions offs_n: decoded codes below nq, tail rows from nq to
    n, 0 past n and past D."""
    dmask = offs_d < D
    quantized = offs_n < nq
    qmask = quantized[:, None] & dmask[None, :]
    row = codes_ptr + b * c_sb + kvh * c_sh + offs_n[:, None] * c_ss
    if FMT == _INT4:
        byte = tl.load(row + (offs_d // 2)[None, :], mask=qmask, other=0).to(tl.int32)
        value = ((byte >> ((offs_d % 2) * 4)[None, :]) & 15).to(tl.float32) - 8.0
    elif FMT == _INT8:
        value = tl.load(row + offs_d[None, :], mask=qmask, other=0).to(tl.int32).to(tl.float32) - 128.0
    else:
        value = float8_to_f32(tl.load(row + offs_d[None, :], mask=qmask, other=0).to(tl.int32), FMT)
    if PER_CHANNEL:
        at = b * s_sb + kvh * s_sh + (offs_n // GROUP)[:, None] * s_ss + offs_d[None, :]
    else:
        at = b * s_sb + kvh * s_sh + offs_n[:, None] * s_ss + (offs_d // GROUP)[None, :]
    scale = tl.load(scale_ptr + at, mask=qmask, other=0.0).to(tl.float32)
    if FMT == _INT8 or FMT == _INT4:
        decoded = value * scale + tl.load(zero_ptr + at, mask=qmask, other=0.0).to(tl.float32)
    else:
        decoded = value * scale
    tmask = ((offs_n >= nq) & (offs_n < n))[:, None] & dmask[None, :]
    tail = tl.load(tail_ptr + b * t_sb + kvh * t_sh + (offs_n - nq)[:, None] * t_ss + offs_d[None, :], mask=tmask,
                   other=0.0)
    return tl.where(quantized[:, None], decoded, tail)


@triton.jit
def _quantized_kv_attention_kernel(
    q_ptr, out_ptr, mask_ptr,
    kc_ptr, ks_ptr, kz_ptr, kt_ptr, kn_ptr,      # key codes, scales, zeros, tail, counts (n, nq)
    vc_ptr, vs_ptr, vz_ptr, vt_ptr, vn_ptr,      # the same for values
    q_sb, q_sh, q_sl, o_sb, o_sh, o_sl, m_sb, m_sh, m_sl,
    kc_sb, kc_sh, kc_ss, ks_sb, ks_sh, ks_ss, kt_sb, kt_sh, kt_ss,
    vc_sb, vc_sh, vc_ss, vs_sb, vs_sh, vs_ss, vt_sb, vt_sh, vt_ss,
    Hq, Hkv, Lq, D, Dv, K_GROUP, V_GROUP, scale,
    K_FMT: tl.constexpr, K_PER_CHANNEL: tl.constexpr, V_FMT: tl.constexpr, MASK: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    item = tl.program_id(0)
    b, kvh = item // Hkv, item % Hkv
    G = Hq // Hkv
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < G * Lq
    h = kvh * G + rows // Lq
    lq = rows % Lq
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b * q_sb + h[:, None] * q_sh + lq[:, None] * q_sl + offs_d[None, :],
                mask=rmask[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)
    n = tl.load(kn_ptr)
    nqk = tl.load(kn_ptr + 1)
    nqv = tl.load(vn_ptr + 1)
    m_i = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_DV), tl.float32)
    for start in range(0, n, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = _side_rows(kc_ptr, ks_ptr, kz_ptr, kt_ptr, b, kvh, offs_n, offs_d, n, nqk, D, K_GROUP,
                       kc_sb, kc_sh, kc_ss, ks_sb, ks_sh, ks_ss, kt_sb, kt_sh, kt_ss, K_FMT, K_PER_CHANNEL)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        visible = rmask[:, None] & (offs_n < n)[None, :]
        if MASK == _NO_MASK:
            visible = visible & (offs_n[None, :] <= (n - Lq + lq)[:, None])
        else:
            at = mask_ptr + b * m_sb + h[:, None] * m_sh + lq[:, None] * m_sl + offs_n[None, :]
            if MASK == _BOOL_MASK:
                visible = visible & (tl.load(at, mask=visible, other=0) != 0)
            else:
                s = s + tl.load(at, mask=visible, other=0.0)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet: every weight 0
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _side_rows(vc_ptr, vs_ptr, vz_ptr, vt_ptr, b, kvh, offs_n, offs_dv, n, nqv, Dv, V_GROUP,
                       vc_sb, vc_sh, vc_ss, vs_sb, vs_sh, vs_ss, vt_sb, vt_sh, vt_ss, V_FMT, False)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(out_ptr + b * o_sb + h[:, None] * o_sh + lq[:, None] * o_sl + offs_dv[None, :], out,
             mask=rmask[:, None] & (offs_dv < Dv)[None, :])


def _dims(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def sdpa_quantized_kv_cache(query: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
                            k_tail: torch.Tensor, k_counts: torch.Tensor, v_codes: torch.Tensor,
                            v_scale: torch.Tensor, v_zero: torch.Tensor, v_tail: torch.Tensor,
                            v_counts: torch.Tensor, attn_mask: torch.Tensor | None, scale: float, enable_gqa: bool,
                            k_format: str, k_group: int, k_per_channel: bool, v_format: str,
                            v_group: int) -> torch.Tensor:
    op = "sdpa_quantized_kv_cache (triton)"
    if query.dim() != 4 or not query.is_floating_point():
        raise ValueError(f"{op}: query must be a floating (batch, heads, positions, head dim) tensor, got "
                         f"{query.dtype} {tuple(query.shape)}")
    for fmt in (k_format, v_format):
        if fmt not in _FORMATS:
            raise ValueError(f"{op}: format {fmt!r} is not one of {sorted(_FORMATS)}")
    B, Hq, Lq, D = query.shape
    Hkv, Dv = k_tail.shape[1], v_tail.shape[3]
    if Hq % Hkv or (Hq != Hkv and not enable_gqa):
        raise ValueError(f"{op}: {Hq} query heads and {Hkv} kv heads need Hq % Hkv == 0 and, when they differ, "
                         f"enable_gqa=True")
    out = torch.empty(B, Hq, Lq, Dv, dtype=torch.float32, device=query.device)
    if out.numel() == 0:
        return out.to(query.dtype)
    mask_kind, mask, mask_strides = _NO_MASK.value, out, (0, 0, 0)
    if attn_mask is not None:
        mask = attn_mask.expand(B, Hq, Lq, attn_mask.shape[-1])
        if mask.dtype == torch.bool:
            mask_kind, mask = _BOOL_MASK.value, mask.view(torch.uint8)
        else:
            mask_kind, mask = _ADDITIVE_MASK.value, mask.float()
        if mask.stride(3) != 1:
            mask = mask.contiguous()
        mask_strides = _dims(mask)
    q = query if query.stride(3) == 1 else query.contiguous()
    k_zero_arg = k_zero if k_zero.numel() else k_scale  # float8: no zeros, never read
    v_zero_arg = v_zero if v_zero.numel() else v_scale
    block_r = 16
    grid = (B * Hkv, triton.cdiv((Hq // Hkv) * Lq, block_r))
    traceable(_quantized_kv_attention_kernel)[grid](
        q, out, mask,
        k_codes, k_scale, k_zero_arg, k_tail, k_counts, v_codes, v_scale, v_zero_arg, v_tail, v_counts,
        *_dims(q), *_dims(out), *mask_strides,
        *_dims(k_codes), *_dims(k_scale), *_dims(k_tail), *_dims(v_codes), *_dims(v_scale), *_dims(v_tail),
        Hq, Hkv, Lq, D, Dv, k_group, v_group, scale,
        K_FMT=_FORMATS[k_format], K_PER_CHANNEL=k_per_channel, V_FMT=_FORMATS[v_format], MASK=mask_kind,
        BLOCK_R=block_r, BLOCK_N=32, BLOCK_D=max(16, triton.next_power_of_2(D)),
        BLOCK_DV=max(16, triton.next_power_of_2(Dv)))
    return out.to(query.dtype)


OP = register("sdpa_quantized_kv_cache", sdpa_quantized_kv_cache)
