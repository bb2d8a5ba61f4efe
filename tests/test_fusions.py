"""The ledger of fused launches: which standard launches each specialized one replaces."""

from __future__ import annotations

import json
import re

from kimi_perf.decode.fusions import (
    REPLACES,
    SPECIALIZED_LAUNCHES,
    STANDARD_LAUNCHES,
    STANDS_IN_FOR,
    LedgerRow,
    fusion_ledger,
)
from tests.conftest import KINETO, REPO
from tests.test_gate import BASELINE

DECODE = REPO / "kimi_perf" / "decode"


def _launch_names(*files: str) -> set[str]:
    """Every launch a path's code annotates: launch("name") and named all-reduces (and the
    default one, o_proj's)."""
    text = "".join((DECODE / f).read_text() for f in files)
    names = set(re.findall(r'launch\("(\w+)"\)', text))
    names |= set(re.findall(r'_all_reduce\([^()]*"(\w+)"\)', text))
    return names | {"all_reduce"}


def test_the_ledger_names_exactly_the_launches_the_paths_make():
    """The map is complete and nothing in it is stale: the standard path's launches (its
    PyTorch ops and its one-kernel-per-step form) and the specialized path's, as their code
    annotates them, TP all-reduces and layer 0's dense MLP included."""
    assert _launch_names("model.py", "standard_kernels.py", "kernel_path.py") \
        == STANDARD_LAUNCHES
    assert _launch_names("specialized.py", "kernel_path.py") == SPECIALIZED_LAUNCHES
    replaced = [n for launch, names in REPLACES.items() if launch not in STANDS_IN_FOR
                for n in names]
    assert len(replaced) == len(set(replaced))      # each standard launch goes to one place
    # an opt-in's launches do between them what the launch they stand in for does
    for default in set(STANDS_IN_FOR.values()):
        assert sorted(n for launch, target in STANDS_IN_FOR.items() if target == default
                      for n in REPLACES[launch]) == sorted(REPLACES[default])


def test_a_run_s_typical_layers_account_for_every_standard_launch():
    doc = json.loads(BASELINE.read_text())["paths"]
    typical = {path: {t["type"]: t["typical_layer"]["kernels"] for t in doc[path]["layer_types"]}
               for path in ("standard", "specialized")}
    for layer_type in ("kda", "mla"):
        standard, specialized = typical["standard"][layer_type], typical["specialized"][layer_type]
        rows, left = fusion_ledger(standard, specialized)
        assert left == [] and len(rows) == len(specialized)
        assert sorted(n for r in rows for n in r.replaces) == sorted(k["name"] for k in standard)
        assert round(sum(r.replaced_us for r in rows), 3) == round(
            sum(k["us"] for k in standard), 3)
    kda = {r.launch: r for r in fusion_ledger(typical["standard"]["kda"],
                                              typical["specialized"]["kda"])[0]}
    assert kda["fused_kda_decode"].replaces == ["f_b_proj", "fused_kda_decode"]
    r = kda["latent_up_proj"]
    assert r.ratio == float(f"{r.replaced_us / r.us:.4g}")
    # to 4 significant digits, as compare's ratios: an interpreted launch's 0.006374 is not
    # 0.006, nor 0.0004 0.0
    assert LedgerRow("in_proj", 1000.0, ["in_proj_qkvgfab"], 6.374).ratio == 0.006374
    assert LedgerRow("in_proj", 10000.0, ["in_proj_qkvgfab"], 4.0).ratio == 0.0004


def test_a_name_launched_twice_is_taken_launch_by_launch():
    """Under TP layer 0 all-reduces twice (after o_proj, after the dense MLP): each of the
    specialized path's all-reduces takes one standard launch, first to first, and the counts
    in the footer are of launches."""
    standard = [{"name": n, "us": us} for n, us in (
        ("o_proj", 5.0), ("all_reduce", 100.0), ("attn_res_post", 2.0), ("dense_gate_up", 8.0),
        ("dense_situ_and_mul", 1.0), ("dense_down", 4.0), ("all_reduce", 30.0))]
    specialized = [{"name": n, "us": us} for n, us in (
        ("o_proj", 5.0), ("all_reduce", 90.0), ("attn_res_post", 2.0),
        ("dense_gate_up_situ", 7.0), ("dense_down", 4.0), ("all_reduce", 20.0))]
    rows, left = fusion_ledger(standard, specialized)
    assert [(r.launch, r.replaces, r.replaced_us) for r in rows] == [
        ("o_proj", ["o_proj"], 5.0), ("all_reduce", ["all_reduce"], 100.0),
        ("attn_res_post", ["attn_res_post"], 2.0),
        ("dense_gate_up_situ", ["dense_gate_up", "dense_situ_and_mul"], 9.0),
        ("dense_down", ["dense_down"], 4.0), ("all_reduce", ["all_reduce"], 30.0)]
    assert left == []
    from kimi_perf.render import fusion_table

    assert fusion_table("dense", "standard", "specialized", rows, left).caption.startswith(
        "6 launches for 7: 128.0 µs for 150.0 µs")
    # a standard launch no specialized one takes is left, once per launch
    rows, left = fusion_ledger(standard, specialized[:2])
    assert left == ["attn_res_post", "dense_gate_up", "dense_situ_and_mul", "dense_down",
                    "all_reduce"]


