"""The library a notebook calls: each command's work as a call, giving what the command
prints, so that the CLI stays a thin layer over it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from kimi_perf import compare_files, load_breakdown
from kimi_perf.cli import EXAMPLE_TRACE, main
from kimi_perf.comparison import WHOLE_STEP, compare, ratio_note
from kimi_perf.errors import TraceError
from kimi_perf.gate import Tolerances, update_baseline
from kimi_perf.report import report_inputs
from kimi_perf.runs import TRACE, load_paths, load_run
from kimi_perf.trace import json_text
from tests.conftest import NSYS, REPO, rank_copy
from tests.test_gate import BASELINE

BEFORE = NSYS / "nsysai_fastvideo_wan2.1_train_2xh100_before.sqlite"
AFTER = NSYS / "nsysai_fastvideo_wan2.1_train_2xh100_after.sqlite"


def _printed(*args) -> dict:
    result = CliRunner().invoke(main, [*map(str, args), "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.mark.parametrize("inputs", [(BEFORE, AFTER), (BASELINE,)], ids=["traces", "run"])
def test_compare_files_is_what_compare_prints(inputs):
    compared = compare_files(*inputs)
    doc = json.loads(json_text(compared.to_json(kernels=True)))
    assert doc == _printed("compare", *inputs, "--kernels")
    assert doc["notes"][:len(compared.table_notes)] == compared.table_notes
    assert [r["type"] for r in doc["rows"]] == [r.type for r in compared.rows]
    if inputs == (BASELINE,):   # one run: path against path, under the paths' names
        assert (compared.label_a, compared.label_b) == ("standard", "specialized")
        assert doc["typical_layers"] and doc["fusions"]


def test_profiler_windows_of_other_layers_have_no_whole_step_ratio():
    """Each device one step (the profiler's window), 17 layers a step against 15: the windows
    ran other work, so their kernels a step have no ratio (a false 1.12x); the layers do."""
    compared = compare_files(BEFORE, AFTER)
    step = next(r for r in compared.rows if r.label == WHOLE_STEP)
    assert (step.layers_a, step.layers_b) == (17, 15)
    assert step.kernel_ratio is None and step.span_ratio is None and not step.same_layers
    assert any("whole step: no ratio" in note for note in compared.table_notes)
    (a_row,) = [r for r in compared.rows if r.type == "A"]
    assert a_row.kernel_ratio == 1.0 and a_row.span_ratio is not None
    same = compare_files(BEFORE, BEFORE)   # the same window on both sides keeps its ratio
    assert next(r for r in same.rows if r.label == WHOLE_STEP).kernel_ratio == 1.0


def test_compare_files_labels_and_short_labels():
    labelled = compare_files(BEFORE, AFTER, labels=("x", "y"))
    assert (labelled.label_a, labelled.label_b) == ("x", "y")
    for wrong in (("x",), ("x", "x"), ("x", "")):
        with pytest.raises(ValueError, match="labels: 2 distinct names"):
            compare_files(BEFORE, AFTER, labels=wrong)
    full = compare_files(BEFORE, AFTER)
    short = compare_files(BEFORE, AFTER, short_labels=True)
    assert (short.label_a, short.label_b) == ("before", "after")
    assert full.label_a.endswith("before") and full.label_a != short.label_a
    assert short.labels_said == f"before: {BEFORE}; after: {AFTER}"
    with pytest.raises(TraceError, match="one run of two decode paths"):
        compare_files(BEFORE)


def test_load_breakdown_and_load_paths():
    runs, doc = load_paths(BASELINE)
    assert set(runs) == {"standard", "specialized"} and doc["schema"] == 1
    specialized = load_breakdown(BASELINE, "specialized")
    assert specialized.to_json() == runs["specialized"].to_json()
    with pytest.raises(TraceError, match=r"choose one with path_name$"):
        load_breakdown(BASELINE)
    with pytest.raises(TraceError, match="is not one"):
        load_breakdown(EXAMPLE_TRACE, "specialized")
    traced, none = load_paths(EXAMPLE_TRACE, "example")
    assert none is None and list(traced) == ["example"]
    assert traced["example"].to_json() == load_breakdown(EXAMPLE_TRACE).to_json()


def test_report_inputs_is_what_report_draws(tmp_path):
    got = report_inputs([BASELINE, EXAMPLE_TRACE], path_name="specialized")
    # a run's path among several inputs is RUN:path; a trace is its file's name
    assert list(got.breakdowns) == ["tiny-cpu:specialized",
                                    "vllm_gptoss20b_decode_fullgraph_mi300x"]
    assert got.run is None and [name for name, _ in got.runs] == ["tiny-cpu"]
    one = report_inputs([BASELINE])
    assert list(one.breakdowns) == ["standard", "specialized"] and one.runs == []
    assert one.run == json.loads(BASELINE.read_text())["run"]
    renamed = one.relabelled(["std", "spec"])
    assert list(renamed.breakdowns) == ["std", "spec"]
    with pytest.raises(ValueError, match="labels"):
        one.relabelled(["std", "std"])
    with pytest.raises(TraceError, match="is not one"):
        report_inputs([EXAMPLE_TRACE], path_name="specialized")
    # a run's two paths beside a trace: decode paths (no spread across them), kept by
    # relabelled(), and write() draws it as the command does
    both = report_inputs([BASELINE, EXAMPLE_TRACE, EXAMPLE_TRACE])
    assert both.of_paths and not got.of_paths and not one.of_paths
    assert both.relabelled(["a", "b", "c", "d"]).of_paths
    page = both.write(tmp_path / "r.html", "t", plotly_js="cdn").read_text()
    assert "No spread or slowest trace" in page and "slowest / fastest" not in page
    assert one.write(tmp_path / "one.html", "t", plotly_js="cdn").exists()


def test_update_baseline_creates_gates_then_stores(tmp_path):
    baseline = tmp_path / "baseline.json"
    tolerances = Tolerances(metrics="kernels")
    assert update_baseline(baseline, BASELINE, tolerances) == (None, "created")
    # the run, and the tolerances it was stored with (the gates against it use them)
    assert load_run(baseline)[1] == {**load_run(BASELINE)[1], "gate_tolerances": {
        "rel_tol": 0.05, "abs_tol_us": 1.0, "alpha": 0.01, "metrics": "kernels"}}
    assert update_baseline(tmp_path / "plain.json", BASELINE) == (None, "created")
    assert load_run(tmp_path / "plain.json")[1] == load_run(BASELINE)[1]
    trace_base = tmp_path / "trace.json"
    assert update_baseline(trace_base, EXAMPLE_TRACE, tolerances) == (None, "created")
    gated, how = update_baseline(trace_base, EXAMPLE_TRACE, tolerances)
    assert how == "updated" and gated.result.ok and set(gated.current) == {TRACE}
    # a run of two paths cannot be gated against one trace's breakdown without a path
    with pytest.raises(TraceError, match="cannot pair them"):
        update_baseline(trace_base, BASELINE, tolerances)
    copy = tmp_path / "trace.sqlite"
    shutil.copy(BEFORE, copy)
    with pytest.raises(TraceError, match="not a trace"):
        update_baseline(copy, BASELINE, tolerances)
    assert copy.read_bytes() == BEFORE.read_bytes()   # refused before anything was written


@pytest.mark.parametrize(("document", "next_section", "least"),
                         [("README.md", "## Development", 4),
                          ("docs/reference.md", "## Tests", 10)])
def test_the_library_samples_name_what_exists(document, next_section, least):
    """Every name the Library sample of the README and of the reference imports exists where
    it says, and every keyword it passes is taken: a renamed or moved function fails here."""
    import ast
    import importlib

    text = (REPO / document).read_text()
    section = text[text.index("## Library"):text.index(next_section)]
    code = section[section.index("```python") + len("```python"):]
    tree = ast.parse(code[:code.index("```")])
    imported = [(node.module, alias.name) for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) for alias in node.names]
    assert len(imported) >= least
    functions = {}
    for module, name in imported:   # where it is defined (or the package exports it), not
        found = importlib.import_module(module)   # a name a module happens to import
        value = getattr(found, name)
        functions[name] = value
        if module == "kimi_perf":
            assert name in found.__all__, name
        else:
            assert getattr(value, "__module__", module) == module, f"{module}.{name}"
    # every keyword the sample passes is one its function takes (a parameter renamed or
    # removed fails here, not in a reader's notebook)
    import inspect

    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id in functions]
    assert any(call.keywords for call in calls)
    for call in calls:
        taken = inspect.signature(functions[call.func.id]).parameters
        for keyword in call.keywords:
            assert keyword.arg in taken or any(
                p.kind is p.VAR_KEYWORD for p in taken.values()), (call.func.id, keyword.arg)


def test_trace_from_json_says_what_compare_says(tmp_path):
    """`trace --from A B --format json`: its comparison holds compare's rows and every note
    compare prints of the same two traces (each side's steps too)."""
    from kimi_perf.capture import analyse, run_document

    run_dir, results, run_info = analyse([BEFORE, AFTER], tmp_path, plotly_js="cdn")
    (comparison,) = run_document(run_dir, results, run_info)["comparisons"]
    compared = compare_files(BEFORE, AFTER)
    assert comparison["notes"] == compared.notes
    assert comparison["rows"] == [r.to_json() for r in compared.rows]
    assert any(n.startswith(f"{compared.label_a}: no step range") for n in compared.notes)
    # the compare command the run ends with labels its paths (the traces' names) as its
    # table did, and says which is which
    again = compare_files(run_dir, short_labels=True)
    assert (again.label_a, again.label_b) == ("before", "after")
    assert again.labels_said == f"before: {compared.label_a}; after: {compared.label_b}"
    assert [r.to_json() for r in again.rows] == comparison["rows"]
    assert compare_files(BASELINE, short_labels=True).label_a == "standard"
    # captures as --capture gives them, one per trace: else a TraceError before any work
    for captures in ([None], [BEFORE], [BEFORE, None]):
        with pytest.raises(TraceError, match="captures: one file for each of the 2 traces"):
            analyse([BEFORE, AFTER], tmp_path / "none", captures=captures, plotly_js="cdn")
    assert not (tmp_path / "none").exists()


def test_option_errors_come_before_any_input_is_read(tmp_path):
    """A bad --layers is said as such, even beside a file that would fail to read: the
    options are checked first, as for every command."""
    broken = tmp_path / "broken.json"
    broken.write_text('{"schema": 1, "paths": {"standard": []}}')
    for command in ("compare", "report"):
        result = CliRunner().invoke(main, [command, str(broken), str(BEFORE), "--layers",
                                           "bogus", "-o", str(tmp_path / "out")])
        assert result.exit_code == 2 and "--layers must be auto" in result.output, command


def test_arrow_tables_for_a_notebook():
    """A trace's tables as Arrow, names decoded; a breakdown's layers as a table, the same
    whether it was made here (from its columns) or read back from JSON."""
    from kimi_perf import breakdown, read_trace
    from kimi_perf.layer_breakdown import Breakdown

    trace = read_trace(NSYS / "jsun-012-assignment2-systems__result__nsys2025.1.3.sqlite")
    kernels = trace.to_arrow("kernels")
    assert kernels.num_rows == len(trace.kernels)
    assert kernels.column("name").to_pylist()[:50] == [trace.strings[c] for c in
                                                      trace.kernels.name[:50].tolist()]
    assert kernels.column("start").to_numpy().tolist() == trace.kernels.start.tolist()
    # its dictionary holds the kernels' names alone (it held every string of the trace: a
    # pandas groupby listed every range name, with 0)
    names = set(kernels.column("name").to_pylist())
    assert sorted(kernels.column("name").combine_chunks().dictionary.to_pylist()) == sorted(
        names) and len(names) < len(trace.strings)
    with pytest.raises(ValueError, match="no table 'kernel' \\(one of kernels, memops"):
        trace.to_arrow("kernel")
    ranges = trace.to_arrow("ranges")   # a range's domain is a string too
    assert ranges.column("domain").to_pylist()[:20] == [trace.strings[c] for c in
                                                       trace.ranges.domain[:20].tolist()]
    b = breakdown(trace)
    table = b.layers_table()
    assert table.num_rows == len(b.layers) > 0
    first = table.slice(0, 1).to_pylist()[0]
    layer = b.layers[0]
    assert {k: first[k] for k in ("step", "index", "type", "kernels", "span_us")} == {
        k: layer[k] for k in ("step", "index", "type", "kernels", "span_us")}
    for cls, ran in layer["classes"].items():
        assert (first[f"kernels:{cls}"], first[f"us:{cls}"]) == (ran["kernels"], ran["us"])
    read_back = Breakdown.from_json(json.loads(json_text(b.to_json())), "x")
    assert read_back.layers_table().equals(table)
    stored = load_run(BASELINE)[0]["specialized"].layers_table()
    assert set(stored.column("type").to_pylist()) == {"dense", "kda", "mla"}


def test_library_calls_given_the_wrong_kind_say_so(tmp_path):
    """The mistakes a notebook makes first: a rel_tol where Tolerances goes, traces where
    compare takes breakdowns, one path where a list goes, a misspelt breakdown option (which
    a stored breakdown would otherwise ignore): a TypeError saying what goes there."""
    from kimi_perf import breakdown, breakdown_of_file, compare, read_trace
    from kimi_perf.capture import analyse
    from kimi_perf.comparison import Comparison, type_pairs
    from kimi_perf.gate import gate_files
    from kimi_perf.layer_breakdown import layer_column
    from kimi_perf.runs import store_baseline, trace_files

    with pytest.raises(TypeError, match=r"tolerances: a Tolerances or a dict of settings, "
                                        r"not float \(0\.1\)"):
        gate_files(BASELINE, BASELINE, 0.1)
    from kimi_perf import range_kernel_summary
    from kimi_perf.gate import gate
    from kimi_perf.report import write_report

    runs = load_run(BASELINE)[0]
    with pytest.raises(TypeError, match=r"tolerances: a Tolerances, not float \(0\.1\)"):
        gate(runs, runs, 0.1)
    with pytest.raises(TypeError, match=r"baseline: Breakdowns by path .* not str: gate_files "
                                        r"takes files"):
        gate(str(BASELINE), runs)
    with pytest.raises(TypeError, match=r"range_kernel_summary takes a Trace .* not str"):
        range_kernel_summary(str(BEFORE))
    with pytest.raises(TypeError, match="inputs: a list of files, not one str"):
        report_inputs(str(BASELINE))
    with pytest.raises(TypeError, match="breakdowns: Breakdowns by label"):
        write_report("r.html", {"a": read_trace(BEFORE)}, "t")
    with pytest.raises(TypeError, match="layers: auto, repeat, nvtx or nvtx:REGEX, not None"):
        breakdown(read_trace(BEFORE), layers=None)
    with pytest.raises(ValueError, match=r"min_samples: an integer ≥ 2 \(not '5'\)"):
        Tolerances(min_samples="5")
    with pytest.raises(ValueError, match="step_regex: an empty regex finds every range"):
        breakdown(read_trace(BEFORE), step_regex="")
    trace = read_trace(NSYS / "jsun-012-assignment2-systems__result__nsys2025.1.3.sqlite")
    with pytest.raises(TypeError, match=r"compare takes two Breakdowns .* not Trace and Trace"):
        compare(trace, trace)
    with pytest.raises(TypeError, match="files: a list of traces, not one str"):
        analyse(str(NSYS / "jsun-012-assignment2-systems__result__nsys2025.1.3.sqlite"), "x")
    for call in (lambda: load_run(BASELINE, layres="repeat"),
                 lambda: load_breakdown(BASELINE, "standard", layres="repeat"),
                 lambda: compare_files(BASELINE, path_name=None, layres="repeat"),
                 lambda: report_inputs([BASELINE], layres="repeat"),
                 lambda: gate_files(BASELINE, BASELINE, layres="repeat")):
        with pytest.raises(TypeError, match=r"unknown breakdown option layres \(one of layers, "
                                            r"rules, step_regex\)"):
            call()
    assert load_run(BASELINE, layers="repeat")[0]   # (a known one: a stored run reads none)
    # more of the wrong kinds, each a TypeError that says what goes there, from the call
    # itself (not an AttributeError from deep inside, nor one naming another function)
    b = breakdown(trace)
    for call, said in (
            (lambda: type_pairs(trace, trace), r"type_pairs takes two Breakdowns .* not Trace "
                                               r"and Trace: breakdown\(trace\) breaks"),
            (lambda: Comparison.of(runs, runs), r"Comparison.of takes two Breakdowns .* not "
                                                r"dict and dict: .* runs\['specialized'\]"),
            (lambda: read_trace(None), r"path: a file's path \(a str or Path\), not NoneType"),
            (lambda: read_trace(BEFORE, capture=3), r"capture: a file's path .* not int"),
            (lambda: compare_files([BEFORE, AFTER]), "a: a file's path .* not a list: one file"),
            (lambda: load_breakdown(7), "path: a file's path"),
            (lambda: breakdown(trace, rules=5), r"rules: load_rules' list, or a TOML file's "
                                                r"path, not 5"),
            (lambda: layer_column(b, "span_us"), r"layer_column takes a breakdown's layers "
                                                 r"\(b.layers\), not the Breakdown"),
            (lambda: breakdown_of_file(BEFORE, layer="auto"),
             "breakdown_of_file.. got an unexpected keyword argument 'layer'"),
            (lambda: trace_files(str(NSYS)), r"paths: a list of traces and folders, not one "
                                             r"str \('.*'\): give \['.*'\]"),
            (lambda: write_report(tmp_path / "r.html", {"a": trace}, "t"),
             r"breakdowns: Breakdowns by label, not a Trace \(breakdown\(trace\)"),
            (lambda: store_baseline(tmp_path / "x.json", runs), r"run_doc: a run's document .* not "
                                                     r"load_run's first value"),
            (lambda: store_baseline(tmp_path / "x.json", {"a": 1}),
             r"run_doc: .* not a dict of another shape")):
        with pytest.raises(TypeError, match=said):
            call()
    with pytest.raises(TypeError, match=r"plotly_js: inline, cdn, a URL or a \.js path, not 5"):
        analyse([BEFORE], tmp_path / "runs", plotly_js=5)   # (before any breakdown)
    assert not list(tmp_path.iterdir())
    with pytest.raises(IndexError, match=f"layer {len(b.layers)} of {len(b.layers)}: out of "
                                         "range"):
        b.layers[len(b.layers)]


def test_a_profiler_window_against_forward_passes_has_no_whole_step_ratio():
    """One trace broken down twice, its 15 forward passes as the steps against the whole
    profiler window as one step (375 layers against 12): no whole-step ratio (it read 0.027,
    the window's many passes against one), and the note says over how many steps each
    side's medians are."""
    import dataclasses

    from kimi_perf import breakdown, read_trace

    trace = read_trace(NSYS / "jsun-012-assignment2-systems__result__nsys2025.1.3.sqlite")
    passes, window = breakdown(trace, step_regex="^Forward$"), breakdown(trace)
    rows = compare(passes, window)
    step = next(r for r in rows if r.label == WHOLE_STEP)
    assert (step.layers_a, step.layers_b, step.steps_a, step.steps_b) == (12, 375, 15, 1)
    assert step.kernel_ratio is None and step.span_ratio is None
    assert "whole step: no ratio, as the steps hold 12 and 375 layers" in ratio_note(
        rows, "A", "B")
    same = compare(passes, passes)
    assert "whole step: the median step, all its kernels" in ratio_note(same, "A", "B")
    # a window holding fewer layers than the passes: a graph's pattern taking two eager
    # layers as one, say; those steps compare
    from kimi_perf.comparison import _other_work

    assert not _other_work([6, 12], [True, False], [False, True])
    assert _other_work([24, 12], [True, False], [False, True])
    fewer = compare(passes, dataclasses.replace(passes, steps=passes.steps[:5]))
    assert next(r for r in fewer if r.label == WHOLE_STEP).kernel_ratio is not None
    assert ("whole step: the median step (of 15 and of 5 steps), all its kernels"
            in ratio_note(fewer, "A", "B"))


def test_a_span_ratio_the_kernels_time_does_not_explain_is_said():
    """wan2.1's training layers before and after: the same 157 kernels, 0.998 of the time,
    yet 0.879 of the span: the note says the rest is idle time between kernels (the table
    shows spans alone), and JSON has the kernel-time ratio."""
    from kimi_perf.comparison import idle_note

    compared = compare_files(BEFORE, AFTER)
    (a_row,) = [r for r in compared.rows if r.type == "A"]
    assert (a_row.span_ratio, a_row.kernel_us_ratio) == (pytest.approx(0.879, abs=5e-4),
                                                         pytest.approx(0.998, abs=5e-4))
    assert a_row.to_json()["kernel_us_ratio"] == a_row.kernel_us_ratio
    assert idle_note(compared.rows) == (
        "µs ratios the kernels' time does not explain (the rest is idle time between kernels: "
        "launch gaps, syncs), against the ratio of kernel µs: A: 0.879, kernel µs 0.998")
    assert idle_note(compared.rows) in compared.table_notes
    assert idle_note(compare_files(BEFORE, BEFORE).rows) is None
    # not where a side's kernels overlap on streams (their µs summed past the span: the
    # spans' difference is no idle time alone), nor of a CPU run's ops
    kineto = NSYS.parent / "kineto"
    overlapped = compare_files(kineto / "hta_trace_diff_test_v100_rank1_cudagraph.json.gz",
                               kineto / "hta_trace_diff_control_a100_rank3.json.gz")
    step = next(r for r in overlapped.rows if r.label == WHOLE_STEP)
    assert step.kernel_us_b > step.span_us_b and step.span_ratio and step.kernel_us_ratio
    assert not any("does not explain" in note for note in overlapped.table_notes)
    assert not any("does not explain" in note for note in compare_files(BASELINE).table_notes)


def test_one_file_compared_with_itself_says_so(tmp_path):
    """compare S S (by any name: a symlink, a run and its breakdown.json) printed every
    ratio 1.00 without a word; a line says the sides are one file, or one capture (a copy).
    One run's two paths are no such slip."""
    link = tmp_path / "link.sqlite"
    link.symlink_to(BEFORE)
    for a, b in ((BEFORE, BEFORE), (BEFORE, link)):
        compared = compare_files(a, b)
        assert compared.side_notes[0] == (f"{compared.label_a} and {compared.label_b} are one "
                                          f"file ({a}): compared with itself")
        assert compared.side_notes[0] in compared.to_json()["notes"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "breakdown.json").symlink_to(BASELINE)
    assert "compared with itself" in compare_files(run_dir, BASELINE, "standard").side_notes[0]
    assert not any("compared with itself" in note for note in compare_files(BASELINE).side_notes)
    copy = tmp_path / "copy.sqlite"   # (one capture by two files: said as such)
    shutil.copy(BEFORE, copy)
    compared = compare_files(BEFORE, copy)
    assert compared.side_notes[0] == (f"{compared.label_a} and {compared.label_b} are one "
                                      f"capture (copy.sqlite: a copy of {BEFORE.name}): "
                                      "compared with itself")


def test_gate_files_given_settings_keeps_the_baseline_s_others(tmp_path):
    """gate_files(base, run, Tolerances(rel_tol=0.1)) used the defaults for every other
    setting, where `kimi-perf gate --rel-tol 0.1` keeps the metrics the baseline stored: the
    verdicts could differ. A dict of settings goes over the baseline's, as the options do."""
    from kimi_perf.gate import gate_files, tolerances_over

    stored = tmp_path / "b.json"
    result = CliRunner().invoke(main, ["gate", "--update", str(stored), str(BASELINE),
                                       "--metrics", "kernels,kernel_us"])
    assert result.exit_code == 0, result.output
    over = tolerances_over(stored, {"rel_tol": 0.1})
    assert (over.rel_tol, over.metrics) == (0.1, ("kernels", "kernel_us"))
    gated = gate_files(stored, BASELINE, {"rel_tol": 0.1})
    assert gated.result.tolerances == over
    printed = _printed("gate", stored, BASELINE, "--rel-tol", "0.1")
    assert printed["tolerances"]["metrics"] == ["kernels", "kernel_us"]
    # the verdict says the settings the baseline keeps, as gate's does, and the one given over
    # them is in force
    assert gated.result.stored_tolerances == printed["stored_tolerances"] == {
        "rel_tol": 0.05, "abs_tol_us": 1.0, "alpha": 0.01, "metrics": "kernels,kernel_us"}
    assert gated.result.tolerances.rel_tol == 0.1
    # none given: the baseline's (as None), never the defaults over its policy
    assert gate_files(stored, BASELINE, {}).result.tolerances == gate_files(
        stored, BASELINE).result.tolerances == tolerances_over(stored, {})
    assert gate_files(stored, BASELINE, Tolerances(rel_tol=0.1)).result.tolerances.metrics is None
    with pytest.raises(ValueError, match="rel_tol: a finite number"):
        tolerances_over(stored, {"rel_tol": -1})
    with pytest.raises(TypeError, match=r"tolerances: no setting 'rel-tol' \(one of rel_tol, "):
        gate_files(stored, BASELINE, {"rel-tol": 0.1})


def test_library_inputs_are_taken_as_their_commands_take_them(tmp_path):
    """A directory of traces stands for them in report_inputs and analyse, as report and
    trace --from take it; analyse refuses a trace given twice, as trace --from does; a
    Trace is saved as a .kptrace, never over the trace it was read from."""
    from kimi_perf import read_trace
    from kimi_perf.capture import analyse

    ranks = tmp_path / "ranks"
    ranks.mkdir()
    for rank in (0, 1):
        rank_copy(EXAMPLE_TRACE, ranks / f"rank{rank}.json.gz", rank)
    assert list(report_inputs([ranks]).breakdowns) == ["rank0", "rank1"]
    _, breakdowns, _ = analyse([ranks], tmp_path / "runs", plotly_js="cdn")
    assert list(breakdowns) == ["rank0", "rank1"]
    with pytest.raises(TraceError, match="given twice"):
        analyse([ranks / "rank0.json.gz", ranks / "rank0.json.gz"], tmp_path / "runs")
    with pytest.raises(ValueError, match="one trace or more"):
        analyse([], tmp_path / "runs")
    trace = read_trace(ranks / "rank0.json.gz")
    with pytest.raises(ValueError, match=r"a \.kptrace file"):
        trace.save(tmp_path / "x.json")
    with pytest.raises(ValueError, match=r"a \.kptrace file"):   # (over its own trace)
        trace.save(ranks / "rank0.json.gz")
    kept = (ranks / "rank0.json.gz").read_bytes()
    assert kept == rank_copy(EXAMPLE_TRACE, tmp_path / "again.json.gz", 0).read_bytes()
    trace.save(tmp_path / "x.kptrace")
    saved = read_trace(tmp_path / "x.kptrace")
    with pytest.raises(TraceError, match="a trace this one was read from: saving over it"):
        saved.save(tmp_path / "x.kptrace")


def test_errors_name_a_calls_arguments_where_the_command_line_names_options(tmp_path):
    """A notebook has no --phase to change: an error of a call names its argument as the call
    spells it (phase='prefill'), and the same error on the command line the option; after a
    command, calls name arguments again."""
    from kimi_perf import breakdown, read_trace
    from kimi_perf.gate import gate_files
    from kimi_perf.report import write_report

    trace = read_trace(BEFORE)
    calls = ((lambda: breakdown(trace, phase="prefill"), "phase='prefill': the trace has no",
              ["breakdown", BEFORE, "--phase", "prefill"], "--phase prefill: the trace has no"),
             (lambda: breakdown(trace, step_regex="zzzz"), "no range matching "
              "step_regex='zzzz' holds", ["breakdown", BEFORE, "--steps", "zzzz"],
              "no range matching --steps 'zzzz' holds"),
             (lambda: breakdown(trace, layers="nvtx:zzz"), "layers='nvtx:zzz': no range",
              ["breakdown", BEFORE, "--layers", "nvtx:zzz"], "--layers nvtx:zzz: no range"),
             (lambda: load_breakdown(BASELINE), "choose one with path_name",
              ["breakdown", BASELINE], "choose one with --path"),
             (lambda: gate_files(BEFORE, AFTER, path_name="standard"),
              "path_name picks a decode path",
              ["gate", BEFORE, AFTER, "--path", "standard"], "--path picks a decode path"),
             (lambda: write_report(tmp_path / "r.html", {"a": breakdown(trace)}, "t",
                                   plotly_js=str(tmp_path / "none.js")),
              "plotly_js: no such file", None, None))
    for call, said, command, said_there in calls:
        with pytest.raises(TraceError) as raised:
            call()
        assert said in str(raised.value) and " --" not in str(raised.value), raised.value
        if command is not None:
            result = CliRunner().invoke(main, [*map(str, command)])
            assert result.exit_code == 2 and said_there in result.output, result.output
    with pytest.raises(TraceError, match="phase='prefill'"):   # (the command is over)
        breakdown(trace, phase="prefill")
    # a run directory among traces: the call that draws it, where the command line names
    # the command
    from kimi_perf.capture import analyse
    from kimi_perf.runs import trace_files
    from tests.conftest import KINETO

    run_dir = analyse([KINETO / "hta_a100_triton_example.json.gz"], tmp_path / "runs")[0]
    with pytest.raises(TraceError, match="not a directory of traces: report_inputs draws it"):
        trace_files([run_dir])
    said = CliRunner().invoke(main, ["trace", "--from", str(run_dir), "-o",
                                     str(tmp_path / "again")])
    assert said.exit_code == 2 and "kimi-perf report draws it" in said.output


def test_compare_says_one_capture_under_two_names_and_the_paths_it_left_out(tmp_path):
    """A trace against a copy of it, or against the .kptrace saved from it elsewhere, read
    every ratio 1.00 without a word (one file by two names was said); trace --from took three
    copies as three ranks; compare of a --from run of three traces dropped the third
    silently; a CPU run's fusion ledger read 'above 1: the fusion is faster'."""
    from kimi_perf.capture import analyse
    from tests.conftest import KINETO

    source = KINETO / "hta_a100_triton_example.json.gz"
    shutil.copy(source, tmp_path / "a.json.gz")
    shutil.copy(source, tmp_path / "b.json.gz")
    compared = compare_files(tmp_path / "a.json.gz", tmp_path / "b.json.gz")
    assert compared.notes.count("a and b are one capture (b.json.gz: a copy of a.json.gz): "
                                "compared with itself") == 1
    (tmp_path / "saved").mkdir()
    assert CliRunner().invoke(main, ["convert", str(source),
                                     str(tmp_path / "saved" / "t.kptrace")]).exit_code == 0
    compared = compare_files(source, tmp_path / "saved" / "t.kptrace")
    assert (f"saved as {tmp_path / 'saved' / 't.kptrace'}): compared with itself"
            in " ".join(compared.notes))   # (not "beside it": it is elsewhere)
    with pytest.raises(TraceError, match=r"b\.json\.gz: given twice \(a copy of a\.json\.gz\)"):
        analyse([tmp_path / "a.json.gz", tmp_path / "b.json.gz"], tmp_path / "runs")
    others = [KINETO / "hta_amd_mi250_rocm62_minitoy.json.gz",
              KINETO / "hta_v100_ns_resolution_gpu_user_annotation.json.gz"]
    run_dir, results, _ = analyse([source, *others], tmp_path / "runs")
    third = list(results)[2]
    note = compare_files(run_dir).notes
    assert (f"{run_dir} holds 3 paths: compared are its first two, {third} left out (its "
            "report sets the first against each of the others)") in note
    ledger = CliRunner().invoke(main, ["compare", str(BASELINE), "--kernels"]).output
    assert "a CPU run: its µs are CPU time, the specialized launches in Triton's" in " ".join(
        ledger.split())
    assert "the fusion is faster" not in ledger


def test_every_call_taking_files_says_what_goes_there(tmp_path):
    """A number or a list where a file's path goes, in each call that takes files: a
    TypeError naming the argument (it was pathlib's "expected str, bytes or os.PathLike")."""
    from kimi_perf.capture import analyse
    from kimi_perf.gate import gate_files
    from kimi_perf.report import write_report
    from kimi_perf.runs import store_baseline

    runs, doc, _ = load_run(BASELINE)
    for call, said in (
            (lambda: gate_files(5, BASELINE), "baseline: a file's path .* not int"),
            (lambda: gate_files(BASELINE, [BASELINE]), "run: a file's path .* not a list"),
            (lambda: update_baseline(5, BASELINE), "baseline: a file's path .* not int"),
            (lambda: update_baseline(tmp_path / "b.json", 5), "run: a file's path .* not int"),
            (lambda: load_paths(5), "path: a file's path .* not int"),
            (lambda: store_baseline(5, doc), "file: a file's path .* not int"),
            (lambda: write_report(5, runs, "t"), "path: a file's path .* not int"),
            (lambda: write_report(tmp_path / "r.html", runs, None),
             "title: the page's title .* not NoneType"),
            (lambda: report_inputs([BASELINE, 5]), r"inputs\[1\]: a file's path .* not int"),
            (lambda: analyse([5], tmp_path), r"files\[0\]: a file's path .* not int"),
            (lambda: analyse([BEFORE], 5), "out_dir: a file's path .* not int"),
            (lambda: compare_files(BEFORE, AFTER, labels="xy"),
             "labels: a tuple of two names, not str 'xy'")):
        with pytest.raises(TypeError, match=said):
            call()
    assert not list(tmp_path.iterdir())


def test_gate_files_takes_the_path_by_the_name_compare_files_does():
    from kimi_perf.gate import gate_files

    gated = gate_files(BASELINE, BASELINE, Tolerances(metrics="kernels"),
                       path_name="specialized")
    assert set(gated.baseline) == set(gated.current) == {"specialized"}
    assert gated.files == (BASELINE, BASELINE)
    with pytest.raises(TypeError, match=r"unknown breakdown option path \(one of layers, rules, "
                                        r"step_regex\); path_name picks the decode path"):
        gate_files(BASELINE, BASELINE, path="specialized")


def test_gate_text_and_document_are_what_gate_writes(tmp_path):
    """What `gate -o FILE`, `--format json` and `--junit` write, as calls (the text was the
    command's own, so that a notebook's JUnit suite had no output)."""
    from kimi_perf.gate import gate_files
    from kimi_perf.render import gate_document, gate_junit, gate_text

    base = tmp_path / "base.json"
    update_baseline(base, BASELINE)
    text, doc, xml = tmp_path / "v.txt", tmp_path / "v.json", tmp_path / "v.xml"
    for args in (["-o", text, "--junit", xml], ["--format", "json", "-o", doc]):
        result = CliRunner().invoke(main, ["gate", str(base), str(BASELINE), "--rel-tol", "0.1",
                                           *map(str, args)])
        assert result.exit_code == 0, result.output
    gated = gate_files(base, BASELINE, {"rel_tol": 0.1})
    assert text.read_text() == gate_text(gated) + "\n"
    assert "gate: pass" in gate_text(gated) and "of CPU runs not checked" in gate_text(gated)
    assert json.loads(doc.read_text()) == json.loads(json.dumps(gate_document(gated)))
    assert xml.read_text() == gate_junit(gated.result, (str(base), str(BASELINE)),
                                         gate_text(gated))


def test_breakdown_from_json_checks_what_it_reads():
    """Breakdown.from_json checks a document as load_run does (layers of another kind were
    taken, and failed later as an AttributeError), and says that a file is read elsewhere."""
    from kimi_perf import Breakdown

    doc = json.loads(BASELINE.read_text())["paths"]["standard"]
    assert len(Breakdown.from_json(doc).layers) == len(doc["layers"])
    for field, value, said in (("layers", "oops", "layers is a string, not a list"),
                               ("steps", [{"kernels": -5}], r"steps\[0\]")):
        with pytest.raises(TraceError, match=f"^x.json: paths.standard.{said}"):
            Breakdown.from_json(doc | {field: value}, "x.json", "paths.standard.")
    with pytest.raises(TypeError, match=r"doc: .* not a str: load_breakdown\(file\) reads"):
        Breakdown.from_json(str(BASELINE))


def test_layer_rows_are_a_sequence_with_columns_by_layer_column():
    """b.layers of a breakdown made here: a Sequence whose index() is the sequence's (a
    column named index hid it), the same as a stored breakdown's list; a field's name as
    an index says where the column is."""
    from kimi_perf import breakdown_of_file
    from kimi_perf.layer_breakdown import layer_column

    b = breakdown_of_file(BEFORE)
    assert b.layers.index(b.layers[3]) == 3 and b.layers.count(b.layers[0]) == 1
    assert layer_column(b.layers, "index").tolist() == [r["index"] for r in b.layers]
    assert b.layers_table().column("index").to_pylist() == [r["index"] for r in b.layers]
    with pytest.raises(TypeError, match=r"layers\['type'\]: the layers are rows, indexed by "
                                        r"number \(layer_column"):
        b.layers["type"]


def test_the_package_completes_to_its_exports_and_modules():
    import kimi_perf
    from kimi_perf.errors import NoGpuWork, NoStepsMatched

    names = dir(kimi_perf)
    assert {"runs", "gate", "report", "capture", "comparison", "breakdown"} <= set(names)
    assert not {"importlib", "TYPE_CHECKING", "_module_named"} & set(names)
    assert (kimi_perf.NoGpuWork, kimi_perf.NoStepsMatched) == (NoGpuWork, NoStepsMatched)


def test_tolerances_of_another_kind_and_a_plural_repr():
    import numpy as np

    from kimi_perf.gate import Check, GateResult

    with pytest.raises(TypeError, match="rel_tol: a number, not str 'x'"):
        Tolerances(rel_tol="x")
    with pytest.raises(TypeError, match="alpha: a number, not bool True"):
        Tolerances(alpha=True)
    kept = Tolerances(rel_tol=np.float32(0.25))
    assert type(kept.rel_tol) is float and json.dumps(kept.rel_tol) == "0.25"
    checks = [Check("standard", "kda", metric, 1.0, 2.0, 1.0, 0.001, "regression")
              for metric in ("kernels", "span_us")]
    assert repr(GateResult(checks, Tolerances())) == "GateResult(FAIL, 2 checks, 2 regressions)"


def test_compare_of_a_tp_run_says_its_figures_are_rank_0_s(tmp_path):
    """A --tp run's breakdowns are its rank 0's: compare says so, as trace and the report do
    (it said nothing, as if the run were of one process)."""
    doc = json.loads(BASELINE.read_text())
    doc["run"]["tp"] = 2
    tp_run = tmp_path / "tp.json"
    tp_run.write_text(json.dumps(doc))
    said = "both are rank 0's of TP 2 (every rank's trace: PATH.rankN.trace.json.gz"
    assert any(note.startswith(said) for note in compare_files(tp_run).notes)
    against = compare_files(BASELINE, tp_run, path_name="specialized").notes
    assert any(note.startswith("tp:specialized is rank 0's of TP 2") for note in against)
    assert not any("rank 0's" in note for note in compare_files(BASELINE).notes)


def test_the_documents_links_name_files_and_sections_they_have():
    """Every link of the README and the reference names a file of the repository and, after
    its ``#``, a heading that file has, by GitHub's anchors (lower case, punctuation dropped,
    spaces as hyphens): a heading renamed or a file moved leaves no dead link."""
    import re

    def prose(path: Path) -> str:   # without code blocks
        return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)

    def anchors(path: Path) -> set[str]:
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                for h in re.findall(r"^#{1,6} (.+)$", prose(path), flags=re.M)}

    dead, checked = [], 0
    for document in (REPO / "README.md", REPO / "docs" / "reference.md"):
        links = re.sub(r"`[^`]*`", "", prose(document))   # not in code: `layer[0](dense)`
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", links):
            if "://" in target or not (target or anchor):
                continue
            linked = (document.parent / target).resolve() if target else document
            checked += 1
            if not linked.is_file() or (anchor and anchor not in anchors(linked)):
                dead.append(f"{document.name}: {target}#{anchor}")
    assert checked >= 25 and dead == []


