import json
import os
import re
import subprocess
import sys

import pytest
import torch

from kimi_perf_kernels.common import INTERPRETED, gpu_tiles
from kimi_perf_kernels.kda_decode import KdaRecords, kda_decode, kda_decode_reference, kda_splits
from tests.kernels.util import assert_close_bf16, poison, program_order

# The fp32 recurrent state against the reference's: the same operations in another order
# differ by a few 1e-7 relative (measured); a state off by 1e-5 is a bug, not rounding.
STATE_TOL = {"rtol": 1e-5, "atol": 1e-6}


def inputs(batch, tokens, heads, d, f_rank, seed):
    gen = torch.Generator().manual_seed(seed)
    proj = heads * d
    rows = 4 * proj + f_rank + heads
    rows += (-rows) % 16
    z = torch.randn(batch, tokens, rows, generator=gen).bfloat16()
    params = dict(
        heads=heads, head_dim=d, f_rank=f_rank,
        w_fb=(torch.randn(proj, f_rank, generator=gen) / f_rank**0.5).bfloat16(),
        dt_bias=0.5 * torch.randn(proj, generator=gen),
        a_log=torch.rand(heads, generator=gen) * 2 - 1,
        conv_w=torch.randn(3 * proj, 4, generator=gen) / 2,
        o_norm=1 + 0.1 * torch.randn(d, generator=gen),
        eps=1e-5, lower_bound=-5.0)
    conv_state = torch.randn(batch, 3 * proj, 3, generator=gen).bfloat16()
    state = torch.randn(batch, heads, d, d, generator=gen) * 0.1
    return z, params, conv_state, state


# (with a GPU's tiles: the last two split a head over 4 programs and take the f_b
# projection in two slices of 64, as a GEMV for a decode token and a product for a verify;
# the last, a K3 TP8 rank's 12 heads of 128 and f_rank 128, over 8 programs a head)
@pytest.mark.parametrize(("batch", "tokens", "heads", "d", "f_rank"),
                         [(1, 1, 2, 16, 16), (3, 1, 4, 32, 16), (2, 4, 2, 16, 32),
                          (2, 2, 2, 64, 32), (1, 1, 2, 64, 128), (1, 3, 2, 64, 128),
                          (1, 1, 12, 128, 128)])
def test_kda_decode_matches_reference(batch, tokens, heads, d, f_rank, tiles):
    z, params, conv_state, state = inputs(batch, tokens, heads, d, f_rank, batch + tokens)
    conv_ref, state_ref = conv_state.clone(), state.clone()
    expected = kda_decode_reference(z, conv_state=conv_ref, state=state_ref, **params)
    out = torch.empty(batch, tokens, heads * d, dtype=torch.bfloat16)
    poison(out)
    kda_decode(z, conv_state=conv_state, state=state, out=out, **params)
    assert_close_bf16(out, expected, ulps=4)
    torch.testing.assert_close(state, state_ref, **STATE_TOL)
    torch.testing.assert_close(conv_state, conv_ref, rtol=0, atol=0)


def _accept(records: KdaRecords, verify: bool, accepted: list[int]) -> None:
    """What DecodeState.advance and accept do to the records after a step."""
    if verify:
        records.half.bitwise_xor_(1)
        records.pending.copy_(torch.tensor(accepted))
    else:
        records.pending.zero_()


