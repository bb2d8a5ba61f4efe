"""Split a trace into steps, and each step into a prologue, N layers and an epilogue.

Steps come from step ranges (``decode_step[i]``, ``ProfilerStep#N``, vLLM's ``execute_...``
annotation), else from CUDA/HIP graph launches when graphs carry the GPU work, else one step per
device (``_device_steps``), or per forward pass where its layers show it ran the model several times
(``passes_from_layer_cycle``). Layers come from per-layer ranges (``layer[3]``, ``layers.3``,
``DecoderLayer_3``...) or, when none exist (unannotated traces), from the repeating kernel
pattern of each step (``find_repeats``). A kernel replayed from a graph whose capture the trace
holds is placed in the ranges open at its capture (``kimi_perf.graphs``).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise
from typing import NamedTuple

import numpy as np

from kimi_perf.classify import Rule, classify, default_rules, layout_class_name, load_rules
from kimi_perf.errors import COMMAND_LINE, NoStepsMatched, argument
from kimi_perf.graphs import GRAPH_LAUNCH, capture_launches, capture_memory_calls
from kimi_perf.memory import release_free_memory
from kimi_perf.nesting import innermost_containing, range_groups, thread_keys
from kimi_perf.text import counted
from kimi_perf.trace import GPU_RANGE, Trace, index_dtype

# Tried in order; the first pattern that matches a range holding GPU work defines the steps.
STEP_PATTERNS = [
    r"^decode_step\[(?P<index>\d+)\]",
    r"^(?:decode_)?step[\[_ #]?(?P<index>\d+)\]?$",
    # vLLM's per-step annotation: execute_context_0(0)_generation_32(32), i.e. no prefill
    # request and 32 decode requests (older builds: execute_32_context_0(...)_generation_32(...),
    # or execute_new_0_cached_32)
    r"^execute_(?:\d+_)?context_\d+",
    r"^execute_new_\d+_cached_\d+",
    r"^execute_model",
    # The root module's call under vLLM's, SGLang's or TensorRT-LLM's layerwise NVTX markers
    # (a module path without a dot): one forward pass.
    r"^\{'Module': '[^'.]*'[,}]",
    r"^ProfilerStep#(?P<index>\d+)$",
]

# vLLM's annotation counts the step's prefill ("context") and decode ("generation") requests.
_VLLM_STEP_REQUESTS = re.compile(r"^execute_(?:\d+_)?context_(\d+)\b.*_generation_(\d+)")
# Older builds: execute_new_N_cached_M, N requests scheduled for the first time (prefilling)
# and M already running (decoding, or a later chunk of a chunked prefill: not said).
_VLLM_NEW_CACHED = re.compile(r"^execute_new_(\d+)_cached_(\d+)")
PHASES = ("auto", "decode", "prefill", "mixed", "all")


def step_phase(name: str) -> str | None:
    """``decode``, ``prefill`` or ``mixed`` where a step's name says which (vLLM's
    annotation, our ``decode_step[i]``); None where it does not."""
    if name.startswith("decode_step["):
        return "decode"
    if (old := _VLLM_NEW_CACHED.match(name)) is not None:
        new, cached = int(old[1]), int(old[2])
        return ("mixed" if new and cached else "prefill") if new else None
    m = _VLLM_STEP_REQUESTS.match(name)
    if m is None:
        return None
    prefill, decode = int(m[1]), int(m[2])
    return ("mixed" if prefill and decode else "prefill" if prefill
            else "decode" if decode else None)


def decode_requests(name: str) -> int | None:
    """The decode requests a step's name says it ran (vLLM's ``..._generation_32``: 32, and 0
    for a step that prefills alone; our ``decode_step[i]`` does not say: its run.json has the
    batch); None where the name says nothing of them."""
    m = _VLLM_STEP_REQUESTS.match(name)
    return int(m[2]) if m is not None else None


def steps_of_phase(steps: list[Step], phase: str = "auto", file: str | None = None
                   ) -> tuple[list[Step], dict[str, int]]:
    """The steps of one phase, and how many steps of each other phase were left out
    ("unknown": a step whose name does not say its phase).

    ``auto``: the decode steps where some steps are decode and others prefill or mixed (a
    prefill step runs other kernels for longer: medians over both describe neither), else
    every step. ``all``: every step. ``decode``, ``prefill``, ``mixed``: those steps; none is
    an error naming the phases the trace has."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}: use {', '.join(PHASES)}")
    phases = [step_phase(step.name) for step in steps]
    if phase == "all" or (phase == "auto" and not (
            "decode" in phases and ({"prefill", "mixed"} & set(phases)))):
        return steps, {}
    wanted = "decode" if phase == "auto" else phase
    kept = [step for step, p in zip(steps, phases, strict=True) if p == wanted]
    left_out = Counter(p or "unknown" for p in phases if p != wanted)
    asked, every = argument("--phase", "phase", phase), argument("--phase", "phase", "all")
    if not steps:
        raise NoStepsMatched(file, f"{asked}: the trace has no steps")
    if not kept and steps[0].found_by == "device":
        raise NoStepsMatched(file, f"{asked}: the trace has no step ranges or graph launches "
                                   "(each device's work is one step, cut into forward passes "
                                   "where its layers repeat), so no step says its phase; "
                                   f"{every} takes every step")
    if not kept:
        said = ", ".join(f"{n} {p}" for p, n in left_out.most_common())
        hint = (f": their names (such as {steps[0].name!r}) do not say their phase"
                if set(left_out) == {"unknown"} else "")
        found = counted(len(steps), "step")
        raise NoStepsMatched(file, f"{asked}: no {phase} step among the {found} found "
                                   f"({said}){hint}; {every} takes every step")
    return kept, dict(left_out.most_common())


# One regex for the common per-layer spellings: layer[3], layer_3, layers.3, model.layers.3,
# DecoderLayer_3, TransformerBlock_3, with an optional type: "layer[3](kda)", "layer[3] mla",
# "layer[3]:kda"; the layerwise NVTX markers of vLLM, SGLang and TensorRT-LLM, a dict whose
# 'Module' is the module's path ("{'Module': 'top.model.layers.3', 'Inputs': [[1, 7168]]}");
# and a module call as the PyTorch profiler names it ("nn.Module: KimiK3DecoderLayer_3"),
# whose number counts that class's modules in call order, not the layers, so the layer's
# place in its step is its index. Sub-modules ("layers.3.mlp") do not match. Group names
# that start with "index" and "type" give the layer's index and type.
DEFAULT_LAYER_PATTERN = (
    r"^(?:[\w.]*\.)?(?:\w*DecoderLayer|\w*TransformerBlock|layers?)"
    r"(?:\[(?P<index>\d+)\]|[._ ](?P<index2>\d+))"
    r"(?:\s*[(:]\s*(?P<type>[A-Za-z][\w-]*)\)?|\s+(?P<type2>[A-Za-z][\w-]*))?$"
    r"|^\{'Module': '(?:[^']*\.)?layers?\.(?P<index3>\d+)'[,}]"
    r"|^nn\.Module: \w*(?:DecoderLayer|TransformerBlock)_\d+$"
)

# Range names that look like a layer's but that DEFAULT_LAYER_PATTERN does not take: another
# case ("Layer 3"), a type of other characters ("layer[3](moe.shared)"). A trace whose layers
# then come from the kernel pattern says so; sub-modules ("layers.3.mlp") are no layers.
LAYER_LIKE = re.compile(r"^(?:[\w.]*\.)?(?:\w*decoderlayer|\w*transformerblock|layers?|blocks?)"
                        r"(?:\[\d+\]|[._ ]?\d+)(?!\w|\.\w)", re.IGNORECASE)