def test_compare_of_a_run_of_many_paths_names_those_it_left_out(tmp_path):
    """A run of five paths: compare names the three it left out, all of them; of six, the
    first three and "…"."""
    doc = json.loads(BASELINE.read_text())
    for name in ("p3", "p4", "p5"):
        doc["paths"][name] = doc["paths"]["standard"]
    five = tmp_path / "five.json"
    five.write_text(json.dumps(doc))
    assert (f"{five} holds 5 paths: compared are its first two, p3, p4, p5 left out (its "
            "report sets") in " ".join(compare_files(five).notes)
    doc["paths"]["p6"] = doc["paths"]["standard"]
    six = tmp_path / "six.json"
    six.write_text(json.dumps(doc))
    assert (f"{six} holds 6 paths: compared are its first two, p3, p4, p5, … left out"
            in " ".join(compare_files(six).notes))


def test_a_file_compared_with_itself_gets_two_labels():
    """One file as both sides, or one run's path twice: B's label is primed, so the table's
    two columns are told apart."""
    from tests.conftest import KINETO

    trace = KINETO / "hta_a100_triton_example.json.gz"
    itself = compare_files(trace, trace)
    assert (itself.label_a, itself.label_b) == ("kineto/hta_a100_triton_example",
                                                "kineto/hta_a100_triton_example'")
    path = compare_files(BASELINE, BASELINE, path_name="specialized")
    assert (path.label_a, path.label_b) == ("tiny-cpu:specialized", "tiny-cpu:specialized'")