@pytest.mark.parametrize("splits", [1, 4])
def test_a_rollback_equals_decoding_only_the_accepted_tokens(splits):
    """A verify step leaves the states as they were (after folding in what it found pending)
    and records its positions; once a prefix of them is accepted per sequence, the next step
    (a decode token, or another verify) replays it first. Over verify, decode, verify, verify,
    decode, each sequence accepting its own count: outputs and states as if each sequence had
    decoded only its accepted tokens, one at a time."""
    batch, heads, d, f_rank = 3, 2, 16, 16
    _, params, conv_state, state = inputs(batch, 1, heads, d, f_rank, 7)
    records = KdaRecords.empty(batch, heads, d, 4, conv_state.dtype)
    poison(records.records, records.inputs)    # what a replay reads, the verify step wrote
    arrivals = torch.zeros(batch * heads, dtype=torch.int32)
    plain = [(conv_state[b: b + 1].clone(), state[b: b + 1].clone()) for b in range(batch)]
    steps = [(4, [1, 3, 4]), (1, None), (3, [3, 1, 2]), (4, [2, 2, 4]), (1, None)]
    for seed, (tokens, accepted) in enumerate(steps):
        z = inputs(batch, tokens, heads, d, f_rank, 30 + seed)[0]
        verify = accepted is not None
        out = kda_decode(z, conv_state=conv_state, state=state, records=records,
                         record=verify, splits=splits, arrivals=arrivals, **params)
        for b, n in enumerate(accepted or [1] * batch):
            conv_b, state_b = plain[b]
            if verify:   # the kernel's states: the plain ones before this step's tokens
                torch.testing.assert_close(state[b: b + 1], state_b, **STATE_TOL)
                torch.testing.assert_close(conv_state[b: b + 1], conv_b, rtol=0, atol=0)
            want = kda_decode_reference(z[b: b + 1, :n], conv_state=conv_b, state=state_b,
                                        **params)
            assert_close_bf16(out[b, :n], want[0], ulps=4)
            if not verify:
                torch.testing.assert_close(state[b: b + 1], state_b, **STATE_TOL)
                torch.testing.assert_close(conv_state[b: b + 1], conv_b, rtol=0, atol=0)
        _accept(records, verify, accepted or [])
    assert not arrivals.any()


@pytest.mark.parametrize("order", ["forward", "reverse"])
@pytest.mark.parametrize("splits", [1, 2, 4, 16])
def test_verify_steps_in_a_row_replay_each_others_records(splits, order):
    """Decode and verify steps of 1 to 4 tokens in turn on one set of records, each verify
    step accepted in part per sequence: every step reads the half the last verify wrote and
    writes the other, whichever of a head's programs runs first."""
    batch, heads, d, f_rank = 2, 2, 16, 16
    _, params, conv_state, state = inputs(batch, 1, heads, d, f_rank, 3)
    records = KdaRecords.empty(batch, heads, d, 4, conv_state.dtype)
    conv_ref, state_ref = conv_state.clone(), state.clone()
    records_ref = KdaRecords(*(t.clone() for t in records))
    arrivals = torch.zeros(batch * heads, dtype=torch.int32)
    steps = [(4, [2, 4]), (3, [1, 3]), (1, None), (4, [4, 1]), (2, [2, 2]), (4, [3, 1]),
             (1, None)]
    with program_order(reverse=order == "reverse"):
        for seed, (tokens, accepted) in enumerate(steps):
            z = inputs(batch, tokens, heads, d, f_rank, 20 + seed)[0]
            verify = accepted is not None
            expected = kda_decode_reference(z, conv_state=conv_ref, state=state_ref,
                                            records=records_ref, record=verify, **params)
            out = kda_decode(z, conv_state=conv_state, state=state, records=records,
                             record=verify, splits=splits, arrivals=arrivals, **params)
            assert_close_bf16(out, expected, ulps=4)
            torch.testing.assert_close(state, state_ref, **STATE_TOL)
            torch.testing.assert_close(conv_state, conv_ref, rtol=0, atol=0)
            torch.testing.assert_close(records.records, records_ref.records, rtol=1e-4,
                                       atol=1e-5)
            torch.testing.assert_close(records.inputs, records_ref.inputs, rtol=0, atol=0)
            assert not arrivals.any()
            for r in (records, records_ref):
                _accept(r, verify, accepted or [])