def test_no_ledger_for_kernel_names():
    """A GPU trace without launch annotations names kernels: no ledger is made up."""
    standard = [{"name": "sm90_xmma_gemm_bf16", "us": 3.0}]
    specialized = [{"name": "_skinny_linear_kernel", "us": 1.0}]
    assert fusion_ledger(standard, specialized) is None
    assert fusion_ledger([{"name": "o_proj", "us": 2.0}], [{"name": "o_proj", "us": 1.0}]) \
        is not None


def test_no_ledger_against_a_trace_without_that_layer_type(tmp_path):
    """The specialized path against a trace that has no layer of its type (a vLLM trace, say):
    its launches replace nothing there, so there is no ledger to show."""
    from click.testing import CliRunner

    from kimi_perf.cli import main

    assert fusion_ledger([], [{"name": "o_proj", "us": 1.0}]) is None
    vllm = KINETO / "tracelens_vllm_gptoss20b_decode_fullgraph_mi300x.json.gz"
    compared = CliRunner().invoke(main, ["compare", str(BASELINE), str(vllm), "--path",
                                         "specialized", "--kernels"])
    assert compared.exit_code == 0 and "Typical" in compared.output, compared.output
    assert "against the standard launches" not in compared.output
    assert "(new work)" not in compared.output
    report = tmp_path / "r.html"
    drawn = CliRunner().invoke(main, ["report", str(BASELINE), str(vllm), "--path",
                                      "specialized", "-o", str(report), "--plotly-js", "cdn"])
    assert drawn.exit_code == 0, drawn.output
    assert "Fusions, launch by launch" not in report.read_text()


def test_compare_kernels_shows_the_ledger_of_the_two_paths(tmp_path):
    from click.testing import CliRunner

    from kimi_perf.cli import main

    out = CliRunner().invoke(main, ["compare", str(BASELINE), "--kernels"]).output
    assert "kda: each specialized launch against the standard launches it replaces" in out
    assert "f_b_proj + fused_kda_decode" in out and "9 launches for 18: " in out
    assert "12 launches for 24: " in out
    # the other way round (specialized as A) it is the same ledger, the columns swapped back
    paths = json.loads(BASELINE.read_text())["paths"]
    for name in ("standard", "specialized"):
        (tmp_path / f"{name}.json").write_text(json.dumps(paths[name]))
    swapped = CliRunner().invoke(main, ["compare", str(tmp_path / "specialized.json"),
                                        str(tmp_path / "standard.json"), "--kernels",
                                        "--format", "json"]).output
    kda = json.loads(swapped)["fusions"]["kda"]
    assert (kda["standard"], kda["specialized"]) == ("standard", "specialized")
    assert kda["ratio_of"] == "replaced_us / us"
    # the table's ratios are specialized over standard there: the ledger's note says its own
    # are the other way round (one output read 27.22 above and 0.01 below, unexplained)
    text = " ".join(CliRunner().invoke(main, [
        "compare", str(tmp_path / "specialized.json"), str(tmp_path / "standard.json"),
        "--kernels"]).output.split())
    assert "ratio: their µs over its, standard over specialized (the other way round from " \
           "the ratios above), above 1 where the launch takes less (a CPU run" in text
    assert "the other way round" not in " ".join(CliRunner().invoke(
        main, ["compare", str(BASELINE), "--kernels"]).output.split())
    assert {r["launch"]: r["replaces"] for r in kda["launches"]}["fused_kda_decode"] == [
        "f_b_proj", "fused_kda_decode"]
    itself = CliRunner().invoke(main, ["compare", str(BASELINE), str(BASELINE), "--path",
                                       "specialized", "--kernels"])
    assert itself.exit_code == 0 and "Typical" in itself.output, itself.output
    assert "against the" not in itself.output   # one path against itself: no fusions to show
    # the JSON holds the same ledger, per layer type
    doc = json.loads(CliRunner().invoke(main, ["compare", str(BASELINE), "--kernels",
                                               "--format", "json"]).output)
    kda = doc["fusions"]["kda"]
    assert (kda["standard"], kda["specialized"]) == ("standard", "specialized")
    fused = {r["launch"]: r for r in kda["launches"]}
    assert len(fused) == 9 and fused["fused_kda_decode"]["replaces"] == [
        "f_b_proj", "fused_kda_decode"]
    assert fused["fused_kda_decode"]["ratio"] == float(
        f'{fused["fused_kda_decode"]["replaced_us"] / fused["fused_kda_decode"]["us"]:.4g}')
    assert kda["unmatched_standard"] == []
    plain = json.loads(CliRunner().invoke(main, ["compare", str(BASELINE), "--format",
                                                 "json"]).output)
    assert "fusions" not in plain and "typical_layers" not in plain


