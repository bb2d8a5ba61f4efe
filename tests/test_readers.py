"""Both readers on every real fixture, checked against independent figures."""

from __future__ import annotations

import contextlib
import csv
import gzip
import json
import re
import shutil
import sqlite3
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from kimi_perf import read_trace
from kimi_perf.errors import CONTROL_CHARACTERS
from kimi_perf.trace import DRIVER, GPU_RANGE, Trace
from tests.conftest import KINETO, NSYS, kineto_fixtures, nsys_fixtures


def test_kineto_fixtures_present():
    assert len(kineto_fixtures()) >= 12, f"Kineto fixtures missing under {KINETO}"


@pytest.mark.parametrize("fixture_file", nsys_fixtures(), ids=lambda p: p.stem[:40])
def test_nsys_kernels_match_cuda_gpu_kern_sum(fixture_file):
    """Instances and total ns per kernel name equal nsys's own cuda_gpu_kern_sum."""
    trace = read_trace(fixture_file)
    assert trace.meta["format"] == "nsys-sqlite"
    assert trace.meta["tool"].startswith("NVIDIA Nsight Systems 20")
    assert trace.meta["schema"].split(".")[0] in ("2", "3")
    from tests.test_nsys_golden import golden_for

    golden = golden_for(fixture_file.stem, "cuda_gpu_kern_sum")
    with sqlite3.connect(fixture_file) as db:
        has_kernels = db.execute("SELECT count(*) FROM sqlite_master WHERE "
                                 "name='CUPTI_ACTIVITY_KIND_KERNEL'").fetchone()[0]
        n_kernels = db.execute("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchone()[0] \
            if has_kernels else 0
    assert len(trace.kernels) == n_kernels
    if golden is None:   # only a fixture without CUDA has no report to hold it to
        assert n_kernels == 0
        return
    ours: dict[str, list[int]] = {}
    names = np.array(trace.strings, dtype=object)[trace.kernels.name]
    for name, dur in zip(names, (trace.kernels.end - trace.kernels.start).tolist(), strict=True):
        ours.setdefault(name, []).append(dur)
    rows = list(csv.DictReader(golden[0].splitlines()))
    assert sum(int(r["Instances"]) for r in rows) == n_kernels
    for row in rows:
        durations = ours[row["Name"]]
        assert len(durations) == int(row["Instances"])
        assert sum(durations) == int(row["Total Time (ns)"])


def test_nsys_oldest_schema_drops_backtrace_duplicates():
    trace = read_trace(NSYS / "hpcgroup-pipit__saxpy-mpi-cuda_nsys_perlmutter0__nsys2022.2.1"
                              ".sqlite")
    assert trace.meta["schema"] == "2.9.1"
    key = list(zip(trace.api.pid.tolist(), trace.api.correlation.tolist(), strict=True))
    with sqlite3.connect(trace.meta["file"]) as db:   # the runtime calls, each once
        (calls,) = db.execute("SELECT count(*) FROM (SELECT DISTINCT globalTid, correlationId "
                              "FROM CUPTI_ACTIVITY_KIND_RUNTIME)").fetchone()
    assert len(key) == len(set(key)) == calls == 57
    # each kernel's launch is the call itself, not its backtrace row (named without the
    # version suffix, and of other times)
    launches = np.array(trace.strings, dtype=object)[trace.api.name[trace.kernels.api]]
    assert set(launches) == {"cudaLaunchKernel_v7000"}
    # Domain-qualified range names as nsys prints them.
    names = set(np.array(trace.strings, dtype=object)[trace.ranges.name])
    assert "MPI:MPI_Send" in names and "saxpy" in names


def test_an_nvtx_range_that_ends_on_another_thread_holds_no_thread(tmp_path):
    """A start/end range that a second thread ended spans both threads' work, so it holds
    neither's launches: its thread is -1; the ranges pushed and popped on one thread keep
    theirs."""
    path = tmp_path / "ended_elsewhere.sqlite"
    shutil.copyfile(NSYS / "Athrun0109-CS336_assignment2__result__nsys2026.2.1.sqlite", path)
    path.chmod(0o644)
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        (row, start, thread), = db.execute(
            "SELECT rowid, start, globalTid FROM NVTX_EVENTS WHERE eventType = 59 "
            "ORDER BY start LIMIT 1").fetchall()
        db.execute("UPDATE NVTX_EVENTS SET eventType = 60, endGlobalTid = ? WHERE rowid = ?",
                   (thread + 1, row))
    ranges = read_trace(path).ranges
    moved = ranges.start == start
    assert moved.sum() == 1 and ranges.tid[moved][0] == -1
    assert (ranges.tid[~moved] >= 0).all() and len(set(ranges.tid[~moved].tolist())) == 1


def test_nsys_without_cuda_or_nvtx_and_with_non_utf8_metadata():
    trace = read_trace(NSYS / "IhorAtlanov-assignment2-systems__result__nsys2025.6.1_NO_CUDA"
                              ".sqlite")
    assert len(trace.kernels) == len(trace.ranges) == len(trace.api) == 0
    assert trace.meta["tool"] == "NVIDIA Nsight Systems 2025.6.1.190"


def test_nsys_two_processes_two_gpus():
    trace = read_trace(NSYS / "nsysai_fastvideo_wan2.1_train_2xh100_before.sqlite")
    pids = set(trace.kernels.pid.tolist())
    assert len(pids) == 2 and set(trace.kernels.device.tolist()) == {0, 1}
    # The capture window cuts a few launches off at its start; the rest all link.
    linked = trace.kernels.api >= 0
    assert linked.mean() > 0.95
    # Each kernel's launch belongs to the kernel's own process.
    assert (trace.api.pid[trace.kernels.api[linked]] == trace.kernels.pid[linked]).all()


def test_nsys_gpu_metadata():
    trace = read_trace(NSYS / "NVIDIA-Fuser__report1__nsys2025.1.1.sqlite")
    assert trace.meta["gpus"] == [{"device": 0, "name": "NVIDIA H200", "sm_count": 132}]
    newest = read_trace(NSYS / "Athrun0109-CS336_assignment2__result__nsys2026.2.1.sqlite")
    assert newest.meta["schema"] == "3.25.0" and newest.meta["processes"] == []


def test_nsys_graph_ids_of_kernels(tmp_path):
    # No fixture replays a graph (graphId NULL throughout): the same export with graph ids
    # written into some of its kernels' rows.
    path = tmp_path / "graphs.sqlite"
    shutil.copy(NSYS / "Athrun0109-CS336_assignment2__result__nsys2026.2.1.sqlite", path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET graphId = 7 + rowid % 3, "
                     "graphNodeId = 1000 + rowid WHERE rowid % 5 = 0")
        want = Counter(conn.execute("SELECT coalesce(graphId, -1), coalesce(graphNodeId, -1) "
                                    "FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchall())
    trace = read_trace(path)
    got = Counter(zip(trace.kernels.graph_id.tolist(), trace.kernels.graph_node_id.tolist(),
                      strict=True))
    assert got == want and len(want) > 800


def _kineto_events(path):
    doc = json.loads(gzip.decompress(path.read_bytes()))
    return doc, doc["traceEvents"]


@pytest.mark.parametrize("fixture_file", kineto_fixtures(), ids=lambda p: p.stem[:40])
def test_kineto_counts_and_times(fixture_file):
    _, events = _kineto_events(fixture_file)
    trace = read_trace(fixture_file)
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    assert len(trace.kernels) == len(kernels)
    assert trace.meta["format"] == "kineto-json"
    # Durations survive to the ns, whether the trace wrote integer or fractional µs.
    expected = Counter(round(e["dur"] * 1000) for e in kernels)
    assert Counter((trace.kernels.end - trace.kernels.start).tolist()) == expected
    # Each kernel keeps its name, GPU and stream with its duration (not only the multiset of
    # durations: a reader that paired one kernel's name with another's time would fail).
    k = trace.kernels
    got = Counter(zip([trace.strings[c] for c in k.name.tolist()],
                      (k.end - k.start).tolist(), k.device.tolist(), k.stream.tolist(),
                      strict=True))
    assert got == Counter((e["name"], round(e["dur"] * 1000), int(e["args"]["device"]),
                           int(e["args"]["stream"])) for e in kernels)
    # and its place in time: the kernels in order of their start are the events in order
    order = np.argsort(k.start, kind="stable")
    by_start = sorted(kernels, key=lambda e: e["ts"])
    assert [trace.strings[c] for c in k.name[order].tolist()] == [e["name"] for e in by_start]
    # Every kernel whose correlation has an API event is linked to it.
    api_corr = {e["args"]["correlation"] for e in events if e.get("cat") in
                ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    linked = sum(e["args"].get("correlation") in api_corr for e in kernels)
    assert int((trace.kernels.api >= 0).sum()) == linked


def test_kineto_full_graph_launch_fans_out():
    trace = read_trace(KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz")
    api_rows, counts = np.unique(trace.kernels.api[trace.kernels.api >= 0], return_counts=True)
    graph = api_rows[counts.argmax()]
    assert counts.max() == 421
    assert trace.strings[trace.api.name[graph]] == "hipGraphLaunch"
    assert "ROCm" in trace.meta["tool"]


def test_a_rocm_trace_is_told_by_its_hip_calls_where_its_metadata_is_silent():
    """PyTorch on ROCm does not always write roctracer_version or hip_runtime_version: its
    runtime calls (hipLaunchKernel) tell it too; a CUDA trace's (cudaLaunchKernel) do not."""
    doc = json.loads(gzip.decompress((KINETO / "hta_amd_mi250_rocm62_minitoy.json.gz")
                                     .read_bytes()))
    assert not {"roctracer_version", "hip_runtime_version"} & set(doc)
    rocm = read_trace(KINETO / "hta_amd_mi250_rocm62_minitoy.json.gz")
    assert rocm.meta["tool"] == "PyTorch profiler (Kineto, ROCm)"
    for name in ("hta_a100_triton_example.json.gz", "hta_v100_ddp_rank1_19k_kernels.json.gz"):
        assert read_trace(KINETO / name).meta["tool"] == "PyTorch profiler (Kineto)"


def test_kineto_driver_launch():
    trace = read_trace(KINETO / "hta_a100_triton_example.json.gz")
    (row,) = trace.kernels.api
    assert trace.api.kind[row] == DRIVER
    assert trace.strings[trace.api.name[row]] == "cuLaunchKernel"


def test_kineto_fractional_ns_and_gpu_annotations():
    trace = read_trace(KINETO / "hta_v100_ns_resolution_gpu_user_annotation.json.gz")
    assert (trace.kernels.start % 1000 != 0).any()
    assert (trace.ranges.style == GPU_RANGE).sum() == 15


def test_kptrace_round_trip(tmp_path):
    trace = read_trace(NSYS / "jsun-012-assignment2-systems__result__nsys2025.1.3.sqlite")
    out = tmp_path / "t.kptrace"
    trace.save(out)
    again = read_trace(out)
    assert isinstance(again, Trace)
    # the file read is the saved one; the trace it was saved from is kept beside it
    assert again.strings == trace.strings and again.meta == {
        **trace.meta, "file": str(out), "converted_from": trace.meta["file"], "kptrace": True}
    assert not trace.summary()["kptrace"] and again.summary()["kptrace"]
    moved = tmp_path / "moved.kptrace"
    again.save(moved)   # saved again: still from the export
    assert read_trace(moved).meta["converted_from"] == trace.meta["file"]
    moved.unlink()
    for table in ("kernels", "memops", "ranges", "api"):
        for col, values in getattr(trace, table).columns().items():
            np.testing.assert_array_equal(getattr(getattr(again, table), col), values)
    assert list(tmp_path.iterdir()) == [out]


def test_kptrace_says_whence_it_came_from_anywhere(tmp_path, monkeypatch):
    """A trace read by a relative path is saved with the path from the root: info on the
    .kptrace, run from another directory, names the trace it was saved from."""
    (tmp_path / "t.sqlite").symlink_to(NSYS / "jsun-012-assignment2-systems__result__"
                                              "nsys2025.1.3.sqlite")
    monkeypatch.chdir(tmp_path)
    read_trace("t.sqlite").save("t.kptrace")
    monkeypatch.chdir("/")
    assert read_trace(tmp_path / "t.kptrace").meta["converted_from"] == str(tmp_path / "t.sqlite")


@pytest.mark.parametrize("fixture_file", nsys_fixtures() + kineto_fixtures(),
                         ids=lambda p: p.name)
def test_every_string_kept_is_a_name_the_tables_use(fixture_file):
    trace = read_trace(fixture_file)
    used = np.unique(np.concatenate([
        getattr(table, col) for table in (trace.kernels, trace.memops, trace.ranges, trace.api)
        for col in ("name", "domain") if hasattr(table, col)]))
    np.testing.assert_array_equal(used, np.arange(len(trace.strings)))


def test_the_recorded_environment_stays_out_of_the_trace(tmp_path):
    # nsys keeps the profiled process's environment in StringIds (this one: a Jupyter
    # server's, with its token variable); neither the trace nor a saved .kptrace carries it.
    path = NSYS / "zx3xyy-assignment2-systems__result_2_7B_nvtx__nsys2024.6.2.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        environment = conn.execute("SELECT value FROM StringIds WHERE value LIKE "
                                   "'%JUPYTER%'").fetchall()
    assert environment
    trace = read_trace(path)
    trace.save(tmp_path / "t.kptrace")
    for strings in (trace.strings, read_trace(tmp_path / "t.kptrace").strings):
        assert not [s for s in strings if "JUPYTER" in s or "PATH=" in s]
        assert len(strings) < 100
    # a .kptrace saved before the readers dropped such strings loses them when read
    trace.strings.append("JUPYTER_TOKEN=secret")
    trace.save(tmp_path / "old.kptrace")
    assert "JUPYTER_TOKEN=secret" not in read_trace(tmp_path / "old.kptrace").strings


def test_control_characters_in_names_are_written_out(tmp_path):
    """A kernel or range name with an escape sequence (an untrusted trace's) reaches every
    table, CSV and report written out, not obeyed by the terminal that shows it; so does a
    bidirectional override, which would show the name's text in another order."""
    events = [{"ph": "X", "cat": "kernel", "name": "gemm\x1b[31m\x07", "ts": 10, "dur": 2,
               "pid": 0, "tid": 7, "args": {"device": 0, "stream": 7, "correlation": 1}},
              {"ph": "X", "cat": "user_annotation", "name": "step\x9b1m\n", "ts": 5,
               "dur": 20, "pid": 1, "tid": 1},
              {"ph": "X", "cat": "user_annotation", "name": "safe\u202elaunch\u2066",
               "ts": 6, "dur": 2, "pid": 1, "tid": 1}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events, "deviceProperties": [
        {"id": 0, "name": "H\x1b[31mX\x07", "numSms": 132}]}))
    trace = read_trace(path)
    assert trace.meta["gpus"][0]["name"] == "H\\x1b[31mX\\x07"
    assert sorted(trace.strings) == ["", "gemm\\x1b[31m\\x07", "safe\\u202elaunch\\u2066",
                                     "step\\x9b1m\\x0a"]
    trace.strings[0] += "\x1b"              # a .kptrace written before: tidied when read
    trace.save(tmp_path / "t.kptrace")
    assert not any(CONTROL_CHARACTERS.search(s)
                   for s in read_trace(tmp_path / "t.kptrace").strings)


# -- Kineto reader: the block reader (at any block size), the one-shot path and the per-event
# replay all give the same trace.

def _raise(exc):
    raise exc


def _kineto_paths(path, monkeypatch) -> dict[str, Trace]:
    from kimi_perf.readers import kineto

    traces = {"blocks": kineto.read_kineto_json(path)}
    with monkeypatch.context() as m:
        m.setattr(kineto, "_BLOCK", 997)  # many pieces, cuts everywhere
        traces["small blocks"] = kineto.read_kineto_json(path)
    with monkeypatch.context() as m:
        m.setattr(kineto, "_read_in_blocks", lambda p: _raise(kineto._Fallback()))
        traces["one shot"] = kineto.read_kineto_json(path)
    with monkeypatch.context() as m:
        m.setattr(kineto._Builder, "add_fast", lambda self, items: _raise(kineto._Slow()))
        traces["replay"] = kineto.read_kineto_json(path)
    return traces


def _assert_same_trace(a: Trace, b: Trace, label: str) -> None:
    assert a.strings == b.strings, label
    assert a.meta == b.meta, label
    for table in ("kernels", "memops", "ranges", "api"):
        for col, values in getattr(a, table).columns().items():
            other = getattr(getattr(b, table), col)
            assert values.dtype == other.dtype, (label, table, col)
            np.testing.assert_array_equal(values, other, err_msg=f"{label}: {table}.{col}")


@pytest.mark.parametrize("name", ["hta_amd_mi250_rocm62_minitoy.json.gz",
                                  "hta_a100_alexnet_cuda_sync.json.gz",
                                  "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz"])
def test_kineto_reader_paths_agree(name, monkeypatch):
    traces = _kineto_paths(KINETO / name, monkeypatch)
    for label, trace in traces.items():
        _assert_same_trace(traces["blocks"], trace, label)


def test_epoch_timestamps_with_fractional_ns_are_held_as_a_float64_holds_them():
    """1712195495519689.047 µs has 0.25 µs steps as a float64 (the reference says so): each
    start is within half a step of its text, each duration exact to the ns."""
    from decimal import Decimal

    path = KINETO / "hta_v100_ns_resolution_gpu_user_annotation.json.gz"
    events = json.loads(gzip.decompress(path.read_bytes()), parse_float=Decimal)["traceEvents"]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    starts = np.array(sorted(int(Decimal(e["ts"]) * 1000) for e in kernels))
    assert starts[0] > 10**18 and (starts % 1000).any()       # epoch ns, with fractions
    trace = read_trace(path)
    assert np.abs(np.sort(trace.kernels.start) - starts).max() <= 126
    durations = sorted(int(Decimal(e["dur"]) * 1000) for e in kernels)
    assert sorted((trace.kernels.end - trace.kernels.start).tolist()) == durations


@pytest.mark.parametrize("compressed", [False, True])
def test_kineto_json_after_a_utf8_bom_reads_as_without(compressed, tmp_path, monkeypatch):
    """Some editors and Windows tools write a byte-order mark before the JSON."""
    text = gzip.decompress((KINETO / "hta_amd_mi250_rocm62_minitoy.json.gz").read_bytes())
    plain, bom = tmp_path / "plain.json", tmp_path / "bom.json"
    plain.write_bytes(text)
    bom.write_bytes(gzip.compress(b"\xef\xbb\xbf" + text) if compressed
                    else b"\xef\xbb\xbf" + text)
    from kimi_perf.readers.kineto import read_kineto_json

    cases = [(read_trace(plain), {"read_trace": read_trace(bom)}),
             (read_kineto_json(plain), _kineto_paths(bom, monkeypatch))]
    for expected, traces in cases:
        for label, trace in traces.items():
            for key in ("file", "source_identity"):   # (what tells the two files apart)
                if key in expected.meta:
                    trace.meta[key] = expected.meta[key]
            _assert_same_trace(expected, trace, label)


def _tricky_kineto_doc() -> dict:
    """Text that looks like event boundaries inside strings and nested values, non-ASCII
    names, a label for a thread id, a gpu_user_annotation and "]" in the fields after the
    events."""
    launch = {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 5,
              "tid": 6, "ts": 100.5, "dur": 2.25, "args": {"correlation": 9, "cbid": 211}}
    kernel = {"ph": "X", "cat": "kernel", "name": 'void k<{lambda()#1}, 2>("µ}, {]")',
              "pid": 0, "tid": 7, "ts": 103.125, "dur": 4,
              "args": {"device": 0, "stream": 7, "correlation": 9, "grid": [1, 2, 3],
                       "nested": [{"a": "}, {"}, {"b": "],"}]}}
    events = [
        {"ph": "M", "name": "thread_name", "pid": "Spans", "tid": "", "args": {"name": "x"}},
        {"ph": "X", "cat": "user_annotation", "name": "step‹0›", "pid": 5, "tid": 6,
         "ts": 99, "dur": 20},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 5, "tid": 6, "ts": 100,
         "dur": 3, "args": {"Input Dims": [[2, 3], [3, 4]]}},
        launch,
        {"ph": "s", "id": 9, "pid": 5, "tid": 6, "ts": 100.5, "cat": "ac2g", "name": "ac2g"},
        kernel,
        {"ph": "f", "id": 9, "pid": 0, "tid": 7, "ts": 103.125, "cat": "ac2g", "name": "ac2g",
         "bp": "e"},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "step‹0›", "pid": 0, "tid": 7,
         "ts": 103, "dur": 5, "args": {"device": 0}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 5, "tid": "main thread",
         "ts": 110, "dur": 1},
        # process names: one that is not text, the first one said, a later one, the GPU's
        # lane (named after the process by Kineto) and a label for a pid
        {"ph": "M", "name": "process_name", "pid": "5", "args": {"name": ["x"]}},
        {"ph": "M", "name": "process_name", "pid": "5", "args": {"name": 'engine‹1› }, {"'}},
        {"ph": "M", "name": "process_name", "pid": 5, "tid": 0, "args": {"name": "later"}},
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "engine"}},
        {"ph": "M", "name": "process_name", "pid": "Spans", "args": {"name": "spans"}},
        {"ph": "M", "name": "process_name", "pid": "²", "args": {"name": "a digit, no int"}},
        {"ph": "M", "name": "thread_name", "pid": "--5", "args": {"name": "no pid"}},
    ]
    return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "G", "numSms": 2}],
            "traceEvents": events, "traceName": "a]b}, {c", "INFO": [["]"], "x]"]}