def layer_like_ranges(trace: Trace, most: int = 3) -> dict | None:
    """The range names that look like layers but that the default layer pattern does not
    take (``LAYER_LIKE``): the first ``most`` and how many; None where there are none."""
    codes = np.unique(trace.ranges.name)
    codes = codes[~trace.names_matching(_compiled(DEFAULT_LAYER_PATTERN, "the layer regex"))[codes]]
    # Only the ranges' names: a trace's strings are mostly kernel names, which are no layers.
    codes = codes[np.fromiter((LAYER_LIKE.search(trace.strings[c]) is not None
                               for c in codes.tolist()), bool, count=len(codes))]
    if not len(codes):
        return None
    return {"names": [trace.strings[c] for c in codes[:most].tolist()], "count": len(codes)}


@dataclass
class GpuOps:
    """The operations a breakdown counts, in one table.

    Normally the GPU work: kernels, then memcpy/memset (``kind == "gpu"``). A trace with no GPU
    work at all (a decode run on a CPU) counts its ``op:<name>`` ranges instead, the launches
    the decode paths annotate (``kind == "cpu-ops"``): the same sequence the GPU would run,
    timed on the CPU.
    """

    name: np.ndarray
    start: np.ndarray
    end: np.ndarray
    device: np.ndarray
    stream: np.ndarray           # -1 for CPU ops
    pid: np.ndarray
    tid: np.ndarray
    api: np.ndarray
    launch_start: np.ndarray     # the launching call's span (the op itself for CPU ops)
    launch_end: np.ndarray
    # Where the op's layer ranges are looked up: the launching call, or for a kernel replayed
    # from a graph the call that captured it (-1 row: nowhere).
    scope_api: np.ndarray
    scope_start: np.ndarray
    scope_end: np.ndarray
    scope_tid: np.ndarray
    kernel_class: np.ndarray     # codes into class_labels
    class_labels: list[str]
    # The classes the layer finder reads (``layout_class_name``): a rule's class of one's own
    # relabels the figures, not the layers' cuts.
    layout_class: np.ndarray
    layout_labels: list[str]
    kind: str = "gpu"

    @classmethod
    def of(cls, trace: Trace, rules: list[Rule] | None = None) -> GpuOps:
        rules = rules if rules is not None else load_rules()
        k, m = trace.kernels, trace.memops
        if len(k) + len(m) == 0:
            cpu = cls._cpu_ops(trace, rules)
            if cpu is not None:
                return cpu

        def cat(columns: list[np.ndarray]) -> np.ndarray:
            # Most traces have no memops: then the kernels' columns serve as they are.
            return columns[0] if len(m) == 0 else np.concatenate(columns)

        names = cat([k.name, m.name])
        api = cat([k.api, m.api])
        kernel_class, labels = classify(names, trace.strings, rules)
        layout_class, layout_labels = _layout_classes(names, trace.strings, rules,
                                                      kernel_class, labels)
        tid = cat([k.tid, m.tid])
        launch_start, launch_end = _call_spans(trace, api)
        captured = capture_launches(trace)
        if (captured < 0).all():  # no graph replay with its capture: the same arrays serve
            scope_api, scope_start, scope_end, scope_tid = api, launch_start, launch_end, tid
        else:
            captured = cat([captured, capture_memory_calls(trace, captured)])
            is_captured = captured >= 0
            scope_api = np.where(is_captured, captured, api)
            scope_start, scope_end = _call_spans(trace, scope_api)
            scope_tid = np.where(is_captured, trace.api.tid[np.where(is_captured, scope_api, 0)],
                                 tid)
        return cls(name=names, start=cat([k.start, m.start]), end=cat([k.end, m.end]),
                   device=cat([k.device, m.device]), stream=cat([k.stream, m.stream]),
                   pid=cat([k.pid, m.pid]), tid=tid,
                   api=api, launch_start=launch_start, launch_end=launch_end,
                   scope_api=scope_api, scope_start=scope_start, scope_end=scope_end,
                   scope_tid=scope_tid, kernel_class=kernel_class, class_labels=labels,
                   layout_class=layout_class, layout_labels=layout_labels)

    @classmethod
    def _cpu_ops(cls, trace: Trace, rules: list[Rule]) -> GpuOps | None:
        r = trace.ranges
        rows = trace.annotated_ops()
        if len(rows) == 0:
            return None
        # Op names without their "op:" prefix, appended to the trace's string table.
        index = {v: i for i, v in enumerate(trace.strings)}
        op_names, of_row = np.unique(r.name[rows], return_inverse=True)
        bare_codes = np.empty(len(op_names), np.int32)
        for i, code in enumerate(op_names.tolist()):   # a name at a time, not an op
            bare = trace.strings[code][3:]
            if bare not in index:
                index[bare] = len(trace.strings)
                trace.strings.append(bare)
            bare_codes[i] = index[bare]
        stripped = bare_codes[of_row]
        kernel_class, labels = classify(stripped, trace.strings, rules)
        layout_class, layout_labels = _layout_classes(stripped, trace.strings, rules,
                                                      kernel_class, labels)
        return cls(name=stripped, start=r.start[rows], end=r.end[rows],
                   device=np.full(len(rows), -1, np.int32),
                   stream=np.full(len(rows), -1, np.int64), pid=r.pid[rows], tid=r.tid[rows],
                   api=rows.astype(np.int64), launch_start=r.start[rows],
                   launch_end=r.end[rows], scope_api=rows.astype(np.int64),
                   scope_start=r.start[rows], scope_end=r.end[rows], scope_tid=r.tid[rows],
                   kernel_class=kernel_class, class_labels=labels, layout_class=layout_class,
                   layout_labels=layout_labels, kind="cpu-ops")

    def __len__(self) -> int:
        return len(self.name)


def _layout_classes(names: np.ndarray, strings: list[str], rules: list[Rule],
                    kernel_class: np.ndarray, labels: list[str]) -> tuple[np.ndarray, list[str]]:
    """``GpuOps.layout_class``: under the default rules, the kernel classes themselves."""
    if rules == default_rules():
        return kernel_class, labels
    return classify(names, strings, rules, layout_class_name)


