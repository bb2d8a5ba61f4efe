"""Skinny GEMV in CuTe DSL for decode: y[M, N] = x[M, K] · W[N, K]ᵀ, M ≤ 4 tokens, bf16.

The contract of ``skinny_linear``'s gemv variant without its fusions, which is what the
specialized path launches for its plain projections (``in_proj``, ``qkv_a_g_proj``,
``o_proj``) at 1-4 tokens: the biggest weight streams of a decode step. Written in CuTe DSL
to find out whether explicit 16-byte vector loads and a K split over a CTA's warps stream W
closer to HBM bandwidth than Triton's tile loop. The GPU check times both side by side on
the K3 TP8 shapes; the specialized path launches it only when given its cubins
(``SpecializedModel(..., gemv=CubinGemv(DIR))``), and the default changes only if a GPU run
shows it wins.

Tiling (shapes are static: one build per (M, N, K)), one CTA per ``rows`` rows of W::

    CTA b      rows [b·rows, (b+1)·rows) of W, all M tokens
      warp w   the K slice [w·K/warps, (w+1)·K/warps)
        lane l 16-byte vectors l, l+32, l+64, ... of that slice: per step a warp reads
               512 contiguous bytes of each of its rows (coalesced), and M vectors of x
    per step   rows·M dot products of 8 bf16 pairs in fp32 registers
    epilogue   shuffle-reduce over the 32 lanes; lane 0 writes shared memory [warps, rows·M];
               threads < rows·M add the warps' partial sums and write y in bf16

K must be a multiple of 256 (32 lanes × 8 bf16); ``warps`` is the largest divisor of K/256
up to 8 (7 for K = 7168, 6 for K = 1536), ``rows`` 8 (or the largest power of two dividing
N). Each step's loads are independent of the sums, so the unrolled steps keep many vector
loads in flight per thread.

CuTe DSL is not needed to run it: ``compile_gemv`` builds a cubin for sm_90a here (fake
tensors, no GPU; ``CUTE_DSL_ARCH`` is set to sm_90a), and ``CubinGemv`` launches the
cubins through CuPy on a GPU that has no CuTe DSL (the device that runs the GPU check: the
DSL's runtime is too large to carry there). With static shapes the kernel's parameters are
just the three pointers, which ``compile_gemv`` checks in the PTX.

    python -m kimi_perf_kernels.cute_gemv --out DIR   # cubins + manifest for the K3 TP8 shapes
"""

# No ``from __future__ import annotations``: CuTe DSL evaluates the kernel's annotations
# (cute.Tensor, cutlass.Constexpr), which only exist inside _cute_gemv_jit.
import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

LANES = 32
VEC = 8  # bf16 per 16-byte load
MAX_M = 4
ARCH = "sm_90a"
CUBIN_MS = tuple(range(1, MAX_M + 1))   # the cubins' token counts (aot compiles each)


@dataclass(frozen=True)
class GemvPlan:
    m: int
    n: int
    k: int
    rows: int      # rows of W per CTA
    warps: int     # warps per CTA, each a K slice

    @property
    def grid(self) -> int:
        return self.n // self.rows

    @property
    def threads(self) -> int:
        return LANES * self.warps

    @property
    def smem_bytes(self) -> int:
        return 4 * self.warps * self.rows * self.m   # the warps' fp32 partial sums

    @property
    def steps(self) -> int:
        return self.k // VEC // self.threads       # vector loads per lane per row


def plan(m: int, n: int, k: int) -> GemvPlan:
    if not 1 <= m <= MAX_M:
        raise ValueError(f"cute_gemv takes 1-{MAX_M} tokens, not {m}")
    if k <= 0 or k % (LANES * VEC):
        raise ValueError(f"cute_gemv needs K a multiple of {LANES * VEC}, not {k}")
    if n <= 0:
        raise ValueError(f"cute_gemv needs N > 0, not {n}")
    vectors_per_lane = k // (LANES * VEC)
    warps = max(w for w in range(1, 9) if vectors_per_lane % w == 0)
    rows = next(r for r in (8, 4, 2, 1) if n % r == 0)
    return GemvPlan(m, n, k, rows, warps)