@pytest.mark.parametrize("layout", ["pretty", "compact", "gzip"])
def test_kineto_reader_tricky_text(layout, tmp_path, monkeypatch):
    doc = _tricky_kineto_doc()
    text = json.dumps(doc, indent=2 if layout == "pretty" else None,
                      separators=(",", ":") if layout == "compact" else None,
                      ensure_ascii=False).encode()
    path = tmp_path / ("t.json.gz" if layout == "gzip" else "t.json")
    path.write_bytes(gzip.compress(text) if layout == "gzip" else text)
    traces = _kineto_paths(path, monkeypatch)
    trace = traces["blocks"]
    for label, other in traces.items():
        _assert_same_trace(trace, other, label)
    assert [trace.strings[i] for i in trace.kernels.name] == [doc["traceEvents"][5]["name"]]
    assert trace.kernels.api.tolist() == [0] and trace.kernels.tid.tolist() == [6]
    assert trace.kernels.end.tolist() == [trace.kernels.start[0] + 4000]
    assert [trace.strings[i] for i in trace.ranges.name] == [
        "step‹0›", "cpu_op:aten::mm", "step‹0›", "cpu_op:aten::mm"]
    assert trace.ranges.style.tolist() == [0, 0, GPU_RANGE, 0]
    assert trace.ranges.tid[3] == 1 << 29  # the label got a synthetic id
    assert trace.meta["gpus"] == [{"device": 0, "name": "G", "sm_count": 2}]
    assert trace.meta["processes"] == [{"pid": 5, "name": 'engine‹1› }, {"'}]


def _eager_kineto_doc(n_layers: int = 4) -> dict:
    """An eager decode step profiled with ``with_stack``: each decoder layer's module call
    holds a Linear's module call, Python frames, an op and two kernel launches."""
    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#7", "pid": 5,
               "tid": 6, "ts": 0, "dur": 100 * n_layers + 50}]
    for i in range(n_layers):
        t = 10 + 100 * i
        events += [
            {"ph": "X", "cat": "python_function", "name": f"nn.Module: LlamaDecoderLayer_{i}",
             "pid": 5, "tid": 6, "ts": t, "dur": 90, "args": {"Python id": 3 * i}},
            {"ph": "X", "cat": "python_function",
             "name": "torch/nn/modules/module.py(1750): _call_impl", "pid": 5, "tid": 6,
             "ts": t + 1, "dur": 80},
            {"ph": "X", "cat": "python_function", "name": f"nn.Module: Linear_{i}", "pid": 5,
             "tid": 6, "ts": t + 2, "dur": 40},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 5, "tid": 6, "ts": t + 3,
             "dur": 30},
        ]
        for k, (name, ts) in enumerate((("gemm", t + 4), ("rmsnorm", t + 50))):
            corr = 10 * i + k
            events += [
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 5,
                 "tid": 6, "ts": ts, "dur": 2, "args": {"correlation": corr}},
                {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts + 5,
                 "dur": 3, "args": {"device": 0, "stream": 7, "correlation": corr}},
            ]
    return {"traceEvents": events}


def test_kineto_module_calls_are_ranges_and_layers(tmp_path, monkeypatch):
    """The profiler's module calls ("nn.Module: ...") are kept as ranges, by every read path,
    and give the layers; its other Python frames are left out."""
    path = tmp_path / "eager.json"
    path.write_text(json.dumps(_eager_kineto_doc()))
    traces = _kineto_paths(path, monkeypatch)
    trace = traces["blocks"]
    for label, other in traces.items():
        _assert_same_trace(trace, other, label)
    names = [trace.strings[i] for i in trace.ranges.name]
    assert [n for n in names if n.startswith("nn.Module")] == [
        f"nn.Module: {cls}_{i}" for i in range(4) for cls in ("LlamaDecoderLayer", "Linear")]
    assert not any("_call_impl" in n for n in names)
    from tests.synth import segment

    _, (step,) = segment(trace)
    assert step.name == "ProfilerStep#7" and step.layer_source == "nvtx"
    assert [x.index for x in step.layers] == [0, 1, 2, 3]
    assert [len(x.ops) for x in step.layers] == [2, 2, 2, 2]