def test_trace_from_records_its_command_and_each_trace_once(tmp_path):
    """A --from run's command names each trace and every option not left at its default, the
    report's plotly.js too, so that it makes the same run again; a trace given again through a
    symlink is the same trace, said with the name it was first given by."""
    import shlex

    from kimi_perf.capture import analyse

    _, _, run_info = analyse([BEFORE, AFTER], tmp_path / "runs", plotly_js="cdn")
    assert run_info["command"] == shlex.join(
        ["kimi-perf", "trace", "--from", str(BEFORE), "--from", str(AFTER), "--out",
         str(tmp_path / "runs"), "--plotly-js", "cdn"])
    link = tmp_path / "link.sqlite"
    link.symlink_to(BEFORE)
    with pytest.raises(TraceError) as said:
        analyse([BEFORE, link], tmp_path / "none")
    assert str(said.value) == f"{link}: given twice (also as {BEFORE}): each trace once"
    assert not (tmp_path / "none").exists()


def test_a_baseline_is_stored_whole_and_never_into_a_run(tmp_path):
    """store_baseline writes as every -o does, a temporary file renamed over the old one: a
    gate that opened the old baseline meanwhile reads it whole and unchanged, and nothing else
    is left beside it. A run directory's breakdown.json (or the directory) is refused: its
    run.json and traces would no longer describe it."""
    from kimi_perf.runs import store_baseline

    doc = json.loads(BASELINE.read_text())
    stored = tmp_path / "b.json"
    stored.write_text("last night's baseline")
    with open(stored) as reading:
        store_baseline(stored, doc)
        assert reading.read() == "last night's baseline"
    assert json.loads(stored.read_text()) == doc
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(BASELINE, run_dir / "breakdown.json")
    (run_dir / "run.json").write_text('{"command": "kimi-perf trace"}\n')
    for target in (run_dir, run_dir / "breakdown.json"):
        with pytest.raises(TraceError, match=r"is a kimi-perf run directory's: its run\.json"):
            store_baseline(target, doc)
    assert (run_dir / "breakdown.json").read_bytes() == BASELINE.read_bytes()


