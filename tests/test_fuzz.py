"""Fuzz both readers with mutated real fixtures: a trace or a TraceError, nothing else.

Whatever reads must also survive the analyses (range summary and breakdown).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import shutil
import sqlite3

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimi_perf import breakdown, range_kernel_summary, read_trace
from kimi_perf.errors import TraceError
from tests.conftest import KINETO, NSYS
from tests.test_readers import _eager_kineto_doc

NSYS_SMALL = NSYS / "hpcgroup-pipit__saxpy-mpi-cuda_nsys_perlmutter0__nsys2022.2.1.sqlite"
NSYS_NEW = NSYS / "Athrun0109-CS336_assignment2__result__nsys2026.2.1.sqlite"
KINETO_SMALL = KINETO / "hta_amd_mi250_rocm62_minitoy.json.gz"
KINETO_GRAPH = KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz"

FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def read_and_analyse(path) -> None:
    try:
        trace = read_trace(path)
    except TraceError as exc:
        assert str(path) in str(exc) and "\n" not in str(exc)
        return
    range_kernel_summary(trace)
    breakdown(trace)


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
