"""The kernels' conversions round as a GPU does, under the interpreter too; programmatic
dependent launch."""

import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from kimi_perf_kernels.common import INTERPRETED, cast, stable_sigmoid


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, EMULATE_RNE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, cast(x, out_ptr.dtype.element_ty, EMULATE_RNE), mask=offs < n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_cast_rounds_to_nearest_even_as_torch_does(dtype):
    """Every magnitude fp8 e4m3 holds, subnormals (below 2^-6) included, the carry into the
    exponent (-1.97 -> -2), and ties: the same bits as torch's conversion."""
    gen = torch.Generator().manual_seed(0)
    magnitudes = torch.logspace(-12, 8.7, 4096, base=2)
    x = magnitudes * torch.randn(4096, generator=gen).sign()
    ties = torch.tensor([1.0625, 1.1875, 3 / 1024, 5 / 1024, 2.5 / 512, -1.97, 0.0])
    x = torch.cat([x, ties, -ties])
    out = torch.empty(len(x), dtype=dtype)
    _cast_kernel[(triton.cdiv(len(x), 256),)](x, out, len(x), EMULATE_RNE=INTERPRETED,
                                               BLOCK=256)
    want = x.to(dtype)
    assert torch.equal(out.view(torch.uint8 if dtype.itemsize == 1 else torch.int16),
                       want.view(torch.uint8 if dtype.itemsize == 1 else torch.int16))


