"""Triton kernels for the decoder's row-wise pieces between its GEMMs, one launch each.

At beam-search row counts a decode step of a small model is launch-bound: the 30-layer default
model's step was 488 kernels (engine 2's profile, H200 2026-12-01, in git history), about 16 per layer, of which
the GEMMs and attention are 5. These kernels fold the rest into 3 per layer, reading the GEMM
outputs where they lie (fused q/k/v and gate/up outputs, no split copies):

- :func:`add_rms_norm`: ``h += a`` (the residual add) and ``x = RMSNorm(h)`` in one pass; ``a=None``
  is the plain norm (the first layer's input norm). :func:`add_rms_norm_fp8` also quantizes ``x`` per row
  to FP8 for the FP8 linear that reads it.
- :func:`rotary_store`: rotary embedding of q and k, q written to a contiguous ``[M, H, D]`` and
  k / v straight into the KV cache at a position read on the device (graph-safe).
- :func:`gated_act`: ``act(gate) * up`` (SiLU or tanh-GELU).
- :func:`row_logsumexp`: float32 log-sum-exp of each logits row, without a float32 copy of the row.

Each kernel repeats the rounding of the torch ops it replaces (HF's modules, op for op): products and
sums are float32 and rounded to the activation dtype where torch rounds, so a bf16 model's step
differs from the eager forward only by the order of float32 reductions. The ``*_reference`` functions
are those torch ops (the CPU path and the tests' oracle). Replacing TorchInductor-compiled versions
of the same functions also removes their compilation from the first batch of every process (a Ray
actor's warm-up): Triton caches these few kernels on disk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.fp8_linear import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, quantize_rows_fp8_reference

ACT_SILU, ACT_GELU_TANH = 0, 1
_ACTS = {"silu": ACT_SILU, "gelu_pytorch_tanh": ACT_GELU_TANH}


def _row_block(n: int) -> int:
    return triton.next_power_of_2(max(n, 16))


# ------------------------------------------------------------------------------- add + RMSNorm
@triton.jit
def _add_rms_norm_kernel(h_ptr, a_ptr, w_ptr, x_ptr, q_ptr, qs_ptr, s_h, s_a, s_x, s_q, N, eps, amax_floor, fp8_max,
                         HAS_ADD: tl.constexpr, UNIT_OFFSET: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    h = tl.load(h_ptr + r * s_h + offs, mask=ok, other=0.0)
    if HAS_ADD:
        a = tl.load(a_ptr + r * s_a + offs, mask=ok, other=0.0)
        h = (h.to(tl.float32) + a.to(tl.float32)).to(h_ptr.dtype.element_ty)   # torch's add rounds
        tl.store(h_ptr + r * s_h + offs, h, mask=ok)
    hf = h.to(tl.float32)
    var = tl.sum(hf * hf, 0) / N
    y = hf * (1.0 / tl.sqrt(var + eps))  # rsqrt as torch.rsqrt (CUDA: 1 / sqrt to within an ulp)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if UNIT_OFFSET:   # Gemma 3: (normed * (1 + w)) in float32, then the dtype
        x = y * (1.0 + w)
    else:             # Llama / Qwen / Mistral: w * normed.to(dtype), rounded again
        x = y.to(x_ptr.dtype.element_ty).to(tl.float32) * w
    xd = x.to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + r * s_x + offs, xd, mask=ok)
    if QUANT:  # the stored row's per-row FP8: kernels.fp8_quant's arithmetic, op for op (padding lanes are 0)
        xr = xd.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(xr), 0), amax_floor) / fp8_max
        tl.store(qs_ptr + r, scale)
        q = tl.minimum(tl.maximum(xr * (1.0 / scale), -fp8_max), fp8_max)
        tl.store(q_ptr + r * s_q + offs, q.to(q_ptr.dtype.element_ty), mask=ok)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """HF's RMSNorm, op for op: Llama/Qwen/Mistral (``weight * normed.to(dtype)``) or Gemma 3
    (``normed * (1 + weight)`` in float32, ``unit_offset``)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (y * (1.0 + weight.float())).to(x.dtype)
    return weight * y.to(x.dtype)


