"""``kimi-perf validate``: every decode path against the float64 reference, same weights."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

import torch

from kimi_perf.decode.config import K3Config, preset
from kimi_perf.decode.model import FP8, K3Model
from kimi_perf.decode.reference import Observer, ReferenceModel
from kimi_perf.decode.weights import random_weights

# standard_kernels: the standard path's steps as one kernel each, as it runs on a GPU
PATHS = ("standard", "standard_kernels", "specialized")
DEFAULT_PATHS = ("standard", "specialized")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Relative-error bounds per compute dtype (and for an fp8 latent cache). float32 checks the
# math itself; bf16 allows the rounding of a deep residual stream, measured on random weights
# of the tiny preset with margin. routing_gap: how far a path's top-k choice may fall below
# the reference's own k-th best sigmoid score (a bf16 router sees a slightly different input).
BOUNDS = {
    ("float32", "bf16"): {"layer": 1e-4, "logits": 1e-4, "routing_gap": 1e-4},
    ("float32", "fp8"): {"layer": 0.15, "logits": 0.1, "routing_gap": 0.1},
    ("bfloat16", "bf16"): {"layer": 0.15, "logits": 0.1, "routing_gap": 0.1},
    ("bfloat16", "fp8"): {"layer": 0.25, "logits": 0.15, "routing_gap": 0.15},
}


@dataclass
class ValidationRun:
    config: K3Config
    batch: int
    prompt: int
    steps: int
    dtype: str
    kv_cache: str
    seed: int


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def make_path(name: str, c: K3Config, weights, dtype: torch.dtype) -> K3Model:
    if name == "standard":
        return K3Model(c, weights, dtype=dtype)
    if name == "standard_kernels":
        from kimi_perf.decode.standard_kernels import StandardKernelsModel

        return StandardKernelsModel(c, weights, dtype=dtype)
    if name == "specialized":
        from kimi_perf.decode.specialized import SpecializedModel

        return SpecializedModel(c, weights, dtype=dtype)
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
    weights = random_weights(c, seed=run.seed)
    gen = torch.Generator().manual_seed(run.seed + 1)
    tokens = torch.randint(0, c.vocab, (run.batch, run.prompt + run.steps), generator=gen)
    model = make_path(path, c, weights, DTYPES[run.dtype])
    kv_dtype = FP8 if run.kv_cache == "fp8" else None
    state = model.new_state(run.batch, run.prompt + run.steps, kv_dtype=kv_dtype)
    ref = ReferenceModel(c, weights, run.batch)

    # Prefill through the path (the standard path always) and the reference, token by token.
    seen = Observer()
    model.forward(tokens[:, : run.prompt], state, seen)
    for t in range(run.prompt):
        ref.step(tokens[:, t], routing={i: e[:, t] for i, e in seen.experts.items()})

    errors: dict[str, float] = {}
    logits_err = gap = 0.0
    launches: dict[str, int] = {}
    for step in range(run.steps):
        seen, expected = Observer(), Observer()
        model.launches = [] if step == 0 else None
        t = run.prompt + step
        logits = model.forward(tokens[:, t: t + 1], state, seen)[:, -1]
        if step == 0:
            launches = launches_per_layer_type(model, c)
        model.launches = None
        want = ref.step(tokens[:, t], expected,
                        routing={i: e[:, -1] for i, e in seen.experts.items()})
        for i in range(c.n_layers):
            kind = c.layer_type(i)
            err = max(rel_err(seen.attn_out[i][:, -1], expected.attn_out[i]),
                      rel_err(seen.mlp_out[i][:, -1], expected.mlp_out[i]))
            errors[kind] = max(errors.get(kind, 0.0), err)
        logits_err = max(logits_err, rel_err(logits, want))
        gap = max([gap, *expected.routing_gap.values()])
    result = {
        "layer_types": {kind: {"max_rel_err": round(err, 6), "launches": launches.get(kind, 0)}
                        for kind, err in sorted(errors.items())},
        "logits_max_rel_err": round(logits_err, 6),
        "routing_max_gap": round(gap, 6),
    }
    if hasattr(model, "fallbacks"):
        result["fallbacks"] = list(model.fallbacks)
    return result


def validate(preset_name: str = "tiny", paths: tuple[str, ...] = DEFAULT_PATHS, steps: int = 8,
             batch: int = 2, prompt: int = 4, dtype: str = "bfloat16", kv_cache: str = "bf16",
             seed: int = 0, n_layers: int | None = None) -> dict:
    run = ValidationRun(preset(preset_name, n_layers=n_layers), batch, prompt, steps, dtype,
                        kv_cache, seed)
    bounds = BOUNDS[(dtype, kv_cache)]
    results = {path: validate_path(path, run) for path in paths}
    failures = []
    for path, r in results.items():
        for kind, v in r["layer_types"].items():
            if v["max_rel_err"] > bounds["layer"]:
                failures.append(f"{path} {kind} layers: {v['max_rel_err']:.3g} > "
                                f"{bounds['layer']:.3g}")
        if r["logits_max_rel_err"] > bounds["logits"]:
            failures.append(f"{path} logits: {r['logits_max_rel_err']:.3g} > "
                            f"{bounds['logits']:.3g}")
        if r["routing_max_gap"] > bounds["routing_gap"]:
            failures.append(f"{path} routing gap: {r['routing_max_gap']:.3g} > "
                            f"{bounds['routing_gap']:.3g}")
    return {"schema": 1, "preset": preset_name, "n_layers": run.config.n_layers,
            "config": run.config.fingerprint(), "dtype": dtype, "kv_cache": kv_cache,
            "batch": batch, "prompt": prompt, "steps": steps, "seed": seed, "bounds": bounds,
            "paths": results, "ok": not failures, "failures": failures}
