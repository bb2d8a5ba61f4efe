"""PyTorch profiler (Kineto) Chrome-trace JSON, plain or gzipped, CUDA or ROCm.

Timestamps are µs: integers in old traces, floats with fractional ns in new ones; both become
int64 ns. Durations are exact; a float timestamp is what its float64 holds: to the ns below
1e13 µs (traces that count from boot or from the profiler's start), to 0.25 µs at epoch-µs
values with fractions (1712195495519689.047), which few traces write.

A kernel links to its launching API call by ``args.correlation``; under a CUDA/HIP graph
every replayed kernel shares the graph launch's correlation. A kernel or copy the trace holds
twice, equal in every field, ran once: the repeats are left out and counted
(``meta["duplicates"]``), as work without a time is (``meta["untimed"]``).

How it reads (a 681 MB trace in a few seconds and a few hundred MB): the file is inflated in
blocks, and the ``traceEvents`` array is cut at event boundaries, each piece decoded with
msgspec into small Structs that hold only the fields used (every other field is skipped, never
built; events of other phases than ``X`` become empty Structs). Each piece's events then turn
into numpy columns in a few C-level passes, and the piece is dropped. A piece with anything
unusual in a field that is used (a label instead of an id, a missing ``ts``, a wrong type) is
decoded again generically and replayed event by event under the event-by-event rules, so an odd
piece yields the same tables as the vectorized pass would if it could read it. Whatever the
block reader cannot place with certainty (the ``traceEvents`` key not found, a piece that will
not cut, invalid JSON) sends the whole file through the one-shot path: inflate, decode the
document, then the same column builder.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import json
import operator
import re
import zlib
from itertools import chain, compress
from operator import attrgetter
from pathlib import Path
from typing import Any, ClassVar, Union

import msgspec
import numpy as np

from kimi_perf.errors import TraceError
from kimi_perf.memory import release_free_memory
from kimi_perf.trace import (
    DRIVER,
    GPU_RANGE,
    PUSHPOP,
    RUNTIME,
    ApiCalls,
    Kernels,
    MemOps,
    Ranges,
    Trace,
    compact_ints,
    index_dtype,
    is_int64,
)

GZIP_MAGIC = b"\x1f\x8b"

_API_CATEGORIES = {"cuda_runtime": RUNTIME, "hip_runtime": RUNTIME, "cuda_driver": DRIVER,
                   "hip_driver": DRIVER}
# CPU ranges: profiler annotations (record_function, ProfilerStep#N) in the default domain,
# and operator events under a "cpu_op" domain so that kernels can be attributed to ops too.
_CPU_RANGE_DOMAINS = {"user_annotation": "", "cpu_op": "cpu_op"}

# Module calls, as the profiler names them with ``with_stack``/``with_modules``
# ("nn.Module: LlamaDecoderLayer_3"), are ranges in the default domain too: in an eager trace
# they are the per-layer structure. The other Python function events are left out.
_MODULE_CALL_PREFIX = "nn.Module: "

# Event categories in the vectorized pass.
(_KERNEL, _MEMCPY, _MEMSET, _RUNTIME_API, _DRIVER_API, _USER_RANGE, _CPU_OP, _GPU_RANGE,
 _MODULE_CALL) = range(1, 10)
_CAT_CODES = {
    "kernel": _KERNEL, "gpu_memcpy": _MEMCPY, "gpu_memset": _MEMSET,
    "cuda_runtime": _RUNTIME_API, "hip_runtime": _RUNTIME_API,
    "cuda_driver": _DRIVER_API, "hip_driver": _DRIVER_API,
    "user_annotation": _USER_RANGE, "cpu_op": _CPU_OP, "gpu_user_annotation": _GPU_RANGE,
    "python_function": _MODULE_CALL,  # only the module calls: see add_fast
}
# Metadata events' category in the vectorized pass: false, so that the filters drop them; not a
# string, so that no "X" event's category can be it.
_METADATA = 0
_RENAMED = {"corr": "correlation"}  # builder column -> table column
_COLUMNS = {
    "a": ("name", "ts", "dur", "pid", "tid", "corr", "kind"),
    "k": ("name", "ts", "dur", "device", "stream", "pid", "corr"),
    "m": ("name", "ts", "dur", "device", "stream", "pid", "corr", "bytes"),
    "r": ("name", "domain", "ts", "dur", "pid", "tid", "device", "stream", "style"),
}

_BLOCK = 4 << 20          # inflated bytes per block
_READ = 4 << 20           # compressed bytes per read
_MAX_PENDING = 32 << 20   # bytes without a usable cut (or before the events) -> one-shot path
_TRIM_EVERY = 8           # blocks between hand-backs of freed heap to the OS
_CUT_TRIES = 4            # candidate event boundaries tried per block (in that block)
_END_TRIES = 256          # candidate ends of the events array tried at the end of the file
_WS = b" \t\n\r"
_KEY = b'"traceEvents"'
_NOT_WS = re.compile(rb"[^ \t\n\r]")
# A boundary between two events: "}" "," whitespace "{" (the "{" may be in the next block).
_NEXT_EVENT = re.compile(rb"[ \t\n\r]*(?:\{|\Z)")
HIP_CALL = re.compile(r"^hip[A-Z]")   # hipLaunchKernel, hipMemcpyWithStream, ...
# an older Kineto's GPU lane, "tid": "stream 7", where args hold no stream: stream 7
STREAM_LABEL = re.compile(r"\s*stream (\d{1,18})\s*")

# -- typed decoding: only the fields used ---------------------------------------------------------

_Id = int | str | None
_IdOrUnset = int | str | None | msgspec.UnsetType


class _Args(msgspec.Struct, gc=False):
    correlation: _Id = -1
    device: _IdOrUnset = msgspec.UNSET
    stream: _IdOrUnset = msgspec.UNSET
    bytes: _Id = -1


class _Complete(msgspec.Struct, tag_field="ph", tag="X", gc=False):
    """A complete ("X") event. Types are what real traces hold in the fields used; anything
    else (a bool, a list, a missing ``ts``) fails validation and sends the piece to the
    generic replay."""

    ts: float
    cat: str = ""
    name: str = ""
    dur: float = -1.0   # none: no time (GPU work without one is left out and counted)
    pid: _Id = None
    tid: _Id = None
    args: _Args | None = None


class _Metadata(msgspec.Struct, tag_field="ph", tag="M", gc=False):
    """A metadata ("M") event, for the names of processes (``process_name``: ``args.name``).
    Any type is taken: what is not a name is left out, never a reason to replay."""

    cat: ClassVar = _METADATA   # a class attribute: the category the vectorized pass sets aside
    name: Any = None
    pid: Any = None
    args: Any = None


# Every other Chrome-trace phase: no fields decoded at all. An unknown phase fails validation
# (generic replay for that piece).
_OTHER_PHASES = tuple(
    msgspec.defstruct(f"_Phase{ord(p)}", [], tag_field="ph", tag=p, gc=False, module=__name__,
                      namespace={"cat": None})  # a class attribute: no category, no filter pass
    for p in "BEiIbneSTpFstfPNODVvRcC()")
_FastEvent = Union[(_Complete, _Metadata, *_OTHER_PHASES)]
_META_FIELDS = ("deviceProperties", "distributedInfo", "schemaVersion", "roctracer_version",
                "hip_runtime_version")


class _Meta(msgspec.Struct, gc=False):
    deviceProperties: Any = msgspec.UNSET
    distributedInfo: Any = msgspec.UNSET
    schemaVersion: Any = msgspec.UNSET
    roctracer_version: Any = msgspec.UNSET
    hip_runtime_version: Any = msgspec.UNSET


class _Doc(_Meta, gc=False):
    traceEvents: list[_FastEvent] | msgspec.UnsetType = msgspec.UNSET


_FAST_EVENTS = msgspec.json.Decoder(list[_FastEvent])
_FAST_CATEGORIES = {**_CAT_CODES, _METADATA: _METADATA}
_FAST_DOC = msgspec.json.Decoder(_Doc | list[_FastEvent])
_META = msgspec.json.Decoder(_Meta)
_GENERIC = msgspec.json.Decoder()

_ts, _dur, _pid, _tid = (attrgetter(f) for f in ("ts", "dur", "pid", "tid"))
_NO_ARGS = _Args()


class _Slow(Exception):
    """A piece that the vectorized pass does not take: replay it event by event."""


class _Fallback(Exception):
    """The block reader cannot go on with certainty: read the file in one shot instead."""


UTF8_BOM = b"\xef\xbb\xbf"  # what some editors and Windows tools put before JSON


def read_kineto_json(path: str | Path) -> Trace:
    path = Path(path)
    try:
        return _read_in_blocks(path)
    except _Fallback:
        return _read_whole(path)


# -- the one-shot path ----------------------------------------------------------------------------

def _repeats_trace_events(raw: bytes) -> bool:
    """Whether an object of the document holds the ``traceEvents`` key twice (only asked when
    the key's text occurs twice, which an event's name could make it do)."""
    repeated = False

    def pairs(items: list) -> None:   # every object read as None: nothing is kept
        nonlocal repeated
        repeated = repeated or sum(key == "traceEvents" for key, _ in items) > 1

    try:
        json.loads(raw, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return False     # not JSON Python reads: the decoders below say what is wrong
    return repeated


def _no_trace_events(path: Path, doc: dict) -> TraceError:
    """No trace: said so, and where the object is a kimi-perf breakdown but for the
    ``schema`` it begins with (one edited by hand), said so too."""
    ours = next((key for key in ("paths", "layer_types") if key in doc), None)
    if next(iter(doc), None) == "command" and "request" in doc:   # (runs.is_kimi_perf_run_json)
        return TraceError(path, "a kimi-perf run's run.json, not a trace: give its run "
                                "directory")
    if ours and "schema" in doc:   # (its keys moved: as runs.is_kimi_perf_json reads it)
        return TraceError(path, "a kimi-perf breakdown JSON, not a trace (breakdown, compare, "
                                "gate and report read it)")
    return TraceError(path, "JSON without a 'traceEvents' list: not a Chrome/Kineto trace" + (
        f"; a kimi-perf breakdown (it holds '{ours}') begins with its 'schema'" if ours
        else ""))


def _read_whole(path: Path) -> Trace:
    raw = _load_bytes(path)
    if not _valid_utf8(raw):
        raise TraceError(path, "invalid or truncated JSON (not valid UTF-8)")
    if raw.count(_KEY) > 1 and _repeats_trace_events(raw):
        # a decoder keeps the last of repeated keys: the other list's events would be lost
        raise TraceError(path, "two 'traceEvents' lists in one object: which one is the trace "
                               "is not certain")
    try:
        doc = _FAST_DOC.decode(raw)
    except msgspec.ValidationError:
        doc = None  # unusual types somewhere: decode generically below
    except msgspec.DecodeError as exc:
        raise _invalid_json(path, exc) from None
    builder = _Builder(path)
    if doc is not None:
        if isinstance(doc, _Doc):
            if doc.traceEvents is msgspec.UNSET:
                raise _no_trace_events(path, _GENERIC.decode(raw))
            events, meta = doc.traceEvents, _meta_dict(doc)
        else:
            events, meta = doc, {}
        doc = None
        try:
            builder.add_fast(events)
        except _Slow:
            pass
        else:
            return _finish(builder, meta, path)
        del events
    try:
        doc = _GENERIC.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise _invalid_json(path, exc) from None
    del raw
    if isinstance(doc, dict):
        events = doc.get("traceEvents")
        if not isinstance(events, list):
            raise _no_trace_events(path, doc)
    elif isinstance(doc, list):
        events, doc = doc, {}
    else:
        raise TraceError(path, "JSON is neither a trace object nor an event list")
    builder.add_events(events)
    if builder.error is not None:
        raise builder.error
    return _finish(builder, doc, path)


def _load_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
        gzipped = raw[:2] == GZIP_MAGIC
        if gzipped:
            raw = gzip.decompress(raw)
    except EOFError as exc:   # (the stream ends before its end marker: cut short)
        raise TraceError(path, f"truncated gzip ({exc})") from None
    except (OSError, zlib.error) as exc:
        raise TraceError(path, f"cannot decompress ({exc})") from None
    raw = raw.removeprefix(UTF8_BOM)
    if not raw or raw.isspace():
        # the file is not empty: what it holds is
        raise TraceError(path, ("a gzip that holds an empty file" if not raw else
                                "a gzip that holds only blanks") if gzipped else "empty file")
    return raw


def _valid_utf8(data: bytes) -> bool:
    """The whole file must be UTF-8, skipped fields too (msgspec checks only what it decodes)."""
    if data.isascii():
        return True
    check = _Utf8()
    return all(check.valid(data[i:i + _BLOCK]) for i in range(0, len(data), _BLOCK)) and \
        check.valid(b"", final=True)


def _invalid_json(path: Path, exc: Exception) -> TraceError:
    detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return TraceError(path, f"invalid or truncated JSON ({detail})")


def _finish(builder: _Builder, meta: dict, path: Path) -> Trace:
    if builder.non_objects and not builder.objects:
        raise TraceError(path, "not a Chrome/Kineto trace: its event list holds no event objects")
    trace = builder.finish()
    # ROCm: said in the metadata by some PyTorch versions, always by the runtime's calls
    hip = bool(len(trace.api.name)) and bool(
        trace.names_matching(HIP_CALL)[trace.api.name].any())
    trace.meta.update(_metadata(meta, path, hip))
    return trace


def _meta_dict(doc: _Meta) -> dict:
    return {f: v for f in _META_FIELDS if (v := getattr(doc, f)) is not msgspec.UNSET}


# -- the block reader -----------------------------------------------------------------------------

def _read_in_blocks(path: Path) -> Trace:
    builder = _Builder(path)
    utf8 = _Utf8()
    with contextlib.closing(_inflated_blocks(path)) as blocks:
        buf = bytearray()
        start = None
        for block in blocks:
            if not utf8.valid(block):
                raise _Fallback
            buf += block.removeprefix(UTF8_BOM) if not buf else block
            start = _events_start(buf)
            if start is not None:
                break
            if len(buf) > _MAX_PENDING:
                raise _Fallback
        if start is None:
            raise _Fallback  # empty, or no events array where expected: the one-shot path says
        head, begin = start
        del buf[:begin - 1]  # buf[0] is the array's "[" from here on
        offset = 0
        for blocks_read, block in enumerate(blocks, start=1):
            if not utf8.valid(block):
                raise _Fallback
            buf += block
            offset = _cut(buf, len(buf) - len(block), builder, offset)
            if blocks_read % _TRIM_EVERY == 0:
                release_free_memory()   # the holes growing columns leave: see memory.py
            if len(buf) > _MAX_PENDING:
                raise _Fallback
        if not utf8.valid(b"", final=True):
            raise _Fallback
        meta = _last_piece(buf, head, builder, offset)
    if builder.error is not None:
        raise builder.error
    return _finish(builder, meta, path)


def _inflated_blocks(path: Path):
    """The file's bytes in blocks, inflated when gzipped. Anything odd about the file
    (unreadable, corrupt or truncated gzip) is for the one-shot path, which reports it."""
    try:
        with open(path, "rb") as f:
            if f.read(2) != GZIP_MAGIC:
                f.seek(0)
                while block := f.read(_BLOCK):
                    yield block
                return
            f.seek(0)
            inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip: zlib checks CRC, size
            data = b""
            while True:
                if not data:
                    data = f.read(_READ)
                    if not data:
                        raise _Fallback  # truncated
                if block := inflate.decompress(data, _BLOCK):
                    yield block
                data = inflate.unconsumed_tail
                if inflate.eof:  # zero padding, then another member or the end of the file
                    data = inflate.unused_data.lstrip(b"\0")
                    while not data:
                        data = f.read(_READ)
                        if not data:
                            return
                        data = data.lstrip(b"\0")
                    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    except (OSError, EOFError, zlib.error):
        raise _Fallback from None


def _skip_ws(buf: bytearray, i: int) -> int:
    m = _NOT_WS.search(buf, i)
    return m.start() if m else len(buf)


def _events_start(buf: bytearray) -> tuple[bytes | None, int] | None:
    """Where the events start: (the document before the ``"traceEvents"`` key, or None for a
    bare event list; the offset after the array's ``[``), or None when more data is needed."""
    first = _skip_ws(buf, 0)
    if first == len(buf):
        return None
    if buf[first] == ord("["):
        return None, first + 1
    if buf[first] != ord("{"):
        raise _Fallback
    pos = buf.find(_KEY, first)
    while pos >= 0:
        colon = _skip_ws(buf, pos + len(_KEY))
        value = _skip_ws(buf, colon + 1)
        if value >= len(buf):
            return None
        if buf[colon] == ord(":") and _top_level_key(head := bytes(buf[:pos])):
            if buf[value] != ord("["):
                raise _Fallback
            return head, value + 1
        pos = buf.find(_KEY, pos + 1)
    return None


def _top_level_key(head: bytes) -> bool:
    """Whether a key starting right after ``head`` is a member of the top-level object."""
    try:
        msgspec.json.decode(head + b'"_":0}')
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return True


class _Utf8:
    """Checks, block by block, that the whole file is UTF-8: skipped fields too, which msgspec
    does not look into (a multi-byte character may span two blocks)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._pending = False

    def valid(self, block: bytes, final: bool = False) -> bool:
        if not self._pending and block.isascii():
            return True
        try:
            self._decoder.decode(block, final)
        except UnicodeDecodeError:
            return False
        self._pending = bool(self._decoder.getstate()[0])
        return True


def _add_front(buf: bytearray, end: int, builder: _Builder, offset: int) -> int:
    """Add ``buf[:end]`` (a "[", events, a "]"), decoded in place."""
    with memoryview(buf) as view, view[:end] as piece:
        return builder.add_piece(piece, offset)


def _cut(buf: bytearray, new: int, builder: _Builder, offset: int) -> int:
    """Add the complete events at the front of ``buf`` (after its "[") and drop them; returns
    the new offset. Only boundaries in the bytes from ``new`` on are tried: those before were
    tried or passed over already (a piece that did not decode then will not now)."""
    hi = len(buf)
    tries = 0
    while tries < _CUT_TRIES:
        c = buf.rfind(b"},", max(new - 1, 0), hi)
        if c < 0:
            break
        hi = c
        if not _NEXT_EVENT.match(buf, c + 2):
            continue
        tries += 1
        buf[c + 1] = ord("]")  # the "," closes the piece while it is decoded
        try:
            n = _add_front(buf, c + 2, builder, offset)
        except msgspec.DecodeError:
            buf[c + 1] = ord(",")
            continue  # the "}," was inside a string or a nested value
        except msgspec.ValidationError:
            raise _Fallback from None
        del buf[:c + 1]
        buf[0] = ord("[")  # and then opens the next one
        return offset + n
    return offset


def _last_piece(buf: bytearray, head: bytes | None, builder: _Builder, offset: int) -> dict:
    """At the end of the file: the last events, the array's ``]``, the rest of the document."""
    hi = len(buf)
    for _ in range(_END_TRIES):
        c = buf.rfind(b"]", 0, hi)
        if c < 0:
            break
        hi = c
        tail = bytes(buf[c + 1:])
        if head is None:
            if tail.strip(_WS):
                continue
            meta = {}
        else:
            if _KEY in tail:
                raise _Fallback  # a second "traceEvents" key: leave it to the one-shot path
            try:
                meta = _meta_dict(_META.decode(head + b'"traceEvents":[]' + tail))
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
        try:
            _add_front(buf, c + 1, builder, offset)
        except msgspec.DecodeError:
            continue
        except msgspec.ValidationError:
            raise _Fallback from None
        return meta
    raise _Fallback


# -- columns --------------------------------------------------------------------------------------

class _Builder:
    """Collects each table's columns piece by piece (numpy arrays from the vectorized pass,
    lists of plain values from the replay), then makes the tables."""

    def __init__(self, path: Path):
        self.path = path
        self.strings: list[str] = []
        self.codes: dict[str, int] = {}
        self.cpu_codes: dict[str, int] = {}  # cpu_op name -> code of "cpu_op:name"
        self.ids: dict[object, int] = {}
        # Per table and column, segments: a _Growing array for a run of pieces taken by the
        # vectorized pass, a list of plain values for a run of replayed ones.
        self.chunks = {t: {c: [] for c in cols} for t, cols in _COLUMNS.items()}
        # The first malformed event: raised once the whole file is known to be valid JSON.
        self.error: Exception | None = None
        # Items of the event list that are objects, and that are not: a list of numbers is
        # no trace.
        self.objects = self.non_objects = 0
        self.process_names: dict[int, str] = {}

    def _code(self, value: str) -> int:
        code = self.codes.get(value)
        if code is None:
            code = self.codes[value] = len(self.strings)
            self.strings.append(value)
        return code

    def _id(self, value, field: str) -> int:
        """pid/tid/device/stream (``field``) may be ints, numeric strings or labels."""
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lstrip("-").isdigit():
            return int(value)
        if value is None:
            return -1
        if isinstance(value, float) and not -(2**63) < value < 2**63:
            # A JSON integer beyond int64 (decoded as a float): no label but a number out of
            # range, which the table refuses naming its column.
            return value
        if isinstance(value, list | dict):
            raise TypeError(f"'{field}' is {_shown(value)}, not an id")
        # Other labels ("stream 7 (graph)", a thread's name): a stable synthetic id per label.
        return self.ids.setdefault(value, (1 << 29) + len(self.ids))

    def _arg_id(self, args: dict, key: str, event: dict, fallback: str) -> int:
        """``args[key]``, or the event's ``fallback`` field where ``args`` lacks it."""
        if key in args:
            return self._id(_num(args[key]), f"args.{key}")
        value = event.get(fallback)
        if key == "stream" and isinstance(value, str) and (
                lane := STREAM_LABEL.fullmatch(value)):
            return int(lane.group(1))
        return self._id(_num(value), fallback)

    def add_piece(self, piece, offset: int) -> int:
        """Add the events of one JSON array (items ``offset``... of traceEvents); returns how
        many items it held. ``msgspec.DecodeError`` if it is not one complete JSON array (and
        nothing was added)."""
        try:
            items = _FAST_EVENTS.decode(piece)
        except msgspec.ValidationError:
            items = None
        if items is not None:
            if self.error is not None:
                return len(items)
            try:
                self.add_fast(items)
                return len(items)
            except _Slow:
                pass
        del items
        items = _GENERIC.decode(piece)
        if self.error is None:
            self.add_events(items, offset)
        return len(items)

    # The vectorized pass: C-level passes over the typed events; nothing is changed unless the
    # whole piece is taken.

    def add_fast(self, items: list) -> None:
        self.objects += len(items)
        category = _FAST_CATEGORIES.get
        cats = [category(e.cat) for e in items]
        if _METADATA in cats:
            for e, c in zip(items, cats, strict=True):
                if c == _METADATA:
                    self._name_process(e.name, e.pid, e.args)
        if _MODULE_CALL in cats:
            cats = [None if c == _MODULE_CALL and not e.name.startswith(_MODULE_CALL_PREFIX)
                    else c for c, e in zip(cats, items, strict=True)]
        events = list(compress(items, cats))
        n = len(events)
        if not n:
            return
        cat = np.fromiter(filter(None, cats), np.int8, n)
        del cats
        ts = np.fromiter(map(_ts, events), np.float64, n)
        dur = np.fromiter(map(_dur, events), np.float64, n)
        masks = {"k": cat == _KERNEL, "m": (cat == _MEMCPY) | (cat == _MEMSET),
                 "a": (cat == _RUNTIME_API) | (cat == _DRIVER_API), "r": cat >= _USER_RANGE}
        new = {}
        for table, mask in masks.items():
            if not mask.any():
                continue
            ev = _select(events, mask)
            if table == "a":
                cols = {"pid": _ints([e.pid for e in ev]), "tid": _ints([e.tid for e in ev]),
                        "corr": _ints([a.correlation for a in _args_of(ev)]),
                        "kind": np.where(cat[mask] == _RUNTIME_API, RUNTIME, DRIVER
                                         ).astype(np.int8)}
            elif table == "r":
                cols = _range_columns(ev, cat[mask])
            else:
                args = _args_of(ev)
                cols = {"device": _int32(_ids([a.device for a in args], ev, _pid)),
                        "stream": _ids([a.stream for a in args], ev, _tid),
                        "pid": np.full(len(ev), -1, np.int64),
                        "corr": _ints([a.correlation for a in args])}
                if table == "m":
                    nbytes = _ints([a.bytes for a in args])
                    nbytes[nbytes == 0] = -1
                    cols["bytes"] = nbytes
            cols["ts"], cols["dur"] = ts[mask], dur[mask]
            new[table] = cols
        # Taken: from here on nothing fails.
        names = self._code_names([e.name for e in events], cat)
        for table, cols in new.items():
            mask = masks[table]
            cols["name"] = names[mask]
            if table == "r":
                is_cpu = cat[mask] == _CPU_OP
                domain = np.empty(len(is_cpu), np.int32)
                if is_cpu.any():
                    domain[is_cpu] = self.codes["cpu_op"]
                if not is_cpu.all():
                    domain[~is_cpu] = self.codes[""]
                cols["domain"] = domain
            chunks = self.chunks[table]
            for col, values in cols.items():
                segments = chunks[col]
                if segments and isinstance(segments[-1], _Growing):
                    segments[-1].extend(values)
                else:
                    segments.append(_Growing(values))

    def _code_names(self, names: list[str], cat: np.ndarray) -> np.ndarray:
        """String codes in event order: each new string, and each range domain right after
        the first range of that domain, numbered as the per-event rules number them."""
        is_cpu = cat == _CPU_OP
        # Parts: (their rows, or None for all; codes looked up, None where new; whether they
        # are cpu_op names, looked up bare in a table of their qualified codes).
        if not is_cpu.any():
            parts = [(None, list(map(self.codes.get, names)), False)]
        else:
            cpu = is_cpu.tolist()
            parts = [(np.flatnonzero(is_cpu),
                      list(map(self.cpu_codes.get, compress(names, cpu))), True)]
            if not is_cpu.all():
                parts.append((np.flatnonzero(~is_cpu),
                              list(map(self.codes.get, compress(names, map(operator.not_, cpu)))),
                              False))
        out = np.empty(len(names), np.int32)
        pending = []
        for part in parts:
            try:
                codes = np.array(part[1], np.int32)
            except TypeError:  # a None: a new name
                pending.append(part)
                continue
            out[slice(None) if part[0] is None else part[0]] = codes
        marks = []  # (row, domain): the domain is numbered right after that row's name
        ranges = (cat == _USER_RANGE) | (cat == _GPU_RANGE) | (cat == _MODULE_CALL)
        if "" not in self.codes and ranges.any():
            marks.append((int(np.argmax(ranges)), ""))
        if "cpu_op" not in self.codes and is_cpu.any():
            marks.append((int(np.argmax(is_cpu)), "cpu_op"))
        new = []  # (row, codes list, index in it, cpu_op name)
        for rows, codes, cpu_part in pending:
            j = -1
            with contextlib.suppress(ValueError):
                while True:
                    j = codes.index(None, j + 1)
                    new.append((j if rows is None else int(rows[j]), codes, j, cpu_part))
        new.sort(key=operator.itemgetter(0))
        marks.sort(reverse=True)
        for row, codes, j, cpu_part in new:
            while marks and marks[-1][0] < row:
                self._code(marks.pop()[1])
            name = names[row]
            if cpu_part:
                codes[j] = self.cpu_codes[name] = self._code(f"cpu_op:{name}")
            else:
                codes[j] = self._code(name)
        for _, domain in reversed(marks):
            self._code(domain)
        for rows, codes, _ in pending:
            out[slice(None) if rows is None else rows] = np.array(codes, np.int32)
        return out

    # The replay: the per-event rules on generically decoded events (dicts).

    def add_events(self, events: list, offset: int = 0) -> None:
        cols = {t: {c: [] for c in names} for t, names in _COLUMNS.items()}
        try:
            self._replay(events, offset, cols)
        except Exception as exc:  # raised as it was, once the whole file is known valid JSON
            self.error = exc
            return
        for table, table_cols in cols.items():
            if table_cols["name"]:
                for col, values in table_cols.items():
                    segments = self.chunks[table][col]
                    if segments and isinstance(segments[-1], list):
                        segments[-1].extend(values)
                    else:
                        segments.append(values)

    def _replay(self, events: list, offset: int, cols: dict) -> None:
        code = self._code
        for i, e in enumerate(events, offset):
            if not isinstance(e, dict):
                self.non_objects += 1
                continue
            self.objects += 1
            if e.get("ph") == "M":
                self._name_process(e.get("name"), e.get("pid"), e.get("args"))
            if e.get("ph") != "X":
                continue
            cat = e.get("cat")
            try:
                if cat == "kernel":
                    args = _args(e)
                    self._gpu(cols["k"], e, args)
                elif cat in ("gpu_memcpy", "gpu_memset"):
                    args = _args(e)
                    self._gpu(cols["m"], e, args)
                    # (a size not given, or given as null: unknown, -1)
                    cols["m"]["bytes"].append(_int_arg(args, "bytes", null_ok=True) or -1)
                elif cat in _API_CATEGORIES:
                    args = _args(e)
                    a = cols["a"]
                    a["name"].append(code(_name(e)))
                    a["ts"].append(_time(e, "ts"))
                    a["dur"].append(_time(e, "dur"))
                    a["pid"].append(self._id(_num(e.get("pid")), "pid"))
                    a["tid"].append(self._id(_num(e.get("tid")), "tid"))
                    a["corr"].append(_int_arg(args, "correlation"))
                    a["kind"].append(_API_CATEGORIES[cat])
                elif cat in _CPU_RANGE_DOMAINS or cat == "gpu_user_annotation" or (
                        cat == "python_function" and isinstance(e.get("name"), str)
                        and e["name"].startswith(_MODULE_CALL_PREFIX)):
                    r = cols["r"]
                    domain = _CPU_RANGE_DOMAINS.get(cat, "")
                    name = _name(e)
                    r["name"].append(code(f"{domain}:{name}" if domain else name))
                    r["domain"].append(code(domain))
                    r["ts"].append(_time(e, "ts"))
                    r["dur"].append(_time(e, "dur"))
                    if cat == "gpu_user_annotation":
                        args = _args(e)
                        r["pid"].append(self._id(_num(e.get("pid")), "pid"))
                        r["tid"].append(-1)
                        r["device"].append(self._arg_id(args, "device", e, "pid"))
                        r["stream"].append(self._arg_id(args, "stream", e, "tid"))
                        r["style"].append(GPU_RANGE)
                    else:
                        r["pid"].append(self._id(_num(e.get("pid")), "pid"))
                        r["tid"].append(self._id(_num(e.get("tid")), "tid"))
                        r["device"].append(-1)
                        r["stream"].append(-1)
                        r["style"].append(PUSHPOP)
            except KeyError as exc:
                raise TraceError(self.path, f"event {i} ({cat}) is malformed: no {exc}") \
                    from None
            except (TypeError, ValueError) as exc:
                raise TraceError(self.path, f"event {i} ({cat}) is malformed: {exc}") from None

    def _name_process(self, event: Any, pid: Any, args: Any) -> None:
        """A ``process_name`` metadata event: the process's name (the first one said), where
        the pid is an id of its own (an int, or digits) and the name is text."""
        if event != "process_name":
            return
        if isinstance(pid, str):   # digits only: "²" is a digit but no int
            pid = int(pid) if re.fullmatch(r"-?[0-9]+", pid) else None
        if is_int64(pid) and isinstance(args, dict) and isinstance(
                name := args.get("name"), str) and name:
            self.process_names.setdefault(pid, name)

    def _gpu(self, cols: dict, e: dict, args: dict) -> None:
        cols["name"].append(self._code(_name(e)))
        cols["ts"].append(_time(e, "ts"))
        cols["dur"].append(_time(e, "dur"))
        cols["device"].append(self._arg_id(args, "device", e, "pid"))
        cols["stream"].append(self._arg_id(args, "stream", e, "tid"))
        cols["pid"].append(-1)  # the launching process comes from the API join below
        cols["corr"].append(_int_arg(args, "correlation"))

    def finish(self) -> Trace:
        """The four tables. Every table's times are checked first, then the tables are
        converted one by one (so the first problem reported is the same for any piece split);
        each column's chunks are dropped as soon as they are joined, so that memory peaks at
        about one copy of the columns."""
        chunks, self.chunks = self.chunks, {}
        release_free_memory()   # what decoding the pieces left: see kimi_perf/memory.py
        times = {name: self._floats({c: _joined(chunks[name].pop(c)) for c in ("ts", "dur")})
                 for name in ("a", "k", "m", "r")}
        firsts = [ts[0] for ts, _ in times.values() if len(ts)]
        base = int(min(firsts)) if firsts else 0
        # GPU work with a negative duration, or none, has no time (the nsys reader's rule):
        # left out and counted, not placed as a zero-length kernel; so is a range (a step
        # range of no time would hold no kernel, and its step be lost without a word).
        untimed = {name: times[name][1] < 0 for name in ("k", "m", "r")}
        duplicates = {"k": 0, "m": 0}
        tables = {}
        for name, kind in (("a", ApiCalls), ("k", Kernels), ("m", MemOps), ("r", Ranges)):
            cols = _to_ns(*times.pop(name), base)
            n = len(cols["start"])
            for col in list(chunks[name]):
                cols[_RENAMED.get(col, col)] = _joined(chunks[name].pop(col))
            if name in untimed and untimed[name].any():
                kept = ~untimed[name]
                cols = {col: values[kept] if isinstance(values, np.ndarray)
                        else list(compress(values, kept.tolist())) for col, values in cols.items()}
                n = int(kept.sum())
            table = kind.from_columns(cols, n, keep_int32=True)
            if kind in (Kernels, MemOps):
                table, duplicates[name] = _without_repeats(table)
            # Compacted once complete: GPU work after the launch join has set its pid and tid.
            tables[name] = table if kind in (Kernels, MemOps) else table.compact()
        api, kernels, memops, ranges = (tables[t] for t in ("a", "k", "m", "r"))
        for gpu_work in (kernels, memops):
            _link_by_correlation(api, gpu_work)
            gpu_work.compact()
        # Named: the processes that called the runtime or annotated. Kineto names the GPUs'
        # lanes (their pids the device ids) after the process too.
        launched = set(np.unique(api.pid).tolist()) | set(np.unique(
            ranges.pid[ranges.style != GPU_RANGE]).tolist())
        meta = {"format": "kineto-json", "processes": [
            {"pid": pid, "name": name} for pid, name in sorted(self.process_names.items())
            if pid in launched]}
        if untimed["k"].any() or untimed["m"].any():
            meta["untimed"] = {"kernels": int(untimed["k"].sum()),
                               "memops": int(untimed["m"].sum())}
        if untimed["r"].any():
            meta["untimed_ranges"] = int(untimed["r"].sum())
        if any(duplicates.values()):
            meta["duplicates"] = {"kernels": duplicates["k"], "memops": duplicates["m"]}
        return Trace(strings=self.strings, kernels=kernels, memops=memops,
                     ranges=ranges, api=api, meta=meta)

    def _floats(self, cols: dict) -> tuple[np.ndarray, np.ndarray]:
        try:
            ts = np.asarray(cols["ts"], dtype=np.float64)
            dur = np.asarray(cols["dur"], dtype=np.float64)
        except (TypeError, ValueError):
            raise TraceError(self.path, "non-numeric 'ts' or 'dur' in events") from None
        if not (np.isfinite(ts).all() and np.isfinite(dur).all()):
            raise TraceError(self.path, "non-finite 'ts' or 'dur' in events")
        # Keep every ns value (and differences of them) well inside int64.
        if len(ts) and max(np.abs(ts).max(), np.abs(dur).max()) > 2**61 / 1000:
            raise TraceError(self.path, "'ts' or 'dur' out of range")
        return ts, dur


def _without_repeats(gpu_work: Kernels | MemOps) -> tuple[Kernels | MemOps, int]:
    """GPU work less the rows that repeat an earlier row in every column (name, times,
    device, stream, correlation, bytes), and how many: one kernel recorded twice (a trace
    merged or written twice) ran once, and counted twice it would add time the GPU never
    spent. Only rows sharing a start with another are compared: usually few. Work of no
    duration is kept whatever repeats it: a trace in whole microseconds writes two short
    launches of one kernel from one graph replay (one correlation) alike."""
    start = gpu_work.start
    if len(start) < 2:
        return gpu_work, 0
    step = np.diff(start)
    if (step > 0).all():    # in time order with no two at one start (no sort needed)
        return gpu_work, 0
    order = np.argsort(start, kind="stable") if (step < 0).any() else np.arange(len(start))
    del step
    ordered = start[order]
    tie = ordered[1:] == ordered[:-1]
    if not tie.any():
        return gpu_work, 0
    tied = np.zeros(len(start), bool)
    tied[1:] = tie
    tied[:-1] |= tie
    rows = np.sort(order[tied])
    rows = rows[gpu_work.end[rows] > start[rows]]
    if len(rows) < 2:
        return gpu_work, 0
    columns = [values[rows] for values in gpu_work.columns().values()]
    # Sorted by every column, then by row: each repeat right after the first of its kind.
    by = np.lexsort([rows, *columns[::-1]])
    same = np.ones(len(by) - 1, bool)
    for values in columns:
        values = values[by]
        same &= values[1:] == values[:-1]
    if not same.any():
        return gpu_work, 0
    kept = np.ones(len(start), bool)
    kept[rows[by[1:][same]]] = False
    n = int(kept.sum())
    table = type(gpu_work).from_columns(
        {name: values[kept] for name, values in gpu_work.columns().items()}, n, keep_int32=True)
    return table, len(start) - n


def _range_columns(ev: list, cat: np.ndarray) -> dict[str, np.ndarray]:
    pid = _ints([e.pid for e in ev])
    tid = _ints([e.tid for e in ev])
    gpu = cat == _GPU_RANGE
    device = np.full(len(ev), -1, np.int32)
    stream = np.full(len(ev), -1, np.int64)
    if gpu.any():
        gev = _select(ev, gpu)
        args = _args_of(gev)
        device[gpu] = _int32(_ids([a.device for a in args], gev, _pid))
        stream[gpu] = _ids([a.stream for a in args], gev, _tid)
        tid = np.where(gpu, -1, tid)
    style = np.where(gpu, GPU_RANGE, PUSHPOP).astype(np.int8)
    return {"pid": pid, "tid": tid, "device": device, "stream": stream, "style": style}


def _select(events: list, mask: np.ndarray) -> list:
    return events if mask.all() else list(compress(events, mask.tolist()))


def _args_of(events: list) -> list[_Args]:
    args = [e.args for e in events]
    if None in args:
        args = [a if a is not None else _NO_ARGS for a in args]
    return args


def _ints(values: list) -> np.ndarray:
    """Plain ints that fit int64 as an array; anything else (a label, None, a huge id) is for
    the replay, whose rules differ per type."""
    if not values:
        return np.empty(0, np.int64)
    try:
        arr = np.array(values)
    except (TypeError, ValueError, OverflowError):
        raise _Slow from None
    if arr.dtype != np.int64 or arr.ndim != 1:
        raise _Slow
    return arr


def _ids(values: list, events: list, fallback) -> np.ndarray:
    """An ``args`` id column where a missing value falls back to the event's pid/tid."""
    try:
        return _ints(values)
    except _Slow:
        if msgspec.UNSET not in values:
            raise
    return _ints([fallback(e) if v is msgspec.UNSET else v
                  for v, e in zip(values, events, strict=True)])


def _int32(values: np.ndarray) -> np.ndarray:
    if len(values) and (values.min() < -(2**31) or values.max() >= 2**31):
        raise _Slow  # the event-by-event path reports the value that does not fit
    return values.astype(np.int32)


def _time(event: dict, key: str) -> int | float:
    """``ts`` (required) or ``dur`` (-1, no time, when absent) of a replayed event: a JSON
    number, as the fast path's typed decoding takes it (a boolean or a numeric string is no
    time)."""
    value = _num(event[key] if key == "ts" else event.get(key, -1))
    if type(value) not in (int, float):
        raise TypeError(f"'{key}' is {_shown(value)}, not a number")
    return value


def _name(event: dict) -> str:
    """A replayed event's ``name``: text ("" when absent; null or a number is no name, which
    a table would show as "None" or "5")."""
    value = event.get("name", "")
    if not isinstance(value, str):
        raise TypeError(f"'name' is {_shown(value)}, not text")
    return value


def _args(event: dict) -> dict:
    """A replayed event's ``args``: an object, or none (absent, null or empty)."""
    args = _num(event.get("args"))
    if not args:
        return {}
    if not isinstance(args, dict):
        raise TypeError(f"'args' is {_shown(args)}, not an object")
    return args


def _int_arg(args: dict, key: str, null_ok: bool = False) -> int:
    """``args[key]`` (-1 when absent, and with ``null_ok`` when null or empty) as an
    integer: a correlation id or a byte count."""
    value = _num(args.get(key, -1))
    if null_ok and value in (None, ""):
        return -1
    try:
        if isinstance(value, float) and not value.is_integer():   # (int() would cut it)
            raise ValueError
        return int(value)
    except (TypeError, ValueError, OverflowError):  # a list, a label, an infinite float
        raise ValueError(f"'args.{key}' is {_shown(value)}, not an integer") from None


def _shown(value) -> str:
    """A value as an error message quotes it: as the JSON holds it (null, "10"), cut short."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):   # (not JSON's: shown as Python has it)
        text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _num(value):
    """A JSON integer outside int64/uint64 as a float, the way a generic JSON decoder gives
    it, so that replayed events read as the fast path would."""
    if type(value) is int and not -(2**63) <= value < 2**64:
        return float(value)
    return value


class _Growing:
    """A column that doubles its capacity as pieces come in: no per-piece arrays are left
    behind, capacity not yet written is never touched (so never resident), and the finished
    column is trimmed in place instead of copied. Integer ids are kept as int32 until a value
    needs int64 (the tables narrow them so anyway)."""

    __slots__ = ("data", "n")

    def __init__(self, values: np.ndarray):
        self.data = np.array(_narrow(values))
        self.n = len(values)

    def extend(self, values: np.ndarray) -> None:
        values = _narrow(values)
        need = self.n + len(values)
        wider = np.result_type(self.data.dtype, values.dtype)
        if need > len(self.data) or wider != self.data.dtype:
            grown = np.empty(max(need, 2 * len(self.data)), wider)
            grown[:self.n] = self.data[:self.n]
            self.data = grown
        self.data[self.n:need] = values
        self.n = need

    def array(self) -> np.ndarray:
        if len(self.data) != self.n:
            self.data.resize(self.n, refcheck=False)
        return self.data


def _narrow(values: np.ndarray) -> np.ndarray:
    return compact_ints(values) if values.dtype == np.int64 else values


def _joined(segments: list):
    """A column from its segments: one array, or (after a replayed piece) one list of plain
    values, converted and checked all together."""
    if not segments:
        return []
    if len(segments) == 1 and isinstance(segments[0], _Growing):
        return segments[0].array()
    return list(chain.from_iterable(s.array().tolist() if isinstance(s, _Growing) else s
                                    for s in segments))


def _to_ns(ts: np.ndarray, dur: np.ndarray, base: int) -> dict[str, np.ndarray]:
    """µs (int or float) -> int64 ns, exact for integers and to the ns for floats: offsets
    from a common integer base keep float64 precise at epoch-sized timestamps. ``ts`` and
    ``dur`` are used up (scaled in place: no float copies of the largest columns). A negative
    ``dur`` (an API call's: GPU work's and ranges' are left out before) ends where it
    starts."""
    ts -= base
    ts *= 1000.0
    start = np.rint(ts, out=ts).astype(np.int64)
    del ts
    start += base * 1000
    np.maximum(dur, 0, out=dur)
    dur *= 1000.0
    end = np.rint(dur, out=dur).astype(np.int64)
    end += start
    return {"start": start, "end": end}


def _link_by_correlation(api: ApiCalls, gpu_work) -> None:
    """Kineto GPU events carry no process id: the correlation id alone names the launch."""
    found = _rows_by_correlation(api.correlation, gpu_work.correlation)
    gpu_work.api = found
    if len(api) == 0:   # a trace of GPU activity alone: nothing to take pids from
        return
    hit = found >= 0
    row = np.where(hit, found, 0)
    # np.where takes the wider dtype: an int32 column widens for pids beyond int32.
    gpu_work.pid = np.where(hit, api.pid[row], gpu_work.pid)
    gpu_work.tid = np.where(hit, api.tid[row], gpu_work.tid)


def _rows_by_correlation(api_corr: np.ndarray, corr: np.ndarray) -> np.ndarray:
    """Per correlation id, the first API row with it, or -1 (``find_launches`` on the
    correlation alone, without its (process, correlation) keys)."""
    if len(api_corr) == 0:
        return np.full(len(corr), -1, np.int64)
    order = np.argsort(api_corr, kind="stable").astype(index_dtype(len(api_corr)))
    sorted_corr = api_corr[order]
    pos = np.minimum(np.searchsorted(sorted_corr, corr), len(sorted_corr) - 1)
    hit = (sorted_corr[pos] == corr) & (corr >= 0)
    return np.where(hit, order[pos], -1)


def _int_or_none(value) -> int | None:
    return value if is_int64(value) else None


def _metadata(doc: dict, path: Path, hip_calls: bool = False) -> dict:
    """What the trace says of itself (``hip_calls``: its runtime calls are HIP's). Nothing of
    the analysis depends on it, so a field of another type than Kineto writes is left out, not
    an error: a GPU without an integer id, a name that is not text, an SM count that is not a
    count."""
    gpus = []
    props = doc.get("deviceProperties")
    for prop in props if isinstance(props, list) else []:
        if isinstance(prop, dict) and (device := _int_or_none(prop.get("id"))) is not None:
            name, sms = prop.get("name"), _int_or_none(prop.get("numSms"))
            gpus.append({"device": device, "name": name if isinstance(name, str) else "",
                         "sm_count": sms if sms is not None and sms >= 0 else None})
    rocm = hip_calls or "roctracer_version" in doc or "hip_runtime_version" in doc
    schema = doc.get("schemaVersion")   # (Kineto writes an integer; anything else unsaid)
    meta = {
        "tool": "PyTorch profiler (Kineto" + (", ROCm" if rocm else "") + ")",
        "schema": str(schema) if type(schema) in (int, str) else None,
        "file": str(path), "gpus": gpus,
    }
    dist = doc.get("distributedInfo")
    if isinstance(dist, dict) and "rank" in dist:
        meta["rank"] = _int_or_none(dist.get("rank"))
        meta["world_size"] = _int_or_none(dist.get("world_size"))
    return meta
