"""The CuTe DSL GEMV, without a GPU: its plan, its sm_90a build (the PTX is read to check the
tiling: which bytes each load reads), the operand checks of its cubin launcher, and the
cubins + manifest the GPU check carries. It runs on a GPU only there (CuTe DSL kernels cannot
launch on a CPU), against the same reference and beside the Triton GEMV."""

import importlib.util
import json
import re

import pytest
import torch

from kimi_perf_kernels.cute_gemv import (
    LANES,
    VEC,
    build_cubins,
    check_operands,
    decode_shapes,
    plan,
)

needs_cute_dsl = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None,
                                    reason="CuTe DSL (the cute extra) is not installed")


def test_plan_splits_k_over_warps_and_rows_over_ctas():
    p = plan(1, 6288, 7168)          # in_proj at TP8: K/256 = 28 vectors per lane -> 7 warps
    assert (p.rows, p.warps, p.steps, p.grid, p.threads) == (8, 7, 4, 786, 224)
    p = plan(4, 7168, 1536)          # o_proj: 6 vectors per lane -> 6 warps of one step
    assert (p.rows, p.warps, p.steps, p.grid) == (8, 6, 1, 896)
    assert p.smem_bytes == 4 * 6 * 8 * 4
    assert plan(1, 7170, 256).rows == 2   # rows divide N
    assert plan(1, 64, 256 * 11).warps == 1   # a prime number of vectors: one warp
    for m, n, k in ((0, 64, 256), (5, 64, 256), (1, 64, 300), (1, 0, 256)):
        with pytest.raises(ValueError, match="cute_gemv"):
            plan(m, n, k)


def test_decode_shapes_are_the_specialized_paths_projections():
    assert decode_shapes("k3-tp8") == {"in_proj": (6288, 7168), "qkv_a_g_proj": (3648, 7168),
                                       "o_proj": (7168, 1536)}


def _global_loads(ptx: str) -> list[tuple[str, str, int]]:
    """(instruction, base register, byte offset) of every global load."""
    loads = []
    pattern = r"(ld\.global\S*)\s+(?:\{[^}]*\}|%\w+),\s*\[(%rd\d+)(?:\+(\d+))?\]"
    for op, base, offset in re.findall(pattern, ptx):
        loads.append((op, base, int(offset or 0)))
    return loads


@needs_cute_dsl
@pytest.mark.parametrize("m,n,k", [(1, 64, 7168), (2, 16, 7168), (4, 32, 1536), (4, 64, 7168)])
def test_sm90a_build_streams_w_in_16_byte_vectors_with_the_planned_tiling(m, n, k):
    from kimi_perf_kernels.cute_gemv import compile_gemv

    c = compile_gemv(m, n, k)
    p = c.plan
    assert ".target sm_90a" in c.ptx and c.cubin[:4] == b"\x7fELF"
    assert re.search(rf"\.reqntid {p.threads}, 1, 1", c.ptx)
    assert (c.spill_stores, c.spill_loads) == (0, 0) and 0 < c.registers <= 128
    loads = _global_loads(c.ptx)
    assert loads and all(op == "ld.global.v4.b32" for op, _, _ in loads)  # 16 B each
    # Per lane: M rows of x and `rows` rows of W at each of `steps` vectors, each read once.
    assert len(loads) == p.steps * (m + p.rows)
    by_base: dict[str, set[int]] = {}
    for _, base, offset in loads:
        by_base.setdefault(base, set()).add(offset)
    step_bytes = LANES * VEC * 2
    want_x = {mi * k * 2 + s * step_bytes for mi in range(m) for s in range(p.steps)}
    want_w = {r * k * 2 + s * step_bytes for r in range(p.rows) for s in range(p.steps)}
    assert sorted(by_base.values(), key=len) == sorted([want_x, want_w], key=len)
    # and one bf16 store per output element: threads < rows·M each write one
    assert len(re.findall(r"st\.global\.b16", c.ptx)) == 1
    assert re.search(rf"setp\.gt\.u32\s+%p\d+, %r\d+, {p.rows * m - 1};", c.ptx)


@needs_cute_dsl
def test_build_cubins_writes_what_the_launcher_loads(tmp_path):
    manifest = build_cubins(tmp_path, {"o_proj": (64, 512)}, ms=(1, 3))
    assert manifest == json.loads((tmp_path / "manifest.json").read_text())
    assert [(e["m"], e["n"], e["k"]) for e in manifest["kernels"]] == [(1, 64, 512), (3, 64, 512)]
    for e in manifest["kernels"]:
        cubin = (tmp_path / f"{e['file']}.cubin").read_bytes()
        assert cubin[:4] == b"\x7fELF" and e["kernel"].encode() in cubin
        assert f".entry {e['kernel']}(" in (tmp_path / f"{e['file']}.ptx").read_text()
        assert e["spill_stores"] == e["spill_loads"] == 0 and e["registers"] > 0


