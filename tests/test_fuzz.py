"""Fuzz both readers with mutated real fixtures: a trace or a TraceError, nothing else.

Whatever reads must also survive the analyses (range summary and breakdown).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import re
import shutil
import sqlite3

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimi_perf import breakdown, range_kernel_summary, read_trace
from kimi_perf.errors import NoGpuWork, TraceError
from tests.conftest import KINETO, NSYS
from tests.test_readers import _eager_kineto_doc

NSYS_SMALL = NSYS / "hpcgroup-pipit__saxpy-mpi-cuda_nsys_perlmutter0__nsys2022.2.1.sqlite"
NSYS_NEW = NSYS / "Athrun0109-CS336_assignment2__result__nsys2026.2.1.sqlite"
KINETO_SMALL = KINETO / "hta_amd_mi250_rocm62_minitoy.json.gz"
KINETO_GRAPH = KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz"
KINETO_CAPTURE = KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_capture_bs32_mi300x.json.gz"

FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def read_and_analyse(path) -> None:
    try:
        trace = read_trace(path)
    except TraceError as exc:
        assert str(path) in str(exc) and "\n" not in str(exc)
        return
    range_kernel_summary(trace)
    try:
        breakdown(trace)
    except NoGpuWork as exc:   # a mutation that leaves no kernel: said, not an empty table
        assert str(path) in str(exc) and "\n" not in str(exc)


@FUZZ
@given(source=st.sampled_from([NSYS_SMALL, NSYS_NEW]), data=st.data())
def test_nsys_byte_mutations(tmp_path, source, data):
    raw = bytearray(source.read_bytes())
    mode = data.draw(st.sampled_from(["truncate", "flip", "zero_page"]))
    if mode == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif mode == "flip":
        for _ in range(data.draw(st.integers(1, 64))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
    else:
        page = data.draw(st.integers(0, len(raw) // 4096 - 1))
        raw[page * 4096: (page + 1) * 4096] = bytes(4096)
    path = tmp_path / "mutated.sqlite"
    path.write_bytes(bytes(raw))
    read_and_analyse(path)


@FUZZ
@given(data=st.data())
def test_gzipped_nsys_mutations(tmp_path, data):
    """A gzipped export (read from a temporary copy) mutated in its gzip bytes or in the
    export inside: a trace or a one-line error, and no temporary copy left behind."""
    import tempfile

    raw = bytearray(NSYS_SMALL.read_bytes())
    if data.draw(st.booleans()):       # the export inside, then gzipped whole
        for _ in range(data.draw(st.integers(1, 32))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        packed = bytearray(gzip.compress(bytes(raw), 1))
    else:                              # the gzip stream itself, cut or flipped past its header
        packed = bytearray(gzip.compress(bytes(raw), 1))
        if data.draw(st.booleans()):
            packed = packed[: data.draw(st.integers(10, len(packed) - 1))]
        else:
            packed[data.draw(st.integers(10, len(packed) - 1))] ^= data.draw(st.integers(1, 255))
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    path = tmp_path / "mutated.sqlite.gz"
    path.write_bytes(bytes(packed))
    before, tempfile.tempdir = tempfile.tempdir, str(scratch)
    try:
        read_and_analyse(path)
    finally:
        tempfile.tempdir = before
    assert not any(scratch.iterdir())


VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64), st.floats(),
                   st.text(max_size=8), st.lists(st.integers(), max_size=2),
                   st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@FUZZ
@given(source=st.sampled_from([NSYS_SMALL, NSYS_NEW]), data=st.data())
def test_nsys_value_mutations(tmp_path, source, data):
    """Valid SQLite, hostile contents: wrong types, NULLs, dropped tables and columns."""
    path = tmp_path / "mutated.sqlite"
    shutil.copy(source, path)
    with sqlite3.connect(path) as db:
        tables = ["CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME", "NVTX_EVENTS",
                  "StringIds", "CUPTI_ACTIVITY_KIND_MEMCPY"]
        for _ in range(data.draw(st.integers(1, 4))):
            table = data.draw(st.sampled_from(tables))
            exists = db.execute("SELECT count(*) FROM sqlite_master WHERE name=?",
                                (table,)).fetchone()[0]
            if not exists:
                continue
            columns = [r[1] for r in db.execute(f"PRAGMA table_info('{table}')")]
            column = data.draw(st.sampled_from(columns))
            action = data.draw(st.sampled_from(["set", "drop_table", "drop_column", "delete"]))
            if action == "set":
                value = data.draw(VALUES)
                if isinstance(value, (list, dict)):
                    value = json.dumps(value)
                if isinstance(value, int) and not -2**63 <= value < 2**63:
                    value = str(value)
                # NOT NULL and key constraints of the export's own schema may refuse it.
                with contextlib.suppress(sqlite3.IntegrityError):
                    db.execute(f"UPDATE {table} SET {column} = ? WHERE rowid % ? = 0",
                               (value, data.draw(st.integers(1, 5))))
            elif action == "drop_table":
                db.execute(f"DROP TABLE {table}")
            elif action == "drop_column":
                # Indexed or primary-key columns cannot be dropped.
                with contextlib.suppress(sqlite3.OperationalError):
                    db.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
            else:
                db.execute(f"DELETE FROM {table} WHERE rowid % 2 = 0")
    read_and_analyse(path)


@FUZZ
@given(source=st.sampled_from([KINETO_SMALL, KINETO_GRAPH]), data=st.data())
def test_kineto_text_mutations(tmp_path, source, data):
    text = bytearray(gzip.decompress(source.read_bytes()))
    mode = data.draw(st.sampled_from(["truncate", "flip", "gzip_truncate"]))
    if mode == "truncate":
        text = text[: data.draw(st.integers(0, len(text) - 1))]
    elif mode == "flip":
        for _ in range(data.draw(st.integers(1, 32))):
            text[data.draw(st.integers(0, len(text) - 1))] = data.draw(st.integers(0, 255))
    payload = gzip.compress(bytes(text))
    if mode == "gzip_truncate":
        payload = payload[: data.draw(st.integers(0, len(payload) - 1))]
    path = tmp_path / "mutated.json.gz"
    path.write_bytes(payload)
    read_and_analyse(path)


@FUZZ
@given(source=st.sampled_from([KINETO_SMALL, KINETO_GRAPH]), data=st.data())
def test_kineto_structured_mutations(tmp_path, source, data):
    """Valid JSON, hostile events: any field of any event replaced by any JSON value."""
    doc = json.loads(gzip.decompress(source.read_bytes()))
    events = doc["traceEvents"]
    for _ in range(data.draw(st.integers(1, 12))):
        event = events[data.draw(st.integers(0, len(events) - 1))]
        key = data.draw(st.sampled_from(["ts", "dur", "pid", "tid", "name", "cat", "ph", "args"]
                                        + [f"args.{k}" for k in ("correlation", "device",
                                                                  "stream", "bytes")]))
        value = data.draw(VALUES)
        if key.startswith("args."):
            if isinstance(event.get("args"), dict):
                event["args"][key[5:]] = value
        else:
            event[key] = value
    if data.draw(st.booleans()):
        doc["deviceProperties"] = data.draw(VALUES)
    path = tmp_path / "mutated.json"
    path.write_text(json.dumps(doc, allow_nan=True))
    read_and_analyse(path)


@settings(FUZZ, max_examples=10)   # (a 2.4 MB capture: 2 s an example)
@given(data=st.data())
def test_graph_capture_saved_apart_mutations(tmp_path, data):
    """vLLM's capture file, its events made hostile where the join and the mapping look
    (times, process and thread, names), joined to its replay: a trace that the analyses
    survive, or one line naming one of the two files."""
    doc = json.loads(gzip.decompress(KINETO_CAPTURE.read_bytes()))
    events = doc["traceEvents"]
    for _ in range(data.draw(st.integers(1, 12))):
        event = events[data.draw(st.integers(0, len(events) - 1))]
        key = data.draw(st.sampled_from(["ts", "dur", "pid", "tid", "name", "cat"]))
        event[key] = data.draw(st.one_of(VALUES, st.sampled_from(
            ["hipGraphLaunch", "hipLaunchKernel", "hipStreamBeginCapture", "cuda_runtime",
             "gpu_user_annotation", 851, 0])))
    path = tmp_path / "capture.json"
    path.write_text(json.dumps(doc, allow_nan=True))
    try:
        trace = read_trace(KINETO_GRAPH, capture=path)
    except TraceError as exc:
        assert (str(path) in str(exc) or str(KINETO_GRAPH) in str(exc)) and "\n" not in str(exc)
        return
    range_kernel_summary(trace)
    try:
        breakdown(trace)
    except NoGpuWork as exc:   # a mutation that leaves no kernel: said, not an empty table
        assert str(path) in str(exc) and "\n" not in str(exc)


@FUZZ
@given(data=st.data())
def test_kineto_module_call_mutations(tmp_path, data):
    """An eager trace whose layers are the profiler's module calls ("nn.Module: ..."), with
    hostile values where the reader tells module calls from other Python frames."""
    doc = _eager_kineto_doc()
    events = doc["traceEvents"]
    for _ in range(data.draw(st.integers(1, 8))):
        event = events[data.draw(st.integers(0, len(events) - 1))]
        key = data.draw(st.sampled_from(["name", "cat", "ts", "dur", "tid"]))
        event[key] = data.draw(st.one_of(VALUES, st.sampled_from(
            ["python_function", "nn.Module: ", "nn.Module: KimiK3DecoderLayer_1", "nn.Modul"])))
    path = tmp_path / "mutated.json"
    path.write_text(json.dumps(doc, allow_nan=True))
    read_and_analyse(path)


@FUZZ
@given(data=st.data())
def test_kptrace_byte_mutations(tmp_path_factory, data):
    """kimi-perf's own format, corrupted: a trace or a one-line error, never a crash (a
    corrupt offset read unchecked reads out of bounds)."""
    saved = tmp_path_factory.getbasetemp() / "saved.kptrace"
    if not saved.exists():
        read_trace(KINETO_GRAPH).save(saved)
    raw = bytearray(saved.read_bytes())
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    path = tmp_path_factory.mktemp("kp") / "mutated.kptrace"
    path.write_bytes(bytes(raw))
    read_and_analyse(path)


def test_a_truncated_kptrace_is_said_to_be(tmp_path):
    """A .kptrace cut short (a copy or download stopped) is said to be truncated, as a cut
    SQLite or JSON file is, not "Not an Arrow file"."""
    import pytest

    saved = tmp_path / "whole.kptrace"
    read_trace(KINETO_GRAPH).save(saved)
    raw = saved.read_bytes()
    for keep in (len(raw) // 2, len(raw) - 1, 10):
        cut = tmp_path / "cut.kptrace"
        cut.write_bytes(raw[:keep])
        with pytest.raises(TraceError, match="truncated: an Arrow file that lacks its end"):
            read_trace(cut)


def test_a_kptrace_whose_replay_rows_pass_its_tables_is_corrupt(tmp_path):
    import pytest

    def change(table, header):
        header["meta"]["replay_rows"] = {"kernels": 10**9, "memops": 0, "ranges": 0, "api": 0}
    with pytest.raises(TraceError, match=r"corrupt: replay_rows: 1000000000 kernels, of \d+"):
        read_trace(_kptrace_with(tmp_path, change))


def test_kptrace_checksum_and_references(tmp_path):
    """A value changed in a saved trace fails its checksum; a trace whose checksum matches
    still has every name and launch checked to point inside it."""
    import pyarrow as pa
    import pytest

    trace = read_trace(KINETO_GRAPH)
    path = tmp_path / "t.kptrace"
    trace.save(path)
    with pa.memory_map(str(path)) as source:     # one kernel's start changed, CRC kept
        table = pa.ipc.open_file(source).read_all()
    starts = table.column("kernels.start").chunk(0).values.to_numpy().copy()
    starts[7] += 1
    column = pa.LargeListArray.from_arrays(pa.array([0, len(starts)], pa.int64()),
                                           pa.array(starts))
    table = table.set_column(table.column_names.index("kernels.start"), "kernels.start",
                             column)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(TraceError, match="corrupt: its contents do not match their checksum"):
        read_trace(path)
    trace.kernels.name[0] = len(trace.strings) + 5
    trace.save(path)
    with pytest.raises(TraceError, match=r"corrupt: kernels.name refers outside \[0, "):
        read_trace(path)


def test_kptrace_header_is_checked_and_checksummed(tmp_path):
    """The header's format version is a whole number this version reads, its checksums are
    there, and from version 2 on the metadata's matches (a GPU's name changed by a byte was
    read as written); a version-1 file, without them, is still read. A file whose checksums
    match but whose kernels end before they start is corrupt too (it printed negative time);
    one whose kernels start before 0 is not (a Kineto trace's clock may)."""
    import pyarrow as pa
    import pytest

    good = tmp_path / "good.kptrace"
    read_trace(KINETO_SMALL).save(good)

    def header_changed(change) -> object:   # (the checksums left as they were)
        with pa.memory_map(str(good)) as source:
            table = pa.ipc.open_file(source).read_all()
        header = json.loads(table.schema.metadata[b"kimi_perf"])
        header = change(header) or header
        table = table.replace_schema_metadata({"kimi_perf": json.dumps(header)})
        bad = tmp_path / "bad.kptrace"
        with pa.OSFile(str(bad), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        return bad

    for change, said in (
            (lambda h: h.update(version="2"), r'\(its format version is "2", not a whole'),
            (lambda h: h.update(version=True), r"\(its format version is true, not a whole"),
            (lambda h: h.update(version=2.0), r"\(its format version is 2.0, not a whole"),
            (lambda h: h.__delitem__("version"), r"\(no format version\)"),
            (lambda h: [h], r"corrupt kimi-perf metadata \(not an object\)"),
            (lambda h: h.update(version=3), "format 3 is not supported .this version reads 1 "
                                            "and 2."),
            (lambda h: h.__delitem__("crc32"), r"\(no checksum crc32\)"),
            (lambda h: h.__delitem__("meta_crc32"), r"\(no checksum meta_crc32\)"),
            (lambda h: h["meta"]["gpus"][0].update(name="G/"),
             "corrupt: its metadata do not match their checksum")):
        with pytest.raises(TraceError, match=said):
            read_trace(header_changed(change))

    def version_1(header):
        header["version"] = 1
        del header["meta_crc32"]
    assert len(read_trace(header_changed(version_1)).kernels) == len(read_trace(good).kernels)

    def version_1_unchecked(header):   # (saved before the columns had a checksum too)
        version_1(header)
        del header["crc32"]
    assert len(read_trace(header_changed(version_1_unchecked)).kernels) == len(
        read_trace(good).kernels)
    # metadata whose keys JSON makes texts (a notebook's {2: .., 10: ..}) saves and reads back
    trace = read_trace(KINETO_SMALL)
    trace.meta["per_rank"] = {2: "a", 10: "b", "x": "c"}
    trace.save(tmp_path / "keys.kptrace")
    assert read_trace(tmp_path / "keys.kptrace").meta["per_rank"] == {"2": "a", "10": "b",
                                                                      "x": "c"}

    def end_before_start(table, header):
        column = table.column("kernels.end").chunk(0).values.to_numpy().copy()
        column[0] = -5
        lists = pa.LargeListArray.from_arrays(pa.array([0, len(column)], pa.int64()),
                                              pa.array(column))
        return table.set_column(table.column_names.index("kernels.end"), "kernels.end", lists)
    with pytest.raises(TraceError, match=r"corrupt: 1 kernel with an end before the start$"):
        read_trace(_kptrace_with(tmp_path, end_before_start))

    def before_0(table, header):   # (every kernel before the clock's 0)
        for name in ("kernels.start", "kernels.end"):
            column = table.column(name).chunk(0).values.to_numpy() - 2**62
            lists = pa.LargeListArray.from_arrays(pa.array([0, len(column)], pa.int64()),
                                                  pa.array(column))
            table = table.set_column(table.column_names.index(name), name, lists)
        return table
    assert (read_trace(_kptrace_with(tmp_path, before_0)).kernels.start < 0).all()


def test_kptrace_that_is_no_kimi_perf_trace_and_gpu_work_of_no_time(tmp_path):
    """What save writes and what load refuses or reads, by what the header holds: save writes
    only a file named .kptrace (a directory is searched for that name), in format version 2
    with both checksums (a version-1 header may lack them); a file that is no Arrow at all is
    unreadable, not "truncated" (which is of a file that begins as Arrow does); an Arrow file
    without kimi-perf's header is no trace (not an empty one); a header whose ``meta`` is no
    object is refused; the metadata's keys in another order still match their checksum (it
    is of the keys sorted). A kernel that ends as it starts (0 ns) is read; a memcpy that
    ends before it starts is corrupt, as such a kernel is."""
    import pyarrow as pa
    import pytest

    from kimi_perf.trace import Trace

    good = tmp_path / "good.kptrace"
    read_trace(KINETO_SMALL).save(good)
    with pytest.raises(ValueError, match=r"good\.arrow: a \.kptrace file \(Arrow\) is named so"):
        read_trace(KINETO_SMALL).save(tmp_path / "good.arrow")
    assert not (tmp_path / "good.arrow").exists()
    with pa.memory_map(str(good)) as source:
        table = pa.ipc.open_file(source).read_all()
    header = json.loads(table.schema.metadata[b"kimi_perf"])
    assert header["version"] == 2 and {"crc32", "meta_crc32"} <= header.keys()

    def written(name, table, metadata):
        path = tmp_path / name
        table = table.replace_schema_metadata(metadata)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        return path

    plain = written("plain.kptrace", table, None)
    noise = tmp_path / "noise.kptrace"
    noise.write_bytes(b"not arrow at all, " * 100)
    reordered = dict(header, meta=dict(reversed(list(header["meta"].items()))))
    for path, said in (
            (noise, "not a readable kimi-perf trace"),
            (plain, "Arrow file without kimi-perf metadata$"),
            (_kptrace_with(tmp_path, lambda t, h: h.update(meta=[])),
             "kimi-perf trace without its metadata$")):
        with pytest.raises(TraceError, match=f"^{re.escape(str(path))}: {said}"):
            Trace.load(path)
    again = read_trace(written("reordered.kptrace", table, {"kimi_perf": json.dumps(reordered)}))
    assert len(again.kernels) == 14 and again.meta["gpus"] == read_trace(good).meta["gpus"]

    def ending(table_name, shift):
        def change(table, header):
            name = f"{table_name}.end"
            start = table.column(f"{table_name}.start").chunk(0).values.to_numpy()
            end = table.column(name).chunk(0).values.to_numpy().copy()
            end[0] = start[0] + shift
            lists = pa.LargeListArray.from_arrays(pa.array([0, len(end)], pa.int64()),
                                                  pa.array(end))
            return table.set_column(table.column_names.index(name), name, lists)
        return change
    instant = read_trace(_kptrace_with(tmp_path, ending("kernels", 0)))
    assert instant.kernels.end[0] == instant.kernels.start[0]
    with pytest.raises(TraceError, match=r"corrupt: 1 memop with an end before the start$"):
        read_trace(_kptrace_with(tmp_path, ending("memops", -1)))


def test_kptrace_metadata_and_references_out_of_bounds_are_corrupt(tmp_path):
    """A forged header (its checksums made to match) whose metadata has the wrong type or a
    count below 0, or whose columns point past the trace, is refused, each by what is wrong:
    a bool is no pid and 2^63 no int64; a replay's rows may be all of a table's, not one
    more; a name or domain is a string's code (0 to len - 1), a launch or a parent range a
    row or -1, nothing below -1 or at the table's length. An id column may come as int32 (as
    ``compact`` narrows it), a time column may not."""
    import pyarrow as pa
    import pytest

    def meta(key, value):
        return lambda table, header: header["meta"].update({key: value})

    def column(name, at, value):
        def change(table, header):
            values = table.column(name).chunk(0).values.to_numpy().copy()
            values[at] = value(len(values))
            lists = pa.LargeListArray.from_arrays(pa.array([0, len(values)], pa.int64()),
                                                  pa.array(values))
            return table.set_column(table.column_names.index(name), name, lists)
        return change

    # the small Kineto trace: 65 strings, 14 kernels, 2 memops, 75 ranges, 21 API calls
    every = {"kernels": 14, "memops": 2, "ranges": 75, "api": 21}
    for change, said in (
            (meta("untimed_ranges", -1), "corrupt metadata: untimed_ranges is not a count"),
            (meta("untimed", {"kernels": -1, "memops": 0}),
             "corrupt metadata: untimed is not {kernels: count, memops: count}"),
            (meta("replay_rows", {"kernels": -1, "memops": 0, "ranges": 0, "api": 0}),
             "corrupt metadata: replay_rows is not {kernels: count"),
            (meta("gpus", [{"device": 0, "name": "G", "sm_count": "104"}]),
             "corrupt metadata: gpus is not a list of {device: int, name: str, sm_count"),
            (meta("processes", [{"pid": True, "name": "python3"}]),
             r"corrupt metadata: processes is not a list of {pid: int, name}"),
            (meta("captures", [1]), "corrupt metadata: captures is not a list of file names"),
            (meta("converted_from", 5), "corrupt metadata: converted_from is not a string"),
            (meta("exported_by_nsys", "yes"),
             "corrupt metadata: exported_by_nsys is not true or false"),
            (meta("schema", 1.5), "corrupt metadata: schema is not a string or an integer"),
            (meta("rank", 2**63), "corrupt metadata: rank is not an integer"),
            (meta("replay_rows", {"kernels": 15, "memops": 0, "ranges": 0, "api": 0}),
             "corrupt: replay_rows: 15 kernels, of 14"),
            (column("kernels.name", 0, lambda n: 65), r"corrupt: kernels.name refers outside "
                                                      r"\[0, 65\)"),
            (column("ranges.domain", 0, lambda n: 65), r"corrupt: ranges.domain refers outside "
                                                       r"\[0, 65\)"),
            (column("kernels.api", 0, lambda n: -2), r"corrupt: kernels.api refers outside "
                                                     r"\[-1, 21\)"),
            (column("ranges.parent", 1, lambda n: n), r"corrupt: ranges.parent refers outside "
                                                      r"\[-1, 75\)")):
        bad = _kptrace_with(tmp_path, change)
        with pytest.raises(TraceError, match=f"^{re.escape(str(bad))}: {said}"):
            read_trace(bad)
    assert read_trace(_kptrace_with(tmp_path, meta("replay_rows", every))).summary()[
        "replay"]["kernels"] == 14

    def int32(name):
        def change(table, header):
            values = table.column(name).chunk(0).values.cast(pa.int32(), safe=False)
            lists = pa.LargeListArray.from_arrays(pa.array([0, len(values)], pa.int64()), values)
            return table.set_column(table.column_names.index(name), name, lists)
        return change
    # an id column may be int32 (compacted), a time may not: it is int64 or corrupt
    assert read_trace(_kptrace_with(tmp_path, int32("kernels.pid"))).kernels.pid.dtype == "int32"
    bad = _kptrace_with(tmp_path, int32("kernels.start"))
    with pytest.raises(TraceError, match=f"^{re.escape(str(bad))}: corrupt: column "
                                         r"kernels\.start holds int32 with 0 nulls$"):
        read_trace(bad)


def test_kptrace_strings_whose_offsets_run_backwards_are_unreadable(tmp_path):
    """Every offset of a saved trace is checked before a value is read: a string table whose
    first string's end is set to the last's (the second then running backwards), its
    checksum made to match, is an unreadable trace, not a string of negative length handed
    to Python (a SystemError) or bytes read past the column."""
    import numpy as np
    import pyarrow as pa
    import pytest

    from kimi_perf.trace import Trace

    def change(table, header):
        values = table.column("strings").chunk(0).values
        buffers = values.buffers()
        offsets = np.frombuffer(buffers[1], np.int64)[
            values.offset: values.offset + len(values) + 1].copy()
        offsets[1] = offsets[-1]
        bad = pa.Array.from_buffers(pa.large_string(), len(values),
                                    [None, pa.py_buffer(offsets.tobytes()), buffers[2]])
        lists = pa.LargeListArray.from_arrays(pa.array([0, len(bad)], pa.int64()), bad)
        return table.set_column(table.column_names.index("strings"), "strings", lists)
    bad = _kptrace_with(tmp_path, change)
    with pytest.raises(TraceError, match=f"^{re.escape(str(bad))}: not a readable kimi-perf "
                                         r"trace \(.*non-monotonic offset"):
        Trace.load(bad)


def test_kptrace_checksum_covers_the_strings_and_load_tidies_them(tmp_path):
    """The columns' checksum covers the string table's bytes and where each string ends: a
    name changed in place (same length), or two names' boundary moved (the same bytes), with
    the checksum left as saved, is corrupt. A trace saved with strings no table names (what
    an nsys export holds of the environment) and a name holding an escape sequence loads with
    the first left out and the second made printable (a file saved before readers tidied)."""
    import pyarrow as pa
    import pytest

    from kimi_perf.trace import Trace

    good = tmp_path / "good.kptrace"
    read_trace(KINETO_SMALL).save(good)
    with pa.memory_map(str(good)) as source:
        table = pa.ipc.open_file(source).read_all()
    strings = table.column("strings").chunk(0).values.to_pylist()
    first, second = strings[0], strings[1]
    assert first and len(second) > 1
    for changed in ([chr(ord(first[0]) ^ 1) + first[1:], second],
                    [first + second[0], second[1:]]):
        values = pa.array(changed + strings[2:], pa.large_string())
        lists = pa.LargeListArray.from_arrays(pa.array([0, len(values)], pa.int64()), values)
        forged = table.set_column(table.column_names.index("strings"), "strings", lists)
        bad = tmp_path / "bad.kptrace"
        with pa.OSFile(str(bad), "wb") as sink, pa.ipc.new_file(sink, forged.schema) as writer:
            writer.write_table(forged)
        with pytest.raises(TraceError, match="corrupt: its contents do not match their checksum"):
            read_trace(bad)
    trace = read_trace(KINETO_SMALL)
    code = int(trace.kernels.name[0])
    trace.strings = [*trace.strings[:code], "k\x1b[31m", *trace.strings[code + 1:],
                     "TOKEN=secret"]
    trace.save(tmp_path / "untidy.kptrace")
    loaded = Trace.load(tmp_path / "untidy.kptrace")
    assert "TOKEN=secret" not in loaded.strings and len(loaded.strings) == len(trace.strings) - 1
    assert loaded.strings[loaded.kernels.name[0]] == "k\\x1b[31m"


def _kptrace_with(tmp_path, change) -> object:
    """The small Kineto fixture saved as a .kptrace, its table changed by ``change(table,
    header)`` (the header's checksums then recomputed, as a careful forger would)."""
    import pyarrow as pa

    from kimi_perf.trace import _checksum, _meta_checksum

    good = tmp_path / "good.kptrace"
    read_trace(KINETO_SMALL).save(good)
    with pa.memory_map(str(good)) as source:
        table = pa.ipc.open_file(source).read_all()
    header = json.loads(table.schema.metadata[b"kimi_perf"])
    table = change(table, header) or table
    header["crc32"], header["meta_crc32"] = _checksum(table), _meta_checksum(header["meta"])
    table = table.replace_schema_metadata({"kimi_perf": json.dumps(header)})
    bad = tmp_path / "bad.kptrace"
    with pa.OSFile(str(bad), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return bad


def _no_traceback(*args) -> None:
    from click.testing import CliRunner

    from kimi_perf.cli import main

    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code in (0, 2) and "Traceback" not in result.output, result.output
    if result.exit_code:
        assert result.output.count("\n") == 1


@FUZZ
@given(key=st.sampled_from(["gpus", "processes", "untimed", "untimed_ranges", "duplicates",
                            "format", "tool", "file", "rank", "world_size", "captures",
                            "replay_rows", "converted_from", "kptrace", "exported_by_nsys",
                            "source_identity", "capture_identities"]),
       value=VALUES,
       data=st.data())
def test_kptrace_metadata_of_any_type(tmp_path, key, value, data):
    """A saved trace's header with a field of any type (its checksum made to match, as a
    careful forger would), whole or inside a GPU entry: read and analysed, or a one-line error
    naming the file."""
    def change(table, header):
        meta = header["meta"]
        if key == "gpus" and data.draw(st.booleans()):
            meta["gpus"] = [{"device": 0, "name": "G", "sm_count": 1,
                             data.draw(st.sampled_from(["device", "name", "sm_count"])): value}]
        else:
            meta[key] = value
    bad = _kptrace_with(tmp_path, change)
    read_and_analyse(bad)
    _no_traceback("info", bad)
    _no_traceback("trace", "--from", bad, "--out", tmp_path / "runs", "--plotly-js", "cdn")


@FUZZ
@given(value=VALUES, key=st.sampled_from(["source_identity", "capture_identities"]),
       field=st.sampled_from([None, "name", "size", "digest"]))
def test_kptrace_source_of_any_type(tmp_path, value, key, field):
    """The identities of the trace a .kptrace was saved from and of its captures (which a
    directory reads once), of any type, whole or a field of one: the directory is read, a
    trace beside it too."""
    import shutil

    from kimi_perf.runs import trace_files

    def change(table, header):
        meta = header["meta"]
        meta["capture_identities"] = [{"name": "capture.json", "size": 1, "digest": "00"}]
        if field is None:
            meta[key] = value
        else:
            (meta[key][0] if key == "capture_identities" else meta[key])[field] = value
    bad = _kptrace_with(tmp_path, change)
    folder = tmp_path / "ranks"
    folder.mkdir(exist_ok=True)
    shutil.copy(bad, folder / "rank0.kptrace")
    shutil.copy(KINETO_SMALL, folder / KINETO_SMALL.name)
    # (the trace it was saved from, told by an identity left whole, is read once)
    assert len(trace_files([folder])) == (1 if key == "capture_identities" else 2)
    _no_traceback("info", folder)


@FUZZ
@given(column=st.sampled_from(["kernels.pid", "kernels.start", "memops.end", "ranges.name",
                               "api.tid"]),
       how=st.sampled_from(["shorten", "lengthen", "nulls", "float"]))
def test_kptrace_columns_that_disagree(tmp_path, column, how):
    """Columns of one table with other lengths, nulls or another type, the checksum made to
    match: an error naming the file, not a crash in an analysis nor a file read as valid."""
    import pyarrow as pa

    def change(table, header):
        values = table.column(column).chunk(0).values
        if how in ("shorten", "lengthen") and len(values) == 0:
            values = pa.array([1], values.type)    # an empty table made one row long
        new = {"shorten": lambda: values.slice(0, max(len(values) - 1, 0)),
               "lengthen": lambda: pa.concat_arrays([values, values.slice(0, 1)]),
               "nulls": lambda: pa.array([None] * max(len(values), 1), values.type),
               "float": lambda: pa.array(values.to_numpy(zero_copy_only=False)
                                         .astype("float64"))}[how]()
        lists = pa.LargeListArray.from_arrays(pa.array([0, len(new)], pa.int64()), new)
        return table.set_column(table.column_names.index(column), column, lists)
    bad = _kptrace_with(tmp_path, change)
    try:
        read_trace(bad)
    except TraceError as exc:
        assert str(bad) in str(exc) and "\n" not in str(exc)
    else:
        raise AssertionError(f"{column} {how}: read as a valid trace")


@FUZZ
@given(field=st.sampled_from(["id", "name", "numSms", None]),
       value=VALUES.filter(lambda v: not isinstance(v, float) or math.isfinite(v)))
def test_kineto_device_properties_of_any_type(tmp_path, field, value):
    """deviceProperties is the trace describing itself: a field of another type leaves that
    GPU out (or its name or SM count), and what is written can be read back (gate, report)."""
    doc = json.loads(gzip.decompress(KINETO_SMALL.read_bytes()))
    if field is None:
        doc["deviceProperties"] = value
    else:
        doc["deviceProperties"] = [{"id": 0, "name": "G", "numSms": 4, field: value}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    trace = read_trace(path)
    assert len(trace.kernels) == len(read_trace(KINETO_SMALL).kernels)
    for gpu in trace.meta["gpus"]:
        assert type(gpu["device"]) is int and isinstance(gpu["name"], str)
    stored = tmp_path / "b.json"
    _no_traceback("breakdown", path, "--format", "json", "-o", stored)
    _no_traceback("gate", stored, stored)


def test_a_kernel_ending_past_any_clock_is_untimed(tmp_path):
    """An end at INT64_MAX ns: left out and counted as untimed, not a step whose sums wrap
    around to minus 9.2e15 µs."""
    path = tmp_path / "t.sqlite"
    shutil.copy(NSYS_NEW, path)
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = 9223372036854775807 "
                   "WHERE rowid = 2")
    trace = read_trace(path)
    assert trace.meta["untimed"]["kernels"] == 1
    assert len(trace.kernels) == len(read_trace(NSYS_NEW).kernels) - 1
    assert all(s["kernel_us"] >= 0 for s in breakdown(trace).steps)
