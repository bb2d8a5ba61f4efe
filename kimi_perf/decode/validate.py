"""``kimi-perf validate``: every decode path against the float64 reference, same weights."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass

import torch

from kimi_perf.decode.config import K3Config, preset
from kimi_perf.decode.fallbacks import every_decode_step_fell_back, summarise
from kimi_perf.decode.model import FP8, DecodeState, K3Model
from kimi_perf.decode.reference import Observer, ReferenceModel
from kimi_perf.decode.weights import random_weights, weight_bytes, weight_values
from kimi_perf.errors import argument

# standard_kernels: the standard path's steps as one kernel each, as it runs on a GPU
PATHS = ("standard", "standard_kernels", "specialized")
DEFAULT_PATHS = ("standard", "specialized")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Relative-error bounds per compute dtype (and for an fp8 latent cache), of each layer given
# the path's own inputs (the reference goes on from the path's outputs): a layer's own rounding
# and its state's over the steps, which does not grow with the depth (measured at 8, 24, 40 and
# 93 layers; more layers sample more of one sequence's tail at batch 1: below).
# float32 checks the math itself; an fp8 cache rounds the cached latents and the absorbed
# query, which the MLA layers' outputs alone show (every other layer, the logits and the
# routing are given the path's inputs: float32's bounds hold for them). Measured on the tiny preset
# (2026-12-05), the largest errors (layers, logits, routing gap) were: standard path, seeds
# 0-5 at batch 1, 2 and 8, 16 steps: bf16 cache 0.018, 0.0065, 0.0017; fp8 cache 0.076,
# 0.0056, 0.0031; float32 1e-6, 0, 0 and with the fp8 cache 0.075, 0, 0. Verify steps of 1+3
# and 1+7 tokens (seeds 0-5 at batch 1 and 4, seeds 0-3 at batch 2): bf16 0.023, 0.0071,
# 0.0031; fp8 0.061, 0.0056, 0.0029. The kernel paths (standard_kernels, specialized; seeds 0-1,
# batch 2, 8 steps): bf16 0.012, 0.0048, 0.0026; fp8 0.064, 0.0053, 0.0005; MXFP4 experts
# bf16 0.011, 0.0041, 0 and float32 3e-6. Another CPU's bf16 kernels round otherwise: on one
# with AVX512-BF16 (oneDNN's bf16 GEMMs; 2026-12-07) the same runs' largest were 0.017, 0.0069,
# 0.0025 (fp8 cache 0.076), and a KDA layer of 40 at batch 1 read 0.046 (seed 0; seeds 1-7
# 0.037 or less, and 0.020 at seed 0 with oneDNN off): at batch 1 the batch's error is one
# sequence's, whose long tail (below) the 34 KDA layers sample at every step. The bounds leave
# 1.6x or more (the KDA and dense layers' bf16 bound that 0.046). routing_gap: how far
# a path's top-k choice may fall below the reference's own k-th best biased score; a router
# that drops its correction bias falls 0.02-0.04 below it, in float32 and in bf16 (a test
# checks both are caught).
# ``layer``: the KDA layers and layer 0; ``mla_layer``: the gated-MLA layers. Those bound the
# batch's error at the decode steps; ``sequence``, ``mla_sequence`` and ``logits_sequence``
# each sequence's at every position, the prompt's too. One sequence's bf16 rounding has a
# long tail: a KDA head's output near zero (the prompt's first position: one token in the
# state) is scaled up by its RMSNorm. Measured (2026-12-05, tiny preset; the standard path at
# seeds 0-7, batch 1, 8 and 64, prompts of 1 and 4, 4 steps; verify steps of 1+3 and 1+7 at
# seeds 0-3, batch 1, 4 and 16; the kernel paths at seeds 0-2, batch 2 and 16, bf16 and MXFP4
# experts, a bf16 and an fp8 cache), the largest (KDA and dense layers, gated-MLA layers,
# logits): bf16 cache 0.144, 0.018, 0.009; fp8 cache 0.144, 0.116, 0.0077; float32 1e-5,
# 1e-6, 0 and with the fp8 cache 1e-5, 0.107, 0. The bounds leave 1.7x or more (float32's
# 10x).
BOUNDS = {
    ("float32", "bf16"): {"layer": 1e-4, "mla_layer": 1e-4, "logits": 1e-4,
                          "routing_gap": 1e-4, "sequence": 1e-4, "mla_sequence": 1e-4,
                          "logits_sequence": 1e-4},
    ("float32", "fp8"): {"layer": 1e-4, "mla_layer": 0.12, "logits": 1e-4, "routing_gap": 1e-4,
                         "sequence": 1e-4, "mla_sequence": 0.2, "logits_sequence": 1e-4},
    ("bfloat16", "bf16"): {"layer": 0.075, "mla_layer": 0.04, "logits": 0.012,
                           "routing_gap": 0.006, "sequence": 0.25, "mla_sequence": 0.05,
                           "logits_sequence": 0.02},
    ("bfloat16", "fp8"): {"layer": 0.075, "mla_layer": 0.125, "logits": 0.012,
                          "routing_gap": 0.006, "sequence": 0.25, "mla_sequence": 0.2,
                          "logits_sequence": 0.02},
}


def layer_bound(bounds: dict[str, float], layer_type: str, sequence: bool = False) -> float:
    return bounds[("mla_" if layer_type == "mla" else "")
                  + ("sequence" if sequence else "layer")]


@dataclass
class ValidationRun:
    config: K3Config
    batch: int
    prompt: int
    steps: int
    dtype: str
    kv_cache: str
    seed: int
    spec_tokens: int = 0     # draft tokens k: each step verifies 1+k tokens, then accepts some
    experts: str = "bf16"    # the routed experts' storage (weights.EXPERT_STORAGES)

    def accepted_lengths(self) -> torch.Tensor | None:
        """[steps, batch] synthetic acceptance (1..1+k tokens per sequence), seeded."""
        if not self.spec_tokens:
            return None
        gen = torch.Generator().manual_seed(self.seed + 2)
        return torch.randint(1, self.spec_tokens + 2, (self.steps, self.batch), generator=gen)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def row_errors(out: torch.Tensor, ref: torch.Tensor) -> list[float]:
    """Each sequence's relative error ‖out − ref‖ / ‖ref‖ (rows of [B, ...]): over the whole
    batch, one sequence's error would shrink as 1/√B."""
    diff = (out.double() - ref).flatten(1).norm(dim=-1)
    return (diff / ref.flatten(1).norm(dim=-1).clamp_min(1e-30)).tolist()


