"""Decode harness: a prompt (prefill, standard path), then N decode steps, annotated per step
and per layer so that traces attribute kernels to ``decode_step[i]`` and ``layer[j](type)``.

Annotations go to the PyTorch profiler (``record_function``: Kineto ``user_annotation``) and
to NVTX for Nsight Systems (``kimi_perf.decode.annotate``).

With CUDA graphs, a decode step is captured once (inside a ``graph_capture`` range, where the
``layer[j]`` ranges open around the captured launches) and replayed for every step: replays
carry ``decode_step[i]`` but no per-layer ranges. The trace core maps each replayed kernel
back to the launch that captured it, and so into its layer (``kimi_perf.graphs``), when the
trace holds the capture.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from kimi_perf.decode.annotate import annotate
from kimi_perf.decode.model import DecodeState, K3Model

# Eager runs before a capture: they compile the Triton kernels and set up cuBLAS workspaces,
# neither of which may happen inside a capture.
GRAPH_WARMUP_RUNS = 2
# Tokens a prefill takes in one forward call, whole sequences at a time: the activations of
# batch 64's prompts of 1024 tokens at once (some 50 GB) would not fit a GPU beside K3's
# weights, and each sequence's are its own (a token attends to its sequence alone).
PREFILL_CHUNK_TOKENS = 8192
# Draft tokens a speculative step verifies at most: 1+7 tokens per sequence is what the
# specialized path's kernels take (kimi_perf.decode.kernel_path.MAX_VERIFY_TOKENS).
MAX_SPEC_TOKENS = 7


def layer_range_name(layer: int, kind: str) -> str:
    return f"layer[{layer}]({kind})"


@dataclass
class DecodeRun:
    """What one harness run measured. Times are wall-clock seconds on the host, synchronised
    with the device after each step; prefill is kept apart from decode throughout."""

    tokens: torch.Tensor    # [B, warm-up + decode steps]: generated ids, or accepted counts
    prefill_s: float
    step_s: list[float] = field(default_factory=list)     # warm-up steps first
    accepted_counts: bool = False
    # the last step's logits all finite (None: no step): argmax picks a NaN as its token, so
    # the tokens alone would not show a path that computes NaN
    logits_finite: bool | None = None
    # the first decode step's logits [B, tokens, vocab] on the host, where asked for: the
    # prefill is the standard path's in every model, so two paths' first steps start from one
    # state (the paths side by side at shapes no float64 reference can afford)
    first_logits: torch.Tensor | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _layer_hook(model: K3Model):
    c = model.c
    return lambda i: annotate(layer_range_name(i, c.layer_type(i)))


@contextlib.contextmanager
def _call(model: K3Model, name: str, traced: bool = True):
    """A forward call of ``model`` named ``name`` (``K3Model.call_name``, which a fallback
    reports) and, when ``traced``, inside a trace range of that name."""
    model.call_name = name
    try:
        with annotate(name) if traced else contextlib.nullcontext():
            yield
    finally:
        model.call_name = None


def prefill_rows(batch: int, prompt: int) -> int:
    """The sequences one forward call of a prefill takes: as many as ``PREFILL_CHUNK_TOKENS``
    hold, one at least (a sequence is never cut)."""
    return max(1, min(batch, PREFILL_CHUNK_TOKENS // max(prompt, 1)))


def _prefill(model: K3Model, prompt: torch.Tensor, state: DecodeState
             ) -> tuple[torch.Tensor, float]:
    """The prompt through the model (the standard path), ``prefill_rows`` sequences a call:
    its last position's logits and the seconds taken. A path that says which calls fell back
    (``fallbacks``) says it of the prefill once, of the whole prompt (of each chunk it would
    name the chunk's batch, and its chunks' sizes apart), or, where some of its calls did not
    fall back (a one-token prompt's last chunk of 64 sequences or fewer), how many did."""
    tokens = prompt.to(model.device)
    rows = prefill_rows(*tokens.shape)
    fallbacks = getattr(model, "fallbacks", None)
    said = len(fallbacks) if fallbacks is not None else 0
    # Timed inside its range: a profiler's first range (nsys loads its NVTX injection then)
    # costs the profiler's start, not the prefill.
    with _call(model, "prefill"):
        start = time.perf_counter()
        logits = torch.cat([
            model.forward(tokens[lo: lo + rows],
                          state if rows >= len(tokens) else state.rows(lo, lo + rows),
                          last_logits=True)
            # (an empty batch as one call: the model says what is wrong with it)
            for lo in range(0, len(tokens), rows) or [0]])
        _sync(model.device)
        elapsed = time.perf_counter() - start
    if fallbacks is not None and len(fallbacks) > said:
        calls = max(1, -(-len(tokens) // rows))
        fell_back = [entry.partition(": ")[2] for entry in fallbacks[said:]]
        del fallbacks[said:]
        fallbacks.append(
            f"prefill: {model.unsupported(tokens, False)}" if len(fell_back) == calls else
            f"prefill: {len(fell_back)} of its {calls} calls ({rows} sequences each): "
            + "; ".join(dict.fromkeys(fell_back)))
    return logits, elapsed


class GraphedDecodeStep:
    """One decode step of ``model`` over ``state`` (``tokens_per_step`` tokens per sequence: 1,
    or 1+k for a speculative verify), captured once as a CUDA graph and replayed on every call:
    tokens go into a static input, logits come out of a static output. The model runs
    graph-safe (no host syncs; the decode state updated in place, a verify step's records
    too); each call tells ``state`` that a verify step awaits ``accept``. A replay checks on
    the host that its tokens fit the KV cache, counting its own replays from the length at
    capture (a verify step's full width: at most what it keeps), since the graph cannot read
    the lengths; steps run otherwise on the same state are not counted."""

    def __init__(self, model: K3Model, state: DecodeState, batch: int, layer_hook=None,
                 tokens_per_step: int = 1):
        device = model.device
        if device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.state = state
        self.tokens = torch.zeros(batch, tokens_per_step, dtype=torch.long, device=device)
        verify = tokens_per_step > 1
        # Graph-safe steps do not check the cache capacity: the warm-up runs must fit in it.
        model.positions(state, GRAPH_WARMUP_RUNS * tokens_per_step)
        self.capacity = state.kv_capacity
        self.furthest = int(state.lengths.max())   # (a sync, before the capture)
        self.tokens_per_step = tokens_per_step
        model.graph_safe = True
        try:
            # The warm-up runs advance the state: put it back before the capture (and its
            # host counters after it: the capture's step has not run)
            saved = [t.clone() for t in state_tensors(state)]
            counters = state.verify_tokens, state.pending_tokens
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for run in range(GRAPH_WARMUP_RUNS):
                    with _call(model, f"graph_warmup[{run}]", traced=False):
                        model.forward(self.tokens, state, verify=verify)
            torch.cuda.current_stream(device).wait_stream(side)
            for t, copy in zip(state_tensors(state), saved, strict=True):
                t.copy_(copy)
            self.graph = torch.cuda.CUDAGraph()
            with _call(model, "graph_capture"), torch.cuda.graph(self.graph):
                self.logits = model.forward(self.tokens, state, verify=verify,
                                            layer_hook=layer_hook)
            self.verify_tokens = state.verify_tokens
            state.verify_tokens, state.pending_tokens = counters
        finally:
            model.graph_safe = False

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.capacity is not None and self.furthest + self.tokens_per_step > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} tokens; this replay needs up to "
                             f"{self.furthest + self.tokens_per_step}")
        self.furthest += self.tokens_per_step
        self.tokens.copy_(tokens)
        self.graph.replay()
        self.state.verify_tokens = self.state.pending_tokens = self.verify_tokens
        return self.logits


def state_tensors(state: DecodeState) -> list[torch.Tensor]:
    """Every tensor a decode step updates in place."""
    spec = [state.pending, state.half] if state.pending is not None else []
    return [*state.kda.values(), *state.conv.values(), *state.kv.values(), state.lengths,
            *state.records.values(), *state.inputs.values(), *spec]


def cache_tokens(prompt_len: int, steps: int, spec_tokens: int, cuda_graphs: bool) -> int:
    """The tokens per sequence a ``run_decode`` cache must hold: the prompt and 1+k for each
    of its ``steps`` (warm-up included) and, with CUDA graphs, each eager warm-up run of the
    captured step (it writes the cache before the capture does). The capture's memory check
    sizes the caches with it before it builds any."""
    spare = GRAPH_WARMUP_RUNS if cuda_graphs else 0
    return prompt_len + (steps + spare) * (1 + spec_tokens)


def run_decode(model: K3Model, prompt: torch.Tensor, steps: int,
               state: DecodeState | None = None, kv_dtype: torch.dtype | None = None,
               after_step=None, warmup: int = 0,
               cuda_graphs: bool = False, spec_tokens: int = 0, seed: int = 0,
               keep_first_logits: bool = False) -> DecodeRun:
    """Greedy decode: prefill ``prompt`` [B, P], then ``warmup`` + ``steps`` decode steps.

    ``spec_tokens=k`` decodes speculatively with synthetic drafts: each step verifies 1+k
    tokens per sequence (the last accepted token and k random drafts, drawn from ``seed``) in
    one forward, accepts a random prefix of 1..1+k of them per sequence and rolls the KDA
    state back to it; ``DecodeRun.tokens`` then holds how many tokens each sequence accepted.

    Warm-up steps are ranges ``warmup_step[i]``, so that analyses of a whole trace (nsys
    records everything) take only the ``decode_step[i]`` ranges as steps. ``after_step()`` runs
    after the prefill and after every decode step (a profiler's ``step``). ``cuda_graphs``
    replays one captured step (``GraphedDecodeStep``; the acceptance runs eagerly after it)
    instead of launching each kernel; the capture comes after the prefill's ``after_step()``,
    in the first decode step's profiler step, so that a profile of the decode steps holds it.
    ``keep_first_logits``: ``DecodeRun.first_logits``, copied after the first step's timing.
    """
    if not 0 <= spec_tokens <= MAX_SPEC_TOKENS:
        raise ValueError(f"spec_tokens must be between 0 and {MAX_SPEC_TOKENS}")
    batch, prompt_len = prompt.shape
    width = 1 + spec_tokens                    # tokens per sequence in each decode step
    verify = spec_tokens > 0
    state = state or model.new_state(
        batch, cache_tokens(prompt_len, warmup + steps, spec_tokens, cuda_graphs),
        kv_dtype=kv_dtype, max_verify=width if verify else 0)
    hook = _layer_hook(model)
    logits, prefill_s = _prefill(model, prompt, state)
    next_token = logits[:, -1].argmax(-1, keepdim=True)
    run = DecodeRun(tokens=torch.empty(batch, warmup + steps, dtype=torch.long),
                    prefill_s=prefill_s, accepted_counts=verify)
    if after_step:
        after_step()
    if cuda_graphs:
        step_logits = GraphedDecodeStep(model, state, batch, hook, tokens_per_step=width)
    else:
        def step_logits(tokens: torch.Tensor) -> torch.Tensor:
            return model.forward(tokens, state, verify=verify, layer_hook=hook)
    gen = torch.Generator().manual_seed(seed)
    rows = torch.arange(batch, device=model.device)
    for step in range(warmup + steps):
        if verify:  # the stand-ins for a draft model and its acceptance, drawn on the host
            drafts = torch.randint(0, model.c.vocab, (batch, spec_tokens), generator=gen)
            kept = torch.randint(1, width + 1, (batch,), generator=gen)
        start = time.perf_counter()
        label = f"warmup_step[{step}]" if step < warmup else f"decode_step[{step - warmup}]"
        with _call(model, label):
            if verify:
                accepted = kept.to(model.device)
                logits = step_logits(torch.cat([next_token, drafts.to(model.device)], dim=1))
                state.accept(accepted)
                # the token after each sequence's accepted prefix: its next step's first
                next_token = logits[rows, accepted - 1].argmax(-1, keepdim=True)
            else:
                logits = step_logits(next_token)
                next_token = logits[:, -1].argmax(-1, keepdim=True)
        _sync(model.device)
        run.step_s.append(time.perf_counter() - start)
        run.tokens[:, step] = kept if verify else next_token[:, 0].cpu()
        if keep_first_logits and step == 0:   # a copy: a graph's output buffer is the
            run.first_logits = logits.to("cpu", copy=True)  # next replay's
        if after_step:
            after_step()
    if warmup + steps:
        run.logits_finite = bool(torch.isfinite(logits).all())
    return run
