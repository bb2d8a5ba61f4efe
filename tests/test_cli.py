"""The CLI end to end, and its behaviour on bad input: one line, exit 2, nothing written."""

from __future__ import annotations

import gzip
import json
import shutil
import sqlite3
import subprocess
import sys

import pytest
from click.testing import CliRunner

from kimi_perf.cli import main
from tests.conftest import KINETO, NSYS
from tests.test_layers import nvtx_decode_trace

VLLM = KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz"


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "kimi_perf", "--help"], capture_output=True,
                         text=True, check=True)
    for command in ("ranges", "breakdown", "compare", "convert", "info"):
        assert command in out.stdout


def test_breakdown_formats(tmp_path):
    result = run("breakdown", VLLM, "--format", "json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["schema"] == 1 and doc["steps"][0]["layers"] == 24
    csv_out = tmp_path / "layers.csv"
    assert run("breakdown", VLLM, "--format", "csv", "-o", csv_out).exit_code == 0
    lines = csv_out.read_text().splitlines()
    assert lines[0] == "step,device,layer,type,kernels,kernel_us,span_us,gap_us,classes"
    assert len(lines) == 25
    table = run("breakdown", VLLM)
    assert table.exit_code == 0 and "Per layer type" in table.output


def test_tables_keep_every_digit():
    """Piped, the tables are laid out wide; in a narrow terminal a cell folds rather than
    losing digits to an ellipsis ("10717…" instead of 10717.3)."""
    import io
    import os

    from rich.console import Console

    from kimi_perf import render
    from kimi_perf.breakdown import breakdown
    from kimi_perf.readers import read_trace

    b = breakdown(read_trace(VLLM))
    kernel_us = f"{b.steps[0]['kernel_us']:.1f}"   # 10717.7: 7 characters
    piped = subprocess.run([sys.executable, "-m", "kimi_perf", "breakdown", str(VLLM)],
                           capture_output=True, text=True, check=True,
                           env={k: v for k, v in os.environ.items() if k != "COLUMNS"})
    assert "…" not in piped.stdout and kernel_us in piped.stdout
    buf = io.StringIO()
    render.print_tables(render.breakdown_tables(b), Console(file=buf, width=50))
    narrow = buf.getvalue()
    assert "…" not in narrow and kernel_us not in narrow   # folded, not cut
    steps_rows = narrow.split("┩")[1].split("└")[0].splitlines()   # the steps table's body
    folded = "".join(line.split("│")[5].strip() for line in steps_rows if "│" in line)
    assert folded == kernel_us                                       # the kernel µs column


def test_layers_option(tmp_path):
    trace = nvtx_decode_trace("blk{i}-{kind}", steps=1).build()
    saved = tmp_path / "t.kptrace"
    trace.save(saved)
    result = run("breakdown", saved, "--format", "json", "--layers",
                 r"nvtx:^blk(?P<index>\d+)-(?P<type>\w+)$")
    assert result.exit_code == 0, result.output
    types = {t["type"] for t in json.loads(result.output)["layer_types"]}
    assert types == {"kda", "mla"}
    bad = run("breakdown", saved, "--layers", "nvtx:(")
    assert bad.exit_code == 2 and "bad regex" in bad.output


def test_compare_traces_and_saved_breakdowns(tmp_path):
    saved = tmp_path / "b.json"
    assert run("breakdown", VLLM, "--format", "json", "-o", saved).exit_code == 0
    result = run("compare", VLLM, saved, "--format", "json", "--labels", "live,saved")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["a"] == "live" and {r["type"] for r in doc["rows"]} >= {"A", "B"}
    assert all(r["span_ratio"] == 1.0 for r in doc["rows"])
    table = run("compare", VLLM, saved)
    assert "kernels /" in table.output and "ratio" in table.output


def test_convert_and_info(tmp_path):
    out = tmp_path / "x.kptrace"
    assert run("convert", NSYS / "zx3xyy-assignment2-systems__result_2_7B_nvtx__nsys2024.6.2"
                          ".sqlite", out).exit_code == 0
    result = run("info", out)
    assert result.exit_code == 0 and "kernels 7328" in result.output
    assert "NVIDIA A100" in result.output


def corrupt_files(tmp_path):
    sqlite_src = NSYS / "zx3xyy-assignment2-systems__result_2_7B_nvtx__nsys2024.6.2.sqlite"
    raw = sqlite_src.read_bytes()
    cases = {
        "empty.sqlite": b"",
        "truncated.sqlite": raw[: len(raw) // 3],
        "header_only.sqlite": raw[:100],
        "garbage.json": b"\x00\x01garbage",
        "truncated.json.gz": VLLM.read_bytes()[:4000],
        "bad.json": b'{"traceEvents": [{"ph": "X", "cat": "kernel", "ts": "x"',
        "notrace.json": b'{"hello": 1}',
        "wrongtypes.json": json.dumps({"traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "k", "ts": "soon", "dur": 1}]}).encode(),
        "text.txt": b"just some text\n",
        "fake.nsys-rep": b"not a report",
    }
    paths = []
    for name, data in cases.items():
        p = tmp_path / name
        p.write_bytes(data)
        paths.append(p)
    # A valid SQLite file that is not an nsys export.
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE t(x)")
    paths.append(other)
    # An nsys export from a future schema major.
    future = tmp_path / "future.sqlite"
    shutil.copy(sqlite_src, future)
    with sqlite3.connect(future) as db:
        db.execute("UPDATE META_DATA_EXPORT SET value='9.0.0' "
                   "WHERE name='EXPORT_SCHEMA_VERSION'")
    paths.append(future)
    # A kernel table without its start column.
    broken = tmp_path / "nostart.sqlite"
    shutil.copy(sqlite_src, broken)
    with sqlite3.connect(broken) as db:
        db.execute("ALTER TABLE CUPTI_ACTIVITY_KIND_KERNEL RENAME COLUMN start TO begin")
    paths.append(broken)
    paths.append(tmp_path / "missing.sqlite")
    paths.append(tmp_path)
    return paths


@pytest.mark.parametrize("command", ["ranges", "breakdown", "info"])
def test_bad_input_one_line_exit_2(tmp_path, command):
    for path in corrupt_files(tmp_path):
        out = tmp_path / "out" / "result.csv"
        out.parent.mkdir(exist_ok=True)
        args = [command, str(path)]
        if command != "info":
            args += ["--format", "csv" if command == "ranges" else "json", "-o", str(out)]
        proc = subprocess.run([sys.executable, "-m", "kimi_perf", *args], capture_output=True,
                              text=True)
        assert proc.returncode == 2, (path.name, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, (path.name, proc.stderr)
        assert lines[0].startswith("kimi-perf: error: ") and str(path) in lines[0]
        assert "Traceback" not in proc.stderr
        assert list(out.parent.iterdir()) == [], "a partial output file was left"


def test_gzipped_json_that_is_not_kineto(tmp_path):
    p = tmp_path / "list.json.gz"
    p.write_bytes(gzip.compress(b"[1, 2, 3]"))
    result = run("breakdown", p, "--format", "json")
    # An event list with no events is a valid, empty trace.
    assert result.exit_code == 0 and json.loads(result.output)["steps"] == []


def test_nsys_rep_without_nsys_says_how_to_get_it(tmp_path, monkeypatch):
    rep = tmp_path / "run.nsys-rep"
    rep.write_bytes(b"binary report")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    result = run("info", rep)
    assert result.exit_code == 2
    assert "needs the Nsight Systems CLI ('nsys') on PATH" in result.output


def test_nsys_rep_is_exported_with_the_nsys_on_path(tmp_path, monkeypatch):
    """A stand-in `nsys` that answers `nsys export` the way the real one does."""
    source = NSYS / "zx3xyy-assignment2-systems__result_2_7B_nvtx__nsys2024.6.2.sqlite"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "nsys"
    fake.write_text(f"""#!{sys.executable}
import shutil, sys
args = sys.argv[1:]
assert args[:3] == ["export", "--type", "sqlite"], args
out = args[args.index("--output") + 1]
shutil.copy({str(source)!r}, out)
""")
    fake.chmod(0o755)
    rep = tmp_path / "run.nsys-rep"
    rep.write_bytes(b"binary report")
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    result = run("info", rep)
    assert result.exit_code == 0, result.output
    assert "kernels 7328" in result.output
    failing = bindir / "nsys"
    failing.write_text("#!/bin/sh\necho 'cannot open report' >&2\nexit 3\n")
    result = run("info", rep)
    assert result.exit_code == 2 and "nsys export failed: cannot open report" in result.output