@dataclass
class Worst:
    """The largest error seen and where. A NaN or an infinity, once seen, stays with where it
    was: a path whose outputs are not numbers fails every bound (``max`` would pass over a
    NaN, ``>`` is False for it), and the first not finite is where it went wrong (the
    reference follows the path's infinity into a NaN a sub-layer on)."""

    value: float = 0.0
    at: str = ""

    def see(self, errors: list[float], where: str, per_sequence: bool = True) -> None:
        for b, err in enumerate(errors):
            if not math.isfinite(self.value):
                return
            if math.isnan(err) or err > self.value:
                self.value = err
                self.at = f"{where}, sequence {b}" if per_sequence else where


def within(value: float, bound: float) -> bool:
    return value <= bound        # (False for a NaN)


def make_path(name: str, c: K3Config, weights, dtype: torch.dtype, experts: str = "bf16"
              ) -> K3Model:
    if name == "standard":
        return K3Model(c, weights, dtype=dtype, experts=experts)
    if name == "standard_kernels":
        from kimi_perf.decode.standard_kernels import StandardKernelsModel

        return StandardKernelsModel(c, weights, dtype=dtype, experts=experts)
    if name == "specialized":
        from kimi_perf.decode.specialized import SpecializedModel

        return SpecializedModel(c, weights, dtype=dtype, experts=experts)
    raise ValueError(f"unknown decode path {name!r} (available: {', '.join(PATHS)})")


def launches_per_layer_type(model: K3Model, c: K3Config) -> dict[str, int]:
    """Median launches per layer of each type in one recorded forward."""
    per_layer = Counter(layer for layer, _ in model.launches or [] if 0 <= layer < c.n_layers)
    by_type: dict[str, list[int]] = {}
    for layer in range(c.n_layers):
        by_type.setdefault(c.layer_type(layer), []).append(per_layer[layer])
    return {t: int(statistics.median(v)) for t, v in by_type.items()}


