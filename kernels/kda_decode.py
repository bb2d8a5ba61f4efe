"""S3: fused KDA decode — f_b projection, gates, conv4 + SiLU, L2 norm, delta-rule recurrence
on the fp32 state, and the gated RMSNorm, in one kernel.

One program per (sequence, head); it walks the T tokens of the step (1 for decode, 1+k for a
speculative verify, then also writing every position's state so the step can be rolled back).
Tiling: per token, q and k (d values each) stay in registers; the head's state S [V=d, K=d]
is streamed in BV-row tiles (a whole 128×128 fp32 state would spill), each tile decayed,
corrected by the delta rule, multiplied by q and written back. The f_b projection is taken
in F_BLOCK-wide slices of its [d, f_rank] weight for the same reason. The output RMSNorm
needs all d outputs: the tiles park them in an fp32 scratch row, normalised at the end.

The standard path runs the f_b projection as a GEMM of its own, as vLLM does, and hands its
output in (``f=``, ``F_GIVEN``): the rest of the kernel is vLLM's ``fused_kda_decode``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_perf_kernels.common import INTERPRETED, cast, interpreter_tiles, sigmoid

STAGES = tl.constexpr(2)  # the next f_b / state tile loads while one is used


@triton.jit
def kda_decode_kernel(z_ptr, wfb_ptr, f_ptr, dt_bias_ptr, a_log_ptr, conv_w_ptr, onorm_ptr,
                      conv_ptr, state_ptr, out_ptr, scratch_ptr, ckpt_state_ptr, ckpt_conv_ptr,
                      B, T, H, stride_zb, stride_zt, stride_fb, stride_ft, stride_ob,
                      stride_ot, g_col, fa_col, b_col, eps, lower_bound, D: tl.constexpr,
                      F_RANK: tl.constexpr, BV: tl.constexpr, F_BLOCK: tl.constexpr,
                      F_GIVEN: tl.constexpr, CHECKPOINT: tl.constexpr, RNE: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    C = 3 * H * D                                     # conv channels: q, k, v of all heads
    i = tl.arange(0, D)
    vb = tl.arange(0, BV)
    r = tl.arange(0, F_BLOCK)
    dt_bias = tl.load(dt_bias_ptr + h * D + i)
    a = tl.exp(tl.load(a_log_ptr + h))
    conv_base = conv_ptr + b * C * 3
    state_base = state_ptr + (b * H + h) * D * D
    scratch = scratch_ptr + pid * D
    for t in range(0, T):
        z = z_ptr + b * stride_zb + t * stride_zt
        ck_conv = ckpt_conv_ptr + (t * B + b) * C * 3
        ck_state = ckpt_state_ptr + ((t * B + b) * H + h) * D * D
        q = _conv_step(z, conv_base, conv_w_ptr, h * D + i, ck_conv, CHECKPOINT)
        k = _conv_step(z, conv_base, conv_w_ptr, H * D + h * D + i, ck_conv, CHECKPOINT)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * (1.0 / tl.sqrt(D * 1.0))
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        if F_GIVEN:
            f = dt_bias + tl.load(f_ptr + b * stride_fb + t * stride_ft + h * D + i).to(
                tl.float32)
        else:
            f = dt_bias
            for r0 in tl.range(0, F_RANK, F_BLOCK, num_stages=STAGES):
                f_a = tl.load(z + fa_col + r0 + r).to(tl.float32)
                w = tl.load(wfb_ptr + (h * D + i)[:, None] * F_RANK + r0 + r[None, :])
                f += tl.sum(w.to(tl.float32) * f_a[None, :], axis=1)
        decay = tl.exp(lower_bound * sigmoid(a * f))
        beta = tl.sigmoid(tl.load(z + b_col + h).to(tl.float32))
        sq = 0.0
        for v0 in tl.range(0, D, BV, num_stages=STAGES):
            rows = v0 + vb
            v = _conv_step(z, conv_base, conv_w_ptr, 2 * H * D + h * D + rows, ck_conv,
                           CHECKPOINT)
            S = tl.load(state_base + rows[:, None] * D + i[None, :]) * decay[None, :]
            u = beta * (v - tl.sum(S * k[None, :], axis=1))
            S = S + u[:, None] * k[None, :]
            tl.store(state_base + rows[:, None] * D + i[None, :], S)
            if CHECKPOINT:
                tl.store(ck_state + rows[:, None] * D + i[None, :], S)
            o = tl.sum(S * q[None, :], axis=1)
            sq += tl.sum(o * o, axis=0)
            tl.store(scratch + rows, o)
        inv_rms = 1.0 / tl.sqrt(sq / D + eps)
        for v0 in range(0, D, BV):
            rows = v0 + vb
            o = tl.load(scratch + rows) * inv_rms * tl.load(onorm_ptr + rows)
            gate = tl.load(z + g_col + h * D + rows).to(tl.float32)
            tl.store(out_ptr + b * stride_ob + t * stride_ot + h * D + rows,
                     cast(o * tl.sigmoid(gate), out_ptr.dtype.element_ty, RNE))


@triton.jit
def _conv_step(z, conv_base, conv_w_ptr, ch, ck_conv, CHECKPOINT: tl.constexpr):
    """y = SiLU(Σ_j w[ch, j] · window[j]) with window = [state[ch, 0..2], z[ch]]; the state
    then drops its oldest entry and keeps the raw input."""
    x = tl.load(z + ch)
    s0 = tl.load(conv_base + ch * 3 + 0)
    s1 = tl.load(conv_base + ch * 3 + 1)
    s2 = tl.load(conv_base + ch * 3 + 2)
    y = (tl.load(conv_w_ptr + ch * 4 + 0) * s0.to(tl.float32)
         + tl.load(conv_w_ptr + ch * 4 + 1) * s1.to(tl.float32)
         + tl.load(conv_w_ptr + ch * 4 + 2) * s2.to(tl.float32)
         + tl.load(conv_w_ptr + ch * 4 + 3) * x.to(tl.float32))
    x = x.to(s2.dtype)
    tl.store(conv_base + ch * 3 + 0, s1)
    tl.store(conv_base + ch * 3 + 1, s2)
    tl.store(conv_base + ch * 3 + 2, x)
    if CHECKPOINT:
        tl.store(ck_conv + ch * 3 + 0, s1)
        tl.store(ck_conv + ch * 3 + 1, s2)
        tl.store(ck_conv + ch * 3 + 2, x)
    return y * tl.sigmoid(y)


def kda_decode(z: torch.Tensor, heads: int, head_dim: int, f_rank: int, w_fb: torch.Tensor,
               dt_bias: torch.Tensor, a_log: torch.Tensor, conv_w: torch.Tensor,
               o_norm: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor,
               eps: float, lower_bound: float, checkpoint: bool = False,
               out: torch.Tensor | None = None, f: torch.Tensor | None = None):
    """z [B, T, in_proj_rows]: the packed in_proj output (q|k|v|g|f_a|b|pad). ``f`` [B, T,
    H*d]: the f_b projection, already taken (then ``w_fb`` is not read).

    Updates ``conv_state`` [B, 3Hd, 3] and ``state`` [B, H, d, d] (fp32) in place; returns
    the gated-normed output [B, T, H*d], and with ``checkpoint`` also every position's
    (state [T, B, H, d, d], conv state [T, B, 3Hd, 3]).
    """
    B, T, _ = z.shape
    proj = heads * head_dim
    if out is None:
        out = torch.empty(B, T, proj, dtype=z.dtype, device=z.device)
    if checkpoint:
        ckpt_state = torch.empty(T, *state.shape, dtype=state.dtype, device=z.device)
        ckpt_conv = torch.empty(T, *conv_state.shape, dtype=conv_state.dtype, device=z.device)
    else:
        ckpt_state, ckpt_conv = state, conv_state
    if z.stride(-1) != 1 or not conv_state.is_contiguous() or not state.is_contiguous():
        raise ValueError("kda_decode needs row-major z, conv_state and state")
    scratch = torch.empty(B * heads, head_dim, dtype=torch.float32, device=z.device)
    if f is not None and (f.shape != (B, T, proj) or f.stride(2) != 1):
        raise ValueError(f"kda_decode: f {tuple(f.shape)} must be [B, T, H*d] = "
                         f"{(B, T, proj)} with contiguous rows")
    f_arg = f if f is not None else z
    kda_decode_kernel[(B * heads,)](
        z, w_fb, f_arg, dt_bias, a_log, conv_w, o_norm, conv_state, state, out, scratch,
        ckpt_state, ckpt_conv, B, T, heads, z.stride(0), z.stride(1), f_arg.stride(0),
        f_arg.stride(1), out.stride(0), out.stride(1), 3 * proj, 4 * proj, 4 * proj + f_rank,
        eps, lower_bound, D=head_dim, F_RANK=f_rank, **kda_tiles(head_dim, f_rank),
        F_GIVEN=f is not None, CHECKPOINT=checkpoint, RNE=INTERPRETED, num_warps=8)
    return (out, ckpt_state, ckpt_conv) if checkpoint else out


def kda_tiles(head_dim: int, f_rank: int) -> dict[str, int]:
    """BV (state rows a tile) and F_BLOCK (f_b columns a slice) of a launch: 64 of each on a
    GPU (at K3's d = 128: 128 registers, and 255 for a verify step, the most there are: no
    spills, no room); the interpreter takes whole dimensions."""
    if interpreter_tiles():
        return {"BV": head_dim, "F_BLOCK": f_rank}
    return {"BV": min(64, head_dim), "F_BLOCK": min(64, f_rank)}


def kda_decode_reference(z, heads, head_dim, f_rank, w_fb, dt_bias, a_log, conv_w, o_norm,
                         conv_state, state, eps, lower_bound, checkpoint=False):
    """The same contract in PyTorch: per token, conv → gates → recurrence → gated norm."""
    B, T, _ = z.shape
    H, d = heads, head_dim
    proj = H * d
    outs, states, convs = [], [], []
    for t in range(T):
        zt = z[:, t].float()
        raw = z[:, t, : 3 * proj]
        window = torch.cat([conv_state.float(), raw.float()[..., None]], dim=-1)
        mixed = torch.nn.functional.silu((window * conv_w).sum(-1))
        conv_state.copy_(torch.cat([conv_state[..., 1:], raw[..., None].to(conv_state.dtype)],
                                   dim=-1))
        q, k, v = mixed.reshape(B, 3, H, d).unbind(1)
        q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * d**-0.5
        k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        f_a = zt[:, 4 * proj: 4 * proj + f_rank]
        f = (f_a @ w_fb.float().T + dt_bias).reshape(B, H, d)
        decay = torch.exp(lower_bound * torch.sigmoid(torch.exp(a_log)[:, None] * f))
        beta = torch.sigmoid(zt[:, 4 * proj + f_rank: 4 * proj + f_rank + H])
        S = state * decay[:, :, None, :]
        u = beta[..., None] * (v - torch.einsum("bhvk,bhk->bhv", S, k))
        S = S + u[..., None] * k[:, :, None, :]
        state.copy_(S)
        o = torch.einsum("bhvk,bhk->bhv", S, q)
        gate = zt[:, 3 * proj: 4 * proj].reshape(B, H, d)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * o_norm * torch.sigmoid(gate)
        outs.append(o.reshape(B, proj).to(z.dtype))
        states.append(S.clone())
        convs.append(conv_state.clone())
    out = torch.stack(outs, dim=1)
    if checkpoint:
        return out, torch.stack(states), torch.stack(convs)
    return out
