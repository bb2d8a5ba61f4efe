"""Memory floors against the design note's own arithmetic (k3-decode.md, section 4: one H200
rank, 4.3 TB/s), which was worked out by hand, apart from this code."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from kimi_perf.cli import main
from kimi_perf.decode.config import preset
from kimi_perf.decode.floors import Storage, expected_experts, floors, launch_bytes

TP8 = preset("k3-tp8")
TP16 = preset("k3-tp16")
MXFP4 = Storage(experts="mxfp4", kv_cache="fp8")


def _state_bytes(layer_type: str, launches: dict[str, float]) -> float:
    """The KV or state part of a layer's bytes (the note's "KV or state MB" column)."""
    if layer_type == "mla":
        return launches["mla_decode"]
    f_b = TP8.kda_heads_local * TP8.kda_head_dim * TP8.f_rank * 2
    return launches["fused_kda_decode"] - f_b


@pytest.mark.parametrize(("layer_type", "storage", "batch", "weights_mb", "state_mb", "floor"), [
    ("kda", Storage(), 1, 393.5, 1.63, 91.9),      # "K3 KDA, all bf16"
    ("kda", MXFP4, 1, 296.4, 1.63, 69.3),          # "K3 KDA+latentMoE (vLLM sharding)"
    ("mla", MXFP4, 1, 268.4, 2.36, 63.0),          # "K3 gated-MLA+latentMoE", fp8 KV @ 4k
    ("kda", MXFP4, 64, 1606, 104.2, 397.8),
    ("mla", MXFP4, 64, 1578, 151.0, 402.2),
])
def test_floors_match_the_design_notes_table(layer_type, storage, batch, weights_mb, state_mb,
                                             floor):
    launches = launch_bytes(TP8, layer_type, batch, 4096, storage)
    state = _state_bytes(layer_type, launches)
    assert (sum(launches.values()) - state) / 1e6 == pytest.approx(weights_mb, rel=2.5e-3)
    assert state / 1e6 == pytest.approx(state_mb, rel=5e-3)
    assert floors(TP8, batch, 4096, storage)["layer_types"][layer_type]["floor_us"] == \
        pytest.approx(floor, abs=0.25)


def test_expected_experts_under_uniform_top_k():
    assert [round(expected_experts(TP8, b), 1) for b in (1, 8, 64)] == [16.0, 120.3, 613.2]


def test_the_note_worked_example_component_by_component():
    """K3 KDA TP8, B=1, bf16 non-expert weights, MXFP4 experts: the note's rows in MB."""
    b = launch_bytes(TP8, "kda", 1, 0, MXFP4)
    assert round(b["in_proj"] / 1e6, 2) == 90.14
    assert round(b["o_proj"] / 1e6, 2) == 22.02
    router, latent = 896 * 7168 * 2, 3584 * 7168 * 2
    assert b["router_latent_down"] == router + latent
    assert b["latent_up_proj"] == latent
    shared = 3 * 2 * 3072 * 7168 / 8 * 2
    routed = 16 * 3 * 384 * 3584 * 0.53125
    assert b["moe_fc1_situ_shared_gate_up"] + b["moe_fc2_combine_shared_down"] \
        == pytest.approx(shared + routed)


def test_storage_and_layer_type_are_checked():
    with pytest.raises(ValueError, match="kv_cache must be one of bf16, fp8"):
        Storage(kv_cache="mxfp4")
    with pytest.raises(ValueError, match="layer type"):
        launch_bytes(TP8, "ssm", 1, 0)


def test_floors_command():
    runner = CliRunner()
    table = runner.invoke(main, ["floors", "--experts", "mxfp4", "--kv-cache", "fp8"])
    assert table.exit_code == 0, table.output
    # the design note's table: 69.3 and 63.0 µs (held to it above within 0.25 µs); printed
    # to a tenth as computed
    assert "floor per layer: kda 69.3 µs" in table.output and "mla 62.9 µs" in table.output
    doc = json.loads(runner.invoke(main, ["floors", "--preset", "k3", "--tp", "16", "--batch",
                                          "64", "--format", "json"]).output)
    assert doc["tp"] == 16 and doc["expected_experts"] == round(expected_experts(TP16, 64), 6)
    kda = doc["layer_types"]["kda"]
    assert kda["bytes"] == sum(v["bytes"] for v in kda["launches"].values())
    # whole bytes in every launch, at batch 1 (16 experts read) as at 64 (613.2, expected)
    for batch in ("1", "64"):
        doc = json.loads(runner.invoke(main, ["floors", "--batch", batch, "--format",
                                              "json"]).output)
        for t in doc["layer_types"].values():
            assert all(type(v["bytes"]) is int for v in t["launches"].values())
    assert doc["expected_experts"] != round(doc["expected_experts"], 2)   # not cut to 47.15
    for args, message in ((["--preset", "k4"], "unknown preset 'k4'"),
                          (["--preset", "k3", "--tp", "7"], "TP 7 does not divide the model: "
                           "kda_heads=96 does not split over 7 ranks")):
        bad = runner.invoke(main, ["floors", *args])
        assert bad.exit_code == 2 and message in bad.output