def validate_path(path: str, run: ValidationRun) -> dict:
    c = run.config
    weights = random_weights(c, seed=run.seed, experts=run.experts)
    width = 1 + run.spec_tokens                     # tokens per sequence in each decode step
    gen = torch.Generator().manual_seed(run.seed + 1)
    tokens = torch.randint(0, c.vocab, (run.batch, run.prompt + run.steps * width),
                           generator=gen)
    accepted = run.accepted_lengths()
    model = make_path(path, c, weights, DTYPES[run.dtype], run.experts)
    kv_dtype = FP8 if run.kv_cache == "fp8" else None
    state = model.new_state(run.batch, tokens.shape[1], kv_dtype=kv_dtype,
                            max_verify=width if run.spec_tokens else 0)
    # With speculative steps, one reference per sequence: after a verify step each keeps its
    # own accepted prefix. They share one float64 copy of the weights (.to of a float64
    # tensor is the tensor). Without, one reference runs the batch. Two of each: one goes
    # on from the path's outputs after every layer (each layer checked on the path's own
    # inputs: its error, bounded, whatever the depth), one from its own (the drift of the
    # whole model: rounding grown through the layers, as random weights amplify it).
    weights64 = {name: w.to(torch.float64) for name, w in weights.items()}
    rows = [[b] for b in range(run.batch)] if run.spec_tokens else [list(range(run.batch))]
    refs = {how: [ReferenceModel(c, weights64, len(r)) for r in rows]
            for how in ("layer", "drift")}

    def reference_step(step_tokens: torch.Tensor, t: int, seen: Observer
                       ) -> dict[str, tuple[torch.Tensor, list[Observer]]]:
        """Each reference of every sequence at position t of the step, following the path's
        routing there: per kind, logits [B, vocab] and what each reference saw."""
        out = {}
        for how, models in refs.items():
            expected = [Observer() for _ in models]
            logits = []
            for ref, r, saw in zip(models, rows, expected, strict=True):
                follow = None if how == "drift" else Observer(
                    attn_out={i: o[r, t] for i, o in seen.attn_out.items()},
                    mlp_out={i: o[r, t] for i, o in seen.mlp_out.items()})
                logits.append(ref.step(step_tokens[r, t], saw, follow=follow, routing={
                    i: e[r, t] for i, e in seen.experts.items()}))
            out[how] = torch.cat(logits), expected
        return out

    # Per layer type (and "logits"): the batch's error at the decode steps, as the paths'
    # rounding is bounded ("layer": given the path's inputs; "drift": on its own), and each
    # sequence's at every position, the prompt's too ("sequence": a sequence gone wrong that
    # the batch's norm would shrink as 1/√B, a wrong prefill).
    errors: dict[str, dict[str, Worst]] = {"layer": {}, "drift": {}, "sequence": {}}
    gap = Worst()
    invalid, invalid_at = 0, []   # (how many, and where the first was)

    def see(how: str, kind: str, out: torch.Tensor, ref: torch.Tensor, where: str,
            decode: bool) -> None:
        if decode:
            errors[how].setdefault(kind, Worst()).see([rel_err(out, ref)], where,
                                                      per_sequence=False)
        if how == "layer":
            errors["sequence"].setdefault(kind, Worst()).see(row_errors(out, ref), where)

    def check(step_tokens: torch.Tensor, t: int, seen: Observer, logits: torch.Tensor,
              where: str, decode: bool = True) -> None:
        """Position t of a forward against each reference: every layer's outputs and the
        logits, and the routing."""
        nonlocal invalid
        for how, (want, expected) in reference_step(step_tokens, t, seen).items():
            for i in range(c.n_layers):
                for part, outs, refs_out in (
                        ("attention", seen.attn_out[i], [e.attn_out[i] for e in expected]),
                        ("MLP", seen.mlp_out[i], [e.mlp_out[i] for e in expected])):
                    see(how, c.layer_type(i), outs[:, t], torch.cat(refs_out),
                        f"{where}, layer {i} {part}", decode)
            see(how, "logits", logits[:, t], want, where, decode)
            if how == "layer":   # (per reference, by layer, each sequence of its rows)
                for r, e in zip(rows, expected, strict=True):
                    for i, gaps in e.routing_gap.items():
                        for b, g in zip(r, gaps, strict=True):
                            gap.see([g], f"{where}, layer {i}, sequence {b}",
                                    per_sequence=False)
                    for i, counts in e.routing_invalid.items():
                        for b, n in zip(r, counts, strict=True):
                            if n and not invalid_at:
                                invalid_at.append(f"{where}, layer {i}, sequence {b}")
                            invalid += n

    # The prompt through the path (the standard path always), checked position by position
    # as the decode steps are: a wrong prefill is a wrong cache for every step after it.
    seen = Observer()
    model.call_name = "prefill"   # (the names a trace of the harness's run would give)
    prompt_logits = model.forward(tokens[:, : run.prompt], state, seen)
    for t in range(run.prompt):
        check(tokens, t, seen, prompt_logits, f"prompt position {t}", decode=False)
    del prompt_logits, seen

    launches: dict[str, int] = {}
    position = torch.full((run.batch,), run.prompt)
    for step in range(run.steps):
        step_tokens = torch.stack([tokens[b, p: p + width]
                                   for b, p in enumerate(position.tolist())])
        seen = Observer()
        model.launches = [] if step == 0 else None
        model.call_name = f"decode_step[{step}]"
        logits = model.forward(step_tokens, state, seen, verify=bool(run.spec_tokens))
        if step == 0:
            launches = launches_per_layer_type(model, c)
        model.launches = None
        keep = torch.ones(run.batch, dtype=torch.long) if accepted is None else accepted[step]
        rollback: dict[tuple[str, int], tuple] = {}
        for t in range(width):
            check(step_tokens, t, seen, logits,
                  f"decode step {step}" + (f" token {t}" if run.spec_tokens else ""))
            for how in refs:
                for b, ref in enumerate(refs[how]):      # one reference per sequence here
                    if run.spec_tokens and t + 1 == int(keep[b]):
                        rollback[how, b] = ref.snapshot()
        if run.spec_tokens:
            state.accept(keep)
            for (how, b), saved in rollback.items():
                refs[how][b].restore(saved)
        position += keep
    def figures(kind: str, prefix: str = "") -> dict:
        layer, sequence = errors["layer"][kind], errors["sequence"][kind]
        return {f"{prefix}max_rel_err": round(layer.value, 6), f"{prefix}max_at": layer.at,
                f"{prefix}sequence_max_rel_err": round(sequence.value, 6),
                f"{prefix}sequence_max_at": sequence.at,
                f"{prefix}drift_max_rel_err": round(errors["drift"][kind].value, 6)}

    result = {
        "layer_types": {kind: {**figures(kind), "launches": launches.get(kind, 0)}
                        for kind in sorted(errors["layer"]) if kind != "logits"},
        **figures("logits", "logits_"),
        "routing_max_gap": round(gap.value, 6),
        "routing_max_gap_at": gap.at or None,   # (None: no choice fell below)
        "routing_invalid": invalid,
        "routing_invalid_at": invalid_at[0] if invalid_at else None,
    }
    if hasattr(model, "fallbacks"):
        result["fallbacks"] = summarise(model.fallbacks)
        result["every_step_fell_back"] = every_decode_step_fell_back(model.fallbacks,
                                                                     run.steps)
    return result