def test_operand_checks_reject_what_the_cubins_cannot_take():
    x, w = torch.zeros(2, 256, dtype=torch.bfloat16), torch.zeros(64, 256, dtype=torch.bfloat16)
    check_operands(x, w, torch.zeros(2, 64, dtype=torch.bfloat16))
    misaligned = torch.zeros(2 * 256 + 1, dtype=torch.bfloat16)[1:].view(2, 256)
    bad = {"bf16": (x.float(), w), "contiguous": (x, torch.zeros(256, 64).bfloat16().T),
           "K=": (x, torch.zeros(64, 128, dtype=torch.bfloat16)), "aligned": (misaligned, w)}
    for why, (xb, wb) in bad.items():
        with pytest.raises(ValueError, match=why):
            check_operands(xb, wb)
    with pytest.raises(ValueError, match="out must be"):
        check_operands(x, w, torch.zeros(64, 2, dtype=torch.bfloat16))


class _FakeCupy:
    """What CubinGemv uses of CuPy, recording module loads and launches."""

    def __init__(self, cubin_loads: bool):
        self.loads, self.launches = [], []
        fake = self

        class CUDADriverError(Exception):
            pass

        class RawModule:
            def __init__(self, path):
                self.path = path

            def get_function(self, name):  # where CuPy loads the module
                fake.loads.append(self.path)
                if self.path.endswith(".cubin") and not cubin_loads:
                    raise CUDADriverError("CUDA_ERROR_UNSUPPORTED_PTX_VERSION")
                return lambda grid, block, args, shared_mem: fake.launches.append(
                    (name, grid, block, [int(a) for a in args], shared_mem))

        class ExternalStream:
            def __init__(self, handle):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        self.RawModule, self.uint64 = RawModule, int
        self.cuda = type("cuda", (), {"ExternalStream": ExternalStream,
                                      "driver": type("driver", (), {
                                          "CUDADriverError": CUDADriverError})})


@pytest.mark.parametrize("cubin_loads", [True, False])
def test_cubin_launcher_launches_the_manifests_plan(tmp_path, monkeypatch, cubin_loads):
    """The launch CubinGemv makes (grid, block, shared memory, pointer order) is the plan's,
    and a driver that refuses the cubin gets the PTX."""
    import sys

    from kimi_perf_kernels.cute_gemv import CubinGemv

    p = plan(2, 64, 768)
    entry = {"name": "o_proj", "file": "gemv_o_proj_m2", "kernel": "kernel_gemv_0",
             "registers": 40, "spill_stores": 0, "spill_loads": 0,
             **{f: getattr(p, f) for f in ("m", "n", "k", "rows", "warps")}}
    (tmp_path / "manifest.json").write_text(json.dumps({"schema": 1, "arch": "sm_90a",
                                                        "kernels": [entry]}))
    fake = _FakeCupy(cubin_loads)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda: type("stream", (), {"cuda_stream": 0}))
    gemv = CubinGemv(tmp_path)
    assert gemv.builds[(2, 64, 768)][0]["loaded"] == ("cubin" if cubin_loads else "ptx")
    assert fake.loads[-1].endswith(".cubin" if cubin_loads else ".ptx")
    x, w = torch.zeros(2, 768, dtype=torch.bfloat16), torch.zeros(64, 768, dtype=torch.bfloat16)
    y = gemv(x, w)
    assert y.shape == (2, 64) and y.dtype == torch.bfloat16
    name, grid, block, args, smem = fake.launches[-1]
    assert name == "kernel_gemv_0" and grid == (p.grid,) and block == (p.threads,)
    assert args == [x.data_ptr(), w.data_ptr(), y.data_ptr()] and smem == p.smem_bytes
    with pytest.raises(ValueError, match="no cute_gemv build for M=1"):
        gemv(x[:1], w)


def test_build_command_refuses_an_unknown_preset(tmp_path, capsys):
    from kimi_perf_kernels.cute_gemv import main

    assert main(["--out", str(tmp_path / "c"), "--preset", "k4"]) == 2
    assert "unknown preset 'k4'" in capsys.readouterr().err and not (tmp_path / "c").exists()