def test_kineto_ids_beyond_int32_stay_int64(tmp_path, monkeypatch):
    """Id columns are int32 only where every value fits; the launch join and the attribution
    carry wide ids exactly."""
    from kimi_perf.attribution import range_kernel_summary

    doc = _tricky_kineto_doc()
    pid, corr, stream = 2**40 + 5, 2**33 + 9, 2**35 + 7
    for event in doc["traceEvents"][:5]:
        if event.get("pid") == 5:
            event["pid"] = pid
    for event in (doc["traceEvents"][3], doc["traceEvents"][5]):
        event["args"]["correlation"] = corr
    doc["traceEvents"][5]["args"]["stream"] = stream
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    traces = _kineto_paths(path, monkeypatch)
    trace = traces["blocks"]
    for label, other in traces.items():
        _assert_same_trace(trace, other, label)
    k = trace.kernels
    assert (k.pid.dtype, k.correlation.dtype, k.stream.dtype, k.tid.dtype) == (
        np.int64, np.int64, np.int64, np.int32)
    assert (k.pid.tolist(), k.correlation.tolist(), k.stream.tolist()) == ([pid], [corr],
                                                                          [stream])
    assert trace.api.pid.dtype == np.int64 and trace.ranges.pid.tolist()[:2] == [pid, pid]
    rows = {(r.range, r.kernel): r for r in range_kernel_summary(read_trace(path))}
    step = rows[("step‹0›", trace.strings[k.name[0]])]
    assert (step.pid, step.tid, step.kernel_instances, step.total_ns) == (pid, 6, 1, 4000)


def test_kineto_reader_errors_name_the_event(tmp_path, monkeypatch):
    from kimi_perf.errors import TraceError
    from kimi_perf.readers import kineto

    doc = _tricky_kineto_doc()
    del doc["traceEvents"][5]["ts"]
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(json.dumps(doc, indent=2).encode()))
    for block in (kineto._BLOCK, 997):
        monkeypatch.setattr(kineto, "_BLOCK", block)
        with pytest.raises(TraceError, match=r"event 5 \(kernel\) is malformed: no 'ts'$"):
            read_trace(path)
    # Invalid UTF-8, even in a field that is never decoded, and a truncated file.
    bad = json.dumps(_tricky_kineto_doc()).encode().replace(b'"bp": "e"', b'"bp": "\xff"')
    (tmp_path / "u.json").write_bytes(bad)
    (tmp_path / "v.json").write_bytes(bad.replace(b"\xff", b"e")[:-40])
    for name in ("u.json", "v.json"):
        with pytest.raises(TraceError, match="invalid or truncated JSON"):
            read_trace(tmp_path / name)


def test_kineto_gpu_activity_without_runtime_events_reads(tmp_path):
    """A profiler that recorded the GPU alone (no cuda_runtime events): the kernels carry
    correlation ids that name no launch; they read, launched by nothing."""
    path = tmp_path / "gpu_only.json"
    path.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 10, "dur": 2,
         "args": {"correlation": 5, "device": 0, "stream": 7}}]}))
    trace = read_trace(path)
    assert len(trace.kernels) == 1 and len(trace.api) == 0
    assert trace.kernels.api.tolist() == [-1] and trace.kernels.end.tolist() == [12000]


def test_kineto_gpu_work_with_a_negative_duration_is_left_out_and_counted(tmp_path,
                                                                         monkeypatch):
    """As in the nsys reader: a kernel or copy whose duration is negative (or missing) has no
    time; it is left out and counted (every reader path alike), not kept as a zero-length
    kernel. A host event's negative duration ends where it starts."""
    from kimi_perf import breakdown
    from kimi_perf.layer_breakdown import step_notes

    def gpu(cat, name, ts, dur, corr):
        return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
                "args": {"correlation": corr, "device": 0, "stream": 7, "bytes": 64}}

    events = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1,
               "tid": 1, "ts": 9, "dur": -2, "args": {"correlation": 1}},
              gpu("kernel", "kept", 10, 5, 1), gpu("kernel", "negative", 20, -3, 2),
              gpu("gpu_memcpy", "Memcpy HtoD", 30, -1, 3), gpu("kernel", "zero", 40, 0, 4),
              gpu("gpu_memset", "Memset", 50, 2, 5), gpu("kernel", "no duration", 60, 0, 6)]
    del events[-1]["dur"]
    path = tmp_path / "negative.json"
    path.write_text(json.dumps({"traceEvents": events}))
    for label, trace in _kineto_paths(path, monkeypatch).items():
        names = [trace.strings[n] for n in trace.kernels.name.tolist()]
        assert names == ["kept", "zero"] and len(trace.memops) == 1, label
        assert trace.meta["untimed"] == {"kernels": 2, "memops": 1}, label
        assert trace.kernels.end.tolist() == [15000, 40000], label
        assert (trace.api.end - trace.api.start).tolist() == [0], label
    assert "2 kernels and 1 memory operations without a time" in " ".join(
        step_notes(breakdown(read_trace(path))))


def test_kineto_ranges_with_a_negative_duration_are_left_out_and_counted(tmp_path,
                                                                         monkeypatch):
    """A range whose duration is negative or missing was kept with no time: it held no
    kernel, so a step of it vanished from ranges' rows and breakdown's steps without a word.
    Now it is left out and counted (every reader path alike), and said: info, ranges,
    breakdown's notes; a .kptrace keeps the count."""
    from click.testing import CliRunner

    from kimi_perf import breakdown
    from kimi_perf.cli import main
    from kimi_perf.layer_breakdown import step_notes

    events = []
    for step, dur in enumerate((100, -5, None, 100)):
        ts = 1000 * step
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}",
                       "pid": 1, "tid": 1, "ts": ts, "dur": dur})
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1,
                       "tid": 1, "ts": ts + 10, "dur": 5, "args": {"correlation": step + 1}})
        events.append({"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7,
                       "ts": ts + 20, "dur": 30, "args": {"correlation": step + 1,
                                                          "device": 0, "stream": 7}})
    del events[6]["dur"]
    path = tmp_path / "steps.json"
    path.write_text(json.dumps({"traceEvents": events}))
    for label, trace in _kineto_paths(path, monkeypatch).items():
        names = [trace.strings[n] for n in trace.ranges.name.tolist()]
        assert names == ["ProfilerStep#0", "ProfilerStep#3"], label
        assert trace.meta["untimed_ranges"] == 2 and "untimed" not in trace.meta, label
    trace = read_trace(path)
    assert trace.summary()["untimed_ranges"] == 2
    trace.save(tmp_path / "steps.kptrace")
    assert read_trace(tmp_path / "steps.kptrace").meta["untimed_ranges"] == 2
    assert "2 ranges without a time (a missing or negative dur) left out: no step or layer is " \
           "one of them" in step_notes(breakdown(trace))
    run = CliRunner().invoke(main, ["info", str(path)])
    assert "left out, without a time: 2 ranges (a missing or negative dur)" in run.output
    run = CliRunner().invoke(main, ["ranges", str(path), "--format", "csv"])
    assert run.exit_code == 0 and run.stderr == (
        f"{path}: 2 ranges without a time (a missing or negative dur) left out, holding no "
        "kernel\n")
    assert [line.split(",")[0] for line in run.stdout.splitlines()[1:]] == [
        "", "ProfilerStep#0", "ProfilerStep#3"]
    # every step range without a time: what finds no step says why, and ranges says once why
    # every kernel is in none
    for event in events:
        if event["cat"] == "user_annotation":
            event["dur"] = -1
    path.write_text(json.dumps({"traceEvents": events}))
    run = CliRunner().invoke(main, ["breakdown", str(path), "--steps", "ProfilerStep"])
    assert run.exit_code == 2 and run.output == (
        f"kimi-perf: error: {path}: no range matching --steps 'ProfilerStep' holds a kernel "
        "launch (4 ranges without a time, a missing or negative dur, left out)\n")
    run = CliRunner().invoke(main, ["ranges", str(path)])
    assert run.exit_code == 0 and run.stderr == (
        f"{path}: 4 ranges without a time (a missing or negative dur) left out, holding no "
        "kernel: every kernel is in none\n")


@pytest.mark.parametrize(("field", "value"), [("ts", True), ("ts", "12"), ("dur", False),
                                              ("dur", "3"), ("dur", None)])
def test_kineto_times_that_are_not_numbers_are_an_error(tmp_path, field, value):
    """A boolean or a numeric string is no time: numpy would read True as 1 and "12" as 12."""
    from kimi_perf.errors import TraceError

    event = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 10, "dur": 2,
             "args": {"correlation": 5, "device": 0, "stream": 7}}
    event[field] = value
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [event]}))
    shown = re.escape(json.dumps(value))   # (as the JSON holds it: "12", null)
    with pytest.raises(TraceError, match=rf"event 0 \(kernel\) is malformed: "
                                         rf"'{field}' is {shown}, not a number"):
        read_trace(path)


@pytest.mark.parametrize("cat", ["kernel", "cuda_runtime", "user_annotation"])
@pytest.mark.parametrize("value", [None, 5, ["k"]])
def test_kineto_names_that_are_not_text_are_an_error(tmp_path, cat, value):
    """A kernel, call or range whose name is null or a number was read under the name
    "None" or "5", which ranges and breakdown then listed; it is malformed, as a time that
    is no number is."""
    from kimi_perf.errors import TraceError

    event = {"ph": "X", "cat": cat, "name": value, "pid": 0, "tid": 7, "ts": 10, "dur": 2,
             "args": {"correlation": 5, "device": 0, "stream": 7}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [event]}))
    with pytest.raises(TraceError, match=rf"event 0 \({cat}\) is malformed: 'name' is "
                                         + re.escape(f"{json.dumps(value)}, not text")):
        read_trace(path)
    del event["name"]   # (absent: no name, as before)
    path.write_text(json.dumps({"traceEvents": [event]}))
    read_trace(path)


def _one_kernel_doc(**args) -> dict:
    """A launch and its kernel, the kernel's ``args`` updated by ``args``, after a plain
    kernel (with ids of ordinary size beside it, numpy reads a list holding 2^63 as floats)."""
    return {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 4, "dur": 2,
         "args": {"correlation": 4, "device": 0, "stream": 7}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
         "ts": 8, "dur": 1, "args": {"correlation": 5}},
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 10, "dur": 2,
         "args": {"correlation": 5, "device": 0, "stream": 7, **args}}]}


@pytest.mark.parametrize(("field", "value", "said"), [
    ("device", 2**31, "Kernels.device holds 2147483648, beyond int32"),
    ("device", 2**63, "Kernels.device holds 9223372036854775808, beyond int32"),
    ("device", 2**64 - 1, "Kernels.device holds 18446744073709551615, beyond int32"),
    ("device", 2**64, "Kernels.device holds 1.84467e+19, beyond int32"),
    ("device", -(2**63) - 1, "Kernels.device holds -9.22337e+18, beyond int32"),
    ("device", -(10**23), "Kernels.device holds -1e+23, beyond int32"),
    ("device", "99999999999999999999999", "Kernels.device holds 99999999999999999999999, "
                                          "beyond int32"),
    ("stream", 2**63, "Kernels.stream holds 9223372036854775808, beyond int64"),
    ("correlation", 2**70, "correlation holds 1180591620717411303424, beyond int64")])
def test_kineto_ids_beyond_int64_are_an_error(tmp_path, field, value, said):
    """An id past int64 is refused by its column as one past int32 is: it came as a float
    (or an object) that a cast wrapped to another GPU with a numpy warning, or failed on
    naming no column."""
    import warnings

    from kimi_perf.errors import TraceError

    path = tmp_path / "t.json"
    path.write_text(json.dumps(_one_kernel_doc(**{field: value})))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TraceError, match=re.escape(said)):
            read_trace(path)


@pytest.mark.parametrize(("args", "said"), [
    ([1, 2], "'args' is [1, 2], not an object"),
    ({"correlation": [5]}, "'args.correlation' is [5], not an integer"),
    ({"correlation": None}, "'args.correlation' is null, not an integer"),
    ({"correlation": 3.5}, "'args.correlation' is 3.5, not an integer"),   # (not cut to 3)
    ({"device": {"id": 0}}, "'args.device' is {\"id\": 0}, not an id")])
def test_kineto_malformed_args_are_named(tmp_path, args, said):
    """An ``args`` that is no object, or a field in it of a type no id has: the event and
    the field are named, not a Python error ("'list' object has no attribute 'get'")."""
    from kimi_perf.errors import TraceError

    doc = _one_kernel_doc()
    doc["traceEvents"][2]["args"] = args if isinstance(args, list) else {
        **doc["traceEvents"][2]["args"], **args}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(TraceError, match=r"event 2 \(kernel\) is malformed: "
                                         + re.escape(said)):
        read_trace(path)