def add_rms_norm_reference(h: torch.Tensor, a: torch.Tensor | None, weight: torch.Tensor, eps: float,
                           unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if a is not None:
        h = h + a
    return h, rms_norm_reference(h, weight, eps, unit_offset)


def add_rms_norm(h: torch.Tensor, a: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``h, a: [..., N]`` (same shape and dtype; rows may be strided, last stride 1) ->
    ``(h + a, RMSNorm(h + a))``; the sum is written into ``h`` in place (the residual stream's own
    buffer), the normed rows into a new contiguous tensor. ``a=None``: ``(h, RMSNorm(h))``."""
    h, x, _ = _launch_add_rms_norm(h, a, weight, eps, unit_offset, quantize=False)
    return h, x


def add_rms_norm_fp8(h: torch.Tensor, a: torch.Tensor | None, weight: torch.Tensor, eps: float, unit_offset: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`add_rms_norm`, and in the same pass the normed rows quantized per row to FP8 as
    :func:`kernels.fp8_linear.quantize_rows_fp8` does (bit for bit): ``(h + a, x, (q float8_e4m3fn [M, N],
    s float32 [M, 1]))`` with ``M`` the rows of ``x.reshape(-1, N)``. The FP8 linear that reads ``x`` takes
    ``(q, s)`` instead of a separate quantization launch that re-reads ``x`` (those took 7 % of a compressed 8B
    search's kernel time at 16-1,024 queries; fused, norm + quantization kernels at 1,024 queries went 111 -> 99 ms
    of ~940, H100)."""
    return _launch_add_rms_norm(h, a, weight, eps, unit_offset, quantize=True)


def add_rms_norm_fp8_reference(h: torch.Tensor, a: torch.Tensor | None, weight: torch.Tensor, eps: float,
                               unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    h, x = add_rms_norm_reference(h, a, weight, eps, unit_offset)
    return h, x, quantize_rows_fp8_reference(x.reshape(-1, x.shape[-1]))


def _launch_add_rms_norm(h: torch.Tensor, a: torch.Tensor | None, weight: torch.Tensor, eps: float,
                         unit_offset: bool, quantize: bool):
    N = h.shape[-1]
    h2 = h.reshape(-1, N)
    if h2.stride(-1) != 1 or (a is not None and a.stride(-1) != 1):
        raise ValueError("add_rms_norm needs a unit last stride")
    if h2.data_ptr() != h.data_ptr() or (h.dim() > 1 and not rows_view_ok(h)):
        raise ValueError("add_rms_norm: h must be viewable as rows without a copy (it is updated in place)")
    a2 = h2 if a is None else a.reshape(-1, N)
    x = torch.empty(h2.shape, device=h.device, dtype=h.dtype)
    q = torch.empty(h2.shape, device=h.device, dtype=FP8_DTYPE) if quantize else x
    qs = torch.empty(h2.shape[0], 1, device=h.device, dtype=torch.float32) if quantize else x
    _add_rms_norm_kernel[(h2.shape[0],)](h2, a2, weight, x, q, qs, h2.stride(0), a2.stride(0), x.stride(0),
                                         q.stride(0), N, float(eps), AMAX_FLOOR, FP8_MAX, HAS_ADD=a is not None,
                                         UNIT_OFFSET=bool(unit_offset), QUANT=quantize, BLOCK=_row_block(N),
                                         num_warps=4 if N <= 4096 else 8)
    return h, x.view(h.shape), ((q, qs) if quantize else None)


def rows_view_ok(h: torch.Tensor) -> bool:
    """Whether ``h.reshape(-1, N)`` is a view (so the kernel's in-place sum lands in ``h``)."""
    try:
        h.view(-1, h.shape[-1])
        return True
    except RuntimeError:
        return False


# ------------------------------------------------------------------------------- rotary + store
@triton.jit
def _rotary_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, vo_ptr, t0_ptr,
                         s_q, s_k, s_v, s_c, T, so_n, so_t, so_h, s_qo,
                         H: tl.constexpr, KV: tl.constexpr, H_PAD: tl.constexpr, KV_PAD: tl.constexpr,
                         D: tl.constexpr, HAS_T0: tl.constexpr):
    """Program = one row m (token n = m // T at position tt = m % T of its sequence), all heads."""
    m = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = D // 2
    offs_d = tl.arange(0, D)
    # rotate_half(x)[d] = -x[d + D/2] for d < D/2, x[d - D/2] otherwise
    rot_d = tl.where(offs_d < half, offs_d + half, offs_d - half)
    sign = tl.where(offs_d < half, -1.0, 1.0)
    c = tl.load(cos_ptr + m * s_c + offs_d).to(tl.float32)
    s = tl.load(sin_ptr + m * s_c + offs_d).to(tl.float32)
    dt = qo_ptr.dtype.element_ty
    heads = tl.arange(0, H_PAD)[:, None]
    h_ok = heads < H
    x = tl.load(q_ptr + m * s_q + heads * D + offs_d[None, :], mask=h_ok, other=0.0)
    xr = tl.load(q_ptr + m * s_q + heads * D + rot_d[None, :], mask=h_ok, other=0.0).to(tl.float32) * sign[None, :]
    # torch: (x * cos) + (rotate_half(x) * sin), each product rounded to the dtype, then the sum
    y = ((x.to(tl.float32) * c[None, :]).to(dt).to(tl.float32) + (xr * s[None, :]).to(dt).to(tl.float32)).to(dt)
    tl.store(qo_ptr + m * s_qo + heads * D + offs_d[None, :], y, mask=h_ok)
    n = m // T
    tt = m % T
    if HAS_T0:
        tt += tl.load(t0_ptr)
    dst = n * so_n + tt * so_t
    kvh = tl.arange(0, KV_PAD)[:, None]
    kv_ok = kvh < KV
    k = tl.load(k_ptr + m * s_k + kvh * D + offs_d[None, :], mask=kv_ok, other=0.0)
    kr = tl.load(k_ptr + m * s_k + kvh * D + rot_d[None, :], mask=kv_ok, other=0.0).to(tl.float32) * sign[None, :]
    ky = ((k.to(tl.float32) * c[None, :]).to(dt).to(tl.float32) + (kr * s[None, :]).to(dt).to(tl.float32)).to(dt)
    tl.store(ko_ptr + dst + kvh * so_h + offs_d[None, :], ky, mask=kv_ok)
    vv = tl.load(v_ptr + m * s_v + kvh * D + offs_d[None, :], mask=kv_ok, other=0.0)
    tl.store(vo_ptr + dst + kvh * so_h + offs_d[None, :], vv, mask=kv_ok)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotary: ``x: [N, heads, T, D]``, ``cos/sin: [N, T, D]``."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def rotary_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_out: torch.Tensor, v_out: torch.Tensor, t0: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary q and k of ``M = N * T`` tokens; k and v stored into a cache, q returned.

    Args:
        q: ``[N, T, H * D]``, k / v ``[N, T, KV * D]``: views of the projections' outputs (any row
            strides, e.g. splits of one fused q/k/v GEMM output; each row's heads contiguous).
        cos, sin: ``[N, T, D]`` (HF's rotary module's outputs, in the activation dtype).
        k_out, v_out: cache views ``[N, KV, P, D]`` (token n's position tt goes to ``[n, :, tt]``;
            e.g. the prompt region ``kp[li][:N]``) or, for one-token steps (T = 1), ``[P, N, KV, D]``
            given as ``k_out.permute(1, 2, 0, 3)`` (the suffix region ``ks[li]``): any strides with a
            unit last stride.
        t0: ``Long[1]`` on the device added to every position (the step's suffix position; graph-safe).
    Returns:
        rotated q ``[N, T, H, D]`` (contiguous).
    """
    N, T = q.shape[0], q.shape[1]
    KV, D = k_out.shape[1], k_out.shape[3]
    H = q.shape[2] // D
    if D & (D - 1) or q.shape[2] != H * D:
        raise ValueError(f"rotary_store needs a power-of-two head size (D={D}) dividing q's width")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1 or x.stride(0) != T * x.stride(1):
            raise ValueError(f"rotary_store: {name} rows must be evenly strided with a unit last stride")
    if k_out.stride() != v_out.stride() or k_out.stride(-1) != 1:
        raise ValueError("rotary_store: k_out / v_out must share strides with a unit last stride")
    cos2, sin2 = cos.reshape(N * T, D), sin.reshape(N * T, D)
    if cos2.stride() != sin2.stride():
        sin2 = sin2.contiguous()
        cos2 = cos2.contiguous()
    qo = torch.empty(N, T, H, D, device=q.device, dtype=q.dtype)
    _rotary_store_kernel[(N * T,)](
        q, k, v, cos2, sin2, qo, k_out, v_out, q if t0 is None else t0,
        q.stride(1), k.stride(1), v.stride(1), cos2.stride(0), T,
        k_out.stride(0), k_out.stride(2), k_out.stride(1), H * D,
        H=H, KV=KV, H_PAD=triton.next_power_of_2(H), KV_PAD=triton.next_power_of_2(KV), D=D, HAS_T0=t0 is not None, num_warps=1 if H * D <= 1024 else 4)
    return qo


# ------------------------------------------------------------------------------- gated activation
@triton.jit
def _gated_act_kernel(g_ptr, u_ptr, o_ptr, s_g, s_u, s_o, N, ACT: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    g = tl.load(g_ptr + r * s_g + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * s_u + offs, mask=ok, other=0.0).to(tl.float32)
    dt = o_ptr.dtype.element_ty
    if ACT == 0:   # F.silu in float32, rounded; then * up, rounded
        a = g / (1.0 + tl.exp(-g))
    else:          # F.gelu(approximate="tanh")
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        th = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
        a = 0.5 * g * (1.0 + th)
    tl.store(o_ptr + r * s_o + offs, (a.to(dt).to(tl.float32) * u).to(dt), mask=ok)


def gated_act_reference(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up  # gelu_pytorch_tanh (Gemma)


def gated_act(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` for ``gate, up: [..., N]`` (rows may be strided: e.g. the two halves of
    one fused gate/up GEMM output) -> contiguous ``[..., N]``."""
    N = gate.shape[-1]
    g2, u2 = gate.reshape(-1, N), up.reshape(-1, N)
    if g2.stride(-1) != 1 or u2.stride(-1) != 1:
        raise ValueError("gated_act needs a unit last stride")
    out = torch.empty(g2.shape, device=gate.device, dtype=gate.dtype)
    block = min(1024, _row_block(N))
    _gated_act_kernel[(g2.shape[0], triton.cdiv(N, block))](
        g2, u2, out, g2.stride(0), u2.stride(0), out.stride(0), N, ACT=_ACTS[act], BLOCK=block, num_warps=4)
    return out.view(gate.shape)


# ------------------------------------------------------------------------------- log-sum-exp
@triton.jit
def _row_lse_kernel(x_ptr, o_ptr, s_x, V, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + r * s_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        acc = acc * tl.exp(m - safe) + tl.exp(x - safe)
        m = m_new
    mx = tl.max(m, 0)
    total = tl.sum(acc * tl.exp(m - mx), 0)
    tl.store(o_ptr + r, mx + tl.log(total))


def row_logsumexp_reference(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits.float(), dim=-1)


def row_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """``Float32[N]`` log-sum-exp of each row of ``logits [N, V]`` (any float dtype, unit last
    stride), accumulated in float32."""
    if logits.stride(-1) != 1:
        raise ValueError("row_logsumexp needs a unit last stride")
    out = torch.empty(logits.shape[0], device=logits.device, dtype=torch.float32)
    _row_lse_kernel[(logits.shape[0],)](logits, out, logits.stride(0), logits.shape[1], BLOCK=2048, num_warps=8)
    return out


__all__ = ["add_rms_norm", "add_rms_norm_reference", "add_rms_norm_fp8", "add_rms_norm_fp8_reference",
           "rms_norm_reference", "rotary_store", "rotate_half", "apply_rotary_reference", "gated_act",
           "gated_act_reference", "row_logsumexp", "row_logsumexp_reference"]