@triton.jit
def _sigmoid_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, stable_sigmoid(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def test_stable_sigmoid_is_exact_far_out_and_never_overflows():
    import warnings

    x = torch.cat([torch.linspace(-200, 200, 4001), torch.tensor([-1e30, 1e30, 0.0])])
    out = torch.empty_like(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # numpy's overflow warning, under the interpreter
        _sigmoid_kernel[(triton.cdiv(len(x), 512),)](x, out, len(x), BLOCK=512)
    torch.testing.assert_close(out, torch.sigmoid(x), rtol=3e-7, atol=1e-30)   # 2 ulps


def test_fresh_buffers_start_poisoned_in_kernel_tests():
    """tests/kernels/conftest.py: what torch.empty gives a kernel's launcher is poison, so a
    missed store fails the comparison with the reference rather than leave a zero."""
    assert torch.isnan(torch.empty(3, 4)).all()
    assert torch.isnan(torch.empty_like(torch.ones(2), dtype=torch.bfloat16)).all()
    assert (torch.empty(5, dtype=torch.int32) == torch.iinfo(torch.int32).min).all()
    assert torch.empty(2, dtype=torch.bool).all()


def test_programmatic_launch_sets_the_launch_flag_within_it_only():
    """Every launcher spreads ``launch_options()``: Triton's ``launch_pdl`` within
    ``programmatic_launch`` (nested contexts restore the outer one), and the ``PDL``
    constexpr that puts ``griddepcontrol`` in the kernel, except under the interpreter,
    which has no inline assembly."""
    from kimi_perf_kernels.common import (
        launch_options,
        programmatic_launch,
        weight_prefetch_bytes,
    )

    assert launch_options() == {"PDL": False, "launch_pdl": False}
    assert weight_prefetch_bytes() == 0
    with programmatic_launch(False, 1 << 20):     # no prefetch before a wait that is not there
        assert weight_prefetch_bytes() == 0
    with programmatic_launch(prefetch_bytes=1 << 20):
        assert launch_options() == {"PDL": not INTERPRETED, "launch_pdl": True}
        assert weight_prefetch_bytes() == (0 if INTERPRETED else 1 << 20)
        with programmatic_launch(False):
            assert launch_options() == {"PDL": False, "launch_pdl": False}
        assert launch_options()["launch_pdl"]
    assert launch_options() == {"PDL": False, "launch_pdl": False}


GRID_DEPENDENCY_KERNELS = '''
import triton
import triton.language as tl

from kimi_perf_kernels.common import after_previous_kernel, prefetch_l2


@triton.jit
def prefetches_first(x_ptr, out_ptr, PDL: tl.constexpr):
    offs = tl.arange(0, 128)
    prefetch_l2(x_ptr + offs * 32)
    after_previous_kernel(PDL)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) * 2.0)


@triton.jit
def waits_first(x_ptr, out_ptr, PDL: tl.constexpr):
    after_previous_kernel(PDL)
    offs = tl.arange(0, 128)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) * 2.0)


@triton.jit
def reads_first(x_ptr, out_ptr, PDL: tl.constexpr):
    offs = tl.arange(0, 128)
    x = tl.load(x_ptr + offs)
    after_previous_kernel(PDL)
    tl.store(out_ptr + offs, x * 2.0)
'''


def test_the_aot_check_of_pdl_kernels_fails_one_that_reads_before_it_waits(tmp_path):
    """``aot.check_grid_dependency`` on kernels compiled for sm_90a: a PDL kernel whose first
    statement is ``after_previous_kernel`` passes, and so does one that prefetches lines into
    L2 before it; one that loads its input first (which may read what the previous kernel
    has not written yet) fails, naming the load; a kernel built without PDL holds no
    ``griddepcontrol``."""
    (tmp_path / "pdl_kernels.py").write_text(GRID_DEPENDENCY_KERNELS)
    script = (
        "import json, sys\n"
        "from triton.compiler import ASTSource\n"
        "import triton\n"
        "from kimi_perf_kernels import aot\n"
        "import pdl_kernels\n"
        "out = {}\n"
        "for name in ('waits_first', 'prefetches_first', 'reads_first'):\n"
        "    for pdl in (False, True):\n"
        "        src = ASTSource(fn=getattr(pdl_kernels, name), constexprs={'PDL': pdl},\n"
        "                        signature={'x_ptr': '*fp32', 'out_ptr': '*fp32',\n"
        "                                   'PDL': 'constexpr'})\n"
        "        ptx = triton.compile(src, target=aot.TARGET).asm['ptx']\n"
        "        try:\n"
        "            aot.check_grid_dependency(name, ptx, pdl)\n"
        "            out[f'{name} {pdl}'] = 'ok'\n"
        "            if 'prefetch.global.L2::evict_last' in ptx.split('griddepcontrol.wait')[0]:\n"
        "                out[f'{name} {pdl}'] = 'ok, prefetched first'\n"
        "        except RuntimeError as exc:\n"
        "            out[f'{name} {pdl}'] = str(exc)\n"
        "print(json.dumps(out))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout)
    assert results["waits_first False"] == results["waits_first True"] == "ok"
    assert results["prefetches_first True"] == "ok, prefetched first"
    assert results["reads_first False"] == "ok"
    assert results["reads_first True"].startswith(
        "reads_first: global memory touched before griddepcontrol.wait: ld.global")


def test_the_pdl_check_knows_which_ptx_instructions_touch_global_memory():
    """Global and generic-address loads, stores, atomics, reductions, async and bulk copies
    and prefetches into L1 count, with or without a predicate; the kernel's parameters,
    shared, local and constant memory, async-copy bookkeeping, address arithmetic and
    prefetches into L2 (no data returned, none stale) do not."""
    from kimi_perf_kernels.aot import touches_global_memory

    touching = ["ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];",
                "@%p1 ld.global.L1::evict_last.v4.b32 {%r1, %r2, %r3, %r4}, [ %rd1 + 0 ];",
                "@!%p2 st.global.b16 [%rd1], %rs1;", "ld.b32 %r1, [%rd1];",
                "cp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2;",
                "atom.global.gpu.acq_rel.add.u32 %r1, [%rd1], 1;", "ldu.global.f32 %f1, [%rd1];",
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], "
                "[%rd1], 256, [%r2];", "red.global.add.f32 [%rd1], %f1;",
                "prefetch.global.L1 [%rd1];"]
    not_touching = ["ld.param.b64 %rd1, [k_param_0];", "ld.shared.b32 %r1, [%r2];",
                    "cp.async.commit_group;", "cp.async.wait_group 0;", "ld.const.f32 %f1, [c];",
                    "ld.local.b32 %r1, [%rd9];", "cvta.to.global.u64 %rd2, %rd1;",
                    "griddepcontrol.wait; // dummy %r1", "// begin inline asm", "$L__tmp0:",
                    "prefetch.global.L2::evict_last [%rd1];"]
    assert [line for line in touching if not touches_global_memory(line)] == []
    assert [line for line in not_touching if touches_global_memory(line)] == []


def test_aot_builds_every_pdl_kernel_both_ways():
    """``aot.pdl_variants``: a kernel with a PDL flag is compiled as launched without PDL and
    with it, the configurations the paths launch too (the interpreter's recording always has
    it off); one without the flag (``l2_prefetch``, on its own stream) as it is. The
    skinny linears' weight prefetch comes before the PDL wait: those builds only with PDL."""
    from kimi_perf_kernels import aot
    from kimi_perf_kernels.l2_prefetch import l2_prefetch_kernel
    from kimi_perf_kernels.rms_norm import rms_norm_kernel

    plain = aot.Build("rms_norm", rms_norm_kernel, {"BLOCK": "constexpr"}, {"BLOCK": 64})
    off, on = aot.pdl_variants(plain)
    assert (off.label, off.constexprs, off.signature["PDL"]) == (
        "rms_norm", {"BLOCK": 64, "PDL": False}, "constexpr")
    assert (on.label, on.constexprs["PDL"]) == ("rms_norm PDL", True)
    other = aot.Build("l2_prefetch", l2_prefetch_kernel, {}, {"BLOCK": 4096})
    assert aot.pdl_variants(other) == [other]
    recorded = {"module": "kimi_perf_kernels.rms_norm", "kernel": "rms_norm_kernel",
                "signature": {"x_ptr": "*bf16", "PDL": "constexpr", "BLOCK": "constexpr"},
                "constexprs": {"PDL": False, "BLOCK": 64}, "divisible": ["x_ptr"],
                "num_warps": 4, "pdl": False}
    both = [("rms_norm tiny (bf16) BLOCK=64", False), ("rms_norm tiny (bf16) BLOCK=64 PDL", True)]
    assert [(b.label, b.constexprs["PDL"]) for b in aot.builds_of([recorded, recorded])] == both
    # launched with PDL only (a weight prefetch before the wait): built so only; launched
    # both ways, both
    with_pdl = {**recorded, "pdl": True}
    assert [(b.label, b.constexprs["PDL"]) for b in aot.builds_of([with_pdl])] == both[1:]
    assert [(b.label, b.constexprs["PDL"])
            for b in aot.builds_of([with_pdl, recorded])] == both
    builds = aot.builds()
    assert {"attn_res h7168", "attn_res h7168 PDL", "l2_prefetch"} <= {b.label for b in builds}
    prefetching = [b for b in builds if b.constexprs.get("PREFETCH_K")]
    assert len(prefetching) == 7 and all(b.constexprs["PDL"] for b in prefetching)
    paired = [b for b in builds if "PDL" in b.fn.arg_names and b not in prefetching]
    assert sorted(b.label for b in paired if b.constexprs["PDL"]) == sorted(
        b.label + " PDL" for b in paired if not b.constexprs["PDL"])


def test_every_k3_build_gives_each_integer_argument_its_value():
    """The JIT specialises an integer argument by its value (a 1 becomes a constant, a
    multiple of 16 is known to be one: wide loads, masks that keep them). A K3 build that
    leaves one out compiles another kernel than a GPU runs: the grouped experts' K loops,
    their K not known to be a multiple of 16, kept their weight tiles out of the pipeline."""
    from kimi_perf_kernels import aot

    for build in aot.builds():
        ints = {name for name, kind in build.signature.items() if kind in ("i32", "i64")}
        assert ints == set(build.ints or {}), build.label


def test_the_wrappers_refuse_a_layout_their_kernels_would_misread():
    """A weight of another K, a transposed operand, a gate of other rows, a block past the
    attention residuals' last: refused on the host, where the kernel would read them wrong
    (or past the end) without a word."""
    from kimi_perf_kernels.attn_res import attn_res
    from kimi_perf_kernels.mla_uv_gate import mla_uv_gate
    from kimi_perf_kernels.skinny_linear import skinny_linear

    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(ValueError, match=r"w \(32, 48\) for x \(2, 64\)"):
        skinny_linear(x, torch.randn(32, 48).bfloat16())
    with pytest.raises(ValueError, match="w must have contiguous rows"):
        skinny_linear(x, torch.randn(64, 32).bfloat16().t())
    with pytest.raises(ValueError, match="an even number, not 33"):
        skinny_linear(x, torch.randn(33, 64).bfloat16(), situ=(4.0, 25.0))
    o_lat, w_uv = torch.randn(3, 2, 32).bfloat16(), torch.randn(2, 32, 16).bfloat16()
    with pytest.raises(ValueError, match="gate \\(2, 32\\) for o_lat of 3 rows"):
        mla_uv_gate(o_lat, w_uv, torch.randn(2, 32).bfloat16())
    with pytest.raises(ValueError, match="w_uv must be contiguous"):
        mla_uv_gate(o_lat, torch.randn(2, 16, 32).bfloat16().transpose(1, 2),
                    torch.randn(3, 32).bfloat16())
    prefix = torch.randn(2, 64).bfloat16()
    with pytest.raises(ValueError, match=r"blocks 2 \(writing 4\) of 4"):
        attn_res(prefix, None, torch.randn(2, 4, 64).bfloat16(), 2, 4, torch.randn(64), None,
                 1e-5)
    with pytest.raises(ValueError, match=r"blocks 5 \(writing 1\) of 4"):
        attn_res(prefix, None, torch.randn(2, 4, 64).bfloat16(), 5, 1, torch.randn(64), None,
                 1e-5)
    with pytest.raises(ValueError, match=r"blocks \(2, 4, 32\) and delta None"):
        attn_res(prefix, None, torch.randn(2, 4, 32).bfloat16(), 1, 1, torch.randn(64), None,
                 1e-5)


# ptxas -v's note as it prints it for the skinny linear's GEMM with its RMSNorm
C7515 = ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are "
         "serialized due to non wgmma instructions defining accumulator registers of a wgmma "
         "between start and end of the pipeline stage in the function 'skinny_linear_kernel'")


def test_the_aot_check_fails_unpipelined_streams_and_unknown_performance_warnings():
    """The compile check itself fails (not a test beside it) a K3 build of a streaming kernel
    with no cp.async in flight, and a ptxas performance warning other than the known ones;
    the tiny preset's builds (one K step) and kda_decode with its f projection given stream
    nothing worth keeping in flight."""
    from kimi_perf_kernels import aot

    def row(label, copies=4, warnings=()):
        return {"kernel": label, "async_copies": copies, "ptxas_warnings": list(warnings)}

    rows = [row("skinny_linear gemv M=1 in_proj", 0), row("mla_attention tiny (bf16)", 0),
            row("kda_decode batch 1 f given (bf16)", 0), row("rms_norm K3", 0),
            row("attn_res K3")]
    assert aot.not_pipelined(rows) == ["skinny_linear gemv M=1 in_proj"]
    warning = aot.performance_warnings(C7515)
    assert warning == ["C7515: wgmma.mma_async instructions are serialized due to non wgmma "
                       "instructions defining accumulator registers of a wgmma between start "
                       "and end of the pipeline stage"]
    assert aot.performance_warnings("ptxas info    : Used 80 registers") == []
    known = row("skinny_linear gemm M=64 latent_up rmsnorm+residual PDL", warnings=warning)
    assert aot.unexpected_slow([known]) == []
    for other in (row("skinny_linear gemm M=64 latent_up residual", warnings=warning),
                  row("moe_fc2_combine K3", warnings=warning),
                  row("skinny_linear gemm M=64 rmsnorm", warnings=["C7510: other"])):
        assert aot.unexpected_slow([other]) == [f"{other['kernel']}: "
                                                f"{other['ptxas_warnings'][0]}"]


def test_the_aot_check_refuses_what_it_cannot_do_before_compiling(tmp_path):
    """Under the interpreter (every build would fail on its own line), or with --json where
    it cannot be written (found after minutes of compiling, with a traceback): one line, exit
    2; the JSON itself is written whole or not at all."""
    from kimi_perf_kernels import aot

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    locked = tmp_path / "locked.json"
    locked.write_text("{}")
    locked.chmod(0o444)
    for extra, argv, said in (
            ({"TRITON_INTERPRET": "1"}, [], "TRITON_INTERPRET is set"),
            ({}, ["--json", str(tmp_path / "no" / "x.json")], "no folder"),
            ({}, ["--json", str(tmp_path)], "a directory, not a file"),
            ({}, ["--json", str(tmp_path / "new") + "/"], "a directory, not a file"),
            ({}, ["--json", str(locked)], "cannot write: it is read-only (mode 444)")):
        proc = subprocess.run([sys.executable, "-m", "kimi_perf_kernels.aot", *argv],
                              capture_output=True, text=True, env={**env, **extra}, timeout=120)
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
        assert len(proc.stderr.splitlines()) == 1 and said in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["locked.json"]   # (nothing made)
    assert aot.json_file_problem(str(tmp_path / "aot.json")) is None


def test_the_aot_check_compiles_every_cubin_the_gpu_check_launches():
    """The CuTe DSL GEMV's cubins are built for 1 to 4 tokens and all of them launch on the
    GPU: the compile check's rows are the same (M, N, K)s (it compiled M = 1 and 4 only)."""
    import importlib.util
    from types import SimpleNamespace

    from kimi_perf_kernels import aot, cute_gemv

    if importlib.util.find_spec("cutlass") is None:
        pytest.skip("CuTe DSL is not installed (the cute extra)")
    compiled = []

    def compile_gemv(m, n, k):     # what a build gives, without the seconds of building it
        compiled.append((m, n, k))
        plan = SimpleNamespace(warps=4, smem_bytes=0)
        return SimpleNamespace(plan=plan, registers=40, spill_stores=0, spill_loads=0,
                               ptx="", cubin=b"x", ptxas_warnings=[])

    real = cute_gemv.compile_gemv
    try:
        cute_gemv.compile_gemv = compile_gemv
        failed: list[str] = []
        rows = aot.cute_dsl_rows(failed)
    finally:
        cute_gemv.compile_gemv = real
    shipped = {(m, n, k) for n, k in cute_gemv.decode_shapes("k3-tp8").values()
               for m in cute_gemv.CUBIN_MS}
    assert failed == [] and set(compiled) == shipped and len(rows) == len(shipped)
    assert cute_gemv.CUBIN_MS == (1, 2, 3, 4)
    assert all("ptxas_warnings" in r for r in rows)
