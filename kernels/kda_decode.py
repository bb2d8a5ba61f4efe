"""S3: fused KDA decode — f_b projection, gates, conv4 + SiLU, L2 norm, delta-rule recurrence
on the fp32 state, and the gated RMSNorm, in one kernel.

Grid: (sequence × head, split). The delta rule keeps a head's state S [V=d, K=d] row by row
apart (row j of the update needs only row j, k, the gates and v[j]), so each program owns BV
of its rows: it loads them once, keeps them in registers across the step's T tokens (1 for
decode, 1+k for a speculative verify, which also writes every position's state so the step
can be rolled back) and stores them once. At K3's d = 128 a split of 8 gives a batch of 1
(12 heads a rank at TP8) 96 programs, not 12, on 132 SMs.

What each program still needs whole, it computes whole: q and k (conv4 + SiLU + L2 norm over
all d), the f_b projection and the decay gate over K. A decode token's projection is a GEMV
in F_BLOCK-wide slices of the head's [d, f_rank] weight; a verify step's tokens take theirs
in one tensor-core product, one pass over the weight, and slide each channel's conv window
in registers over the tokens. q's and k's conv state, which every program of the head reads,
is only read while the step runs: the head's last program to finish writes it. Each program
writes its own v channels' (a decode token's at once, a verify step's at the end).

The gated RMSNorm needs all d outputs of a token: the programs park their rows in an fp32
scratch row and count themselves in on an arrival counter (an atomic, acquire-release); the
last to arrive normalises the head's rows and sets the counter back to 0 for the next launch.

The standard path runs the f_b projection as a GEMM of its own, as vLLM does, and hands its
output in (``f=``, ``F_GIVEN``): the rest of the kernel is vLLM's ``fused_kda_decode``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_perf_kernels.common import INTERPRETED, cast, interpreter_tiles, sigmoid

STAGES = tl.constexpr(2)  # the next f_b slice loads while one is used
MIN_ROWS = 16             # state rows a program on a GPU: fewer and q, k, f are mostly overhead
MAX_ROWS = 64             # more and a [rows, d = 128] fp32 tile kept in registers spills
MAX_VERIFY_ROWS = 32      # a verify step's (its conv windows and decay gates held too)


@triton.jit
def kda_decode_kernel(z_ptr, wfb_ptr, f_ptr, dt_bias_ptr, a_log_ptr, conv_w_ptr, onorm_ptr,
                      conv_ptr, state_ptr, out_ptr, scratch_ptr, arrivals_ptr, ckpt_state_ptr,
                      ckpt_conv_ptr, B, T, H, stride_zb, stride_zt, stride_fb, stride_ft,
                      stride_ob, stride_ot, g_col, fa_col, b_col, eps, lower_bound,
                      D: tl.constexpr, F_RANK: tl.constexpr, BV: tl.constexpr,
                      F_BLOCK: tl.constexpr, T_PAD: tl.constexpr, F_GIVEN: tl.constexpr,
                      CHECKPOINT: tl.constexpr, DOT_FP32: tl.constexpr, RNE: tl.constexpr):
    pid = tl.program_id(0)                            # (sequence, head)
    split = tl.program_id(1)                          # which BV rows of the head's state
    b = pid // H
    h = pid % H
    C = 3 * H * D                                     # conv channels: q, k, v of all heads
    i = tl.arange(0, D)
    rows = split * BV + tl.arange(0, BV)
    r = tl.arange(0, F_BLOCK)
    q_ch = h * D + i
    k_ch = H * D + h * D + i
    v_ch = 2 * H * D + h * D + rows
    zb = z_ptr + b * stride_zb
    conv_base = conv_ptr + b * C * 3
    dt_bias = tl.load(dt_bias_ptr + h * D + i)
    a = tl.exp(tl.load(a_log_ptr + h))
    tile = (b * H + h) * D * D + rows[:, None] * D + i[None, :]
    S = tl.load(state_ptr + tile)
    scratch = scratch_ptr + pid * T * D
    if T_PAD > 1:
        # A verify step's conv windows (the conv state's three inputs) and weights, loaded
        # once and slid in registers over its tokens: the conv state is only read here.
        qw0, qw1, qw2, qw3 = _conv_weights(conv_w_ptr, q_ch)
        kw0, kw1, kw2, kw3 = _conv_weights(conv_w_ptr, k_ch)
        vw0, vw1, vw2, vw3 = _conv_weights(conv_w_ptr, v_ch)
        qx0, qx1, qx2 = _window(conv_base, q_ch)
        kx0, kx1, kx2 = _window(conv_base, k_ch)
        vx0, vx1, vx2 = _window(conv_base, v_ch)
    if not F_GIVEN and T_PAD > 1:
        # A verify step's f_b projections at once: one pass over the head's [d, f_rank]
        # weight (not one a token), rows t < T of a [T_PAD, d] tensor-core product.
        tok = tl.arange(0, T_PAD)
        f_all = tl.zeros([T_PAD, D], dtype=tl.float32)
        for r0 in tl.range(0, F_RANK, F_BLOCK, num_stages=STAGES):
            f_a = tl.load(zb + tok[:, None] * stride_zt + fa_col + r0 + r[None, :],
                          mask=tok[:, None] < T, other=0.0)
            w_t = tl.load(wfb_ptr + (h * D + i)[None, :] * F_RANK + r0 + r[:, None])
            if DOT_FP32 or f_a.dtype == tl.float32:
                # fp32 products in fp32 (not tf32: as a decode token's GEMV takes them); the
                # interpreter's bf16 dot is wrong
                f_all = tl.dot(f_a.to(tl.float32), w_t.to(tl.float32), f_all,
                               input_precision="ieee")
            else:
                f_all = tl.dot(f_a, w_t, f_all)       # bf16 products, exact in fp32
        decay_all = tl.exp(lower_bound * sigmoid(a * (f_all + dt_bias[None, :])))
    for t in range(0, T):
        z = zb + t * stride_zt
        if T_PAD > 1:
            qn = tl.load(z + q_ch)
            kn = tl.load(z + k_ch)
            vn = tl.load(z + v_ch)
            q = _silu_conv(qw0, qw1, qw2, qw3, qx0, qx1, qx2, qn)
            k = _silu_conv(kw0, kw1, kw2, kw3, kx0, kx1, kx2, kn)
            v = _silu_conv(vw0, vw1, vw2, vw3, vx0, vx1, vx2, vn)
            # the window keeps the input as the conv state stores it
            qx0, qx1, qx2 = qx1, qx2, qn.to(qx0.dtype)
            kx0, kx1, kx2 = kx1, kx2, kn.to(kx0.dtype)
            vx0, vx1, vx2 = vx1, vx2, vn.to(vx0.dtype)
        else:
            q = _decode_conv(z, conv_base, conv_w_ptr, q_ch)
            k = _decode_conv(z, conv_base, conv_w_ptr, k_ch)
            v = _decode_conv(z, conv_base, conv_w_ptr, v_ch)
            # The v channels are this program's alone: their new conv state is written at
            # once (after every thread has read the old), not held over the f_b GEMV (at 64
            # rows a program: 128 registers, not 168; two CTAs an SM).
            if CHECKPOINT:
                _shift_window(z, conv_base, ckpt_conv_ptr + b * C * 3, v_ch)
            tl.debug_barrier()
            _shift_window(z, conv_base, conv_base, v_ch)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * (1.0 / tl.sqrt(D * 1.0))
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        if F_GIVEN:
            f = dt_bias + tl.load(f_ptr + b * stride_fb + t * stride_ft + h * D + i).to(
                tl.float32)
            decay = tl.exp(lower_bound * sigmoid(a * f))
        elif T_PAD > 1:
            decay = tl.sum(tl.where(tok[:, None] == t, decay_all, 0.0), axis=0)   # row t
        else:
            f = dt_bias
            for r0 in tl.range(0, F_RANK, F_BLOCK, num_stages=STAGES):
                f_a = tl.load(z + fa_col + r0 + r).to(tl.float32)
                w = tl.load(wfb_ptr + (h * D + i)[:, None] * F_RANK + r0 + r[None, :])
                f += tl.sum(w.to(tl.float32) * f_a[None, :], axis=1)
            decay = tl.exp(lower_bound * sigmoid(a * f))
        beta = tl.sigmoid(tl.load(z + b_col + h).to(tl.float32))
        S = S * decay[None, :]
        u = beta * (v - tl.sum(S * k[None, :], axis=1))
        S = S + u[:, None] * k[None, :]
        tl.store(scratch + t * D + rows, tl.sum(S * q[None, :], axis=1))
        if CHECKPOINT:                                # position t's state, for the rollback
            tl.store(ckpt_state_ptr + t * B * H * D * D + tile, S)
            ck_conv = ckpt_conv_ptr + (t * B + b) * C * 3
            if T_PAD > 1:
                _store_window(ck_conv, v_ch, vx0, vx1, vx2)
                if split == 0:
                    _store_window(ck_conv, q_ch, qx0, qx1, qx2)
                    _store_window(ck_conv, k_ch, kx0, kx1, kx2)
            elif split == 0:
                _shift_window(z, conv_base, ck_conv, q_ch)
                _shift_window(z, conv_base, ck_conv, k_ch)
    tl.store(state_ptr + tile, S)
    tl.debug_barrier()                                # every thread's reads and writes done
    if T_PAD > 1:
        _store_window(conv_base, v_ch, vx0, vx1, vx2)
    arrived = tl.atomic_add(arrivals_ptr + pid, 1, sem="acq_rel")
    if arrived == tl.num_programs(1) - 1:
        # the head's last program: the others have read q's and k's conv state and parked
        # their rows of every token's output
        if T_PAD > 1:
            _store_window(conv_base, q_ch, qx0, qx1, qx2)
            _store_window(conv_base, k_ch, kx0, kx1, kx2)
        else:
            _shift_window(zb, conv_base, conv_base, q_ch)
            _shift_window(zb, conv_base, conv_base, k_ch)
        tl.store(arrivals_ptr + pid, 0)
        norm_w = tl.load(onorm_ptr + i)
        for t in range(0, T):
            o = tl.load(scratch + t * D + i, cache_modifier=".cg")   # from L2, not a stale L1
            inv_rms = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / D + eps)
            gate = tl.load(zb + t * stride_zt + g_col + h * D + i).to(tl.float32)
            tl.store(out_ptr + b * stride_ob + t * stride_ot + h * D + i,
                     cast(o * inv_rms * norm_w * tl.sigmoid(gate), out_ptr.dtype.element_ty,
                          RNE))


@triton.jit
def _conv_weights(conv_w_ptr, ch):
    return (tl.load(conv_w_ptr + ch * 4 + 0), tl.load(conv_w_ptr + ch * 4 + 1),
            tl.load(conv_w_ptr + ch * 4 + 2), tl.load(conv_w_ptr + ch * 4 + 3))


@triton.jit
def _window(conv_base, ch):
    """A conv state's three inputs of channels ``ch``, oldest first."""
    return (tl.load(conv_base + ch * 3 + 0), tl.load(conv_base + ch * 3 + 1),
            tl.load(conv_base + ch * 3 + 2))