@pytest.mark.parametrize("size", [None, "", -1])
def test_kineto_copies_of_no_size_read_as_unknown(tmp_path, size):
    """A copy whose ``bytes`` is null or empty is of unknown size (-1), as one without it."""
    doc = _one_kernel_doc()
    doc["traceEvents"].append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "pid": 0,
                               "tid": 7, "ts": 20, "dur": 1,
                               "args": {"device": 0, "stream": 7, "bytes": size}})
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    assert read_trace(path).memops.bytes.tolist() == [-1]


def test_kineto_exact_repeats_of_gpu_work_are_left_out_and_counted(tmp_path, monkeypatch):
    """A kernel or copy the trace holds twice (every field equal: a trace written or merged
    twice) ran once: counted twice it added time the GPU never spent (kernel µs over the
    span). Repeats are left out and counted by every read path, said by info and the steps'
    notes; work differing in any field (another stream, correlation, time) is kept."""
    from kimi_perf import breakdown
    from kimi_perf.layer_breakdown import step_notes

    doc = _eager_kineto_doc()
    events = doc["traceEvents"]
    kernels = [e for e in events if e["cat"] == "kernel"]
    copy = {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "pid": 0, "tid": 7,
            "ts": 1, "dur": 1, "args": {"device": 0, "stream": 7, "correlation": 1,
                                        "bytes": 64}}
    events += [copy, json.loads(json.dumps(copy))]
    events += [json.loads(json.dumps(k)) for k in kernels]        # every kernel again
    events.append(json.loads(json.dumps(kernels[0])))             # and the first a third time
    near = [json.loads(json.dumps(kernels[1])) for _ in range(5)]
    near[0]["args"]["stream"] = 8
    near[1]["args"]["correlation"] = 999
    near[2]["dur"] = 4
    # work of no duration, alike: two sub-µs launches of one graph replay in a trace of
    # whole microseconds, not one written twice
    near[3]["dur"] = near[4]["dur"] = 0
    events += near
    path = tmp_path / "repeated.json"
    path.write_text(json.dumps(doc))
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(_eager_kineto_doc()))
    expected = read_trace(plain)
    for label, trace in _kineto_paths(path, monkeypatch).items():
        assert len(trace.kernels) == len(expected.kernels) + 5 and len(trace.memops) == 1, label
        assert trace.meta["duplicates"] == {"kernels": len(kernels) + 1, "memops": 1}, label
    trace = read_trace(path)
    assert trace.summary()["duplicates"] == {"kernels": len(kernels) + 1, "memops": 1}
    assert f"{len(kernels) + 1} kernels and 1 memory operations that repeat another exactly" \
        in " ".join(step_notes(breakdown(trace)))
    assert "duplicates" not in expected.meta
    from click.testing import CliRunner

    from kimi_perf.cli import main

    said = CliRunner().invoke(main, ["info", str(path)]).output
    assert (f"left out, exact repeats of another event: {len(kernels) + 1} kernels, "
            "1 memcpy/memset op\n") in said


FUSER = NSYS / "NVIDIA-Fuser__report1__nsys2025.1.1.sqlite"


def test_nsys_string_ids_are_looked_up_not_indexed(tmp_path):
    """An export trimmed to the strings it uses keeps ids in the millions (nsys-ai's fixtures:
    126 strings up to id 3435062); an id near 2^63 reads as well, with no table that large."""
    trimmed = read_trace(NSYS / "nsysai_fastvideo_wan2.1_train_2xh100_after.sqlite")
    names = {trimmed.strings[n] for n in np.unique(trimmed.kernels.name).tolist()}
    assert len(trimmed.kernels) and "<unknown>" not in names
    copy = tmp_path / "huge_id.sqlite"
    copy.write_bytes(FUSER.read_bytes())
    with sqlite3.connect(copy) as db:
        (kernel_name,) = db.execute("SELECT demangledName FROM CUPTI_ACTIVITY_KIND_KERNEL "
                                    "LIMIT 1").fetchone()
        db.execute("UPDATE StringIds SET id = 9000000000000000000 WHERE id = ?", (kernel_name,))
        db.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET demangledName = 9000000000000000000 "
                   "WHERE demangledName = ?", (kernel_name,))
    before, after = read_trace(FUSER), read_trace(copy)
    assert Counter(before.strings[n] for n in before.kernels.name.tolist()) == Counter(
        after.strings[n] for n in after.kernels.name.tolist())


def _fuser_with(tmp_path, change: str):
    """FUSER with ``change`` made to its kernel table (rebuilt without NOT NULL)."""
    copy = tmp_path / "changed.sqlite"
    copy.write_bytes(FUSER.read_bytes())
    with sqlite3.connect(copy) as db:
        db.execute("CREATE TABLE k AS SELECT * FROM CUPTI_ACTIVITY_KIND_KERNEL")
        db.execute("DROP TABLE CUPTI_ACTIVITY_KIND_KERNEL")
        db.execute("ALTER TABLE k RENAME TO CUPTI_ACTIVITY_KIND_KERNEL")
        db.execute(change)
    return copy


@pytest.mark.parametrize(("change", "left_out"), [
    ("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = NULL WHERE rowid <= 2", 2),
    ("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = NULL WHERE rowid = 1", 1),
    ("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = 0, end = 0 WHERE rowid = 3", 1),
    ("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = start - 5 WHERE rowid > 15", 3)])
def test_nsys_kernels_without_a_time_are_left_out_and_counted(tmp_path, change, left_out):
    """CUPTI records a kernel it could not time with start and end 0; a NULL or an end
    before the start is no time either. Placed at 0 it would stretch its step over the
    session: such kernels are left out, counted, and said (info, the steps' notes)."""
    from kimi_perf import breakdown
    from kimi_perf.layer_breakdown import step_notes

    trace = read_trace(_fuser_with(tmp_path, change))
    assert len(trace.kernels) == len(read_trace(FUSER).kernels) - left_out
    assert trace.meta["untimed"] == {"kernels": left_out, "memops": 0}
    assert f"{left_out} kernels and 0 memory operations without a time" in " ".join(
        step_notes(breakdown(trace)))


def test_nsys_gpu_ids_beyond_32_bits_are_an_error(tmp_path):
    """A GPU id no export holds would read as another GPU (99999999999 as 1215752191)."""
    from kimi_perf.errors import TraceError

    with pytest.raises(TraceError, match=r"Kernels\.device holds 99999999999, beyond int32"):
        read_trace(_fuser_with(tmp_path, "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET deviceId = "
                                         "99999999999"))


ATHRUN = NSYS / "Athrun0109-CS336_assignment2__result__nsys2026.2.1.sqlite"


def test_nsys_ranges_without_an_end(tmp_path):
    """An unterminated NVTX range runs to the last NVTX timestamp (as nsys stats does), also
    where no range ends at all (the last one's start, then), not a Python error ("int()
    argument must be ... not 'NoneType'")."""
    copy = _athrun_copy(tmp_path / "open.sqlite")
    with sqlite3.connect(copy) as db:
        (last,) = db.execute("SELECT max(end) FROM NVTX_EVENTS").fetchone()
        db.execute("UPDATE NVTX_EVENTS SET end = NULL WHERE rowid = (SELECT min(rowid) FROM "
                   "NVTX_EVENTS WHERE eventType = 59)")
    ranges = read_trace(copy).ranges
    assert len(ranges) == len(read_trace(ATHRUN).ranges) and ranges.end.max() == last
    with sqlite3.connect(copy) as db:
        db.execute("UPDATE NVTX_EVENTS SET end = NULL")
        (last_start,) = db.execute("SELECT max(start) FROM NVTX_EVENTS").fetchone()
    open_ranges = read_trace(copy)
    assert len(open_ranges.ranges) == len(ranges)
    assert (open_ranges.ranges.end == last_start).all()
    assert len(open_ranges.kernels) == len(read_trace(ATHRUN).kernels) > 0


def _athrun_copy(path: Path) -> Path:
    """A copy of the Athrun nsys export to change."""
    path.write_bytes(ATHRUN.read_bytes())
    return path


def test_nsys_string_ids_without_their_text_column(tmp_path):
    """StringIds without its ``value`` column is said as any missing column is, not as a
    corrupt file ("no such column: value")."""
    from kimi_perf.errors import TraceError

    with sqlite3.connect(copy := _athrun_copy(tmp_path / "novalue.sqlite")) as db:
        db.execute("ALTER TABLE StringIds DROP COLUMN value")
    with pytest.raises(TraceError, match=r"novalue\.sqlite: table StringIds lacks column\(s\) "
                                         r"value \(export schema"):
        read_trace(copy)


def test_formats_are_told_by_content_not_name(tmp_path):
    """A Kineto trace named .nsys-rep reads as Kineto (nsys is not asked); an SQLite export
    cut short reads as an error, not as a trace that lacks its last rows."""
    from kimi_perf.errors import TraceError

    misnamed = tmp_path / "trace.nsys-rep"
    misnamed.write_bytes((KINETO / "hta_amd_mi250_rocm62_minitoy.json.gz").read_bytes())
    assert read_trace(misnamed).meta["format"] == read_trace(
        KINETO / "hta_amd_mi250_rocm62_minitoy.json.gz").meta["format"]
    cut = tmp_path / "cut.sqlite"
    cut.write_bytes(FUSER.read_bytes()[:-1000])
    with pytest.raises(TraceError, match="truncated or corrupt: its header says 2011136 bytes, "
                                         "the file holds 2010136"):
        read_trace(cut)