def test_report_pairs_layer_types_for_its_ledgers_as_compare_does(tmp_path):
    """Types found by their kernel pattern keep a letter per trace ("A" in one may be "B" in
    the other): the report's ledgers pair them as compare does (by pattern, then by class
    mix), not by the letter."""
    from click.testing import CliRunner

    from kimi_perf.cli import main

    paths = json.loads(BASELINE.read_text())["paths"]
    letters = {"standard": dict(zip(("dense", "kda", "mla"), "ABC", strict=True)),
               "specialized": dict(zip(("dense", "kda", "mla"), "CAB", strict=True))}
    for name, letter in letters.items():
        doc = paths[name]
        for t in doc["layer_types"]:
            t["pattern"] = f"{name}-{t['type']}"       # digests that differ between paths
            t["type"] = letter[t["type"]]
        for layer in doc["layers"]:
            layer["type"] = letter[layer["type"]]
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    a, b = (str(tmp_path / f"{name}.json") for name in ("standard", "specialized"))
    fusions = json.loads(CliRunner().invoke(main, ["compare", a, b, "--kernels", "--format",
                                                   "json"]).output)["fusions"]
    assert {label: len(f["launches"]) for label, f in fusions.items()} == {
        "A = C": 7, "B = A": 9, "C = B": 12}   # dense, kda, mla: paired by their mixes
    report = tmp_path / "r.html"
    result = CliRunner().invoke(main, ["report", a, b, "-o", str(report), "--plotly-js",
                                       "cdn"])
    assert result.exit_code == 0, result.output
    ledgers = re.findall(r"<h3>(\w): each (\S+) launch against the \S+ launches it replaces"
                         r"</h3>.*?<th>(\d+) launches</th>", report.read_text())
    assert sorted((t, int(n)) for t, _, n in ledgers) == [("A", 7), ("B", 9), ("C", 12)]


def test_no_ratio_for_new_work_or_a_launch_of_no_time():
    """A launch that replaces nothing (the L2 prefetch: new work) has no ratio, nor does one
    whose median is 0 µs (no division by it); otherwise it is what it replaced over it."""
    assert LedgerRow("l2_prefetch", 3.0, [], 0.0).ratio is None
    assert LedgerRow("o_proj", 0.0, ["o_proj"], 1.0).ratio is None
    assert LedgerRow("o_proj", 4.0, ["o_proj"], 1.0).ratio == 0.25


def test_no_ledger_when_any_launch_is_named_by_its_kernel():
    """One kernel name among either path's launch names (a trace part annotated) is not a
    ledger: every launch of both must be a launch name of its path."""
    standard = [{"name": "o_proj", "us": 2.0}]
    specialized = [{"name": "o_proj", "us": 1.0}, {"name": "_skinny_linear_kernel", "us": 1.0}]
    assert fusion_ledger(standard, specialized) is None
    assert fusion_ledger([*standard, {"name": "sm90_xmma_gemm_bf16", "us": 1.0}],
                         specialized[:1]) is None


def test_the_fusion_table_names_new_work_and_says_which_way_its_ratios_go(monkeypatch):
    """A specialized launch that replaces no standard launch reads "(new work)", with no
    ratio; the caption counts the launches on each side and the µs of each; where the
    comparison above has the specialized path as A, it says its ratios go the other way
    round, and of a CPU run that they are no speed figure."""
    from kimi_perf.render import fusion_table, tables_text

    rows = [LedgerRow("dense_gate_up_situ", 7.0, ["dense_gate_up", "dense_situ_and_mul"], 9.0),
            LedgerRow("extra_launch", 2.0, [], 0.0),
            LedgerRow("attn_res", 2.0, ["attn_res_pre", "attn_res_post"], 3.0)]
    table = fusion_table("dense", "standard", "specialized", rows, ["dense_down"])
    monkeypatch.delenv("COLUMNS", raising=False)   # (as piped: the table boxed, whole)
    cells = [[c.strip() for c in line.split("│")[1:-1]]
             for line in tables_text([table]).splitlines() if line.startswith("│")]
    assert cells == [["dense_gate_up_situ", "7.0", "dense_gate_up + dense_situ_and_mul", "9.0",
                      "1.29"], ["extra_launch", "2.0", "(new work)", "0.0", "-"],
                     ["attn_res", "2.0", "attn_res_pre + attn_res_post", "3.0", "1.50"]]
    assert table.caption == ("3 launches for 4: 11.0 µs for 12.0 µs; ratio: their µs over its, "
                             "above 1: the fusion is faster\n"
                             "standard launches no specialized launch took: dense_down")
    cpu = fusion_table("dense", "standard", "specialized", rows, [], on_cpu=True,
                       specialized_first=True).caption
    assert cpu.startswith("3 launches for 4: 11.0 µs for 12.0 µs; ratio: their µs over its, "
                          "standard over specialized (the other way round from the ratios "
                          "above), above 1 where the launch takes less (a CPU run: ")
    assert "\n" not in cpu and "the fusion is faster" not in cpu
