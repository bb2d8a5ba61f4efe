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