def test_a_gzipped_export_reads_as_the_export(tmp_path, monkeypatch):
    """An nsys SQLite export gzipped (as exports are shared; named anything) reads as the
    export does, and its temporary copy is gone after; one cut short is an error naming it,
    not taken for JSON."""
    import gzip
    import tempfile

    from kimi_perf.errors import TraceError

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    packed = tmp_path / "report.sqlite.gz"
    packed.write_bytes(gzip.compress(FUSER.read_bytes()))
    plain = read_trace(FUSER)
    trace = read_trace(packed)
    assert not any(scratch.iterdir())
    assert trace.meta["file"] == str(packed) and trace.meta["tool"] == plain.meta["tool"]
    for table in ("kernels", "memops", "ranges", "api"):
        assert len(getattr(trace, table)) == len(getattr(plain, table)), table
    assert np.array_equal(trace.kernels.start, plain.kernels.start)
    cut = tmp_path / "cut.sqlite"          # the name says SQLite, the content is gzip
    cut.write_bytes(packed.read_bytes()[: packed.stat().st_size // 2])
    with pytest.raises(TraceError, match=r"cut\.sqlite: truncated or corrupt gzip"):
        read_trace(cut)
    assert not any(scratch.iterdir())


@pytest.mark.parametrize(("content", "said"), [
    ("kptrace", "a gzipped .kptrace: gunzip it"),
    (b"Nothing like a trace\n", "unknown format inside the gzip"),
    (b"\xef\xbb\xbf  \n{\"traceEvents\": [", "invalid or truncated JSON"),
    (b"", "a gzip that holds an empty file"), (b" \n\t", "a gzip that holds only blanks")])
def test_what_a_gzip_holds_is_named(tmp_path, content, said):
    """A gzip of what no reader takes (a .kptrace, which is compressed within; text) says
    so, rather than calling it JSON that is not UTF-8; gzipped JSON (a BOM and blanks before
    it) still goes to the Kineto reader, which says what is wrong with it."""
    from kimi_perf.errors import TraceError

    if content == "kptrace":
        read_trace(KINETO / "hta_amd_mi250_rocm62_minitoy.json.gz").save(tmp_path / "t.kptrace")
        content = (tmp_path / "t.kptrace").read_bytes()
    packed = tmp_path / "packed.gz"
    packed.write_bytes(gzip.compress(content))
    with pytest.raises(TraceError, match=r"packed\.gz: " + re.escape(said)):
        read_trace(packed)


@pytest.mark.parametrize("name", ["run%41.sqlite", "run#2.sqlite", "t?x.sqlite", "50%.sqlite"])
def test_an_export_is_read_whatever_its_name(tmp_path, name):
    """SQLite opens a URI: '%41', '#' or '?' in a file's name must not open another file
    ('run%41' read 'runA', 'run#2' read 'run')."""
    import shutil

    shutil.copy(FUSER, tmp_path / name)
    decoy = NSYS / "IhorAtlanov-assignment2-systems__result__nsys2025.6.1_NO_CUDA.sqlite"
    for other in ("runA.sqlite", "run", "t"):
        shutil.copy(decoy, tmp_path / other)
    trace = read_trace(tmp_path / name)
    assert trace.meta["tool"] == read_trace(FUSER).meta["tool"]
    assert len(trace.kernels) == len(read_trace(FUSER).kernels) > 0


def test_a_second_trace_events_list_is_an_error(tmp_path):
    """A JSON decoder keeps the last of two equal keys: with a second "traceEvents" the
    trace's own events were dropped without a word. An event named so is no second list."""
    from kimi_perf.errors import TraceError

    source = KINETO / "hta_amd_mi250_rocm62_minitoy.json.gz"
    text = gzip.decompress(source.read_bytes()).decode().rstrip()
    twice = tmp_path / "twice.json"
    twice.write_text(text[:-1] + ', "traceEvents": []}')
    with pytest.raises(TraceError, match=r"twice\.json: two 'traceEvents' lists in one object"):
        read_trace(twice)
    doc = json.loads(text)
    for event in doc["traceEvents"][:2]:
        event["name"] = "traceEvents"
    named = tmp_path / "named.json"
    named.write_text(json.dumps(doc))
    assert len(read_trace(named).kernels) == len(read_trace(source).kernels)


@pytest.mark.parametrize("fixture_file", nsys_fixtures() + kineto_fixtures(),
                         ids=lambda p: p.name)
def test_summary_accounts_for_every_kernel(fixture_file):
    """Trace.summary (what `kimi-perf info` prints): every kernel in one process or none and on
    one GPU; processes the most kernels first; plain JSON."""
    trace = read_trace(fixture_file)
    info = json.loads(json.dumps(trace.summary()))
    assert info["kernels"] == len(trace.kernels) and info["api_calls"] == len(trace.api)
    assert sum(p["kernels"] for p in info["processes"]) + info["kernels_without_process"] \
        == info["kernels"] == sum(g["kernels"] for g in info["gpus"])
    counts = [p["kernels"] for p in info["processes"]]
    assert counts == sorted(counts, reverse=True)
    if len(trace.kernels):
        assert info["span_ns"] >= int(trace.kernels.end.max() - trace.kernels.start.min())
        work = [t for t in (trace.kernels, trace.memops) if len(t)]
        assert info["gpu_span_ns"] == (max(int(t.end.max()) for t in work)
                                       - min(int(t.start.min()) for t in work))
        assert info["gpu_span_ns"] <= info["span_ns"]
    else:
        assert info["gpu_span_ns"] is None or len(trace.memops)


def test_summary_of_a_small_trace_by_hand():
    """Trace.summary's every count worked by hand on a trace built for it: process 0 (a pid
    like any other) and process 5 share device 1's stream 7, two streams; two kernels no call
    launched (no process) on that stream and on stream 9, which only the second adds; a graph
    launch whose two kernels are its graph kernels (the unlaunched ones none of them); a memcpy
    ending last, so the GPU span (100 to 1900) runs to it and the span (-50, a range's start)
    too; device 0 described and idle, device 1 undescribed; ``op:`` ranges on a thread
    annotated ops, not one on the GPU nor a name that holds ``op:`` later; untimed memops 0
    where the metadata gives kernels only. A trace of nothing has no span."""
    from kimi_perf.trace import GPU_RANGE, Kernels
    from tests.synth import TraceBuilder

    b = TraceBuilder()
    b.launch("a", 0, 50, 100, 300, pid=0, tid=3, device=1)
    b.launch("b", 400, 450, 500, 700, pid=5, tid=8, device=1)
    for name, start in (("g1", 900), ("g2", 1000)):
        b.launch(name, 800, 850, start, start + 100, pid=5, tid=8, device=1,
                 api_name="cudaGraphLaunch", correlation=40)
    for name, start, stream in (("lost", 1200, 7), ("lost2", 1300, 9)):
        b.kernels.append(dict(name=b.strings.code(name), start=start, end=start + 100,
                              device=1, stream=stream, pid=-1, correlation=90 + stream))
    b.memop("[CUDA memcpy Host-to-Device]", 1500, 1900, correlation=40, pid=5, device=1)
    b.range("step", -50, 1000, pid=5, tid=8)
    b.range("op:in_proj", 400, 450, pid=5, tid=8)
    b.range("layer:op:q", 800, 850, pid=5, tid=8)
    b.ranges.append(dict(name=b.strings.code("op:gpu"), domain=b.strings.code(""), start=500,
                         end=700, pid=5, tid=-1, device=1, stream=7, style=GPU_RANGE))
    trace = b.build()
    trace.meta |= {"gpus": [{"device": 0, "name": "H100", "sm_count": 132}],
                   "processes": [{"pid": 5, "name": "python"}], "untimed": {"kernels": 2}}
    info = trace.summary()
    assert {k: info[k] for k in (
        "kernels", "memops", "ranges", "api_calls", "annotated_ops", "untimed", "duplicates",
        "span_ns", "gpu_span_ns", "kernel_ns", "streams", "graph_launches", "graph_kernels",
        "kernels_without_process", "unlaunched_kernels")} == {
        "kernels": 6, "memops": 1, "ranges": 4, "api_calls": 3, "annotated_ops": 1,
        "untimed": {"kernels": 2, "memops": 0}, "duplicates": {"kernels": 0, "memops": 0},
        "span_ns": 1950, "gpu_span_ns": 1800, "kernel_ns": 800, "streams": 3,
        "graph_launches": 1, "graph_kernels": 2, "kernels_without_process": 2,
        "unlaunched_kernels": 2}
    assert info["processes"] == [{"pid": 5, "name": "python", "kernels": 3, "api_calls": 2},
                                 {"pid": 0, "name": None, "kernels": 1, "api_calls": 1}]
    assert info["gpus"] == [
        {"device": 0, "name": "H100", "described": True, "sm_count": 132, "kernels": 0},
        {"device": 1, "name": None, "described": False, "sm_count": None, "kernels": 6}]
    nothing = Trace(strings=[], kernels=Kernels.empty()).summary()
    assert (nothing["span_ns"], nothing["gpu_span_ns"], nothing["streams"],
            nothing["processes"], nothing["gpus"]) == (None, None, 0, [], [])


def test_summary_of_two_processes_on_two_gpus():
    info = read_trace(NSYS / "nsysai_fastvideo_wan2.1_train_2xh100_before.sqlite").summary()
    assert [g["device"] for g in info["gpus"] if g["kernels"]] == [0, 1]
    assert sum(1 for p in info["processes"] if p["kernels"]) == 2


@pytest.mark.parametrize(("content", "said"), [
    (b"", "empty file"), (b" \n\t\r\n" * 100_000, "holds only blanks (spaces and line breaks)"),
    (b" " * 70 + b"x", "unknown format")])
def test_a_file_of_nothing_is_said_so(tmp_path, content, said):
    """An empty file, or one of blanks alone (past the 64 bytes the format is told from),
    is said to be that, not an unknown format; blanks before anything else are not."""
    from kimi_perf.errors import TraceError

    path = tmp_path / "t.json"
    path.write_bytes(content)
    with pytest.raises(TraceError, match=r"t\.json: " + re.escape(said)):
        read_trace(path)


def test_gpu_span_is_the_gpu_works_own():
    """HTA's triton example: one kernel of 1.76 µs, and a ProfilerStep annotation on a thread
    that launched nothing, lasting 13 s: the events span 13 s, the GPU work the kernel."""
    trace = read_trace(KINETO / "hta_a100_triton_example.json.gz")
    info = trace.summary()
    (duration,) = (trace.kernels.end - trace.kernels.start).tolist()
    assert info["gpu_span_ns"] == duration == 1760
    assert info["span_ns"] > 13e9
    assert read_trace(NSYS / "IhorAtlanov-assignment2-systems__result__nsys2025.6.1_NO_CUDA"
                                 ".sqlite").summary()["gpu_span_ns"] is None


def test_a_kineto_kernel_without_a_correlation_has_no_launch(tmp_path):
    """A kernel event lacking its correlation is linked to no API call, not to a call that
    lacks one too (a synchronize): no launching thread, process or ranges of that call's."""
    events = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "pid": 5,
               "tid": 6, "ts": 10, "dur": 5, "args": {}},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 5,
               "tid": 6, "ts": 20, "dur": 2, "args": {"correlation": 1}},
              {"ph": "X", "cat": "kernel", "name": "k1", "pid": 0, "tid": 7, "ts": 30,
               "dur": 3, "args": {"device": 0, "stream": 7, "correlation": 1}},
              {"ph": "X", "cat": "kernel", "name": "k2", "pid": 0, "tid": 7, "ts": 40,
               "dur": 3, "args": {"device": 0, "stream": 7}}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    trace = read_trace(path)
    launch = [trace.strings[trace.api.name[a]] if a >= 0 else None
              for a in trace.kernels.api.tolist()]
    assert launch == ["cudaLaunchKernel", None]
    assert trace.kernels.pid.tolist() == [5, -1]


@pytest.mark.parametrize(("change", "untimed"), [
    ("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = 0 WHERE rowid = 3", 0),
    ("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = start WHERE rowid = 3", 0),
    ("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = (1 << 62) - 1 WHERE rowid = 3", 0),
    ("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = 1 << 62 WHERE rowid = 3", 1)])
def test_nsys_kernels_at_the_edges_of_a_time(tmp_path, change, untimed):
    """What is no time is exactly what the rule says: a kernel starting at 0 with an end
    after it, or of no duration (start = end), is timed and kept as it is; an end at 2^62 ns
    is past any clock (left out), one ns before it is not."""
    with sqlite3.connect(path := _fuser_with(tmp_path, change)) as db:
        (start, end), = db.execute("SELECT start, end FROM CUPTI_ACTIVITY_KIND_KERNEL "
                                   "WHERE rowid = 3").fetchall()
    trace = read_trace(path)
    assert len(trace.kernels) == 18 - untimed
    assert trace.meta.get("untimed") == ({"kernels": 1, "memops": 0} if untimed else None)
    if not untimed:
        at = np.flatnonzero(trace.kernels.correlation == 230)
        assert len(at) == 1
        assert (trace.kernels.start[at[0]], trace.kernels.end[at[0]]) == (start, end)


def test_nsys_size_in_the_header_is_read_as_sqlite_states_it(tmp_path):
    """The size an SQLite header states (page size x page count) holds only where its
    version-valid-for number equals its change counter; a page size of 65536 is stored
    as 1. A stale count is not a truncation; a file cut short of 64 KiB pages is."""
    from kimi_perf.errors import TraceError

    stale = bytearray(FUSER.read_bytes())
    stale[28:32] = (10 ** 6).to_bytes(4, "big")                # a page count far too large
    stale[92:96] = (int.from_bytes(stale[24:28], "big") + 1).to_bytes(4, "big")
    (path := tmp_path / "stale.sqlite").write_bytes(bytes(stale))
    assert len(read_trace(path).kernels) == 18
    big = tmp_path / "big.sqlite"
    big.write_bytes(FUSER.read_bytes())
    with contextlib.closing(sqlite3.connect(big)) as db:
        db.execute("PRAGMA page_size = 65536")
        db.execute("VACUUM")
    data = big.read_bytes()
    assert data[16:18] == b"\x00\x01" and len(data) % 65536 == 0
    (cut := tmp_path / "cut.sqlite").write_bytes(data[:-1000])
    with pytest.raises(TraceError, match=f"its header says {len(data)} bytes, the file holds "
                                         f"{len(data) - 1000}$"):
        read_trace(cut)


TRIMMED = NSYS / "nsysai_fastvideo_wan2.1_train_2xh100_after.sqlite"


def test_nsys_columns_an_export_lacks_read_as_unknown():
    """A column an older export lacks (graphId before 2026) reads as -1, unknown, as a NULL
    does: never 0, a graph id like any other."""
    with sqlite3.connect(FUSER) as db:
        cols = {r[1] for r in db.execute("PRAGMA table_info('CUPTI_ACTIVITY_KIND_KERNEL')")}
    assert "graphId" not in cols and "graphNodeId" in cols
    kernels = read_trace(FUSER).kernels
    assert len(kernels) == 18 and (kernels.graph_id == -1).all()


def test_nsys_nulls_read_as_unknown_also_where_the_rows_are_read_one_by_one(tmp_path):
    """A value the joined text cannot carry exactly (INT64_MAX, where numpy saturates) sends
    a table through the row-by-row reader; a NULL there is unknown (-1) as it is in the
    joined reading: a kernel whose start is NULL has no time and is left out, not placed at
    0."""
    path = _fuser_with(tmp_path, "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = NULL "
                                 "WHERE rowid = 3")
    with sqlite3.connect(path) as db:
        db.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET graphNodeId = 9223372036854775807 "
                   "WHERE rowid = 4")
    trace = read_trace(path)
    assert len(trace.kernels) == 17 and trace.meta["untimed"] == {"kernels": 1, "memops": 0}
    assert 230 not in trace.kernels.correlation.tolist()
    assert trace.kernels.graph_node_id.tolist().count(9223372036854775807) == 1