def _call_spans(trace: Trace, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and end of API calls by row (0 where the row is -1)."""
    if not len(trace.api):
        return np.zeros(len(rows), np.int64), np.zeros(len(rows), np.int64)
    ok = rows >= 0
    row = np.where(ok, rows, 0)
    return np.where(ok, trace.api.start[row], 0), np.where(ok, trace.api.end[row], 0)


@dataclass
class Layer:
    index: int
    ops: np.ndarray           # rows of GpuOps, in GPU start order
    type: str = ""
    lettered: bool = False    # its type a letter for its kernel sequence (``assign_types``)


@dataclass
class Step:
    index: int
    device: int
    pid: int
    name: str
    ops: np.ndarray
    prologue: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    epilogue: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    layers: list[Layer] = field(default_factory=list)
    layer_source: str = "none"   # "nvtx", "repeat" or "none"
    # Per op of the step: launched from another thread while the step's range was open (None:
    # none was). Counted in the step; the layers come from the step range's own thread.
    borrowed: np.ndarray | None = None
    # What made it a step: a "range", a "graph" launch, or with neither, a whole "device" or
    # one forward "pass" of the device's
    found_by: str = "range"
    range_row: int = -1          # the step's range (a row of trace.ranges; -1: none)
    # Other steps' ranges inside this step's range (an outer range the step regex matched too,
    # "Benchmark Forward Only" around each "Forward"): the step holds only the ops between them.
    encloses: int = 0

    @property
    def other_thread_ops(self) -> int:
        return 0 if self.borrowed is None else int(self.borrowed.sum())


# -- steps -------------------------------------------------------------------------------------

def find_steps(trace: Trace, ops: GpuOps, step_regex: str | None = None) -> list[Step]:
    if step_regex == "":   # (read as none, it gave the default's steps without a word)
        raise ValueError("step_regex: an empty regex finds every range: name the step "
                         "ranges, or None for the default's")
    if step_regex is not None and _compiled(step_regex, "step_regex").search(""):
        raise ValueError(f"step_regex {step_regex!r} matches an empty name, so every range: "
                         "name the step ranges")   # ('.*': every op range a step)
    patterns = [step_regex] if step_regex is not None else STEP_PATTERNS
    launch_start, launch_end = ops.launch_start, ops.launch_end
    keys = thread_keys(ops.pid, np.where(ops.api >= 0, ops.tid, -1))
    range_keys = range_groups(trace.ranges)
    range_keys[trace.ranges.style == GPU_RANGE] = -1
    for pattern in patterns:
        regex = _compiled(pattern, "step_regex")
        matching = trace.names_matching(regex)[trace.ranges.name] if len(trace.ranges) else \
            np.zeros(0, bool)
        if not matching.any():
            continue
        rkeys = np.where(matching, range_keys, -1)
        # A nested step range of the same pattern: the innermost (latest start) holds the op.
        owner = innermost_containing(trace.ranges, rkeys, keys, launch_start, launch_end,
                                     trace.ranges.start)
        del rkeys
        if not (owner >= 0).any():
            continue
        owners = np.unique(owner[owner >= 0])
        encloses = _enclosed_counts(trace.ranges, range_keys[owners], owners)
        del keys, range_keys  # before the steps' own arrays
        borrowed = _other_thread_owners(trace, ops, matching, owner, launch_start, launch_end)
        op_rows = np.flatnonzero(owner >= 0).astype(index_dtype(len(ops)))
        steps = _steps_from_groups(trace, ops, owner[op_rows], op_rows)
        for step in steps:
            step.encloses = encloses.get(step.range_row, 0)
        if borrowed.any():
            for step in steps:
                mine = borrowed[step.ops]
                step.borrowed = mine if mine.any() else None
        return steps
    if step_regex:
        raise NoStepsMatched(trace.meta.get("file"),
                             "no range matching "
                             + (f"--steps '{step_regex}'" if COMMAND_LINE.get()
                                else f"step_regex={step_regex!r}") + " holds a kernel launch")
    graph_steps = _graph_launch_steps(trace, ops)
    if graph_steps:
        return graph_steps
    return _device_steps(ops)


# Ranges that name an operation, not a region of the program: no answer to "where did it run".
_OP_RANGE = re.compile(r"^(?:cpu_)?op:")


def outermost_ranges(trace: Trace, ops: GpuOps, rows: np.ndarray, most: int = 3
                     ) -> list[dict]:
    """Where these ops were launched: the outermost range of the launching thread around
    each (not an operator's own range), counted by name with step numbers folded
    (``warmup_step[…]``), the most ops first; ``None`` for the ops in no range."""
    return ranges_named(trace, outermost_names(trace, ops, rows), most)


def outermost_names(trace: Trace, ops: GpuOps, rows: np.ndarray) -> np.ndarray:
    """Per op of ``rows``, the name code of the outermost range of the launching thread
    around its launch (not an operator's own range), -1 for none."""
    if not len(rows) or not len(trace.ranges):
        return np.full(len(rows), -1, np.int64)
    launch_start, launch_end = ops.launch_start, ops.launch_end
    keys = thread_keys(ops.pid[rows], np.where(ops.api[rows] >= 0, ops.tid[rows], -1))
    r = trace.ranges
    range_keys = range_groups(r)
    region = ~trace.names_matching(_OP_RANGE)[r.name] & (r.style != GPU_RANGE)
    range_keys[~region] = -1
    owner = innermost_containing(r, range_keys, keys, launch_start[rows], launch_end[rows],
                                 -r.depth.astype(np.int64))
    return np.where(owner >= 0, r.name[np.maximum(owner, 0)], -1).astype(np.int64)


def ranges_named(trace: Trace, codes: np.ndarray, most: int = 3) -> list[dict]:
    """``outermost_names``' codes counted by name, step numbers folded, the most first."""
    named: Counter = Counter()
    for code, n in zip(*np.unique(codes, return_counts=True), strict=True):
        named[None if code < 0 else fold_numbers(trace.strings[code])] += int(n)
    return [{"range": name, "ops": n} for name, n in named.most_common(most)]


def fold_numbers(name: str) -> str:
    """A range name with its step number folded (``warmup_step[…]``, ``ProfilerStep#…``)."""
    return re.sub(r"\[\d+\]", "[…]", re.sub(r"#\d+", "#…", name))


def _enclosed_counts(ranges, keys: np.ndarray, rows: np.ndarray) -> dict[int, int]:
    """Of these step ranges (rows, with their thread keys), the ones holding others of them
    whole on their thread: row -> how many (start-end ranges that merely overlap hold none)."""
    out: dict[int, int] = {}
    order = np.lexsort((-ranges.end[rows], ranges.start[rows], keys))
    rows, keys = rows[order], keys[order]
    cuts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1], True])
    for lo, hi in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True):
        starts, ends = ranges.start[rows[lo:hi]], ranges.end[rows[lo:hi]]
        # the ranges after one in start order that start before it ends: inside it if they
        # also end by its end
        later = np.searchsorted(starts, ends, side="left")
        for i in np.flatnonzero(later > np.arange(1, hi - lo + 1)).tolist():
            n = int((ends[i + 1: later[i]] <= ends[i]).sum())
            if n:
                out[int(rows[lo + i])] = n
    return out


def _other_thread_owners(trace: Trace, ops: GpuOps, matching: np.ndarray, owner: np.ndarray,
                         launch_start: np.ndarray, launch_end: np.ndarray) -> np.ndarray:
    """Ops that no step range of their own thread holds, launched from another thread of the
    process while one of its step ranges was open (a training run's autograd thread, a
    scheduler that annotates steps while a worker thread launches): ``owner`` takes that
    range. Only where a process's step ranges do not overlap, so that the window is one
    step's. Returns the mask of the ops so placed."""
    borrowed = np.zeros(len(ops), bool)
    r = trace.ranges
    step_rows = np.flatnonzero(matching & (r.style != GPU_RANGE) & (r.pid >= 0))
    # with a launching call: a kernel whose call the trace lost has only its GPU time, which
    # may fall in a later step's window
    loose = np.flatnonzero((owner < 0) & (ops.pid >= 0) & (ops.api >= 0))
    if len(step_rows) == 0 or len(loose) == 0:
        return borrowed
    for pid in np.unique(r.pid[step_rows]).tolist():
        rows = step_rows[r.pid[step_rows] == pid]
        rows = rows[np.argsort(r.start[rows], kind="stable")]
        starts, ends = r.start[rows], r.end[rows]
        if (ends[:-1] > starts[1:]).any():
            continue  # overlapping steps (several threads annotate them): no single window
        mine = loose[ops.pid[loose] == pid]
        at = np.searchsorted(starts, launch_start[mine], side="right") - 1
        inside = (at >= 0) & (ends[np.maximum(at, 0)] >= launch_end[mine])
        owner[mine[inside]] = rows[at[inside]]
        borrowed[mine[inside]] = True
    return borrowed