@triton.jit
def _store_window(dest, ch, x0, x1, x2):
    tl.store(dest + ch * 3 + 0, x0)
    tl.store(dest + ch * 3 + 1, x1)
    tl.store(dest + ch * 3 + 2, x2)


@triton.jit
def _decode_conv(z, conv_base, conv_w_ptr, ch):
    """A decode token's conv: its window is the conv state's three inputs and its own."""
    return _silu_conv(*_conv_weights(conv_w_ptr, ch), *_window(conv_base, ch), tl.load(z + ch))


@triton.jit
def _shift_window(z, conv_base, dest, ch):
    """Write to ``dest`` the conv state after a decode token: the state's two newest inputs
    and the token's (all read before any is written: ``dest`` may be the state)."""
    _, x1, x2 = _window(conv_base, ch)
    _store_window(dest, ch, x1, x2, tl.load(z + ch).to(x2.dtype))


@triton.jit
def _silu_conv(w0, w1, w2, w3, x0, x1, x2, x3):
    """SiLU(Σ_j w_j · x_j) over a window of four inputs, oldest first."""
    y = (w0 * x0.to(tl.float32) + w1 * x1.to(tl.float32) + w2 * x2.to(tl.float32)
         + w3 * x3.to(tl.float32))
    return y * tl.sigmoid(y)