def test_nsys_negative_string_ids_are_an_error(tmp_path):
    """StringIds ids count from 0: a negative one is a corrupt table, said, not an index
    from the end of the lookup table (which would name a kernel after another string)."""
    from kimi_perf.errors import TraceError

    copy = tmp_path / "negative.sqlite"
    copy.write_bytes(FUSER.read_bytes())
    with sqlite3.connect(copy) as db:
        db.execute("INSERT INTO StringIds (id, value) VALUES (-2, 'negative')")
    with pytest.raises(TraceError, match=r"negative\.sqlite: StringIds holds negative ids$"):
        read_trace(copy)


@pytest.mark.parametrize("source", [FUSER, TRIMMED], ids=["indexed", "searched"])
def test_nsys_a_string_id_given_twice_reads_as_its_last_row(tmp_path, source):
    """An id that StringIds (rebuilt without its key) gives twice is its last row's text,
    whether ids are looked up in a table indexed by id (ids from 0) or searched (an export
    trimmed to its strings, ids in the millions): the two agree."""
    copy = tmp_path / "twice.sqlite"
    copy.write_bytes(source.read_bytes())
    with sqlite3.connect(copy) as db:
        (name_id,) = db.execute("SELECT demangledName FROM CUPTI_ACTIVITY_KIND_KERNEL "
                                "ORDER BY start LIMIT 1").fetchone()
        (count,) = db.execute("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL "
                              "WHERE demangledName = ?", (name_id,)).fetchone()
        db.execute("CREATE TABLE s AS SELECT * FROM StringIds ORDER BY id")
        db.execute("DROP TABLE StringIds")
        db.execute("ALTER TABLE s RENAME TO StringIds")
        db.execute("INSERT INTO StringIds VALUES (?, 'the last text')", (name_id,))
    trace = read_trace(copy)
    names = [trace.strings[n] for n in trace.kernels.name.tolist()]
    assert names.count("the last text") == count > 0


def test_nsys_a_string_id_past_the_last_one_reads_as_unknown(tmp_path):
    """A kernel name id one past the largest StringIds id (of a table indexed by id) is an
    id StringIds lacks: '<unknown>', not an error."""
    copy = tmp_path / "past.sqlite"
    copy.write_bytes(FUSER.read_bytes())
    with sqlite3.connect(copy) as db:
        (top,) = db.execute("SELECT max(id) FROM StringIds").fetchone()
        db.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET demangledName = ? WHERE rowid = 3",
                   (top + 1,))
    trace = read_trace(copy)
    names = [trace.strings[n] for n in trace.kernels.name.tolist()]
    assert names.count("<unknown>") == 1 and len(names) == 18
    assert names[int(np.flatnonzero(trace.kernels.correlation == 230)[0])] == "<unknown>"


def test_nsys_kernel_names_of_text_and_ids_in_one_column(tmp_path):
    """A kernel name column that holds plain text (some exports) is read row by row: a
    text is the name, an integer still a StringIds id (id 0 as well: nsys counts from 0)."""
    path = _fuser_with(tmp_path, "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET demangledName = "
                                 "'a kernel named in text' WHERE rowid = 1")
    with sqlite3.connect(path) as db:
        db.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET demangledName = 0 WHERE rowid = 3")
        (zero,) = db.execute("SELECT value FROM StringIds WHERE id = 0").fetchone()
        (second,) = db.execute("SELECT value FROM StringIds WHERE id = (SELECT demangledName "
                               "FROM CUPTI_ACTIVITY_KIND_KERNEL WHERE rowid = 2)").fetchone()
    trace = read_trace(path)
    names = dict(zip(trace.kernels.correlation.tolist(),
                     (trace.strings[n] for n in trace.kernels.name.tolist()), strict=True))
    assert names[167] == "a kernel named in text"
    assert names[195] == second and names[230] == zero


@pytest.mark.parametrize("version", ["4.0.0", "1.9.9"])
def test_nsys_schemas_next_to_the_ones_read_are_refused(tmp_path, version):
    """Schemas 2.x and 3.x are read; the majors beside them (a 4.x whose tables may have
    changed, a 1.x before them) are said, not read as if they were."""
    from kimi_perf.errors import TraceError

    copy = tmp_path / "schema.sqlite"
    copy.write_bytes(FUSER.read_bytes())
    with sqlite3.connect(copy) as db:
        db.execute("UPDATE META_DATA_EXPORT SET value = ? WHERE name = "
                   "'EXPORT_SCHEMA_VERSION'", (version,))
    with pytest.raises(TraceError, match=rf"schema\.sqlite: nsys export schema {version} is "
                                         r"not supported \(kimi-perf reads schemas 2\.x and "
                                         r"3\.x\)$"):
        read_trace(copy)


def test_nsys_export_without_its_metadata_is_told_by_its_cupti_tables(tmp_path):
    """Without its metadata table an export is still one where it holds CUPTI tables (read,
    schema unknown); an SQLite file with neither (only a StringIds) is not an export."""
    from kimi_perf.errors import TraceError

    bare = tmp_path / "bare.sqlite"
    bare.write_bytes(FUSER.read_bytes())
    with sqlite3.connect(bare) as db:
        db.execute("DROP TABLE META_DATA_EXPORT")
    trace = read_trace(bare)
    assert len(trace.kernels) == 18 and trace.meta["schema"] is None
    assert trace.meta["tool"] == "NVIDIA Nsight Systems unknown"
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT)")
    with pytest.raises(TraceError, match=r"other\.sqlite: not an Nsight Systems export \(no "
                                         r"export metadata and no CUPTI tables\)$"):
        read_trace(other)


def test_nsys_gpus_of_both_target_tables(tmp_path):
    """GPUs from TARGET_INFO_GPU (name, SMs) completed by TARGET_INFO_CUDA_DEVICE: its SM
    count only where the first has none, a CUDA device it alone lists added without a name;
    listed by device id whatever the rows' order."""
    assert read_trace(ATHRUN).meta["gpus"] == [
        {"device": 0, "name": "NVIDIA RTX 5000 Ada Generation Laptop GPU", "sm_count": 76},
        {"device": 1, "name": "Intel(R) Iris(R) Xe Graphics", "sm_count": 0},
        {"device": 2, "name": "Microsoft Basic Render Driver", "sm_count": 0}]
    copy = tmp_path / "gpus.sqlite"
    copy.write_bytes(ATHRUN.read_bytes())
    with sqlite3.connect(copy) as db:
        db.execute("UPDATE TARGET_INFO_GPU SET smCount = NULL WHERE id = 1")
        db.execute("UPDATE TARGET_INFO_CUDA_DEVICE SET numMultiprocessors = 99")
        db.execute("INSERT INTO TARGET_INFO_CUDA_DEVICE (cudaId, pid, numMultiprocessors) "
                   "VALUES (1, 7, 20), (5, 7, 10), (4, 7, NULL)")
        db.execute("CREATE TABLE g AS SELECT * FROM TARGET_INFO_GPU ORDER BY id DESC")
        db.execute("DROP TABLE TARGET_INFO_GPU")
        db.execute("ALTER TABLE g RENAME TO TARGET_INFO_GPU")
    assert read_trace(copy).meta["gpus"] == [
        {"device": 0, "name": "NVIDIA RTX 5000 Ada Generation Laptop GPU", "sm_count": 76},
        {"device": 1, "name": "Intel(R) Iris(R) Xe Graphics", "sm_count": 20},
        {"device": 2, "name": "Microsoft Basic Render Driver", "sm_count": 0},
        {"device": 4, "name": "", "sm_count": None},
        {"device": 5, "name": "", "sm_count": 10}]


def test_nsys_processes_are_listed_by_pid(tmp_path):
    """The processes an export lists, by pid whatever its rows' order, a NULL name read
    as none; a PROCESSES table without a name column lists none."""
    processes = read_trace(FUSER).meta["processes"]
    assert len(processes) == 111
    assert processes[:3] == [{"pid": 1, "name": "nvidia_entrypoi"}, {"pid": 237, "name": "bash"},
                             {"pid": 292, "name": "bash"}]
    assert [p["pid"] for p in processes] == sorted(p["pid"] for p in processes)
    copy = tmp_path / "processes.sqlite"
    copy.write_bytes(FUSER.read_bytes())
    with sqlite3.connect(copy) as db:
        db.execute("UPDATE PROCESSES SET name = NULL WHERE pid = 237")
    assert read_trace(copy).meta["processes"][1] == {"pid": 237, "name": ""}
    with sqlite3.connect(copy) as db:
        db.execute("ALTER TABLE PROCESSES DROP COLUMN name")
    assert read_trace(copy).meta["processes"] == []


SAXPY = NSYS / "hpcgroup-pipit__saxpy-mpi-cuda_nsys_perlmutter0__nsys2022.2.1.sqlite"


def test_nsys_api_calls_keep_the_exports_order_when_backtrace_rows_are_dropped():
    """Dropping the backtrace rows keeps the other calls in the export's own order (by
    time), not in the (process, correlation) order the de-duplication sorts by."""
    trace = read_trace(SAXPY)
    with sqlite3.connect(SAXPY) as db:
        want = db.execute("SELECT start, correlationId FROM CUPTI_ACTIVITY_KIND_RUNTIME "
                          "WHERE eventClass != 67 ORDER BY rowid").fetchall()
    assert len(want) == 57
    assert list(zip(trace.api.start.tolist(), trace.api.correlation.tolist(),
                    strict=True)) == want


def test_nsys_backtrace_rows_are_dropped_per_process():
    """Correlation ids count per process: two processes reuse them. Where a backtrace row
    makes the reader de-duplicate, one call is kept per (process, correlation), the real
    call before its backtrace row, in the rows' order; a call of one process never drops
    another's with the same id (here process 1's last id is process 2's first: they sort
    side by side)."""
    from kimi_perf.readers.nsys import _first_per_key

    pid = np.array([1, 1, 1, 2, 2, 1])
    corr = np.array([3, 7, 7, 7, 9, 5])
    real = np.array([True, False, True, True, True, True])
    assert _first_per_key(pid, corr, real).tolist() == [0, 2, 3, 4, 5]
    assert _first_per_key(pid, corr, np.ones(6, bool)).tolist() == [0, 1, 3, 4, 5]


def test_nsys_api_kinds_by_name():
    """CUDA and HIP runtime calls, driver calls (cu*), and anything else (NCCL, cuBLAS
    markers) are told apart by name."""
    from kimi_perf.readers.nsys import _api_kind
    from kimi_perf.trace import DRIVER, OTHER_API, RUNTIME

    assert [_api_kind(n) for n in ("cudaLaunchKernel", "hipMemcpyAsync", "cuLaunchKernel",
                                   "cuModuleLoad", "ncclAllReduce", "")] == [
        RUNTIME, RUNTIME, DRIVER, DRIVER, OTHER_API, OTHER_API]


def test_nsys_memory_operations_named_by_their_kind(tmp_path):
    """Copies are named by their copyKind as nsys names them ("[CUDA memcpy Host-to-Device]",
    a kind it does not know as Unknown), sets as "[CUDA memset]"; sizes, devices and streams
    as the export holds them, and each linked to its launch's thread."""
    copy = tmp_path / "memops.sqlite"
    copy.write_bytes(FUSER.read_bytes())
    with sqlite3.connect(copy) as db:
        db.execute("UPDATE CUPTI_ACTIVITY_KIND_MEMCPY SET copyKind = 2 WHERE correlationId = 1885")
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY (start, end, deviceId, contextId, "
                   "streamId, correlationId, globalPid, bytes, copyKind, srcKind, dstKind, "
                   "srcDeviceId, dstDeviceId) SELECT start + 1, end + 1, deviceId, contextId, "
                   "streamId, 999999, globalPid, 5, 42, srcKind, dstKind, srcDeviceId, "
                   "dstDeviceId FROM CUPTI_ACTIVITY_KIND_MEMCPY WHERE correlationId = 213")
    trace = read_trace(copy)
    got = sorted(zip(trace.memops.start.tolist(), (trace.strings[n] for n in
                                                    trace.memops.name.tolist()),
                     trace.memops.bytes.tolist(), trace.memops.correlation.tolist(),
                     trace.memops.device.tolist(), trace.memops.stream.tolist(), strict=True))
    assert got == [
        (7476932404, "[CUDA memcpy Host-to-Device]", 394002432, 213, 0, 7),
        (7476932405, "[CUDA memcpy Unknown]", 5, 999999, 0, 7),
        (8168978473, "[CUDA memset]", 4, 1472, 0, 7),
        (8745862005, "[CUDA memcpy Device-to-Host]", 2, 1885, 0, 7),
        (8746253265, "[CUDA memcpy Device-to-Device]", 62914560, 1904, 0, 7),
        (9030581732, "[CUDA memset]", 4, 2177, 0, 7),
        (9032768812, "[CUDA memset]", 4, 2199, 0, 7)]
    linked = trace.memops.api >= 0
    assert linked.sum() == 6 and (trace.memops.tid[linked] ==
                                  trace.api.tid[trace.memops.api[linked]]).all()