def test_a_trace_in_a_run_directory_is_a_path_s_only_where_its_name_says_one(tmp_path):
    """``captured_path``: a file in a ``kimi-perf trace`` run directory is a decode path's
    trace where its name, up to its first dot, is a path the run captured (run.json's
    request.paths); any other file there (a note, a trace copied in) is none, and brings no
    run information (``captured_run``); nor does a path's trace beside no run.json."""
    from kimi_perf.runs import captured_path, captured_run

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    info = {"command": "kimi-perf trace", "request": {"paths": ["standard", "specialized"]}}
    (run_dir / "run.json").write_text(json.dumps(info))
    names = ("standard.kptrace", "specialized.rank1.trace.json.gz", "extra.kptrace",
             "notes.json", "standardized.kptrace")
    for name in names:
        (run_dir / name).write_text("x")
    assert [captured_path(run_dir / n) for n in names] == [
        "standard", "specialized", None, None, None]
    assert captured_run(run_dir / "standard.kptrace") == {"run": info}
    assert captured_run(run_dir / "extra.kptrace") is None
    (tmp_path / "standard.kptrace").write_text("x")
    assert captured_path(tmp_path / "standard.kptrace") is None
    # a run.json the gate could not read (a count as text) brings no run information
    (run_dir / "run.json").write_text(json.dumps({**info, "batch": "two"}))
    assert captured_path(run_dir / "standard.kptrace") == "standard"
    assert captured_run(run_dir / "standard.kptrace") is None