def _steps_from_groups(trace: Trace, ops: GpuOps, group: np.ndarray, op_rows: np.ndarray,
                       names: dict[int, str] | None = None) -> list[Step]:
    """Steps from (group id, op row) pairs, split by device, ordered by first GPU start."""
    steps = []
    order = np.lexsort((ops.start[op_rows], ops.device[op_rows], group)).astype(op_rows.dtype)
    g, rows = group[order], op_rows[order]
    del order
    dev = ops.device[rows]
    cut = np.flatnonzero(np.r_[True, (g[1:] != g[:-1]) | (dev[1:] != dev[:-1])])
    bounds = np.r_[cut, len(rows)]
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        members = rows[lo:hi]
        gid = int(g[lo])
        label = names.get(gid, "") if names else trace.strings[trace.ranges.name[gid]]
        steps.append(Step(index=0, device=int(dev[lo]), pid=int(ops.pid[members[0]]),
                          name=label, ops=members, range_row=-1 if names else gid))
    steps.sort(key=lambda s: (s.device, int(ops.start[s.ops[0]])))
    _number_per_device(steps)
    return steps


def _graph_launch_steps(trace: Trace, ops: GpuOps) -> list[Step]:
    """One step per graph launch, where graph launches carry (nearly) all the GPU work."""
    if len(trace.api) == 0 or len(ops) == 0 or ops.kind != "gpu":
        return []
    is_graph = trace.names_matching(GRAPH_LAUNCH)[trace.api.name]
    launched = ops.api >= 0
    in_graph = np.zeros(len(ops), bool)
    in_graph[launched] = is_graph[ops.api[launched]]
    if in_graph.sum() < 0.9 * len(ops):
        return []
    rows = np.flatnonzero(in_graph)
    names = {int(a): trace.strings[trace.api.name[a]] for a in np.unique(ops.api[rows])}
    steps = _steps_from_groups(trace, ops, ops.api[rows], rows, names)
    for step in steps:
        step.found_by = "graph"
    return steps


def _device_steps(ops: GpuOps) -> list[Step]:
    """A step per device, or per process on a device that several processes' work shares
    (their kernels interleave: one step of both would hold neither's layers). Work whose
    process the trace does not know (pid -1: a Kineto kernel launched before the profiler's
    window) goes with the device's process that ran the most."""
    if len(ops) == 0:
        return []
    steps = []
    for dev in np.unique(ops.device).tolist():
        on_device = np.flatnonzero(ops.device == dev)
        pid_of = ops.pid[on_device]
        known, counts = np.unique(pid_of[pid_of >= 0], return_counts=True)
        if len(known) < 2:
            groups = [(None, on_device)]
        else:
            most = known[np.argmax(counts)]
            groups = [(int(pid), on_device[(pid_of == pid) | ((pid_of < 0) & (pid == most))])
                      for pid in known.tolist()]
        for pid, rows in groups:
            rows = rows[np.argsort(ops.start[rows], kind="stable")]
            # (its process, not that of its first op: work of no known process may come first)
            steps.append(Step(index=0, device=dev,
                              pid=pid if pid is not None else int(known[0]) if len(known) else -1,
                              name=f"device {dev}" + (f" pid {pid}" if pid is not None else ""),
                              ops=rows, found_by="device"))
    steps.sort(key=lambda s: (s.device, int(ops.start[s.ops[0]])))
    _number_per_device(steps)
    return steps


def _number_per_device(steps: list[Step]) -> None:
    """Each step's index: its place among its device's steps, in the list's order."""
    per_device: Counter = Counter()
    for s in steps:
        s.index = per_device[s.device]
        per_device[s.device] += 1


# -- layers from ranges -------------------------------------------------------------------------

def _compiled(pattern: str, what: str) -> re.Pattern:
    """A regex the caller gave, or a ValueError that says which and why (not re.error)."""
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"{what}: bad regex {pattern!r} ({exc})") from None


def layers_from_ranges(trace: Trace, ops: GpuOps, steps: list[Step], layer_regex: str) -> bool:
    """Assign each op to its innermost matching layer range; fill ``steps[*].layers``.

    Returns False when no layer range holds any GPU work.
    """
    regex = _compiled(layer_regex, "the layer regex")
    r = trace.ranges
    if len(r) == 0:
        return False
    matching = trace.names_matching(regex)[r.name]
    rkeys = np.where(matching & (r.style != GPU_RANGE), range_groups(r), -1)
    keys = thread_keys(ops.pid, np.where(ops.scope_api >= 0, ops.scope_tid, -1))
    # Each op's innermost layer range.
    layer_of_op = innermost_containing(r, rkeys, keys, ops.scope_start, ops.scope_end, r.depth)
    del rkeys, keys
    if not (layer_of_op >= 0).any():
        return False

    parsed: dict[int, tuple[int | None, str]] = {}
    for code in np.unique(r.name[layer_of_op[layer_of_op >= 0]]).tolist():
        m = regex.search(trace.strings[code])
        groups = m.groupdict() if m else {}
        idx = next((v for k, v in groups.items() if k.startswith("index") and v), None)
        if idx is None and m and m.groups():
            idx = next((g for g in m.groups() if g and g.isdigit()), None)
        kind = next((v for k, v in groups.items() if k.startswith("type") and v), "")
        if idx is not None and not idx.isdecimal():
            raise NoStepsMatched(trace.meta.get("file"), f"{argument('--layers', 'layers')}: the "
                                 f"'index' group matched {idx!r} in the range "
                                 f"{trace.strings[code]!r}: not a layer number")
        # Layer rows hold int64 indices (and int() refuses 4,300 digits and more).
        if idx is not None and (len(idx.lstrip("0")) > 19 or int(idx) > np.iinfo(np.int64).max):
            raise NoStepsMatched(trace.meta.get("file"), f"the range {trace.strings[code]!r} "
                                 "numbers its layer beyond int64: not a layer number")
        parsed[code] = (int(idx) if idx is not None else None, kind)

    for step in steps:
        owner = layer_of_op[step.ops]
        inside = owner >= 0
        if not inside.any():
            continue
        step.layer_source = "nvtx"
        positions = np.flatnonzero(inside)
        step.prologue = step.ops[: positions[0]]
        step.epilogue = step.ops[positions[-1] + 1:]
        # The step's ops grouped by their layer range in one stable sort (each group keeps
        # op order), not a mask over the whole step per layer: that is layers x ops, and a
        # trace without step ranges is one step of every layer.
        by_layer = np.argsort(owner[positions], kind="stable")
        owners = owner[positions][by_layer]
        starts = np.flatnonzero(np.r_[True, owners[1:] != owners[:-1]])
        layer_rows = owners[starts]                    # ascending, as np.unique gives them
        grouped = np.split(step.ops[positions[by_layer]], starts[1:])
        for seq, g in enumerate(np.argsort(r.start[layer_rows], kind="stable").tolist()):
            idx, kind = parsed.get(int(r.name[layer_rows[g]]), (None, ""))
            step.layers.append(Layer(index=idx if idx is not None else seq,
                                     ops=grouped[g], type=kind))
    return any(s.layers for s in steps)


# -- layers from the repeating kernel pattern -------------------------------------------------