def test_kda_decode_refuses_records_it_cannot_use():
    z, params, conv_state, state = inputs(2, 4, 2, 16, 16, 5)
    with pytest.raises(ValueError, match="verify step of 4 tokens needs records"):
        kda_decode(z, conv_state=conv_state, state=state, record=True, **params)
    short = KdaRecords.empty(2, 2, 16, 3, conv_state.dtype)
    with pytest.raises(ValueError, match="room for them, not 3"):
        kda_decode(z, conv_state=conv_state, state=state, records=short, record=True, **params)
    wrong = short._replace(pending=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"records\.pending"):
        kda_decode(z[:, :1], conv_state=conv_state, state=state, records=wrong, **params)


def test_kda_decode_with_the_f_b_projection_given():
    """The standard path's variant: f = f_a · W_fbᵀ arrives from its own GEMM (fp32 here, so
    it equals the fused projection up to summation order)."""
    batch, tokens, heads, d, f_rank = 2, 2, 2, 16, 16
    z, params, conv_state, state = inputs(batch, tokens, heads, d, f_rank, 9)
    conv_ref, state_ref = conv_state.clone(), state.clone()
    expected = kda_decode_reference(z, conv_state=conv_ref, state=state_ref, **params)
    proj = heads * d
    f = z[..., 4 * proj: 4 * proj + f_rank].float() @ params["w_fb"].float().T
    out = torch.empty(batch, tokens, proj, dtype=torch.bfloat16)
    poison(out)
    kda_decode(z, conv_state=conv_state, state=state, out=out, f=f,
               **{**params, "w_fb": torch.full_like(params["w_fb"], float("nan"))})
    assert_close_bf16(out, expected, ulps=4)
    torch.testing.assert_close(state, state_ref, **STATE_TOL)
    with pytest.raises(ValueError, match="kda_decode: f"):
        kda_decode(z, conv_state=conv_state, state=state, f=f[:, :1], **params)


@pytest.mark.parametrize("order", ["forward", "reverse"])
@pytest.mark.parametrize(("splits", "tokens", "f_given"),
                         [(2, 3, False), (4, 3, False), (16, 3, False), (4, 1, False),
                          (4, 3, True), (4, 1, True)])
def test_kda_decode_split_over_state_rows(splits, tokens, f_given, order):
    """A head's state split over programs (16: a row each) through verify steps of 3 tokens
    or of one (the standard path's variant too, its f_b projection given), twice on one
    arrivals buffer, the second replaying what the first recorded: each program reads the
    conv state the step started from, whichever program runs first; the last to arrive norms
    the head and leaves its counter at 0 for the next launch."""
    batch, heads, d, f_rank = 2, 2, 16, 16
    z, params, conv_state, state = inputs(batch, tokens, heads, d, f_rank, splits)
    records = KdaRecords.empty(batch, heads, d, tokens, conv_state.dtype)
    conv_ref, state_ref = conv_state.clone(), state.clone()
    records_ref = KdaRecords(*(t.clone() for t in records))
    arrivals = torch.zeros(batch * heads + 3, dtype=torch.int32)
    with program_order(reverse=order == "reverse"):
        for step in range(2):
            z_step = z + step
            expected = kda_decode_reference(z_step, conv_state=conv_ref, state=state_ref,
                                            records=records_ref, record=True, **params)
            f = (z_step[..., 4 * heads * d: 4 * heads * d + f_rank].float()
                 @ params["w_fb"].float().T) if f_given else None
            out = kda_decode(z_step, conv_state=conv_state, state=state, records=records,
                             record=True, arrivals=arrivals, splits=splits, f=f, **params)
            assert_close_bf16(out, expected, ulps=4)
            torch.testing.assert_close(records.records, records_ref.records, rtol=1e-4,
                                       atol=1e-5)
            torch.testing.assert_close(records.inputs, records_ref.inputs, rtol=0, atol=0)
            torch.testing.assert_close(state, state_ref, **STATE_TOL)
            torch.testing.assert_close(conv_state, conv_ref, rtol=0, atol=0)
            assert not arrivals.any()
            for r in (records, records_ref):
                _accept(r, True, [tokens, max(1, tokens - 1)])