def test_runs_of_the_same_paths_in_another_order_were_captured_alike():
    """``run_differences(..., paths=True)``: the decode paths two runs captured are paired by
    name, so the same paths listed in another order (``--paths specialized,standard``) are
    no difference of capture; a path one run lacks is."""
    import copy

    from kimi_perf.runs import run_differences

    doc = json.loads(BASELINE.read_text())
    assert doc["run"]["request"]["paths"] == ["standard", "specialized"]
    turned = copy.deepcopy(doc)
    turned["run"]["request"]["paths"] = ["specialized", "standard"]
    assert run_differences(doc, turned, paths=True) == []
    fewer = copy.deepcopy(doc)
    fewer["run"]["request"]["paths"] = ["standard"]
    assert run_differences(doc, fewer, paths=True) == [
        "decode paths standard, specialized vs standard"]
    assert run_differences(doc, fewer) == []


def test_an_empty_file_named_as_a_trace_is_read_not_left_out(tmp_path):
    """``trace_files``: an empty ``*.trace.json`` in a directory is a trace cut short (a
    worker that crashed before writing: the reader says so), kept among the traces; an empty
    JSON of another name (a summary not written) is left out, said to be empty."""
    from kimi_perf.runs import trace_files

    (tmp_path / "worker.trace.json").write_text("")
    (tmp_path / "summary.json").write_text("")
    (tmp_path / "main.json").write_text('{"traceEvents": []}')
    left_out: list = []
    assert trace_files([tmp_path], left_out=left_out) == [tmp_path / "main.json",
                                                          tmp_path / "worker.trace.json"]
    assert left_out == [(tmp_path / "summary.json", "an empty file")]
    # a trace after more blanks than the head read holds is no empty file: read, as read_trace
    # reads it
    (tmp_path / "summary.json").write_text(" " * (1 << 16) + '{"traceEvents": []}')
    left_out.clear()
    assert trace_files([tmp_path], left_out=left_out) == [
        tmp_path / "main.json", tmp_path / "summary.json", tmp_path / "worker.trace.json"]
    assert left_out == []