@dataclass
class RepeatSplit:
    """Half-open [start, end) positions of N layers within a step's op sequence."""

    starts: np.ndarray
    ends: np.ndarray


def find_repeats(seq: np.ndarray, classes: np.ndarray | None = None,
                 attention: np.ndarray | None = None,
                 min_coverage: float = 0.5, layers: int | None = None,
                 generic: np.ndarray | None = None) -> RepeatSplit | None:
    """Find N consecutive layers in a sequence of kernel-name codes.

    Names that occur exactly N times, once in each layer, anchor the layers: for the right N,
    their i-th occurrences all fall between their (i-1)-th and (i+1)-th. The N with the most
    such occurrences wins, unless its anchors are kernels that a layer runs k times (an
    unfused norm before attention and before the MLP): see ``_layer_count``, which takes
    ``attention``, a mask of the attention-class ops. Between two anchored *cores* lies the
    tail of one layer and then the head of the next. The first layer's head is the one part of
    that gap that must also appear just before the first core (a layer's tail cannot precede
    layer 0), so each gap is split where its longest suffix that the prologue ends with
    begins. Matching uses kernel classes (``classes``, same length as ``seq``) where given,
    because the first layer often runs a variant kernel (a plain norm where later layers fuse
    the residual add). Where the prologue ends with no gap's head (layer 0 has none) and the
    gaps are alike, each gap is the tail of the layer before, as far as the epilogue begins
    with it (an eager Llama's projections, one GEMV kernel, leave its down projection outside
    the cores). Ops whose class says nothing of their role (``generic``: a mask of
    the elementwise and copy ops, ``GENERIC_CLASSES``) match by name, or an eager model, all
    elementwise kernels and GEMMs, would match almost any suffix (its residual add taken for
    the embedding's gather). ``layers``: how many layers there are, when known (a forward
    pass of a step that ran several).
    """
    n = len(seq)
    if n < 4:
        return None
    uniq, inverse, counts = np.unique(seq, return_inverse=True, return_counts=True)
    positions_of = _positions_by_name(inverse, len(uniq))
    candidates: list[tuple[int, int, np.ndarray, np.ndarray]] = []  # score, count, lo, hi
    for count in np.unique(counts).tolist():
        if count < 2 or count > n // 2 or layers not in (None, count):
            continue
        names = np.flatnonzero(counts == count)
        lo, hi, support = _consistent_cores(names, positions_of)
        if support >= 2:  # one recurring kernel is no pattern
            candidates.append((support * count, count, lo, hi))
    if not candidates:
        return None
    _, count, lo, hi = _layer_count(candidates, attention)
    kinds = seq if classes is None else classes
    if generic is not None:
        kinds = np.where(generic, -1 - seq, kinds)   # (names negative, beside class codes)
    prologue, epilogue = kinds[: lo[0]], kinds[hi[-1] + 1:]
    gaps = [kinds[hi[i - 1] + 1: lo[i]] for i in range(1, count)]
    splits_of: dict[bytes, tuple[int, int]] = {}    # the gaps of a step repeat: split each once
    for gap in gaps:
        if (key := gap.tobytes()) not in splits_of:
            splits_of[key] = _head_split(gap, prologue)
    splits = [splits_of[gap.tobytes()] for gap in gaps]
    # A gap whose head the prologue lacks (a layer type unlike layer 0) keeps the tail length
    # the other gaps have: tails end a layer the same way whatever its type.
    matched_tails = [split for split, matched in splits if matched]
    typical_tail = Counter(matched_tails).most_common(1)[0][0] if matched_tails else 0
    # No gap's head in a prologue there is (layer 0 runs none), the gaps all alike and two at
    # least (one gap is alike by itself): each is the tail of the layer before, as far as the
    # epilogue begins with it (``_tail_of``). A step that begins at layer 0's core (a window
    # cut after its norm) has no prologue to tell by: its gaps keep their heads.
    tails_by_epilogue = (not matched_tails and lo[0] > 0 and len(gaps) >= 2
                         and len(splits_of) == 1)
    starts = np.empty(count, np.int64)
    tails = []
    first_head = 0
    for i, (gap, (split, matched)) in enumerate(zip(gaps, splits, strict=True), start=1):
        if not matched:
            split = (_tail_of(gap, epilogue) if tails_by_epilogue
                     else min(typical_tail, len(gap)))
        starts[i] = hi[i - 1] + 1 + split
        tails.append(gap[:split])
        first_head = max(first_head, matched)
    starts[0] = lo[0] - first_head
    ends = np.r_[starts[1:], 0].astype(np.int64)
    distinct_tails = {t.tobytes(): t for t in tails}.values()
    ends[-1] = hi[-1] + 1 + max(_match_forward(epilogue, 0, t) for t in distinct_tails)
    if (ends - starts).sum() < min_coverage * n:
        return None
    return RepeatSplit(starts=starts, ends=ends)


# Norms a layer runs: 2 (Llama), 3 (a DiT block), 4 (Gemma's sandwich norms). A count that
# holds more of another's to a span is of units above layers (whole training iterations).
MAX_PARTS_PER_LAYER = 4


def _layer_count(candidates: list[tuple[int, int, np.ndarray, np.ndarray]],
                 attention: np.ndarray | None) -> tuple[int, int, np.ndarray, np.ndarray]:
    """The candidate whose cores are the layers: the most anchored occurrences (the more
    repeats on a tie), unless that count N is of parts of layers: a smaller count M whose
    layers hold N's cores 2 <= k <= MAX_PARTS_PER_LAYER each, with an attention op between
    each two of M's cores but not between each two of N's (a layer attends; its parts need
    not), is the layer count instead. Layers that alternate two kinds (sliding and full
    attention) attend in each span and stay layers. Without attention ops to tell by, N."""
    best = max(candidates, key=lambda c: (c[0], c[1]))
    if attention is None or not attention.any():
        return best
    _, count, lo, _ = best
    attended = np.r_[0, np.cumsum(attention)]

    def attends(starts: np.ndarray) -> bool:  # each span from one core to the next
        return bool((np.diff(attended[starts]) > 0).all())

    if attends(lo):
        return best
    holding = []
    for candidate in candidates:
        fewer, fewer_lo = candidate[1], candidate[2]
        if fewer >= count or fewer < 2:
            continue
        between = np.diff(np.searchsorted(lo, fewer_lo))  # the winner's cores per M-layer
        k = int(between[0])
        if 2 <= k <= MAX_PARTS_PER_LAYER and (between == k).all() and attends(fewer_lo):
            holding.append(candidate)
    return max(holding, key=lambda c: (c[0], c[1])) if holding else best


def _tail_of(gap: np.ndarray, epilogue: np.ndarray) -> int:
    """Where every gap is this one and its head is not in the prologue (layer 0 has none
    before its core), how much of ``gap`` is the tail of the layer before: the part the
    epilogue begins with, as the last layer's tail is there (an eager layer's last GEMM, of
    one kernel name with its others, outside the cores; it began the next layer); none where
    the epilogue begins otherwise. (Gaps that differ, passes joined with the work between
    them, keep their heads; see ``find_repeats``.)"""
    most = min(len(gap), len(epilogue))
    unequal = np.flatnonzero(gap[:most] != epilogue[:most])
    return int(unequal[0]) if len(unequal) else most


def _head_split(gap: np.ndarray, prologue: np.ndarray) -> tuple[int, int]:
    """Where the next layer's head begins in ``gap``, and how many prologue ops it matched:
    the longest suffix of the gap whose first op the prologue's end also holds."""
    for k in range(len(gap)):
        matched, first_used = _match_backward(prologue, len(prologue), gap[k:])
        if first_used:
            return k, matched
    return len(gap), 0