def cache_storage(dtype: str, kv_cache: str) -> str:
    """What the latent cache holds: fp8, or the paths' dtype (``kv_cache="bf16"`` of a float32
    run is a float32 cache: float32 checks the math itself)."""
    return "fp8" if kv_cache == "fp8" else {"bfloat16": "bf16", "float32": "float32"}[dtype]


def cache_bytes(dtype: str, kv_cache: str) -> int:
    return 1 if kv_cache == "fp8" else DTYPES[dtype].itemsize


def memory_need(dtype: str):
    """The bytes a validation holds for a config, at most: the weights drawn (bf16), a path's
    model of them in ``dtype`` and its packed copy, and the references' float64 copy (of every
    value: vectors too, which the others keep in fp32)."""
    def need(c: K3Config) -> int:
        return (weight_bytes(c) + 2 * weight_bytes(c, DTYPES[dtype])
                + 8 * weight_values(c))
    return need


def decode_need(c: K3Config, batch: int, prompt: int, steps: int, dtype: str, kv_cache: str,
                spec_tokens: int = 0) -> int:
    """About what a validation holds beside its weights, at most: the path's caches and the
    two references' (every value float64: their KDA states too; and one gated-MLA layer's keys
    and values decompressed over the cache), the token ids, the path's layer outputs over the
    prompt (fp32, kept for the reference to check) and the path's prefill
    (``prefill_bytes``). One path at a time: each is dropped before the next."""
    from kimi_perf.capture import prefill_bytes

    width = 1 + spec_tokens
    tokens = prompt + steps * width
    path = DecodeState.bytes_of(c, batch, tokens, cache_bytes(dtype, kv_cache),
                                DTYPES[dtype].itemsize, width if spec_tokens else 0)
    kda_layers = sum(not c.is_mla(i) for i in range(c.n_layers))
    reference = (DecodeState.bytes_of(c, batch, tokens, 8, 8)   # (its KDA states at fp32)
                 + kda_layers * batch * c.kda_heads * c.kda_head_dim ** 2 * 4
                 + batch * tokens * c.mla_heads * (c.qk_nope + c.v_head) * 8)
    seen = 2 * c.n_layers * batch * prompt * c.hidden * 4
    return (path + 2 * reference + 8 * batch * tokens + seen
            + prefill_bytes(c, batch, prompt, width, whole=True))