def test_nsys_nvtx_ranges_of_every_kind_and_the_end_of_an_open_one(tmp_path):
    """NVTX and NVTXT push/pop ranges are push/pop, their start/end ranges start/end; a
    range at time 0 that ends at 0 is ended. A range never ended runs to the last NVTX
    timestamp, a start or an end, whichever is later: here a range started after every
    other ended, itself open."""
    from kimi_perf.trace import PUSHPOP, STARTEND

    copy = tmp_path / "kinds.sqlite"
    copy.write_bytes(ATHRUN.read_bytes())
    with sqlite3.connect(copy) as db:
        (last_end,) = db.execute("SELECT max(end) FROM NVTX_EVENTS").fetchone()
        db.execute("UPDATE NVTX_EVENTS SET eventType = 70 WHERE rowid = 1")
        db.execute("UPDATE NVTX_EVENTS SET eventType = 71 WHERE rowid = 2")
        db.execute("UPDATE NVTX_EVENTS SET eventType = 60 WHERE rowid = 3")
        db.execute("UPDATE NVTX_EVENTS SET start = 0, end = 0 WHERE rowid = 4")
        db.execute("UPDATE NVTX_EVENTS SET end = NULL WHERE rowid = 5")
        db.execute("UPDATE NVTX_EVENTS SET start = ?, end = NULL WHERE rowid = 6",
                   (last_end + 100,))
        rows = db.execute("SELECT start, end FROM NVTX_EVENTS WHERE rowid <= 6 ORDER BY "
                          "rowid").fetchall()
    ranges = read_trace(copy).ranges
    assert len(ranges) == 180
    got = {start: (end, style) for start, end, style in zip(
        ranges.start.tolist(), ranges.end.tolist(), ranges.style.tolist(), strict=True)}
    (s1, e1), (s2, e2), (s3, e3), _, (s5, _), _ = rows
    assert got[s1] == (e1, PUSHPOP) and got[s2] == (e2, STARTEND) and got[s3] == (e3, STARTEND)
    assert got[0] == (0, PUSHPOP)
    assert got[s5] == (last_end + 100, PUSHPOP) and got[last_end + 100] == (last_end + 100,
                                                                            PUSHPOP)


def test_nsys_nvtx_domains_are_their_own_processes(tmp_path):
    """A domain id names a domain in the process that created it: another process's ranges
    with that id are in no domain unless that process created one (its name then a registered
    string, textId, as well as a text); a range of a domain with no text of its own is named
    after the domain alone ("MPI:")."""
    copy = tmp_path / "domains.sqlite"
    copy.write_bytes(SAXPY.read_bytes())
    with sqlite3.connect(copy) as db:
        ((gtid, start),) = db.execute("SELECT globalTid, start FROM NVTX_EVENTS WHERE "
                                      "rowid = 4").fetchall()
        rows = [(gtid + (1 << 24), 59, 1, None, 85, 10, 20),       # another process
                (gtid + (2 << 24), 75, 1, None, 68, 1, None),      # a third, its own domain
                (gtid + (2 << 24), 59, 1, None, 85, 30, 40),
                (gtid, 59, 1, None, None, 50, 60)]                  # MPI, no text
        db.executemany("INSERT INTO NVTX_EVENTS (globalTid, eventType, domainId, text, "
                       "textId, start, end) VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
    trace = read_trace(copy)
    ranges = trace.ranges
    named = {s: (trace.strings[n], trace.strings[d]) for s, n, d in zip(
        ranges.start.tolist(), ranges.name.tolist(), ranges.domain.tolist(), strict=True)}
    assert len(ranges) == 22 + 3
    assert named[start] == ("MPI:MPI_Send", "MPI")
    assert named[10] == ("MPI_Send", "")
    assert named[30] == ("MPI_Recv:MPI_Send", "MPI_Recv")
    assert named[50] == ("MPI:", "MPI")


def test_nsys_nvtx_ranges_without_a_text_column(tmp_path):
    """An export whose NVTX table lacks the text column: ranges named by a registered string
    keep their names (with no domain: the MPI domain was named by a text), the others are
    nameless (""), none of them dropped."""
    copy = tmp_path / "notext.sqlite"
    copy.write_bytes(SAXPY.read_bytes())
    with sqlite3.connect(copy) as db:
        db.execute("ALTER TABLE NVTX_EVENTS DROP COLUMN text")
    trace = read_trace(copy)
    names = Counter(trace.strings[n] for n in trace.ranges.name.tolist())
    plain = read_trace(SAXPY)
    before = Counter(plain.strings[n] for n in plain.ranges.name.tolist())
    assert before["saxpy"] == 5 and names[""] == 5 and "saxpy" not in names
    assert names == Counter({"" if n == "saxpy" else n.removeprefix("MPI:"): k
                             for n, k in before.items()})


def _athrun_range_names(tmp_path, *changes) -> dict[int, str]:
    """ATHRUN's NVTX ranges with ``changes`` made: range name by the row's rowid (its ranges
    all start apart)."""
    copy = tmp_path / "names.sqlite"
    copy.write_bytes(ATHRUN.read_bytes())
    with sqlite3.connect(copy) as db:
        for change in changes:
            db.execute(*change)
        starts = dict(db.execute("SELECT start, rowid FROM NVTX_EVENTS"))
    trace = read_trace(copy)
    assert len(trace.ranges) == len(starts) == 180
    return {starts[s]: trace.strings[n] for s, n in zip(
        trace.ranges.start.tolist(), trace.ranges.name.tolist(), strict=True)}


def test_nsys_nvtx_names_of_text_and_registered_strings(tmp_path):
    """A range's name is its registered string (textId, id 0 included) where it has one,
    else its text; each row keeps its own, whether the texts are read all at once or row by
    row (where a textId is not an integer)."""
    plain = _athrun_range_names(tmp_path)
    assert plain[1] == plain[4] == "computing attention scores" and plain[3] == (
        "computing final matmul")
    registered = _athrun_range_names(
        tmp_path, ("UPDATE NVTX_EVENTS SET textId = 2 WHERE rowid = 2",))
    assert registered == {**plain, 2: "[Max depth]"}
    by_rows = _athrun_range_names(
        tmp_path, ("UPDATE NVTX_EVENTS SET textId = 0 WHERE rowid = 2",),
        ("UPDATE NVTX_EVENTS SET textId = 'x' WHERE rowid = 5",))
    assert by_rows == {**plain, 2: "[Unknown]"}


@pytest.mark.parametrize("text", [
    b"1,-,3", b"1,2-3,4", b"1,--2,3", b"1,5-,3", b"1,2.5,3", b"1, 2,3", b"1,,3", b"1,2,",
    b"1,2", b"1,2,3,4", b"1,99999999999999999999,3", b"1,-99999999999999999999,3",
    b"1,9223372036854775807,3", b"1,-9223372036854775808,3"])
def test_nsys_joined_integers_are_parsed_only_where_exact(text):
    """A column's values joined as text are parsed only where that is certainly what they
    hold: numpy reads a lone "-" or a blank as 0 and saturates numbers beyond int64, so any
    such text (and a count other than the rows') is left to the row-by-row reader."""
    from kimi_perf.readers.nsys import _parse_int_list

    assert _parse_int_list(text, 3) is None
    assert _parse_int_list(b"-7,0,9223372036854775806", 3).tolist() == [
        -7, 0, 9223372036854775806]


def test_nsys_global_thread_ids_split_as_nsys_stats_prints_them():
    """globalTid packs the pid in bits 24-47 and the tid in bits 0-23 (above them, the
    hardware and VM ids): pids and tids past 16 bits (1230493 here) come out whole, as nsys
    stats and the PROCESSES table give them; 0 is pid 0, a NULL (read as -1) none."""
    from kimi_perf.readers.nsys import _split_global_tid

    trace = read_trace(SAXPY)
    assert set(trace.kernels.pid.tolist()) == set(trace.api.pid.tolist()) == {1230493}
    assert set(trace.api.tid.tolist()) == set(trace.ranges.tid.tolist()) == {1230493}
    assert {"pid": 1230493, "name": "./saxpy-mpi-cuda"} in trace.meta["processes"]
    pid, tid = _split_global_tid(np.array([302119224788637, 0, -1, (5 << 24) | 7]))
    assert pid.tolist() == [1230493, 0, -1, 5] and tid.tolist() == [1230493, 0, -1, 7]


def test_nsys_a_non_integer_number_where_an_id_belongs_is_an_error(tmp_path):
    """A correlation id of 230.9 names no launch: it is refused as a text there is ("holds
    non-integer values where integers are expected"), not cut to 230, which would link the
    kernel to launch 230 (the Kineto reader refuses such an id too)."""
    from kimi_perf.errors import TraceError

    path = _fuser_with(tmp_path, "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET correlationId = 230.9 "
                                 "WHERE rowid = 3")
    with pytest.raises(TraceError, match="holds non-integer values where integers are "
                                         "expected"):
        read_trace(path)


def test_nsys_an_unknown_kernel_name_id_reads_alike_in_a_text_column(tmp_path):
    """A kernel name id StringIds lacks is '<unknown>' whether or not another row of the
    column holds a plain-text name."""
    path = _fuser_with(tmp_path, "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET demangledName = "
                                 "'a kernel named in text' WHERE rowid = 1")
    with sqlite3.connect(path) as db:
        db.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET demangledName = 99999 WHERE rowid = 3")
    trace = read_trace(path)
    at = int(np.flatnonzero(trace.kernels.correlation == 230)[0])
    assert trace.strings[trace.kernels.name[at]] == "<unknown>"


def test_nsys_reader_takes_only_the_whole_sqlite_magic(tmp_path):
    """The nsys reader, also called on the export beside a report, takes a file whose first
    16 bytes are SQLite's ("SQLite format 3" and a NUL) and no other, named so."""
    from kimi_perf.errors import TraceError
    from kimi_perf.readers.nsys import read_nsys_sqlite

    (near := tmp_path / "near.sqlite").write_bytes(b"SQLite format 3!" + bytes(4096))
    with pytest.raises(TraceError, match=r"near\.sqlite: not an SQLite file$"):
        read_nsys_sqlite(near)


def test_kineto_fractional_ns_round_to_the_nearest_ns(tmp_path, monkeypatch):
    """µs with fractions of a ns become the nearest ns, not the ns below (2.0006 µs is
    2001 ns, not 2000), starts and durations alike, by every read path."""

    events = [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 5, "tid": 6,
         "ts": 1.0007, "dur": 0.0016, "args": {"correlation": 3}},
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 2.0006,
         "dur": 1.0004, "args": {"device": 0, "stream": 7, "correlation": 3}}]
    path = tmp_path / "ns.json"
    path.write_text(json.dumps({"traceEvents": events}))
    traces = _kineto_paths(path, monkeypatch)
    for label, trace in traces.items():
        _assert_same_trace(traces["blocks"], trace, label)
    trace = traces["blocks"]
    assert (trace.api.start.tolist(), trace.api.end.tolist()) == ([1001], [1003])
    assert (trace.kernels.start.tolist(), trace.kernels.end.tolist()) == ([2001], [3001])


def test_kineto_work_differing_only_in_name_is_no_repeat(tmp_path, monkeypatch):
    """Two kernels alike in every field but their names (two kernels of one graph replay,
    one correlation, timed alike in whole µs) are two kernels, not a repeat: both kept by
    every read path, no duplicates said; likewise a copy and a set alike but for theirs."""

    gpu = {"pid": 0, "tid": 7, "ts": 30, "dur": 3,
           "args": {"device": 0, "stream": 7, "correlation": 1, "bytes": 8}}
    events = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": 5,
               "tid": 6, "ts": 20, "dur": 2, "args": {"correlation": 1}},
              {"ph": "X", "cat": "kernel", "name": "k1", **gpu},
              {"ph": "X", "cat": "kernel", "name": "k2", **gpu},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", **gpu},
              {"ph": "X", "cat": "gpu_memset", "name": "Memset", **gpu}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    for label, trace in _kineto_paths(path, monkeypatch).items():
        assert sorted(trace.strings[n] for n in trace.kernels.name.tolist()) == ["k1", "k2"], \
            label
        assert sorted(trace.strings[n] for n in trace.memops.name.tolist()) == [
            "Memcpy DtoD", "Memset"], label
        assert "duplicates" not in trace.meta, label


def test_kineto_copies_of_zero_bytes_read_as_unknown_by_every_path(tmp_path, monkeypatch):
    """Kineto writes ``bytes: 0`` for a copy or set whose size it did not record: unknown
    (-1) by the vectorized pass and the event-by-event replay alike; a size stays as given."""

    events = [{"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": 1,
               "args": {"device": 0, "stream": 7, "correlation": 1, "bytes": size}}
              for cat, name, ts, size in (("gpu_memcpy", "Memcpy HtoD", 10, 0),
                                          ("gpu_memset", "Memset", 20, 0),
                                          ("gpu_memcpy", "Memcpy DtoH", 30, 4096))]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    for label, trace in _kineto_paths(path, monkeypatch).items():
        assert trace.memops.bytes.tolist() == [-1, -1, 4096], label