def test_a_speculative_verify_step_routes_every_token_and_records_every_position():
    """A verify of 1+3 tokens at batch 2: the experts of 8 routed tokens; the KDA states read
    and written once, as a decode step's, and per position each head's key, decay and
    correction (fp32) and the conv inputs (bf16) written and read back by the next step; the
    latent cache read once per sequence."""
    plain = launch_bytes(TP8, "kda", 2, 4096, MXFP4)
    verify = launch_bytes(TP8, "kda", 2, 4096, MXFP4, tokens=4)
    position = 12 * 3 * 128 * 4 + 3 * 12 * 128 * 2              # records of one position
    assert verify["fused_kda_decode"] - plain["fused_kda_decode"] == 2 * 2 * 4 * position
    state = 12 * 128 * 128 * 4
    assert 2 * 4 * position < state / 3    # where keeping each position's state took 4 more
    routed = 3 * 384 * 3584 * 0.53125                          # one MXFP4 expert's bytes
    assert (verify["moe_fc1_situ_shared_gate_up"] + verify["moe_fc2_combine_shared_down"]
            - plain["moe_fc1_situ_shared_gate_up"] - plain["moe_fc2_combine_shared_down"]
            ) == pytest.approx((expected_experts(TP8, 8) - expected_experts(TP8, 2)) * routed)
    mla = launch_bytes(TP8, "mla", 2, 4096, MXFP4, tokens=4)
    assert mla["mla_decode"] == launch_bytes(TP8, "mla", 2, 4096, MXFP4)["mla_decode"]
    out = CliRunner().invoke(main, ["floors", "--batch", "2", "--spec-tokens", "3",
                                    "--format", "json"])
    doc = json.loads(out.output)
    assert doc["tokens"] == 4 and doc["expected_experts"] == round(expected_experts(TP8, 8), 6)
    table = CliRunner().invoke(main, ["floors", "--batch", "2", "--spec-tokens", "3"]).output
    assert "batch 2 verifying 4 tokens each" in " ".join(table.split())


def test_a_run_s_floors_are_of_the_layer_types_it_holds():
    """A capture's run.json holds the floors of the layer types its model has: two layers
    are the dense-MLP layer and a gated-MLA one, no KDA layer with the MoE."""
    from kimi_perf.decode.floors import floors

    two, three = preset("tiny", n_layers=2), preset("tiny", n_layers=3)
    assert two.layer_types() == ["dense", "mla"] and three.layer_types() == ["dense", "kda",
                                                                               "mla"]
    doc = floors(two, 1, 4, layer_types=tuple(two.layer_types()))
    assert list(doc["layer_types"]) == ["dense", "mla"]
    assert doc["layer_types"]["mla"] == floors(three, 1, 4)["layer_types"]["mla"]


@pytest.mark.parametrize("option", ["--batch", "--context", "--spec-tokens", "--bandwidth"])
def test_floors_options_are_bounded(option):
    """A batch, context or draft count of 400 digits (no float holds it) or a bandwidth of
    1e308 (floors of 0 µs, and Infinity in JSON): one usage line, exit 2, the number cut
    short; within the bounds every figure is finite, JSON as any parser reads it."""
    runner = CliRunner()
    for value in (str(10**400), "1e308", "-1"):
        result = runner.invoke(main, ["floors", option, value, "--format", "json"])
        assert result.exit_code == 2, result.output
        (line,) = result.output.strip().splitlines()
        assert line.startswith(f"kimi-perf: error: Invalid value for '{option}'")
        assert len(line) < 200


def test_floors_at_the_bounds_stay_finite_and_whole():
    def refuse(constant: str):
        raise AssertionError(f"{constant} in floors' JSON")

    runner = CliRunner()
    for bandwidth in ("0.001", "1000"):
        result = runner.invoke(main, ["floors", "--preset", "k3", "--batch", "65536",
                                      "--context", str(2**24), "--spec-tokens", "31",
                                      "--bandwidth", bandwidth, "--format", "json"])
        assert result.exit_code == 0, result.output
        doc = json.loads(result.output, parse_constant=refuse)
        layers = doc["layer_types"].values()
        assert all(0 < t["floor_us"] < 1e13 for t in layers)
        # (bf16 experts, all 896 read) whole numbers below 2^53: no digits of rounding noise
        assert all(t["bytes"] < 2**53 and t["bytes"] == int(t["bytes"]) for t in layers)


