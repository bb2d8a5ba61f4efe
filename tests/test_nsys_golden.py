"""`kimi-perf ranges` against NVIDIA's own `nsys stats --report nvtx_kern_sum` output."""

from __future__ import annotations

import csv
import gzip
import io

import pytest
from click.testing import CliRunner

from kimi_perf.cli import main
from tests.conftest import DATA, NSYS, nsys_fixtures

SAXPY = "hpcgroup-pipit__saxpy-mpi-cuda_nsys_perlmutter0__nsys2022.2.1"


def golden_for(stem: str, report: str = "nvtx_kern_sum") -> tuple[str, str] | None:
    """NVIDIA's ``nsys stats`` report for a fixture: shipped with it, or made here for those
    that shipped without (``tests/data/nsys_stats_2023.4.4/README.md``)."""
    shipped = NSYS / "golden" / stem / f"{report}.csv"
    if shipped.exists():
        return shipped.read_text(), str(shipped)
    ours = DATA / "nsys_stats_2023.4.4" / f"{stem}_{report}.csv.gz"
    if ours.exists():
        return gzip.decompress(ours.read_bytes()).decode(), str(ours)
    return None


def golden_rows(text: str) -> list[tuple[str, ...]]:
    return [(r["NVTX Range"], r["Style"], r["PID"], r["TID"], r["NVTX Inst"], r["Kern Inst"],
             r["Total Time (ns)"], r["Avg (ns)"], r["Min (ns)"], r["Max (ns)"],
             r["StdDev (ns)"], r["Kernel Name"]) for r in csv.DictReader(io.StringIO(text))]


def our_rows(path) -> tuple[list[str], list[tuple[str, ...]]]:
    result = CliRunner().invoke(main, ["ranges", str(path), "--format", "csv"])
    assert result.exit_code == 0, result.output
    reader = csv.reader(io.StringIO(result.output))
    header = next(reader)
    return header, [tuple(r) for r in reader]


WITH_GOLDEN = [p for p in nsys_fixtures() if golden_for(p.stem) and p.stem != SAXPY]


def test_fixtures_present():
    assert len(nsys_fixtures()) >= 10, f"nsys fixtures missing under {NSYS}"
    assert len(WITH_GOLDEN) >= 7


@pytest.mark.parametrize("fixture_file", WITH_GOLDEN, ids=lambda p: p.stem[:40])
def test_ranges_match_nsys_stats_exactly(fixture_file):
    text, _ = golden_for(fixture_file.stem)
    expected = golden_rows(text)
    header, rows = our_rows(fixture_file)
    # every column of NVIDIA's report but its median, in its order, to the character
    assert header == ["range", "style", "pid", "tid", "range_instances", "kernel_instances",
                      "total_ns", "avg_ns", "min_ns", "max_ns", "stddev_ns", "kernel"]
    assert len(rows) == len(expected)
    assert sorted(rows) == sorted(expected)
    # Same order as nsys where nsys's order is total: by range name, pid, tid, total desc.
    key = [(r[0], int(r[2] or -1), int(r[3] or -1)) for r in rows]
    assert key == sorted(key)


def test_saxpy_reports_the_correct_total_where_nsys_double_counts():
    """The reference double-counts (duplicate backtrace rows in the runtime table): its
    total is twice the kernels' and its standard deviation that of each duration twice; its
    mean, median and ends are the kernels' own."""
    path = NSYS / f"{SAXPY}.sqlite"
    (expected,) = golden_rows(golden_for(SAXPY)[0])
    _, rows = our_rows(path)
    (ours,) = rows
    kern_sum = next(csv.DictReader(io.StringIO(
        (NSYS / "golden" / SAXPY / "cuda_gpu_kern_sum.csv").read_text())))
    true_total = int(kern_sum["Total Time (ns)"])
    assert ours[:6] == expected[:6] and ours[7:10] == expected[7:10]
    assert ours[11] == expected[11]
    assert int(ours[6]) == true_total == 88573480
    assert int(expected[6]) == 2 * true_total
    n = int(ours[5])   # the same durations twice over: a sum of squares twice, over 2n - 1
    assert float(expected[10]) == pytest.approx(
        float(ours[10]) * ((2 * (n - 1)) / (2 * n - 1)) ** 0.5, abs=0.1)