def _positions_by_name(inverse: np.ndarray, n_names: int) -> list[np.ndarray]:
    order = np.argsort(inverse, kind="stable")
    bounds = np.searchsorted(inverse[order], np.arange(n_names + 1))
    return [order[bounds[i]: bounds[i + 1]] for i in range(n_names)]


def _consistent_cores(names: np.ndarray, positions_of: list[np.ndarray]
                      ) -> tuple[np.ndarray, np.ndarray, int]:
    """Greedily keep names whose i-th occurrences stay inside layer i for every i."""
    matrix = np.stack([positions_of[k] for k in names.tolist()])  # [names, count]
    spacing = np.diff(matrix, axis=1)
    regularity = spacing.std(axis=1) / np.maximum(spacing.mean(axis=1), 1)
    reference = matrix[np.argmin(regularity)]
    offsets = matrix - reference
    order = np.argsort(offsets.std(axis=1), kind="stable")
    lo = hi = reference.copy()
    support = 0
    for row in order.tolist():
        new_lo = np.minimum(lo, matrix[row])
        new_hi = np.maximum(hi, matrix[row])
        if (new_hi[:-1] < new_lo[1:]).all():
            lo, hi = new_lo, new_hi
            support += 1
    return lo, hi, support


def _match_backward(seq: np.ndarray, before: int, pattern: np.ndarray) -> tuple[int, bool]:
    """Align ``pattern`` backwards with the ops just before ``before``, skipping pattern
    entries the sequence lacks: (ops matched, whether the pattern's first entry matched)."""
    j = before - 1
    first_used = False
    for i, name in enumerate(pattern[::-1].tolist()):
        if j >= 0 and seq[j] == name:
            j -= 1
            first_used = i == len(pattern) - 1
    return before - 1 - j, first_used


def _match_forward(seq: np.ndarray, start: int, pattern: np.ndarray) -> int:
    j = start
    for name in pattern.tolist():
        if j < len(seq) and seq[j] == name:
            j += 1
    return j - start


# Classes that say nothing of an op's role in a layer: ``find_repeats`` matches these by name.
# (Not "other" nor "conv": a CNN's convolutions, and many kernels no rule classes, are named
# otherwise layer by layer.)
GENERIC_CLASSES = ("elementwise", "memcpy")


def generic_ops(classes: np.ndarray, labels: list[str]) -> np.ndarray:
    """Which ops of a sequence are of a ``GENERIC_CLASSES`` class, for ``find_repeats``."""
    return np.isin(classes, [labels.index(c) for c in GENERIC_CLASSES if c in labels])


def attending(classes: np.ndarray, labels: list[str]) -> np.ndarray:
    """Which ops of a sequence attend, for ``find_repeats``: the attention class, but for an
    op right before or after a router op, which routes (an eager MoE's softmax, before its
    top-k, or after it over the k chosen, GPT-OSS's order)."""
    def of(label: str) -> np.ndarray:
        return classes == (labels.index(label) if label in labels else -1)
    attention, router = of("attention"), of("router")
    attention[:-1] &= ~router[1:]
    attention[1:] &= ~router[:-1]
    return attention


def layers_from_repeats(ops: GpuOps, steps: list[Step]) -> bool:
    found = False
    for step in steps:
        rows = step.ops if step.borrowed is None else step.ops[~step.borrowed]
        classes = ops.layout_class[rows]
        split = find_repeats(ops.name[rows], classes, attending(classes, ops.layout_labels),
                             generic=generic_ops(classes, ops.layout_labels))
        if split is None:
            continue
        found = True
        step.layer_source = "repeat"
        step.prologue = rows[: split.starts[0]]
        step.epilogue = rows[split.ends[-1]:]
        step.layers = [Layer(index=i, ops=rows[s:e])
                       for i, (s, e) in enumerate(zip(split.starts.tolist(),
                                                      split.ends.tolist(), strict=True))]
    return found


# -- forward passes in a device's step -----------------------------------------------------------

# The fewest layers a forward pass holds, for its passes to be found by their layer types:
# architectures repeat shorter cycles of their own (K3's MLA every 4th layer, Gemma's global
# attention every 6th, an MoE layer every 2nd or 4th, a shared block every 6th), and one of
# those layers may well run all another runs and more.
MIN_PASS_LAYERS = 8


def passes_from_layer_cycle(ops: GpuOps, step: Step) -> list[Step] | None:
    """A device's step (no step range, no graph launch) that ran the model N times: its N
    forward passes, as steps, each with its own prologue, layers and epilogue; None when its
    layers show no passes (``layer_cycle``). Where the trace begins or ends within a pass,
    that part of a pass is a step too, of ``found_by`` "partial pass" and without layers
    (``find_layers`` leaves it out of the steps).

    Passes are cut where the work that joins two begins (``pass_cuts``), then split into
    their P layers each. The work between two passes is split where the first whole pass's
    prologue recurs (the embedding before the next pass's first layer); without such a head
    it ends the earlier pass, and so does what the next pass begins with that continues it as
    the last pass's epilogue goes on (the last pass ends whole: its epilogue shows what a pass
    ends with)."""
    cycle = layer_cycle(ops, step)
    if cycle is None:
        return None
    period = cycle.period
    rows, names = step.ops, ops.name[step.ops]
    cuts, whole_parts = pass_cuts(ops, step, cycle)
    whole = []
    for (lo, hi), is_whole in zip(pairwise(cuts), whole_parts, strict=True):
        if not is_whole:             # the trace begins or ends within this pass
            continue
        classes = ops.layout_class[rows[lo:hi]]
        split = find_repeats(names[lo:hi], classes, attending(classes, ops.layout_labels),
                             layers=period, generic=generic_ops(classes, ops.layout_labels))
        if split is None:
            return None
        whole.append((lo, hi, lo + split.starts, lo + split.ends))
    if not cycle.whole and _joining_work_left(names, whole):
        return None
    first_prologue = names[whole[0][0]: whole[0][2][0]]
    last_epilogue = names[whole[-1][3][-1]: whole[-1][1]]
    edges = [whole[0][0]]
    for (_, _, _, ends), (_, _, begins, _) in pairwise(whole):
        head, matched = _head_split(names[ends[-1]: begins[0]], first_prologue)
        edge = int(ends[-1] + head) if matched else int(begins[0])
        epilogue = names[ends[-1]: edge]
        rest = last_epilogue[len(epilogue):]
        if (len(rest) and np.array_equal(last_epilogue[: len(epilogue)], epilogue)
                and np.array_equal(names[edge: edge + len(rest)], rest)
                and edge + len(rest) < begins[1]):
            edge += len(rest)
            begins[0] = max(begins[0], edge)
        edges.append(edge)
    edges.append(whole[-1][1])
    if len(whole) > 1:
        # A part of a pass before the first whole one ends with what a pass ends with (the
        # LM head), and one after the last whole pass begins with it: the whole passes' own
        # edges, between two of them, say how much is whose.
        head = names[edges[1]: whole[1][2][0]]
        tail = names[whole[0][3][-1]: edges[1]]
        begins, ends = whole[0][2], whole[-1][3]
        if edges[0] > 0 and np.array_equal(names[begins[0] - len(head): begins[0]], head):
            edges[0] = max(edges[0], int(begins[0]) - len(head))
        if edges[-1] < len(rows) and np.array_equal(
                names[ends[-1]: ends[-1] + len(tail)], tail):
            edges[-1] = max(edges[-1], int(ends[-1]) + len(tail))
    passes = []
    for k, (_, _, begins, ends) in enumerate(whole):
        lo, hi = edges[k], edges[k + 1]
        passes.append(Step(
            index=k, device=step.device, pid=step.pid, name=f"{step.name} pass {k}",
            ops=rows[lo:hi], prologue=rows[lo: begins[0]], epilogue=rows[ends[-1]: hi],
            layers=[Layer(index=i, ops=rows[a:b]) for i, (a, b) in
                    enumerate(zip(begins.tolist(), ends.tolist(), strict=True))],
            layer_source="repeat", found_by="pass"))
    if not cycle.whole and not _passes_agree(passes):
        return None
    cut = [(0, edges[0])] * (edges[0] > 0) + [(edges[-1], len(rows))] * (edges[-1] < len(rows))
    return passes + [Step(index=-1, device=step.device, pid=step.pid,
                          name=f"{step.name} partial pass", ops=rows[lo:hi],
                          found_by="partial pass") for lo, hi in cut]