def test_floors_refuse_mxfp4_experts_a_rank_cannot_store():
    """MXFP4 experts where a rank's expert inputs are not whole groups of 32 (tiny at TP 4:
    16 per rank) have no floors, as trace refuses them: the same one line, exit 2; called,
    a ValueError naming the argument; the floors still import no torch."""
    result = CliRunner().invoke(main, ["floors", "--preset", "tiny", "--tp", "4",
                                       "--experts", "mxfp4"])
    assert result.exit_code == 2, result.output
    (line,) = result.output.splitlines()
    assert line.startswith("kimi-perf: error: --experts mxfp4: MXFP4 experts need their "
                           "inputs in groups of 32: the routed experts' intermediate per rank "
                           "is 16 (at TP 4)")
    with pytest.raises(ValueError, match=r"^storage.experts='mxfp4': MXFP4 experts need"):
        floors(preset("tiny", tp=4), 1, 4, Storage(experts="mxfp4"))
    assert floors(preset("tiny", tp=2), 1, 4, Storage(experts="mxfp4"))["tp"] == 2
    imported = subprocess.run(
        [sys.executable, "-c", "import sys, kimi_perf.decode.floors; "
         "print('torch' in sys.modules)"], capture_output=True, text=True, check=True)
    assert imported.stdout == "False\n"


def test_fp8_weights_leave_w_uk_w_uv_and_the_router_in_bf16():
    """K3 TP8, batch 1, context 4096, fp8 non-expert weights and bf16 experts and cache:
    every launch's bytes, elements × dtype size. The non-expert weights (and the shared
    experts) read 1 byte each; W_UK, W_UV and the router stay 2, as does the bf16 cache; the
    KDA states are fp32 (read and written), the conv states bf16. Layer 0 (``dense``) is a
    KDA attention and the dense MLP: no MoE launches."""
    fp8 = Storage(weights="fp8")
    kda_attention = {
        "in_proj": 6288 * 7168,
        "fused_kda_decode": 12 * 128 * 128 + 2 * (12 * 128 * 128 * 4 + 3 * 1536 * 3 * 2),
        "o_proj": 7168 * 1536}
    moe = {"router_latent_down": 896 * 7168 * 2 + 3584 * 7168,
           "moe_fc1_situ_shared_gate_up": 16 * 2 * 384 * 3584 * 2 + 2 * 768 * 7168,
           "moe_fc2_combine_shared_down": 16 * 3584 * 384 * 2 + 7168 * 768,
           "latent_up_proj": 7168 * 3584}
    mla = {"qkv_a_g_proj": (1536 + 576 + 12 * 128) * 7168,
           "q_b_proj": 12 * (128 + 64) * 1536,
           "bmm_w_uk_cache_insert": 12 * 128 * 512 * 2,
           "mla_decode": 4096 * 576 * 2,
           "bmm_w_uv_gate": 12 * 512 * 128 * 2,
           "o_proj": 7168 * 12 * 128}
    dense = {**kda_attention, "dense_gate_up_situ": 2 * 4224 * 7168, "dense_down": 4224 * 7168}
    for layer_type, want in (("kda", {**kda_attention, **moe}), ("mla", {**mla, **moe}),
                             ("dense", dense)):
        got = launch_bytes(TP8, layer_type, 1, 4096, fp8)
        assert list(got) == list(want)
        assert got == pytest.approx(want, rel=1e-12), layer_type
    doc = floors(TP8, 1, 4096, fp8)
    assert doc["layer_types"]["dense"]["bytes"] == sum(dense.values())
    assert (doc["context"], doc["storage"]) == (4096, {"weights": "fp8", "experts": "bf16",
                                                       "kv_cache": "bf16"})


def test_floors_round_bytes_to_whole_and_microseconds_to_3_decimals():
    """At batch 3 the expected distinct experts, 896 - 880³/896², make FC1 read
    281570742 6/7 bytes: whole, 281570743 (rounded, not cut). At 1 TB/s a launch's floor is
    its bytes over 1e6 µs, to 3 decimals (in_proj, 90144768 bytes: 90.145 µs), and so is
    the layer's."""
    from fractions import Fraction

    experts = 896 * (1 - Fraction(880, 896) ** 3)
    fc1 = experts * 2 * 384 * 3584 * 2 + 2 * 768 * 7168 * 2
    assert fc1 == 281570742 + Fraction(6, 7)
    doc = floors(TP8, 3, 0, bandwidth=1e12)
    kda = doc["layer_types"]["kda"]
    assert kda["launches"]["moe_fc1_situ_shared_gate_up"]["bytes"] == 281570743
    assert kda["launches"]["in_proj"] == {"bytes": 90144768, "floor_us": 90.145}
    assert kda["floor_us"] == round(kda["bytes"] / 1e6, 3) != round(kda["bytes"] / 1e6, 2)


def test_a_step_of_no_tokens_and_an_unknown_expert_storage_are_refused():
    """A step holds at least one token per sequence; experts are stored bf16, fp8 or MXFP4."""
    with pytest.raises(ValueError, match="at least one token per sequence, not 0"):
        floors(TP8, 1, 0, tokens=0)
    with pytest.raises(ValueError, match="experts must be one of bf16, fp8, mxfp4, not 'fp4'"):
        Storage(experts="fp4")