def test_kimi_perf_s_own_json_in_a_directory_of_traces_is_left_out_once(tmp_path):
    """``trace_files``: a breakdown JSON saved beside a profiler's traces is kimi-perf's own
    JSON, left out and said once as that (not again as JSON that is no trace)."""
    from kimi_perf.runs import trace_files

    (tmp_path / "rank0.json").write_text('{"traceEvents": []}')
    shutil.copy(BASELINE, tmp_path / "breakdown-rank0.json")
    left_out: list = []
    assert trace_files([tmp_path], left_out=left_out) == [tmp_path / "rank0.json"]
    assert left_out == [(tmp_path / "breakdown-rank0.json", "kimi-perf's own JSON")]


def test_a_breakdown_json_is_one_breakdown_under_the_label_given(tmp_path):
    """``load_paths`` and ``stored_breakdowns``: a breakdown JSON (one trace's) is one
    breakdown, named by the label given, with no run document; a decode path asked of it is
    said to be a run's to pick (it is no run)."""
    from kimi_perf import runs as runs_mod

    one = tmp_path / "one.json"
    one.write_text(json.dumps(json.loads(BASELINE.read_text())["paths"]["standard"]))
    breakdowns, run_doc = load_paths(one, label="before")
    assert list(breakdowns) == ["before"] and run_doc is None
    assert breakdowns["before"].layer_types == load_breakdown(one).layer_types
    assert runs_mod.stored_breakdowns(one)[1] is None
    with pytest.raises(TraceError, match=r"picks a decode path of a kimi-perf run: .* is not one"):
        load_breakdown(one, path_name="standard")