def kda_splits(rows: int, head_dim: int, device: torch.device, tokens: int = 1) -> int:
    """Programs a head's state is split over, for ``rows`` (sequence, head) pairs: rows of
    MIN_ROWS to MAX_ROWS a program, doubling the split while the grid is under two programs
    an SM; 1 under the interpreter's whole tiles. Depends on shapes only (a CUDA graph keeps
    it)."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    elif interpreter_tiles():
        return 1
    else:
        sms = 132                                     # a GPU's tiles under the interpreter: H200
    splits = max(1, head_dim // (MAX_ROWS if tokens == 1 else MAX_VERIFY_ROWS))
    while rows * splits < 2 * sms and head_dim // (2 * splits) >= MIN_ROWS:
        splits *= 2
    return splits


def kda_decode(z: torch.Tensor, heads: int, head_dim: int, f_rank: int, w_fb: torch.Tensor,
               dt_bias: torch.Tensor, a_log: torch.Tensor, conv_w: torch.Tensor,
               o_norm: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor,
               eps: float, lower_bound: float, checkpoint: bool = False,
               out: torch.Tensor | None = None, f: torch.Tensor | None = None,
               arrivals: torch.Tensor | None = None, splits: int | None = None):
    """z [B, T, in_proj_rows]: the packed in_proj output (q|k|v|g|f_a|b|pad). ``f`` [B, T,
    H*d]: the f_b projection, already taken (then ``w_fb`` is not read).

    Updates ``conv_state`` [B, 3Hd, 3] and ``state`` [B, H, d, d] (fp32) in place; returns
    the gated-normed output [B, T, H*d], and with ``checkpoint`` also every position's
    (state [T, B, H, d, d], conv state [T, B, 3Hd, 3]).

    ``arrivals``: int32 zeros, at least B*H of them, which the launch leaves zero (a caller
    that keeps one spares each launch a memset; launches that may run at the same time need
    one each, and one a failed launch left nonzero must be zeroed again); ``splits``:
    programs a head (a power of two dividing d; ``kda_splits`` when None).
    """
    B, T, _ = z.shape
    proj = heads * head_dim
    if z.stride(-1) != 1 or not conv_state.is_contiguous() or not state.is_contiguous():
        raise ValueError("kda_decode needs row-major z, conv_state and state")
    if f is not None and (f.shape != (B, T, proj) or f.stride(2) != 1):
        raise ValueError(f"kda_decode: f {tuple(f.shape)} must be [B, T, H*d] = "
                         f"{(B, T, proj)} with contiguous rows")
    if splits is None:
        splits = kda_splits(B * heads, head_dim, z.device, T)
    if splits < 1 or head_dim % splits or (splits & (splits - 1)):
        raise ValueError(f"kda_decode: {splits} splits must be a power of two dividing "
                         f"head_dim {head_dim}")
    if arrivals is None:
        arrivals = torch.zeros(B * heads, dtype=torch.int32, device=z.device)
    elif arrivals.dtype != torch.int32 or arrivals.numel() < B * heads:
        raise ValueError(f"kda_decode: arrivals must be int32 with at least {B * heads} "
                         f"elements, not {arrivals.dtype} x {arrivals.numel()}")
    tiles = kda_tiles(head_dim, f_rank, splits)
    if head_dim & (head_dim - 1) or f_rank % tiles["F_BLOCK"] or (
            T > 1 and f is None and not INTERPRETED and min(tiles["F_BLOCK"], head_dim) < 16):
        # (unmasked slices; a tensor-core product needs 16 at least on a GPU)
        raise ValueError(f"kda_decode: head_dim {head_dim} must be a power of two and f_rank "
                         f"{f_rank} a multiple of {tiles['F_BLOCK']} (16 or more for a verify "
                         "step on a GPU)")
    if out is None:
        out = torch.empty(B, T, proj, dtype=z.dtype, device=z.device)
    if checkpoint:
        ckpt_state = torch.empty(T, *state.shape, dtype=state.dtype, device=z.device)
        ckpt_conv = torch.empty(T, *conv_state.shape, dtype=conv_state.dtype, device=z.device)
    else:
        ckpt_state, ckpt_conv = state, conv_state
    scratch = torch.empty(B * heads, T, head_dim, dtype=torch.float32, device=z.device)
    f_arg = f if f is not None else z
    kda_decode_kernel[(B * heads, splits)](
        z, w_fb, f_arg, dt_bias, a_log, conv_w, o_norm, conv_state, state, out, scratch,
        arrivals, ckpt_state, ckpt_conv, B, T, heads, z.stride(0), z.stride(1),
        f_arg.stride(0), f_arg.stride(1), out.stride(0), out.stride(1), 3 * proj, 4 * proj,
        4 * proj + f_rank, eps, lower_bound, D=head_dim, F_RANK=f_rank, **tiles,
        T_PAD=kda_token_rows(T), F_GIVEN=f is not None, CHECKPOINT=checkpoint,
        DOT_FP32=INTERPRETED, RNE=INTERPRETED,
        num_warps=kda_warps(tiles["BV"]))
    return (out, ckpt_state, ckpt_conv) if checkpoint else out


def kda_tiles(head_dim: int, f_rank: int, splits: int) -> dict[str, int]:
    """BV (state rows a program: head_dim / splits) and F_BLOCK (f_b columns a slice: 64 on
    a GPU, the whole rank under the interpreter's tiles)."""
    return {"BV": head_dim // splits,
            "F_BLOCK": f_rank if interpreter_tiles() else min(64, f_rank)}


def kda_token_rows(tokens: int) -> int:
    """Rows of a verify step's f_b product (a tensor-core tile: 16 at least); 1 for decode,
    whose one token takes the projection as a GEMV."""
    return 1 if tokens == 1 else max(16, triton.next_power_of_2(tokens))


def kda_warps(rows: int) -> int:
    """4 warps for a tile of up to 32 state rows, 8 above."""
    return 4 if rows <= 32 else 8


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