class Cycle(NamedTuple):
    """How a step's forward passes repeat (``layer_cycle``)."""

    period: int          # layers a pass
    joins: list[int]     # the layers that join two passes
    offset: int          # how many ops into such a layer the work between passes begins
    extra: tuple         # that work's kernel names (codes)
    whole: bool          # the step holds whole passes, each of P layers from its first


def _passes_agree(passes: list[Step]) -> bool:
    """Whether the whole passes found in a trace that begins or ends within a pass read
    alike, as a model's passes do: two at least, as many ops in each layer, layer by layer,
    and as many before their first layer and after their last (the first pass's prologue
    aside: the trace's own start may hold more there)."""
    return (len(passes) > 1
            and len({tuple(len(layer.ops) for layer in p.layers) for p in passes}) == 1
            and len({len(p.prologue) for p in passes[1:]}) == 1
            and len({len(p.epilogue) for p in passes}) == 1)


def _joining_work_left(names: np.ndarray, whole: list[tuple]) -> bool:
    """Whether a layer of the passes found still runs a common layer's kernels and more than
    a variant's difference besides (the LM head and embedding of the cut that failed)."""
    layers = [Counter(names[a:b].tolist()) for *_, begins, ends in whole
              for a, b in zip(begins.tolist(), ends.tolist(), strict=True)]
    common = Counter(dict(Counter(tuple(sorted(c.items())) for c in layers).most_common(1)[0][0]))
    return any(not common - c and (c - common).total() > MAX_VARIATION for c in layers)


def pass_cuts(ops: GpuOps, step: Step, cycle: Cycle) -> tuple[list[int], list[bool]]:
    """Where a step's forward passes meet (op offsets in the step, its ends included), and
    whether each part between two cuts is a whole pass. A step of whole passes is cut every
    P layers. Otherwise each cut lies in a joining layer where the work between passes
    begins, and a first or last part is whole when it runs every layer kernel a part between
    two cuts runs (the work between passes aside): a pass the trace begins or ends within
    lacks some."""
    starts = np.cumsum([len(step.prologue)] + [len(layer.ops) for layer in step.layers])
    if cycle.whole:
        cuts = [0] + [int(starts[k]) for k in range(cycle.period, len(step.layers),
                                                     cycle.period)] + [len(step.ops)]
        return cuts, [True] * (len(cuts) - 1)
    cuts = list(dict.fromkeys([0, *(int(starts[a]) + cycle.offset for a in cycle.joins),
                               len(step.ops)]))   # no empty part
    names = ops.name[step.ops]
    if any(tuple(names[c: c + len(cycle.extra)].tolist()) != cycle.extra for c in cuts[1:-1]):
        return [0, len(step.ops)], [False]   # the work between passes is not where it joins
    parts = [Counter(names[a:b].tolist()) for a, b in pairwise(cuts)]
    layers_run = Counter(names[int(starts[cycle.joins[0]]) + cycle.offset:
                               int(starts[cycle.joins[1]]) + cycle.offset].tolist())
    layers_run -= Counter(cycle.extra)
    return cuts, [not layers_run - p for p in parts]