def test_rank_numbers_past_any_job_s_say_no_missing_rank():
    """``missing_ranks``: ranks skipped from 0 to the highest given are said, but a number of
    4096 or more names no rank of a job (a port, a pid), and says none missing."""
    from kimi_perf.runs import missing_ranks, ranks_missing

    assert ranks_missing(["job.rank0.json", "job.rank3.json"]) == (
        "ranks missing among the traces: job.rank{1, 2}.json (of 0 to the highest given)")
    assert missing_ranks(["rank0", "rank4095"]) == {("rank", ""): list(range(1, 4095))}
    assert missing_ranks(["rank0", "rank4096"]) == {}


def test_a_report_and_an_export_older_than_it_are_two_captures(tmp_path):
    """``same_capture``, for traces given one by one: an .nsys-rep and the SQLite export nsys
    left beside it are one capture (the one given later is said to be the other's); an export
    older than its report is an earlier capture's (``nsys profile -f true`` again), no twin."""
    import os

    from kimi_perf.runs import same_capture

    report, export = tmp_path / "x.nsys-rep", tmp_path / "x.sqlite"
    report.write_bytes(b"a report")
    export.write_bytes(b"its export")
    assert same_capture([report, export]) == (export, "the export of x.nsys-rep")
    assert same_capture([export, report]) == (report, "the report exported as x.sqlite")
    os.utime(export, (1_000_000, 1_000_000))    # (1970: long before the report)
    assert same_capture([report, export]) is None
    assert same_capture([export, report]) is None


def test_one_run_given_three_times_is_drawn_three_times_each_label_primed_once_more():
    """report_inputs of one stored run given three times keeps every path of each: the
    second's labels primed once, the third's twice, none drawn over another."""
    got = report_inputs([BASELINE] * 3)
    assert list(got.breakdowns) == [
        "tiny-cpu:standard", "tiny-cpu:specialized", "tiny-cpu:standard'",
        "tiny-cpu:specialized'", "tiny-cpu:standard''", "tiny-cpu:specialized''"]