@dataclass(frozen=True)
class CompiledGemv:
    plan: GemvPlan
    kernel: str        # the cubin's entry point
    ptx: str
    cubin: bytes
    registers: int          # from ptxas, as are the spills
    spill_stores: int
    spill_loads: int
    ptxas_warnings: list[str]   # its performance-loss notes (``aot.performance_warnings``)


def _cute_gemv_jit():
    """The CuTe DSL kernel and its host launcher (imports CuTe DSL on first use)."""
    import cutlass
    import cutlass.cute as cute

    @cute.kernel
    def gemv_kernel(gX: cute.Tensor, gW: cute.Tensor, gY: cute.Tensor,
                    rows: cutlass.Constexpr, warps: cutlass.Constexpr):
        M = cute.size(gX, mode=[0])
        K = cute.size(gX, mode=[1])
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        # ((1, VEC), (rows, K / VEC)): mode 0 is one 16-byte vector
        x_vecs = cute.zipped_divide(gX, (1, VEC))
        w_vecs = cute.zipped_divide(gW, (1, VEC))
        steps = K // VEC // (LANES * warps)
        row0 = bidx * rows
        acc = [[cutlass.Float32(0.0) for _ in range(M)] for _ in range(rows)]
        for s in cutlass.range_constexpr(steps):
            j = (warp * steps + s) * LANES + lane  # this lane's vector in the warp's K slice
            xs = [x_vecs[(None, (m, j))].load().to(cutlass.Float32) for m in range(M)]
            for r in cutlass.range_constexpr(rows):
                w_row = w_vecs[(None, (row0 + r, j))].load().to(cutlass.Float32)
                for m in cutlass.range_constexpr(M):
                    acc[r][m] = acc[r][m] + (w_row * xs[m]).reduce(
                        cute.ReductionOp.ADD, cutlass.Float32(0.0), 0)
        partial = cutlass.memory.SmemAllocator().allocate_tensor(
            cutlass.Float32, cute.make_layout((warps, rows * M)), 16)
        for r in cutlass.range_constexpr(rows):
            for m in cutlass.range_constexpr(M):
                total = cute.arch.warp_reduction_sum(acc[r][m])
                if lane == 0:
                    partial[warp, r * M + m] = total
        cute.arch.barrier()
        if tidx < rows * M:
            out = cutlass.Float32(0.0)
            for wi in cutlass.range_constexpr(warps):
                out = out + partial[wi, tidx]
            gY[tidx % M, row0 + tidx // M] = out.to(cutlass.BFloat16)

    @cute.jit
    def gemv(x: cute.Tensor, w: cute.Tensor, y: cute.Tensor, rows: cutlass.Constexpr,
             warps: cutlass.Constexpr):
        m = cute.size(x, mode=[0])
        gemv_kernel(x, w, y, rows, warps).launch(
            grid=[cute.size(w, mode=[0]) // rows, 1, 1], block=[LANES * warps, 1, 1],
            smem=4 * warps * rows * m)

    return cutlass, cute, gemv


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_ENTRY = re.compile(r"\.visible \.entry (\w+)\(([^)]*)\)")
_DUMP = tempfile.TemporaryDirectory(prefix="cute_gemv_")  # removed at exit


def compile_gemv(m: int, n: int, k: int) -> CompiledGemv:
    """Build the kernel for (M, N, K) for sm_90a without a GPU: PTX, cubin, and ptxas's
    registers and spills."""
    p = plan(m, n, k)
    # Read once by CuTe DSL: without the arch it would silently target sm_100a; the PTX and
    # cubin are written to the dump directory and read back from there.
    os.environ.setdefault("CUTE_DSL_ARCH", ARCH)
    os.environ["CUTE_DSL_KEEP"] = "ptx,cubin"
    os.environ.setdefault("CUTE_DSL_DUMP_DIR", _DUMP.name)
    cutlass, cute, gemv = _cute_gemv_jit()
    from cutlass.cute.runtime import make_fake_compact_tensor

    def fake(rows: int, cols: int):
        return make_fake_compact_tensor(cutlass.BFloat16, (rows, cols), stride_order=(1, 0),
                                        assumed_align=16)

    log = io.StringIO()
    with contextlib.redirect_stderr(log):  # ptxas's report arrives as a remark on stderr
        compiled = cute.compile(gemv, fake(m, k), fake(n, k), fake(m, n), p.rows, p.warps,
                                options="remarks{ptx}")
    ptx, cubin = compiled.artifacts.PTX, compiled.artifacts.CUBIN
    if ptx is None or cubin is None:
        raise RuntimeError("cute_gemv: CuTe DSL kept no PTX or cubin: it was imported before "
                           "compile_gemv could configure it (CUTE_DSL_KEEP=ptx,cubin)")
    if f".target {ARCH}" not in ptx:
        target = re.search(r"\.target (\S+)", ptx)
        raise RuntimeError(f"cute_gemv compiled for {target and target.group(1)}, not {ARCH} "
                           "(CUTE_DSL_ARCH was set before CuTe DSL was imported)")
    entry = _ENTRY.search(ptx)
    if entry is None:
        raise RuntimeError("cute_gemv: no kernel entry in the PTX")
    params = [s for s in entry.group(2).split(",") if s.strip()]
    # CubinGemv passes three 8-byte pointers: the build must take exactly that.
    if len(params) != 3 or not all(s.strip().endswith("[8]") for s in params):
        raise RuntimeError(f"cute_gemv: expected 3 pointer parameters, got {params}")
    report = log.getvalue()
    regs, spills = _PTXAS_REGS.search(report), _PTXAS_SPILLS.search(report)
    if regs is None or spills is None:
        raise RuntimeError(f"cute_gemv: no ptxas report in the compiler's output: {report[-300:]}")
    from kimi_perf_kernels.aot import performance_warnings

    return CompiledGemv(p, entry.group(1), ptx, cubin, int(regs.group(1)),
                        int(spills.group(1)), int(spills.group(2)), performance_warnings(report))


def decode_shapes(config="k3-tp8") -> dict[str, tuple[int, int]]:
    """(N, K) of the plain projections the specialized path streams at 1-4 tokens
    (``SpecializedModel.plain_linear``), for a preset name or a K3Config; the gated-MLA
    layers' o_proj is listed apart only where its K differs from the KDA layers'."""
    from kimi_perf.decode.config import preset

    c = preset(config) if isinstance(config, str) else config
    shapes = {"in_proj": (c.in_proj_rows, c.hidden),
              "qkv_a_g_proj": (c.q_lora + c.kv_cache_dim + c.mla_heads_local * c.v_head,
                               c.hidden),
              "o_proj": (c.hidden, c.kda_heads_local * c.kda_head_dim)}
    if c.mla_heads_local * c.v_head != c.kda_heads_local * c.kda_head_dim:
        shapes["mla_o_proj"] = (c.hidden, c.mla_heads_local * c.v_head)
    return shapes


def _dsl_version() -> str | None:
    """The CuTe DSL release that built the cubins (evidence of a GPU run names it)."""
    from importlib import metadata

    try:
        return metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        return None


def build_cubins(out: Path, shapes: dict[str, tuple[int, int]], ms=CUBIN_MS) -> dict:
    """Cubins (and their PTX, for a driver too old for the cubin) for every (shape, M), and
    a manifest that CubinGemv loads."""
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for name, (n, k) in shapes.items():
        for m in ms:
            c = compile_gemv(m, n, k)
            file = f"gemv_{name}_m{m}"
            (out / f"{file}.cubin").write_bytes(c.cubin)
            (out / f"{file}.ptx").write_text(c.ptx)
            entries.append({"name": name, "file": file, "kernel": c.kernel,
                            "registers": c.registers, "spill_stores": c.spill_stores,
                            "spill_loads": c.spill_loads, "ptxas_warnings": c.ptxas_warnings,
                            **asdict(c.plan)})
    manifest = {"schema": 1, "arch": ARCH, "cutlass_dsl": _dsl_version(), "kernels": entries}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


class CubinGemv:
    """The cubins of ``build_cubins`` launched through CuPy on torch's current stream (no CuTe
    DSL needed): ``gemv(x, w)`` for bf16, contiguous, 16-byte aligned x [M, K] and W [N, K]
    whose shape has a build."""

    def __init__(self, directory: Path):
        import cupy

        self._cupy = cupy
        manifest = json.loads((directory / "manifest.json").read_text())
        if manifest.get("schema") != 1:
            raise ValueError(f"{directory / 'manifest.json'}: unknown schema")
        self.builds: dict[tuple[int, int, int], tuple[dict, object]] = {}
        for e in manifest["kernels"]:
            try:  # CuPy loads the module when it looks the kernel up
                fn = cupy.RawModule(path=str(directory / f"{e['file']}.cubin")).get_function(
                    e["kernel"])
                e = {**e, "loaded": "cubin"}
            except cupy.cuda.driver.CUDADriverError:  # a driver older than the compiler
                fn = cupy.RawModule(path=str(directory / f"{e['file']}.ptx")).get_function(
                    e["kernel"])
                e = {**e, "loaded": "ptx"}
            self.builds[(e["m"], e["n"], e["k"])] = (e, fn)

    def __call__(self, x, w, out=None):
        import torch

        check_operands(x, w, out)
        m, k = x.shape
        n = w.shape[0]
        build = self.builds.get((m, n, k))
        if build is None:
            raise ValueError(f"no cute_gemv build for M={m}, N={n}, K={k}")
        e, fn = build
        y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
        stream = self._cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        launch = GemvPlan(m, n, k, e["rows"], e["warps"])   # the build's plan
        with stream:
            args = tuple(self._cupy.uint64(t.data_ptr()) for t in (x, w, y))
            fn((launch.grid,), (launch.threads,), args, shared_mem=launch.smem_bytes)
        return y


def check_operands(x, w, out=None) -> None:
    """What the cubins assume: bf16, contiguous rows, 16-byte aligned, matching K."""
    import torch

    tensors = {"x": x, "w": w} | ({} if out is None else {"out": out})
    for name, t in tensors.items():
        if t.dtype != torch.bfloat16 or t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"cute_gemv: {name} must be a contiguous 2-D bf16 tensor")
        if t.data_ptr() % 16:
            raise ValueError(f"cute_gemv: {name} must be 16-byte aligned")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"cute_gemv: x has K={x.shape[1]}, w has K={w.shape[1]}")
    if out is not None and tuple(out.shape) != (x.shape[0], w.shape[0]):
        raise ValueError(f"cute_gemv: out must be {x.shape[0]}x{w.shape[0]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="k3-tp8")
    args = parser.parse_args(argv)
    try:
        shapes = decode_shapes(args.preset)
    except KeyError as exc:
        print(f"cute_gemv: {exc.args[0]}", file=sys.stderr)
        return 2
    manifest = build_cubins(args.out, shapes)
    for e in manifest["kernels"]:
        print(f"{e['name']:14s} M={e['m']} N={e['n']:5d} K={e['k']:5d} rows {e['rows']} "
              f"warps {e['warps']}: {e['registers']} registers, spills "
              f"{e['spill_stores']}/{e['spill_loads']} B")
    spilled = [e for e in manifest["kernels"] if e["spill_stores"] or e["spill_loads"]]
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())