def layer_cycle(ops: GpuOps, step: Step) -> Cycle | None:
    """Where a step's layer types (as ``assign_types`` named them) show the model run more
    than once, how its passes repeat. One type recurs every P >=
    ``MIN_PASS_LAYERS`` layers, in every pass but perhaps the first or the last; the others
    repeat with period P; and that type's layer runs all that another type's runs plus more
    than a variant's difference, as one run of extra kernels (the final norm and LM head, or
    the embedding, of the passes it joins) before, inside or after that layer's kernels.
    Layers are compared by each type's most common kernel sequence. A hybrid model's other
    layer type runs other attention kernels, not another layer's and more: it makes no
    passes. A step whose joining layers come first or last of every P from its first layer
    holds whole passes (``Cycle.whole``); one the trace begins or ends within a pass of
    does not."""
    types = [layer.type for layer in step.layers]
    n = len(types)
    if n < 2 * MIN_PASS_LAYERS:
        return None
    signatures: dict[str, Counter] = {}
    for layer in step.layers:
        signatures.setdefault(layer.type, Counter())[tuple(ops.name[layer.ops].tolist())] += 1
    sequence_of = {t: sigs.most_common(1)[0][0] for t, sigs in signatures.items()}
    kernels_of = {t: Counter(seq) for t, seq in sequence_of.items()}
    common = Counter(types).most_common(1)[0][0]
    inner_types = set(types[1:-1])
    for joint in kernels_of:
        at = [i for i, t in enumerate(types) if t == joint]
        if joint == common or len(at) < 2:
            continue
        period = at[1] - at[0]
        if period < MIN_PASS_LAYERS or any(b - a != period for a, b in pairwise(at)):
            continue
        joins = set(at)
        mismatched = {i for i in range(period, n) if i not in joins
                      and i - period not in joins and types[i] != types[i - period]}
        whole = (n % period == 0 and at[0] % period in (0, period - 1)
                 and len(at) >= n // period - 1 and not mismatched)
        # A step cut within a pass: its first or last layer may be a part of one (neither a
        # join nor like the layer a period on), and a whole pass holds a join.
        if not whole and (mismatched - {period, n - 1} or at[0] == 0 or at[-1] == n - 1
                          or at[0] > period or n - 1 - at[-1] > period):
            continue
        kernels = kernels_of[joint]
        for t, other in kernels_of.items():
            # (another type of inner layers: not a part of a layer at the trace's edge)
            if (t == joint or t not in inner_types or other - kernels
                    or (kernels - other).total() <= MAX_VARIATION):
                continue
            inner, seq = sequence_of[t], sequence_of[joint]
            extra = len(seq) - len(inner)
            # the extra kernels as one run, as late in the layer as it may lie
            offset = next((j for j in range(len(inner), -1, -1)
                           if seq[:j] == inner[:j] and seq[j + extra:] == inner[j:]), None)
            if whole or offset is not None:
                return Cycle(period, at, offset or 0,
                             seq[offset: offset + extra] if offset is not None else (), whole)
    return None


# -- layer types ------------------------------------------------------------------------------

# How many kernels a layer may differ from its type's by and still be of that type (a plain
# norm where the others fuse the residual add).
MAX_VARIATION = 2


def assign_types(ops: GpuOps, steps: list[Step], max_variation: int = MAX_VARIATION) -> None:
    """Name layer types: keep types the ranges gave; otherwise group layers by their kernel
    sequence, named A, B, ... in order of first appearance. A step's first or last layer whose
    sequence no inner layer ran, and that differs from an inner layer's by at most
    ``max_variation`` kernels (a plain norm where the others fuse the residual add), is a
    variant of that layer's type, not a type of its own; one that differs more (a dense first
    layer, a last layer of the rarer type) is its own type. An edge layer as near to a
    commoner edge layer of the same place (first or last) is of that layer's type, whichever
    it is (a warm-up step's first layer, one copy more than the later steps' first layers: of
    their type, not a type of the warm-up alone)."""
    layers: list[Layer] = []
    signatures: list[tuple] = []
    inner: dict[tuple, None] = {}   # in order of first appearance: ties resolve the same way
    places: dict[tuple, set[str]] = {}   # where in its step an edge layer's sequence ran
    for step in steps:
        last = len(step.layers) - 1
        for i, layer in enumerate(step.layers):
            if layer.type:
                continue
            signature = tuple(ops.name[layer.ops].tolist())
            layers.append(layer)
            signatures.append(signature)
            if 0 < i < last:
                inner.setdefault(signature)
            for place, at in (("first", i == 0), ("last", i == last)):
                if at:
                    places.setdefault(signature, set()).add(place)
    if not layers:
        return
    counts = Counter(signatures)
    distinct = sorted(dict.fromkeys(signatures), key=lambda sig: -counts[sig])
    near = _Nearest(distinct, max_variation)
    row = {signature: r for r, signature in enumerate(distinct)}
    inner_rows = np.array([row[sig] for sig in inner], np.int64)
    group: dict[tuple, tuple] = {}
    edges: list[tuple] = []         # edge sequences grouped so far, commonest first
    for signature in distinct:
        group[signature] = signature
        if signature in inner:
            continue
        # near an inner layer's sequence, else near an edge layer's of the same place (a
        # warm-up step's first layer beside the later steps' first layers): its group
        same_place = np.array([row[e] for e in edges if places[e] & places[signature]],
                              np.int64)
        for candidates in (inner_rows, same_place):
            if (closest := near.first_within(row[signature], candidates)) is not None:
                found = distinct[closest]
                group[signature] = group.get(found, found)   # (inner: its own group)
                break
        edges.append(signature)
    labels: dict[tuple, str] = {}
    for layer, signature in zip(layers, signatures, strict=True):
        representative = group[signature]
        if representative not in labels:
            labels[representative] = _type_label(len(labels))
        layer.type, layer.lettered = labels[representative], True


class _Nearest:
    """Kernel sequences as counts per kernel name (a sparse row each), to find among many the
    one nearest a given sequence in one vectorized pass. Two sequences differ by the larger of
    what each runs and the other does not (a kernel swapped for another counts once):
    max(len a, len b) - Σ min(a's count, b's) over the names a runs, so only a's columns are
    read; and by |len a - len b| at least, so longer or shorter ones are passed over first
    (an eager MoE's layers, each expert's GEMM of its own variant, are thousands of
    sequences: a pair at a time was quadratic)."""

    def __init__(self, sequences: list[tuple], most: int):
        from scipy.sparse import csr_matrix

        self.most = most
        names: dict[int, int] = {}
        self.columns, self.values, indptr = [], [], [0]
        for sequence in sequences:
            kernels, count = np.unique(np.asarray(sequence, np.int64), return_counts=True)
            self.columns.append(np.array([names.setdefault(k, len(names))
                                          for k in kernels.tolist()], np.int64))
            self.values.append(count)
            indptr.append(indptr[-1] + len(count))
        self.length = np.array([len(sequence) for sequence in sequences], np.int64)
        self.matrix = csr_matrix(
            (np.concatenate(self.values) if sequences else np.zeros(0, np.int64),
             np.concatenate(self.columns) if sequences else np.zeros(0, np.int64),
             np.array(indptr)), shape=(len(sequences), max(len(names), 1))).tocsc()

    def first_within(self, row: int, candidates: np.ndarray) -> int | None:
        """The first of ``candidates`` (rows) nearest ``row``'s sequence, where it differs by
        at most ``most`` kernels; else None."""
        candidates = candidates[np.abs(self.length[candidates] - self.length[row])
                                <= self.most]
        if not len(candidates):
            return None
        # Σ min over row's names, for every sequence at once: its columns' entries, each
        # capped at row's count, summed per sequence
        held = self.matrix[:, self.columns[row]]
        name = np.repeat(np.arange(held.shape[1]), np.diff(held.indptr))
        common = np.bincount(held.indices, np.minimum(held.data, self.values[row][name]),
                             minlength=held.shape[0])[candidates]
        difference = np.maximum(self.length[candidates], self.length[row]) - common
        nearest = int(np.argmin(difference))    # (the first of equals, as in order)
        return int(candidates[nearest]) if difference[nearest] <= self.most else None


def _type_label(i: int) -> str:
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    return letters[i] if i < len(letters) else f"T{i}"


def find_layers(trace: Trace, ops: GpuOps, steps: list[Step], layers: str = "auto"
                ) -> list[Step]:
    """Each step's layers and their types, in place (``layers``: ``auto``, per-layer ranges
    when the trace has them, else the repeating pattern; ``nvtx`` / ``nvtx:REGEX``, ranges
    only; ``repeat``). A mode
    asked for by name that finds no layer in any step is an error, as an unmatched step
    regex is; ``auto`` may find none. Where a device's step splits into forward passes
    (``passes_from_layer_cycle``), the parts of passes the trace begins or ends within are
    left out of the steps and returned."""
    if layers == "auto":
        if not layers_from_ranges(trace, ops, steps, DEFAULT_LAYER_PATTERN):
            layers_from_repeats(ops, steps)
    elif layers == "repeat":
        if not layers_from_repeats(ops, steps) and steps:
            raise NoStepsMatched(trace.meta.get("file"), f"{argument('--layers', 'layers', layers)}"
                                 ": no step repeats a kernel pattern (no layers found)")
    elif layers == "nvtx" or layers.startswith("nvtx:"):
        regex = layers[5:] or DEFAULT_LAYER_PATTERN
        if _compiled(regex, "layer regex").search(""):   # ('.*': every range a layer)
            raise ValueError(f"layers {layers!r}: the regex matches an empty name, so every "
                             "range: name the layer ranges")
        if not layers_from_ranges(trace, ops, steps, regex) and steps:
            said = "its regex" if layers[5:] else "the default layer pattern"
            raise NoStepsMatched(trace.meta.get("file"), f"{argument('--layers', 'layers', layers)}"
                                 f": no range matching {said} holds a kernel launch of a step")
    else:
        raise ValueError(f"layers: auto, repeat, nvtx or nvtx:REGEX, not {layers!r}")
    release_free_memory()
    assign_types(ops, steps)
    if steps and steps[0].found_by == "device":
        split = [passes_from_layer_cycle(ops, step) if step.layer_source == "repeat" else None
                 for step in steps]
        if any(split):
            found = [p for step, passes in zip(steps, split, strict=True)
                     for p in (passes or [step])]
            steps[:] = [p for p in found if p.found_by != "partial pass"]
            _number_per_device(steps)   # (each process's passes on a device it shares)
            for step in steps:      # named again together: a pass's layers are new
                for layer in step.layers:
                    layer.type = ""
            assign_types(ops, steps)
            return [p for p in found if p.found_by == "partial pass"]
    return []