def test_kda_splits_fill_the_gpu_within_the_tile_bounds():
    """Off a GPU, a GPU's tiles are an H200's (132 SMs)."""
    cpu = torch.device("cpu")
    with gpu_tiles():
        assert kda_splits(12, 128, cpu) == 8        # batch 1 at TP8: 96 programs, 16 rows each
        assert kda_splits(96, 128, cpu) == 4        # batch 8: 384 programs
        assert kda_splits(768, 128, cpu) == 2       # batch 64: 64 rows a program at most
        assert kda_splits(4, 16, cpu) == 1          # a 16-row state is one tile
        assert kda_splits(768, 128, cpu, tokens=4) == 4   # a verify step: 32 rows at most
    if INTERPRETED:
        assert kda_splits(12, 128, cpu) == 1        # the interpreter's whole tiles


def test_kda_decode_refuses_bad_splits_and_arrivals():
    z, params, conv_state, state = inputs(1, 1, 2, 16, 16, 3)
    for kwargs, message in (({"splits": 3}, "3 splits must be a power of two"),
                            ({"splits": 32}, "32 splits must be a power of two"),
                            ({"arrivals": torch.zeros(1, dtype=torch.int32)}, "at least 2"),
                            ({"arrivals": torch.zeros(2)}, "must be int32")):
        with pytest.raises(ValueError, match=message):
            kda_decode(z, conv_state=conv_state, state=state, **kwargs, **params)
    # a head_dim the tiles cannot take whole, an f_rank that a GPU's 64-wide slices overrun,
    # or one under 64 that is no power of two (its one slice could not be a tile)
    for d, f_rank, message in ((24, 16, "head_dim 24 must be a power of two"),
                               (16, 96, "f_rank 96 a multiple of 64"),
                               (16, 48, "f_rank 48 a multiple of 48, a power of two too")):
        z, params, conv_state, state = inputs(1, 1, 2, d, f_rank, 3)
        with gpu_tiles(), pytest.raises(ValueError, match=message):
            kda_decode(z, conv_state=conv_state, state=state, splits=1, **params)


def test_the_arrival_is_released_after_a_barrier_in_the_compiled_kernel():
    """What the interpreter cannot show (it runs programs one at a time, each op whole): in
    the PTX built for sm_90a, every store of a program's state and output rows precedes a CTA
    barrier that precedes its one acquire-release arrival, whose result reaches the CTA's
    threads through a barrier before the last program reads the others' rows."""
    script = (
        "import json\n"
        "from kimi_perf_kernels import aot\n"
        "builds = [b for b in aot.builds() if b.label in ('kda_decode d128 batch 1 split 8',\n"
        "          'kda_decode d128 batch 8 verify 1+3 split 4')]\n"
        "print(json.dumps({b.label: aot.compile_build(b).asm['ptx'] for b in builds}))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    ptx_of = json.loads(done.stdout)
    assert len(ptx_of) == 2
    for label, ptx in ptx_of.items():
        lines = ptx.splitlines()
        atoms = [n for n, line in enumerate(lines) if "atom.global" in line]
        assert len(atoms) == 1 and "atom.global.gpu.acq_rel.add" in lines[atoms[0]], label
        arrival = atoms[0]
        fp32_stores = [n for n, line in enumerate(lines[:arrival])
                       if re.search(r"st\.global(\.v\d)?\.b32", line)]
        assert fp32_stores, label
        assert any("bar.sync" in line for line in lines[fp32_stores[-1]:arrival]), label
        after = lines[arrival:]
        broadcast = next(n for n, line in enumerate(after) if "bar.sync" in line)
        cg_load = next(n for n, line in enumerate(after) if "ld.global.cg" in line)
        assert broadcast < cg_load, label
