"""S3: fused KDA decode — f_b projection, gates, conv4 + SiLU, L2 norm, delta-rule recurrence
on the fp32 state, and the gated RMSNorm, in one kernel.

Grid: (sequence × head, split). The delta rule keeps a head's state S [V=d, K=d] row by row
apart (row j of the update needs only row j, k, the gates and v[j]), so each program owns BV of
its rows: it loads them once, keeps them in registers across the step's T tokens (1 for decode,
1+k for a speculative verify, which records each position for a replay rather than storing its
state: see ``RECORD`` below) and stores them once. At K3's d = 128 a split of 8 gives a batch of
1 (12 heads a rank at TP8) 96 programs, not 12, on 132 SMs.

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

A speculative verify step (``RECORD``) leaves the state and the conv state as they were and
records, per position, what a rollback needs to redo it: each head's normalised key, decay
and delta-rule correction u (the update is then S <- S * decay + u k^T: two vectors and a
row each, not a state) and the conv inputs. Once the step's tokens are accepted, ``pending``
says how many positions of each sequence stand; the next step of that state (``REPLAY``)
folds them into the state it has just loaded, in registers, before its own tokens, and
writes it back as any decode step does. A rollback so costs no launch and no state copy,
where keeping every position's state costs T state writes a verify step and a copy back.
Records come in two halves, the one a step reads and the one a verify step writes, so that
no program overwrites what another of its head still has to replay.

The standard path runs the f_b projection as a GEMM of its own, as vLLM does, and hands its
output in (``f=``, ``F_GIVEN``): the rest of the kernel is vLLM's ``fused_kda_decode``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kimi_perf_kernels.common import (
    INTERPRETED,
    after_previous_kernel,
    cast,
    check_layout,
    interpreter_tiles,
    launch_options,
    stable_sigmoid,
)

STAGES = tl.constexpr(2)  # the next f_b slice loads while one is used
MIN_ROWS = 16             # state rows a program on a GPU: fewer and q, k, f are mostly overhead
MAX_ROWS = 64             # more and a [rows, d = 128] fp32 tile kept in registers spills
MAX_VERIFY_ROWS = 32      # a verify step's (its conv windows and decay gates held too)


@triton.jit
def kda_decode_kernel(z_ptr, wfb_ptr, f_ptr, dt_bias_ptr, a_log_ptr, conv_w_ptr, onorm_ptr,
                      conv_ptr, state_ptr, out_ptr, scratch_ptr, arrivals_ptr, records_ptr,
                      inputs_ptr, pending_ptr, half_ptr, B, T, H, T_REC, stride_zb, stride_zt,
                      stride_fb, stride_ft, stride_ob, stride_ot, g_col, fa_col, b_col, eps,
                      lower_bound, D: tl.constexpr, F_RANK: tl.constexpr, BV: tl.constexpr,
                      F_BLOCK: tl.constexpr, T_PAD: tl.constexpr, F_GIVEN: tl.constexpr,
                      REPLAY: tl.constexpr, RECORD: tl.constexpr, DOT_FP32: tl.constexpr,
                      RNE: tl.constexpr, PDL: tl.constexpr = False):
    # (T_PAD, the rows of a verify step's f_b product, ``kda_token_rows``, is 1 for a decode
    # step: the ``T_PAD > 1`` branches are a verify step's)
    after_previous_kernel(PDL)
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
    accepted = 0
    old_inputs = inputs_ptr
    new_records = records_ptr
    new_inputs = inputs_ptr
    if REPLAY:
        # The last verify step's accepted positions, folded into the state: S * decay + u k^T
        # a position, from two vectors and this program's rows of u.
        half = tl.load(half_ptr)
        accepted = tl.load(pending_ptr + b)
        head_records = records_ptr + ((half * B + b) * H + h) * T_REC * 3 * D
        for t in range(0, accepted):
            record = head_records + t * 3 * D
            key = tl.load(record + i)
            decay = tl.load(record + D + i)
            u = tl.load(record + 2 * D + rows)
            S = S * decay[None, :] + u[:, None] * key[None, :]
        old_inputs = inputs_ptr + (half * B + b) * T_REC * C
        new_records = records_ptr + (((1 - half) * B + b) * H + h) * T_REC * 3 * D
        new_inputs = inputs_ptr + ((1 - half) * B + b) * T_REC * C
        if RECORD:  # noqa: SIM102 (a constexpr test apart from the runtime one)
            if accepted > 0:
                tl.store(state_ptr + tile, S)         # where a verify step leaves the state
    if T_PAD > 1:
        # A verify step's conv windows (the three inputs before its first token) and weights,
        # loaded once and slid in registers over its tokens.
        qw0, qw1, qw2, qw3 = _conv_weights(conv_w_ptr, q_ch)
        kw0, kw1, kw2, kw3 = _conv_weights(conv_w_ptr, k_ch)
        vw0, vw1, vw2, vw3 = _conv_weights(conv_w_ptr, v_ch)
        qx0, qx1, qx2 = _window(conv_base, old_inputs, C, q_ch, accepted, REPLAY)
        kx0, kx1, kx2 = _window(conv_base, old_inputs, C, k_ch, accepted, REPLAY)
        vx0, vx1, vx2 = _window(conv_base, old_inputs, C, v_ch, accepted, REPLAY)
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
        decay_all = tl.exp(lower_bound * stable_sigmoid(a * (f_all + dt_bias[None, :])))
    for t in range(0, T):
        z = zb + t * stride_zt
        qn = tl.load(z + q_ch)
        kn = tl.load(z + k_ch)
        vn = tl.load(z + v_ch)
        if T_PAD > 1:
            q = _silu_conv(qw0, qw1, qw2, qw3, qx0, qx1, qx2, qn)
            k = _silu_conv(kw0, kw1, kw2, kw3, kx0, kx1, kx2, kn)
            v = _silu_conv(vw0, vw1, vw2, vw3, vx0, vx1, vx2, vn)
            # the window keeps the input as the conv state stores it
            qx0, qx1, qx2 = qx1, qx2, qn.to(qx0.dtype)
            kx0, kx1, kx2 = kx1, kx2, kn.to(kx0.dtype)
            vx0, vx1, vx2 = vx1, vx2, vn.to(vx0.dtype)
        else:
            q = _decode_conv(conv_base, old_inputs, C, conv_w_ptr, q_ch, accepted, qn, REPLAY)
            k = _decode_conv(conv_base, old_inputs, C, conv_w_ptr, k_ch, accepted, kn, REPLAY)
            vx0, vx1, vx2 = _window(conv_base, old_inputs, C, v_ch, accepted, REPLAY)
            v = _silu_conv(*_conv_weights(conv_w_ptr, v_ch), vx0, vx1, vx2, vn)
            if not RECORD:
                # The v channels are this program's alone: their new conv state is written
                # at once (after every thread has read the old), not held over the f_b GEMV
                # in registers (64 rows a program at batch 64: 136 registers on sm_90a, at
                # 8 warps one CTA an SM; the compile table has each build's). Capped at 128
                # (maxnreg), two an SM, it compiles without spills, while the replay and
                # verify builds spill 112-156 bytes: untried on a GPU.
                tl.debug_barrier()
                _store_window(conv_base, v_ch, vx1, vx2, vn.to(vx2.dtype))
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * (1.0 / tl.sqrt(D * 1.0))
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        if F_GIVEN:
            f = dt_bias + tl.load(f_ptr + b * stride_fb + t * stride_ft + h * D + i).to(
                tl.float32)
            decay = tl.exp(lower_bound * stable_sigmoid(a * f))
        elif T_PAD > 1:
            decay = tl.sum(tl.where(tok[:, None] == t, decay_all, 0.0), axis=0)   # row t
        else:
            f = dt_bias
            for r0 in tl.range(0, F_RANK, F_BLOCK, num_stages=STAGES):
                f_a = tl.load(z + fa_col + r0 + r).to(tl.float32)
                w = tl.load(wfb_ptr + (h * D + i)[:, None] * F_RANK + r0 + r[None, :])
                f += tl.sum(w.to(tl.float32) * f_a[None, :], axis=1)
            decay = tl.exp(lower_bound * stable_sigmoid(a * f))
        beta = tl.sigmoid(tl.load(z + b_col + h).to(tl.float32))
        S = S * decay[None, :]
        u = beta * (v - tl.sum(S * k[None, :], axis=1))
        S = S + u[:, None] * k[None, :]
        tl.store(scratch + t * D + rows, tl.sum(S * q[None, :], axis=1))
        if RECORD:                                    # position t, for its replay
            record = new_records + t * 3 * D
            tl.store(record + 2 * D + rows, u)
            tl.store(new_inputs + t * C + v_ch, vn.to(new_inputs.dtype.element_ty))
            if split == 0:
                tl.store(record + i, k)
                tl.store(record + D + i, decay)
                tl.store(new_inputs + t * C + q_ch, qn.to(new_inputs.dtype.element_ty))
                tl.store(new_inputs + t * C + k_ch, kn.to(new_inputs.dtype.element_ty))
    if not RECORD:
        tl.store(state_ptr + tile, S)
    tl.debug_barrier()                                # every thread's reads and writes done
    if RECORD:
        if accepted > 0:                              # the accepted inputs join the conv state
            _store_window(conv_base, v_ch,
                          *_window(conv_base, old_inputs, C, v_ch, accepted, REPLAY))
    elif T_PAD > 1:
        _store_window(conv_base, v_ch, vx0, vx1, vx2)
    arrived = tl.atomic_add(arrivals_ptr + pid, 1, sem="acq_rel")
    if arrived == tl.num_programs(1) - 1:
        # the head's last program: the others have read q's and k's conv state and parked
        # their rows of every token's output
        if RECORD:
            if accepted > 0:
                _store_window(conv_base, q_ch,
                              *_window(conv_base, old_inputs, C, q_ch, accepted, REPLAY))
                _store_window(conv_base, k_ch,
                              *_window(conv_base, old_inputs, C, k_ch, accepted, REPLAY))
        elif T_PAD > 1:
            _store_window(conv_base, q_ch, qx0, qx1, qx2)
            _store_window(conv_base, k_ch, kx0, kx1, kx2)
        else:
            _shift_window(zb, conv_base, old_inputs, C, q_ch, accepted, REPLAY)
            _shift_window(zb, conv_base, old_inputs, C, k_ch, accepted, REPLAY)
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
def _window(conv_base, old_inputs, C, ch, accepted, REPLAY: tl.constexpr):
    """Channels ``ch``'s three newest inputs, oldest first: the conv state's, followed by the
    ``accepted`` inputs a verify step recorded (``REPLAY``)."""
    if REPLAY:
        return (_input(conv_base, old_inputs, C, ch, accepted),
                _input(conv_base, old_inputs, C, ch, accepted + 1),
                _input(conv_base, old_inputs, C, ch, accepted + 2))
    else:
        return (tl.load(conv_base + ch * 3 + 0), tl.load(conv_base + ch * 3 + 1),
                tl.load(conv_base + ch * 3 + 2))


@triton.jit
def _input(conv_base, old_inputs, C, ch, j):
    """Input j of the channels' history: the conv state's three, then the recorded ones."""
    kept = tl.load(conv_base + ch * 3 + j, mask=j < 3, other=0.0)
    recorded = tl.load(old_inputs + (j - 3) * C + ch, mask=j >= 3, other=0.0)
    return tl.where(j < 3, kept, recorded)


@triton.jit
def _store_window(dest, ch, x0, x1, x2):
    tl.store(dest + ch * 3 + 0, x0)
    tl.store(dest + ch * 3 + 1, x1)
    tl.store(dest + ch * 3 + 2, x2)


@triton.jit
def _decode_conv(conv_base, old_inputs, C, conv_w_ptr, ch, accepted, x, REPLAY: tl.constexpr):
    """A decode token's conv: its window is the channels' three newest inputs and its own."""
    return _silu_conv(*_conv_weights(conv_w_ptr, ch),
                      *_window(conv_base, old_inputs, C, ch, accepted, REPLAY), x)


@triton.jit
def _shift_window(z, conv_base, old_inputs, C, ch, accepted, REPLAY: tl.constexpr):
    """Write the conv state after a decode token: the two newest inputs before it and its
    own (the thread that stores an input is the one that read those it replaces)."""
    _, x1, x2 = _window(conv_base, old_inputs, C, ch, accepted, REPLAY)
    _store_window(conv_base, ch, x1, x2, tl.load(z + ch).to(x2.dtype))


@triton.jit
def _silu_conv(w0, w1, w2, w3, x0, x1, x2, x3):
    """SiLU(Σ_j w_j · x_j) over a window of four inputs, oldest first."""
    y = (w0 * x0.to(tl.float32) + w1 * x1.to(tl.float32) + w2 * x2.to(tl.float32)
         + w3 * x3.to(tl.float32))
    return y * tl.sigmoid(y)


def kda_splits(rows: int, head_dim: int, device: torch.device, tokens: int = 1) -> int:
    """Programs a head's state is split over, for ``rows`` (sequence, head) pairs: rows of
    MIN_ROWS to MAX_ROWS a program (to MAX_VERIFY_ROWS for a verify step's ``tokens``),
    doubling the split while the grid is under two programs an SM; 1 under the interpreter's
    whole tiles. Depends on shapes only (a CUDA graph keeps it)."""
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


class KdaRecords(NamedTuple):
    """What speculative verify steps leave for their rollback, in two halves (the one a step
    reads, the one a verify step writes).

    ``records`` [2, B, H, T, 3, d] fp32: per position, each head's normalised key, decay and
    delta-rule correction u (u = beta (v - S k), S already decayed); ``inputs`` [2, B, T, 3Hd]
    (the conv state's dtype): every position's conv inputs; ``pending`` [B] int32: how many
    positions of the last verify step each sequence accepted and the state has not folded in
    yet (0: none; at most T); ``half`` [1] int32: the half that holds them (0 or 1). The
    kernel reads both on the device, unchecked (``DecodeState.accept`` clamps the counts to
    the step): a count past T would replay another head's records.
    """

    records: torch.Tensor
    inputs: torch.Tensor
    pending: torch.Tensor
    half: torch.Tensor

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int, tokens: int, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> KdaRecords:
        """Room for verify steps of up to ``tokens`` positions, none pending."""
        return cls(torch.zeros(2, batch, heads, tokens, 3, head_dim, device=device),
                   torch.zeros(2, batch, tokens, 3 * heads * head_dim, dtype=dtype,
                               device=device),
                   torch.zeros(batch, dtype=torch.int32, device=device),
                   torch.zeros(1, dtype=torch.int32, device=device))

    def check(self, batch: int, heads: int, head_dim: int, conv_dtype: torch.dtype) -> None:
        rec = self.records
        tokens = rec.shape[3] if rec.dim() == 6 else 0
        want = {"records": ((2, batch, heads, tokens, 3, head_dim), torch.float32),
                "inputs": ((2, batch, tokens, 3 * heads * head_dim), conv_dtype),
                "pending": ((batch,), torch.int32), "half": ((1,), torch.int32)}
        for name, (shape, dtype) in want.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"kda_decode: records.{name} {tuple(t.shape)} {t.dtype} must "
                                 f"be contiguous {shape} {dtype}")


def kda_decode(z: torch.Tensor, heads: int, head_dim: int, f_rank: int, w_fb: torch.Tensor,
               dt_bias: torch.Tensor, a_log: torch.Tensor, conv_w: torch.Tensor,
               o_norm: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor,
               eps: float, lower_bound: float, out: torch.Tensor | None = None,
               f: torch.Tensor | None = None, arrivals: torch.Tensor | None = None,
               splits: int | None = None, records: KdaRecords | None = None,
               record: bool = False) -> torch.Tensor:
    """z [B, T, in_proj_rows]: the packed in_proj output (q|k|v|g|f_a|b|pad). ``f`` [B, T,
    H*d]: the f_b projection, already taken (then ``w_fb`` is not read). Returns the
    gated-normed output [B, T, H*d].

    ``conv_state`` [B, 3Hd, 3] and ``state`` [B, H, d, d] (fp32) are updated in place: first
    with the positions ``records`` has pending (when given), then with the step's tokens;
    except that a verify step (``record``, which needs ``records``) leaves them after the
    pending positions and records its own in the other half (``KdaRecords``; its caller then
    flips ``half`` and sets ``pending``).

    ``arrivals``: int32 zeros, at least B*H of them, which the launch leaves zero (a caller
    that keeps one spares each launch a memset; launches that may run at the same time need
    one each, and one a failed launch left nonzero must be zeroed again); ``splits``:
    programs a head (a power of two dividing d; ``kda_splits`` when None).
    """
    B, T, width = z.shape
    proj = heads * head_dim
    if width < 4 * proj + f_rank + heads:
        raise ValueError(f"kda_decode: z's {width} columns cannot hold q|k|v|g|f_a|b "
                         f"({4 * proj + f_rank + heads})")
    if f is not None and (f.shape != (B, T, proj) or f.stride(2) != 1):
        raise ValueError(f"kda_decode: f {tuple(f.shape)} must be [B, T, H*d] = "
                         f"{(B, T, proj)} with contiguous rows")
    # (w_fb is read only without f)
    check_layout("kda_decode", {"w_fb": None if f is not None else w_fb, "dt_bias": dt_bias,
                                "a_log": a_log, "conv_w": conv_w, "o_norm": o_norm,
                                "conv_state": conv_state, "state": state,
                                "arrivals": arrivals,
                                **(records._asdict() if records else {})},
                 {"z": z, "out": out, "f": f},
                 {"w_fb": (proj, f_rank), "dt_bias": (proj,), "a_log": (heads,),
                  "conv_w": (3 * proj, 4), "o_norm": (head_dim,),
                  "conv_state": (B, 3 * proj, 3), "state": (B, heads, head_dim, head_dim),
                  "out": (B, T, proj)},
                 {"state": (torch.float32,)})
    if records is not None:
        records.check(B, heads, head_dim, conv_state.dtype)
    if record and (records is None or records.records.shape[3] < T):
        room = 0 if records is None else records.records.shape[3]
        raise ValueError(f"kda_decode: a verify step of {T} tokens needs records with room "
                         f"for them, not {room}")
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
    f_block = tiles["F_BLOCK"]
    if head_dim & (head_dim - 1) or f_rank % f_block or f_block & (f_block - 1) or (
            T > 1 and f is None and not INTERPRETED and min(f_block, head_dim) < 16):
        # (unmasked slices; a tensor-core product needs 16 at least on a GPU)
        raise ValueError(f"kda_decode: head_dim {head_dim} must be a power of two and f_rank "
                         f"{f_rank} a multiple of {f_block}, a power of two too (16 or more "
                         "for a verify step on a GPU)")
    if out is None:
        out = torch.empty(B, T, proj, dtype=z.dtype, device=z.device)
    # (without records the kernel reads none of theirs: any pointers of the types stand in)
    rec = records or KdaRecords(state, conv_state, arrivals, arrivals)
    scratch = torch.empty(B * heads, T, head_dim, dtype=torch.float32, device=z.device)
    f_arg = f if f is not None else z
    kda_decode_kernel[(B * heads, splits)](
        z, w_fb, f_arg, dt_bias, a_log, conv_w, o_norm, conv_state, state, out, scratch,
        arrivals, *rec, B, T, heads, rec.records.shape[3] if records else 0, z.stride(0),
        z.stride(1), f_arg.stride(0), f_arg.stride(1), out.stride(0), out.stride(1), 3 * proj,
        4 * proj, 4 * proj + f_rank, eps, lower_bound, D=head_dim, F_RANK=f_rank, **tiles,
        T_PAD=kda_token_rows(T), F_GIVEN=f is not None, REPLAY=records is not None,
        RECORD=record, DOT_FP32=INTERPRETED, RNE=INTERPRETED,
        num_warps=kda_warps(tiles["BV"]), **launch_options())
    return out


def kda_tiles(head_dim: int, f_rank: int, splits: int) -> dict[str, int]:
    """BV (state rows a program: head_dim / splits) and F_BLOCK (f_b columns a slice: 64 on
    a GPU, the whole rank under the interpreter's tiles). K3's whole rank of 128 in one slice
    spills the batch-64 replay build on sm_90a; two slices of 64 do not (the AOT check)."""
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
                         conv_state, state, eps, lower_bound, records=None, record=False):
    """The same contract in PyTorch, a sequence and a token at a time: the pending positions
    replayed, then per token conv → gates → recurrence → gated norm."""
    B, T, _ = z.shape
    H, d = heads, head_dim
    proj = H * d
    if records is not None:
        half = int(records.half)
        for b in range(B):
            for t in range(int(records.pending[b])):
                key, decay, u = records.records[half, b, :, t].unbind(1)        # [H, d]
                state[b] = state[b] * decay[:, None, :] + u[:, :, None] * key[:, None, :]
                conv_state[b] = torch.cat([conv_state[b, :, 1:],
                                           records.inputs[half, b, t][:, None]], dim=-1)
    S, conv = state.clone(), conv_state.clone()
    outs = []
    for t in range(T):
        zt = z[:, t].float()
        raw = z[:, t, : 3 * proj]
        window = torch.cat([conv.float(), raw.float()[..., None]], dim=-1)
        mixed = torch.nn.functional.silu((window * conv_w).sum(-1))
        conv = torch.cat([conv[..., 1:], raw[..., None].to(conv.dtype)], dim=-1)
        q, k, v = mixed.reshape(B, 3, H, d).unbind(1)
        q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * d**-0.5
        k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        f_a = zt[:, 4 * proj: 4 * proj + f_rank]
        f = (f_a @ w_fb.float().T + dt_bias).reshape(B, H, d)
        decay = torch.exp(lower_bound * torch.sigmoid(torch.exp(a_log)[:, None] * f))
        beta = torch.sigmoid(zt[:, 4 * proj + f_rank: 4 * proj + f_rank + H])
        S = S * decay[:, :, None, :]
        u = beta[..., None] * (v - torch.einsum("bhvk,bhk->bhv", S, k))
        S = S + u[..., None] * k[:, :, None, :]
        o = torch.einsum("bhvk,bhk->bhv", S, q)
        gate = zt[:, 3 * proj: 4 * proj].reshape(B, H, d)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * o_norm * torch.sigmoid(gate)
        outs.append(o.reshape(B, proj).to(z.dtype))
        if record:
            records.records[1 - half, :, :, t] = torch.stack([k, decay, u], dim=2)
            records.inputs[1 - half, :, t] = raw.to(records.inputs.dtype)
    if not record:
        state.copy_(S)
        conv_state.copy_(conv)
    return torch.stack(outs, dim=1)