def test_a_kineto_json_after_many_blank_lines_reads(tmp_path):
    """JSON may begin with any amount of blanks: a Kineto trace after 100 of them reads as it
    does gzipped (where blanks past the bytes looked at are taken for JSON) and as the Kineto
    reader reads it, not as a file of unknown format."""
    import gzip

    text = b" \n" * 50 + json.dumps(_one_kernel_doc()).encode()
    (packed := tmp_path / "t.json.gz").write_bytes(gzip.compress(text))
    assert len(read_trace(packed).kernels) == 2
    (path := tmp_path / "t.json").write_bytes(text)
    assert len(read_trace(path).kernels) == 2


def test_kineto_gpu_lanes_where_args_hold_no_device_or_stream(tmp_path, monkeypatch):
    """An older Kineto writes a kernel's GPU and stream only in its lane: the device is the
    event's pid, the stream its tid, "stream 7" read as stream 7 (a tid of another text,
    "stream 7 (graph)", is a label: a synthetic id); by every read path."""

    def kernel(ts, pid, tid):
        return {"ph": "X", "cat": "kernel", "name": "k", "pid": pid, "tid": tid, "ts": ts,
                "dur": 1, "args": {"correlation": 1}}

    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"traceEvents": [kernel(10, 2, 9), kernel(20, 3, 11)]}))
    for label, trace in _kineto_paths(plain, monkeypatch).items():
        assert trace.kernels.device.tolist() == [2, 3], label
        assert trace.kernels.stream.tolist() == [9, 11], label
    lanes = tmp_path / "lanes.json"
    lanes.write_text(json.dumps({"traceEvents": [kernel(10, 1, " stream 7 "),
                                                 kernel(20, 1, "stream 7 (graph)")]}))
    traces = _kineto_paths(lanes, monkeypatch)
    for label, trace in traces.items():
        _assert_same_trace(traces["blocks"], trace, label)
    assert traces["blocks"].kernels.stream.tolist() == [7, 1 << 29]
    assert traces["blocks"].kernels.device.tolist() == [1, 1]


def test_kineto_processes_and_gpus_said_of_themselves(tmp_path):
    """The processes named are those that called the runtime or annotated (a process with
    ranges only, a data loader's, included; the GPU lanes Kineto names after the process
    left out), by the first name said that is one (an empty name is none); a GPU of 0 SMs
    says 0, one of a negative count says none."""
    events = [
        {"ph": "M", "name": "process_name", "pid": 5, "args": {"name": ""}},
        {"ph": "M", "name": "process_name", "pid": 5, "args": {"name": "trainer"}},
        {"ph": "M", "name": "process_name", "pid": 8, "args": {"name": 8}},
        {"ph": "M", "name": "process_name", "pid": 8, "args": {"name": "loader"}},
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "trainer"}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 5, "tid": 6,
         "ts": 10, "dur": 2, "args": {"correlation": 1}},
        {"ph": "X", "cat": "user_annotation", "name": "load", "pid": 8, "tid": 9, "ts": 1,
         "dur": 5},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "step", "pid": 0, "tid": 7,
         "ts": 12, "dur": 5, "args": {"device": 0}},
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 13, "dur": 3,
         "args": {"device": 0, "stream": 7, "correlation": 1}}]
    doc = {"traceEvents": events, "deviceProperties": [
        {"id": 0, "name": "G", "numSms": 0}, {"id": 1, "name": "H", "numSms": -4}]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    meta = read_trace(path).meta
    assert meta["processes"] == [{"pid": 5, "name": "trainer"}, {"pid": 8, "name": "loader"}]
    assert meta["gpus"] == [{"device": 0, "name": "G", "sm_count": 0},
                            {"device": 1, "name": "H", "sm_count": None}]


@pytest.mark.parametrize(("ts", "dur"), [(2.5e15, 1), (10, 2.5e15), (-2.5e15, 1)])
def test_kineto_times_past_any_clock_are_an_error(tmp_path, ts, dur):
    """A time past 2^61 ns (about 73 years of µs) is corrupt: said, rather than read into
    ns that sums and differences of them would carry past int64."""
    from kimi_perf.errors import TraceError

    doc = {"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7,
                            "ts": ts, "dur": dur,
                            "args": {"device": 0, "stream": 7, "correlation": 1}}]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(TraceError, match=r"t\.json: 'ts' or 'dur' out of range$"):
        read_trace(path)


def test_kineto_trace_events_key_of_a_nested_object_is_not_the_trace(tmp_path, monkeypatch):
    """Only the top-level object's "traceEvents" is the trace: an object holding its own
    "traceEvents" list (a tool's saved settings) is skipped, before the trace's list as
    where there is no other; then the file is no trace, by every read path."""
    from kimi_perf.errors import TraceError

    def kernel(name, ts):
        return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts,
                "dur": 1, "args": {"device": 0, "stream": 7, "correlation": 1}}

    nested = '{"settings": {"traceEvents": [' + json.dumps(kernel("nested", 1)) + ']}'
    path = tmp_path / "t.json"
    path.write_text(nested + ', "traceEvents": [' + json.dumps(kernel("real", 5)) + ", "
                    + json.dumps(kernel("real", 9)) + "]}")
    traces = _kineto_paths(path, monkeypatch)
    for label, trace in traces.items():
        _assert_same_trace(traces["one shot"], trace, label)
    trace = traces["blocks"]
    assert [trace.strings[n] for n in trace.kernels.name.tolist()] == ["real", "real"]
    alone = tmp_path / "alone.json"
    alone.write_text(nested + "}")
    with pytest.raises(TraceError, match=r"alone\.json: JSON without a 'traceEvents' list"):
        read_trace(alone)


def test_kineto_invalid_utf8_in_a_field_not_read_is_an_error(tmp_path, monkeypatch):
    """The whole file must be UTF-8, the fields the reader skips too: a stray byte there is
    said by the one-shot path as by the block reader, also where a block ends inside a
    character (its lead byte) and the next block begins with ASCII."""
    from kimi_perf.errors import TraceError
    from kimi_perf.readers import kineto

    events = json.dumps(_one_kernel_doc()["traceEvents"]).encode()
    stray = b'{"traceName": "a\xffb", "traceEvents": ' + events + b"}"
    (path := tmp_path / "stray.json").write_bytes(stray)
    for reader in (kineto.read_kineto_json, kineto._read_whole):
        with pytest.raises(TraceError, match=r"stray\.json: invalid or truncated JSON \(not "
                                             r"valid UTF-8\)$"):
            reader(path)
    head = b'{"traceName": "'
    cut = head + b"x" * (63 - len(head)) + b'\xc3a", "traceEvents": ' + events + b"}"
    assert cut[63:65] == b"\xc3a"
    (path := tmp_path / "cut.json").write_bytes(cut)
    monkeypatch.setattr(kineto, "_BLOCK", 64)
    with pytest.raises(TraceError, match=r"cut\.json: invalid or truncated JSON \(not "
                                         r"valid UTF-8\)$"):
        kineto.read_kineto_json(path)


def test_kineto_a_wide_id_after_pieces_of_narrow_ones_stays_whole(tmp_path, monkeypatch):
    """Columns grow piece by piece as int32 while every id fits; a later piece with an id
    beyond int32 widens the column, the ids before and that one kept exactly (read in
    blocks of 997 bytes, hundreds of pieces)."""
    from kimi_perf.readers import kineto

    wide = 2**40 + 3
    events = [{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 10 * i,
               "dur": 1, "args": {"device": 0, "stream": 7, "correlation": i}}
              for i in range(300)]
    events[-1]["args"]["correlation"] = wide
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    monkeypatch.setattr(kineto, "_BLOCK", 997)
    trace = kineto.read_kineto_json(path)
    assert trace.kernels.correlation.tolist() == [*range(299), wide]


def test_kineto_an_event_list_of_objects_and_other_values(tmp_path):
    """An event list holding no object at all is no trace; one holding objects beside other
    values (a stray number) is read for its objects."""
    from kimi_perf.errors import TraceError

    (numbers := tmp_path / "numbers.json").write_text("[1, 2, 3]")
    with pytest.raises(TraceError, match=r"numbers\.json: not a Chrome/Kineto trace: its "
                                         r"event list holds no event objects$"):
        read_trace(numbers)
    (mixed := tmp_path / "mixed.json").write_text(json.dumps(
        {"traceEvents": [7, *_one_kernel_doc()["traceEvents"], "x"]}))
    assert len(read_trace(mixed).kernels) == 2


def test_kineto_copies_alone_without_a_time_are_counted(tmp_path, monkeypatch):
    """A copy without a duration (and no kernel without one) is left out and counted as
    untimed all the same, by every read path."""

    doc = _one_kernel_doc()
    doc["traceEvents"].append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD",
                               "pid": 0, "tid": 7, "ts": 20,
                               "args": {"device": 0, "stream": 7, "bytes": 8}})
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    for label, trace in _kineto_paths(path, monkeypatch).items():
        assert len(trace.memops) == 0 and len(trace.kernels) == 2, label
        assert trace.meta["untimed"] == {"kernels": 0, "memops": 1}, label


def test_kineto_a_kernel_links_to_the_first_call_of_its_correlation(tmp_path, monkeypatch):
    """Where two API calls share a correlation id (a runtime call and the driver call it
    made), a kernel of that id is launched by the first of them in the trace, by every read
    path."""

    events = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 5,
               "tid": 6, "ts": 10, "dur": 5, "args": {"correlation": 1}},
              {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "pid": 5,
               "tid": 8, "ts": 11, "dur": 2, "args": {"correlation": 1}},
              {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 20,
               "dur": 3, "args": {"device": 0, "stream": 7, "correlation": 1}}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    for label, trace in _kineto_paths(path, monkeypatch).items():
        (row,) = trace.kernels.api.tolist()
        assert trace.strings[trace.api.name[row]] == "cudaLaunchKernel", label
        assert trace.kernels.tid.tolist() == [6], label


def test_kineto_rank_and_world_size_only_as_integers(tmp_path):
    """distributedInfo's rank and world size are said where they are integers, else left
    unsaid (None), never carried as another type."""
    doc = _one_kernel_doc()
    doc["distributedInfo"] = {"rank": 1, "world_size": "2", "backend": "nccl"}
    (path := tmp_path / "t.json").write_text(json.dumps(doc))
    meta = read_trace(path).meta
    assert (meta["rank"], meta["world_size"]) == (1, None)


@pytest.mark.parametrize(("version", "said"), [(1, "1"), ("1.0.2", "1.0.2"), (1.5, None),
                                               ([1], None), (True, None), (None, None)])
def test_kineto_schema_version_said_only_as_kineto_writes_it(tmp_path, version, said):
    """Kineto writes its schemaVersion as an integer (some tools as text): said as text;
    any other type is left unsaid, not shown as Python prints it."""
    doc = {**_one_kernel_doc(), "schemaVersion": version}
    (path := tmp_path / "t.json").write_text(json.dumps(doc))
    assert read_trace(path).meta["schema"] == said


def test_kineto_gzip_of_several_members_and_padding_is_read_in_blocks(tmp_path, monkeypatch):
    """A gzip of several members (files compressed apart, then joined) with zero padding
    after them is inflated block by block like a plain one, never sent whole through the
    one-shot path (which holds the whole inflated file in memory at once), and reads as the
    text it holds."""
    from kimi_perf.readers import kineto

    text = json.dumps(_one_kernel_doc()).encode()
    cut = len(text) // 2
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(text[:cut]) + bytes(512) + gzip.compress(text[cut:])
                     + bytes(512))
    monkeypatch.setattr(kineto, "_read_whole", lambda p: _raise(AssertionError("one shot")))
    trace = kineto.read_kineto_json(path)
    assert trace.kernels.start.tolist() == [4000, 10000] and len(trace.api) == 1


@pytest.mark.parametrize(("table", "change", "said"), [
    ("TARGET_INFO_GPU", "smCount = 'many'",
     "gpus is not a list of {device: int, name: str, sm_count: int or null}"),
    ("PROCESSES", "pid = 'init'", "processes is not a list of {pid: int, name}")])
def test_nsys_metadata_of_another_type_is_said(tmp_path, table, change, said):
    """An export whose GPU or process rows hold another type than nsys writes (an SM count
    in words, a pid that is a name) is said in a line when read, not carried into the
    trace to trip an analysis far away."""
    from kimi_perf.errors import TraceError

    copy = tmp_path / "meta.sqlite"
    copy.write_bytes(FUSER.read_bytes())
    with sqlite3.connect(copy) as db:
        db.execute(f"UPDATE {table} SET {change}")
    with pytest.raises(TraceError, match=re.escape(f"meta.sqlite: malformed trace metadata: "
                                                   f"{said}")):
        read_trace(copy)