def whole_model(preset_name: str, n_layers: int | None = None) -> K3Config:
    """The preset's config; a ValueError for one of a rank's shapes (``k3-tp8``), which the
    float64 reference of the whole model cannot check (said before any weights are made:
    k3-tp8's take minutes)."""
    config = preset(preset_name, n_layers=n_layers)
    if config.tp != 1:
        raise ValueError(f"{argument('--preset', 'preset_name', preset_name)}: one rank's "
                         f"shapes of {config.tp}, and the float64 reference runs the whole "
                         "model: validate tiny or k3")
    return config


def validate(preset_name: str = "tiny", paths: tuple[str, ...] = DEFAULT_PATHS, steps: int = 8,
             batch: int = 2, prompt: int = 4, dtype: str = "bfloat16", kv_cache: str = "bf16",
             seed: int = 0, n_layers: int | None = None, spec_tokens: int = 0,
             experts: str = "bf16") -> dict:
    """Each path against the float64 reference: each layer given the path's own inputs (its
    error, bounded: ``max_rel_err``), and the whole model run on its own (its drift, not
    bounded: ``drift_max_rel_err``); ``spec_tokens=k`` makes every decode step a
    speculative verify of 1+k tokens per sequence followed by a seeded synthetic acceptance
    of 1..1+k of them (the state rolls back to it, and so does each sequence's reference).
    A verify step the specialized path does not take (over 8 tokens) falls back, and its
    ``fallbacks`` say so. ``experts="mxfp4"``: the routed experts hold MXFP4 values, and the
    kernel paths stream them as MXFP4 (the reference computes on the same values)."""
    if spec_tokens < 0:
        raise ValueError(f"spec_tokens takes 0 or more draft tokens, not {spec_tokens}")
    if steps < 1:   # (the bounds are of the decode steps: none would check no path)
        raise ValueError(f"steps: 1 or more decode steps, not {steps}")
    run = ValidationRun(whole_model(preset_name, n_layers), batch, prompt, steps, dtype,
                        kv_cache, seed, spec_tokens, experts)
    bounds = BOUNDS[(dtype, kv_cache)]
    results = {path: validate_path(path, run) for path in paths}
    failures = []
    for path, r in results.items():
        checked = [(f"{kind} layers", v, "", layer_bound(bounds, kind),
                    layer_bound(bounds, kind, sequence=True))
                   for kind, v in r["layer_types"].items()]
        checked.append(("logits", r, "logits_", bounds["logits"], bounds["logits_sequence"]))
        for what, v, prefix, bound, sequence_bound in checked:
            if prefix == "":
                v["bound"], v["sequence_bound"] = bound, sequence_bound
            if not within(v[f"{prefix}max_rel_err"], bound):
                failures.append(f"{path} {what}: {v[f'{prefix}max_rel_err']:.3g} > "
                                f"{bound:.3g} (at {v[f'{prefix}max_at']})")
            if not within(v[f"{prefix}sequence_max_rel_err"], sequence_bound):
                failures.append(f"{path} {what}, one sequence: "
                                f"{v[f'{prefix}sequence_max_rel_err']:.3g} > "
                                f"{sequence_bound:.3g} (at {v[f'{prefix}sequence_max_at']})")
        if not within(r["routing_max_gap"], bounds["routing_gap"]):
            failures.append(f"{path} routing gap: {r['routing_max_gap']:.3g} > "
                            f"{bounds['routing_gap']:.3g} (at {r['routing_max_gap_at']})")
        if r["routing_invalid"]:
            failures.append(f"{path} routing: {r['routing_invalid']} top-k choice(s) of a "
                            "token chose an expert twice or one that does not exist (the "
                            f"first at {r['routing_invalid_at']})")
        if r.get("every_step_fell_back"):
            failures.append(f"{path}: every decode step fell back to the standard path's "
                            f"PyTorch ops ({r['fallbacks'][-1].partition(': ')[2]}): none "
                            "of its kernels was checked")
    return {"schema": 1, "preset": preset_name, "n_layers": run.config.n_layers,
            "config_hash": run.config.fingerprint(), "dtype": dtype,
            "kv_cache": cache_storage(dtype, kv_cache),
            "experts": experts,
            "batch": batch, "prompt": prompt, "steps": steps, "seed": seed,
            "spec_tokens": spec_tokens,
            **({"accepted": run.accepted_lengths().tolist()} if spec_tokens else {}),
            "bounds": bounds,
            "paths": results, "ok": not failures, "failures": failures}
