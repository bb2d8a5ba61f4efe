"""Kimi-K3-style decoder, standard decode path: vLLM's kernel sequence, built from PyTorch ops.

One forward handles T new tokens per sequence: a prompt (prefill), one token (decode), or 1+k
tokens (speculative verify). Activations are bf16 (or the weights' dtype), the KDA state is
fp32, the latent KV cache bf16 or fp8 e4m3 with a per-tensor scale, as in vLLM; so is the
absorbed query q̂ with an fp8 cache (vLLM's "fp8 cache -> fp8 query"), with a scale of its own.

Each step of vLLM's standard sequence is one ``self.launch(name)`` below: in vLLM one kernel
launch (a GEMM, a collective, or one of its fused Triton/CUDA ops), here written as the
equivalent PyTorch, which on a GPU launches several kernels per fused op. On a GPU the
standard path therefore runs ``standard_kernels.StandardKernelsModel``: the same steps, one
kernel each. The sequence, per layer (``*`` only when TP > 1):

KDA layer (vLLM ``kda.py`` / ``model.py``)::

    attn_res_pre        fold the previous MLP output into the prefix, write the block buffer
                        on block boundaries, depth-softmax mix, input RMSNorm
    in_proj_qkvgfab     one GEMM for q, k, v, g, f_a, b
    f_b_proj            GEMM 128 -> heads*128
    fused_kda_decode    conv4 + SiLU, L2 norm, gate, beta, delta-rule recurrence (fp32 state),
                        gated RMSNorm
    o_proj, all_reduce*
    attn_res_post       prefix update, mix, post-attention RMSNorm
    MoE (below)

Gated-MLA layer (vLLM ``mla.py``)::

    attn_res_pre, fused_qkv_a_proj, g_proj, fused_q_kv_rmsnorm, q_b_proj, bmm_w_uk,
    q_concat_kv_cache_insert, mla_decode (attention over the latent cache), bmm_w_uv,
    gate_sigmoid_mul, o_proj, all_reduce*, attn_res_post, MoE

Latent MoE (vLLM ``latent_moe_runner.py``, the portable tail of tier 1)::

    router_gemm (fp32 out), latent_down_proj, topk (sigmoid + bias + top-k + renormalise),
    moe_fc1_situ, moe_fc2, moe_finalize, shared_gate_up, shared_situ_and_mul, shared_down,
    latent_all_reduce*, latent_rmsnorm (one FlashInfer kernel in vLLM under TP; two here),
    latent_up_proj, shared_all_reduce*, moe_add

Layer 0 runs a dense MLP instead of the MoE: ``dense_gate_up, dense_situ_and_mul,
dense_down, all_reduce*``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kimi_perf.decode import choose_triton_backend
from kimi_perf.decode.annotate import annotate
from kimi_perf.decode.config import K3Config
from kimi_perf.decode.reference import Observer
from kimi_perf.decode.weights import (
    Weights,
    check_expert_storage,
    check_weight_shapes,
    layer_prefix,
    mxfp4_codes,
    mxfp4_problem,
)

choose_triton_backend()    # before anything that runs the model can import triton

if TYPE_CHECKING:
    from kimi_perf_kernels.mxfp4 import Mxfp4

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass
class DecodeState:
    """Per-sequence caches of one rank: KDA recurrent and conv state, latent KV cache.

    Every step updates these tensors in place, never rebinds them: a CUDA graph captured
    over a step keeps reading and writing the same addresses when it is replayed.

    A state made for speculative decoding (``max_verify``, the most tokens a verify step
    takes per sequence) also has room for what a verify step records of each KDA layer for
    its rollback (``kimi_perf_kernels.kda_decode.KdaRecords``: per position each head's key,
    decay and delta-rule correction, and the conv inputs). A verify step leaves the KDA and
    conv states where it found them (after folding in what was pending) and records its
    positions; ``accept`` sets how many of them each sequence keeps (``pending``); the next
    step of any path folds those into the state before its own tokens. No state is copied.
    """

    kda: dict[int, torch.Tensor]          # [B, H, V, K] fp32
    conv: dict[int, torch.Tensor]         # [B, 3*H*d, conv-1] raw pre-conv inputs
    kv: dict[int, torch.Tensor]           # [B, max_len, kv_lora + rope] bf16 or fp8
    kv_scale: float                       # an fp8 cache's per-tensor scale
    lengths: torch.Tensor                 # [B] tokens in the cache
    # per KDA layer, in two halves (read, written): [2, B, H, max_verify, 3, d] fp32 (key,
    # decay, correction) and [2, B, max_verify, 3*H*d] (conv inputs)
    records: dict[int, torch.Tensor] = field(default_factory=dict)
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    pending: torch.Tensor | None = None   # [B] int32: accepted positions not yet folded in
    half: torch.Tensor | None = None      # [1] int32: the half of the records they are in
    max_verify: int = 0                   # tokens per sequence a verify step may take
    verify_tokens: int = 0                # tokens per sequence of the verify step to accept
    pending_tokens: int = 0               # at most this many pending (known on the host)
    q_scale: float = 1.0                  # an fp8 cache's fp8 q̂: its per-tensor scale

    @classmethod
    def empty(cls, c: K3Config, batch: int, max_len: int, kv_dtype: torch.dtype,
              dtype: torch.dtype, device: torch.device | str = "cpu",
              kv_scale: float = 1.0, max_verify: int = 0, q_scale: float = 1.0
              ) -> DecodeState:
        h, d = c.kda_heads_local, c.kda_head_dim
        kda_layers = [i for i in range(c.n_layers) if not c.is_mla(i)]
        spec = max_verify > 0
        return cls(
            kda={i: torch.zeros(batch, h, d, d, dtype=torch.float32, device=device)
                 for i in kda_layers},
            conv={i: torch.zeros(batch, 3 * h * d, c.conv_size - 1, dtype=dtype, device=device)
                  for i in kda_layers},
            kv={i: torch.zeros(batch, max_len, c.kv_cache_dim, dtype=kv_dtype, device=device)
                for i in range(c.n_layers) if c.is_mla(i)},
            kv_scale=kv_scale,
            lengths=torch.zeros(batch, dtype=torch.long, device=device),
            records={i: torch.zeros(2, batch, h, max_verify, 3, d, dtype=torch.float32,
                                    device=device)
                     for i in kda_layers if spec},
            inputs={i: torch.zeros(2, batch, max_verify, 3 * h * d, dtype=dtype, device=device)
                    for i in kda_layers if spec},
            pending=torch.zeros(batch, dtype=torch.int32, device=device) if spec else None,
            half=torch.zeros(1, dtype=torch.int32, device=device) if spec else None,
            max_verify=max_verify,
            q_scale=q_scale,
        )

    @staticmethod
    def bytes_of(c: K3Config, batch: int, max_len: int, kv_bytes: int, dtype_bytes: int,
                 max_verify: int = 0) -> int:
        """The bytes ``empty`` allocates for these sizes (``kv_bytes``, ``dtype_bytes``: an
        element of the latent cache and of the model's dtype): checked before a run starts,
        as a cache the machine cannot hold fills its memory page by page, for the
        out-of-memory killer to end, not an error."""
        h, d = c.kda_heads_local, c.kda_head_dim
        kda_layers = sum(not c.is_mla(i) for i in range(c.n_layers))
        per_kda = batch * h * d * d * 4 + batch * 3 * h * d * (c.conv_size - 1) * dtype_bytes
        if max_verify:   # the records (fp32) and inputs of a verify step, two of each
            per_kda += 2 * batch * h * max_verify * 3 * d * 4
            per_kda += 2 * batch * max_verify * 3 * h * d * dtype_bytes
        mla_layers = c.n_layers - kda_layers
        return kda_layers * per_kda + mla_layers * batch * max_len * c.kv_cache_dim * kv_bytes

    def rows(self, lo: int, hi: int) -> DecodeState:
        """Sequences ``lo:hi`` as a state of their own whose tensors are views of this one's:
        a step through it updates those sequences here (every step writes its state in
        place), as a prefill in chunks of sequences does."""
        return dataclasses.replace(
            self, kda={i: t[lo:hi] for i, t in self.kda.items()},
            conv={i: t[lo:hi] for i, t in self.conv.items()},
            kv={i: t[lo:hi] for i, t in self.kv.items()}, lengths=self.lengths[lo:hi],
            records={i: t[:, lo:hi] for i, t in self.records.items()},
            inputs={i: t[:, lo:hi] for i, t in self.inputs.items()},
            pending=None if self.pending is None else self.pending[lo:hi])

    @property
    def kv_capacity(self) -> int | None:
        """Tokens per sequence the latent caches hold (None: no gated-MLA layer)."""
        return min((kv.shape[1] for kv in self.kv.values()), default=None)

    def check_verify(self, tokens: int) -> None:
        if tokens > self.max_verify:
            raise ValueError(f"a verify step of {tokens} tokens per sequence needs a state "
                             f"made for it (new_state(..., max_verify={tokens})); this one "
                             f"takes {self.max_verify}")

    def advance(self, tokens: int, verify: bool) -> None:
        """A step of ``tokens`` per sequence is in the caches; a verify step awaits ``accept``
        (until then, all its tokens stand)."""
        self.lengths.add_(tokens)
        if self.pending is not None:
            if verify:
                self.half.bitwise_xor_(1)
                self.pending.fill_(tokens)
            else:
                self.pending.zero_()
        self.verify_tokens = self.pending_tokens = tokens if verify else 0

    def accept(self, accepted: torch.Tensor) -> None:
        """After a verify step of T tokens: keep ``accepted[b]`` (1..T) of them per sequence.

        The next step folds that many of the step's positions into the KDA and conv states;
        the KV cache keeps its entries and only its length shrinks (later tokens overwrite the
        rejected ones). Two small writes, no state copied: graph-safe.
        """
        if not self.verify_tokens:
            raise ValueError("accept() follows a verify step (forward with verify=True)")
        if not isinstance(accepted, torch.Tensor) or accepted.is_floating_point() \
                or accepted.dtype == torch.bool:
            raise TypeError("accept() takes a tensor of whole counts, one per sequence, not "
                            f"{getattr(accepted, 'dtype', type(accepted).__name__)}")
        if accepted.shape != self.pending.shape:
            raise ValueError(f"accept() takes a count per sequence: {tuple(accepted.shape)} "
                             f"for a batch of {len(self.pending)}")
        if accepted.device.type == "cpu" and not (
                (accepted >= 1) & (accepted <= self.verify_tokens)).all():
            raise ValueError(f"accepted counts must be 1..{self.verify_tokens}: "
                             f"{accepted.tolist()}")
        # (on a GPU clamped rather than checked, which would wait for the device: a count
        # past the step would replay another step's records, or another head's)
        accepted = accepted.to(self.pending.device).clamp(1, self.verify_tokens)
        self.pending.copy_(accepted)
        self.lengths.add_(accepted - self.verify_tokens)
        self.verify_tokens = 0


def check_tokens(tokens: object) -> None:
    """A step's tokens are a tensor [B, T] of int64 or int32 ids, the index types the
    embedding takes (uint8 would index as a mask), by its shape and type alone: no read of
    the values, so graph-safe."""
    if not (isinstance(tokens, torch.Tensor) and tokens.dim() == 2
            and tokens.dtype in (torch.int64, torch.int32)):
        said = (f"of shape {tuple(tokens.shape)} and {tokens.dtype}"
                if isinstance(tokens, torch.Tensor) else f"a {type(tokens).__name__}")
        raise ValueError(f"forward: tokens are int64 or int32 ids [B, T], not {said}")


def check_batch(tokens: torch.Tensor, state: DecodeState, vocab: int, graph_safe: bool
                ) -> None:
    """A step's tokens [B, T] are of the state's B sequences, at least one each (a torch size
    error, else), and, where they are on the CPU and the step is not graph-safe, ids of the
    vocabulary: the embedding would take a negative id from its end. On a GPU reading them
    is a kernel more in the step and a wait on the device (which a CUDA graph's capture
    forbids): they are left unchecked there, so that a traced step runs its own kernels
    alone."""
    if len(tokens) != len(state.lengths):
        raise ValueError(f"forward: {len(tokens)} sequences for a state of "
                         f"{len(state.lengths)} (new_state(batch, ...))")
    if tokens.numel() == 0:
        raise ValueError(f"forward: no tokens (tokens [B, T] of shape {tuple(tokens.shape)}): "
                         "a step takes at least one per sequence")
    if tokens.device.type == "cpu" and not graph_safe:
        low, high = (int(end) for end in torch.aminmax(tokens))
        if low < 0 or high >= vocab:
            raise ValueError(f"forward: token ids are 0..{vocab - 1}, not {low}..{high}")


def forward_bytes(c: K3Config, tokens: int) -> int:
    """About what the standard path's forward holds in activations at least, for ``tokens``
    tokens (sequences × positions: a prefill's): a token's fp32 values of 24 hidden widths
    and 4 dense-MLP intermediates. Fitted to a prefill's peak memory on the CPU (2026-12-05):
    0.55 to 1.4 times the peaks measured for the tiny preset and variants with one or two
    widths doubled or more (hidden, dense, routed and shared experts, heads; the peak is that
    of one layer's phase, so widths do not add up, and it moves by a quarter from run to
    run). A gated-MLA layer's scores over the prompt come on top (quadratic in it)."""
    return 4 * tokens * (24 * c.hidden + 4 * c.dense_intermediate_local)


class K3Model:
    """The standard decode path for one tensor-parallel rank."""

    def __init__(self, c: K3Config, weights: Weights, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", all_reduce: Callable | None = None,
                 experts: str = "bf16"):
        check_expert_storage(experts)
        if experts == "mxfp4" and (problem := mxfp4_problem(c)):
            raise ValueError(problem)   # (before any weight moves)
        check_weight_shapes(c, weights)
        self.c = c
        self.experts = experts
        self.dtype = dtype
        self.device = torch.device(device)
        self.all_reduce = all_reduce
        self.launches: list[tuple[int, str]] | None = None
        # With annotate_ops, each launch is also a profiler range "op:<name>" that lasts
        # until the next launch or the end of the layer: CPU traces, which have no GPU
        # kernels, count these instead.
        self.annotate_ops = False
        self._open_op = None
        # Graph-safe steps never wait on the device (CUDA-graph capture forbids it): the cache
        # capacity is the caller's to check, and attention reads the whole cache, masked.
        self.graph_safe = False
        # The caller's name for the forward call under way (the harness's: its trace range,
        # decode_step[3]); a kernel-built path reports a call it leaves to these ops by it.
        self.call_name: str | None = None
        self.layer = -1
        w = {k: v.to(self.device) for k, v in weights.items()}
        self.w = {k: (v.to(dtype) if v.dim() == 2 else v) for k, v in w.items()}
        self._pack()
        self._pack_experts()

    # -- weights as the kernels want them --------------------------------------------------

    def _pack(self) -> None:
        c = self.c
        self.packed: dict[int, dict[str, torch.Tensor]] = {}
        for i in range(c.n_layers):
            a = layer_prefix(i) + "self_attn."
            p: dict[str, torch.Tensor] = {}
            if c.is_mla(i):
                p["qkv_a"] = self.pack_rows([a + "q_a_proj.weight",
                                             a + "kv_a_proj_with_mqa.weight"])
                h = c.mla_heads_local
                kv_b = self.w.pop(a + "kv_b_proj.weight").reshape(   # (read as these two)
                    h, c.qk_nope + c.v_head, c.kv_lora)
                p["w_uk"] = kv_b[:, : c.qk_nope].contiguous()         # [H, nope, kv_lora]
                p["w_uv"] = kv_b[:, c.qk_nope:].transpose(1, 2).contiguous()  # [H, kv_lora, v]
            else:
                p["in_proj"] = self.pack_rows([a + f"{n}_proj.weight" for n in
                                               ("q", "k", "v", "g", "f_a", "b")],
                                              rows=c.in_proj_rows)
                p["conv"] = torch.cat([self.w.pop(a + f"{n}_conv1d.weight")[:, 0, :]
                                       for n in "qkv"]).float()
            m = layer_prefix(i) + "mlp."
            if i == 0:
                p["gate_up"] = self.pack_rows([m + "gate_proj.weight", m + "up_proj.weight"])
            else:
                s = m + "shared_experts."
                p["shared_gate_up"] = self.pack_rows([s + "gate_proj.weight",
                                                      s + "up_proj.weight"])
                p["w13"] = torch.stack([torch.cat([self.w[m + f"experts.{e}.w1.weight"],
                                                   self.w[m + f"experts.{e}.w3.weight"]])
                                        for e in range(c.n_experts)])
                p["w2"] = torch.stack([self.w[m + f"experts.{e}.w2.weight"]
                                       for e in range(c.n_experts)])
                for e in range(c.n_experts):  # keep one copy of the expert weights
                    for n in ("w1", "w2", "w3"):
                        del self.w[m + f"experts.{e}.{n}.weight"]
            self.packed[i] = p

    def pack_rows(self, names: list[str], rows: int | None = None) -> torch.Tensor:
        """The weights ``names`` stacked by rows in one buffer (zero rows after them, up to
        ``rows``) for the launch that reads them in one pass; each weight then a view of its
        rows there, so that the ops that read one alone (the fallback's) hold no second copy.
        """
        parts = [self.w[n] for n in names]
        total = sum(t.shape[0] for t in parts)
        packed = parts[0].new_zeros(total if rows is None else rows, parts[0].shape[1])
        at = 0
        for name, part in zip(names, parts, strict=True):
            packed[at: at + part.shape[0]] = part
            self.w[name] = packed[at: at + part.shape[0]]
            at += part.shape[0]
        return packed

    # Whether the path streams MXFP4 experts as codes (the kernel paths); the PyTorch ops
    # compute on the stacks in the model's dtype, their values MXFP4's, and keep none.
    keeps_mxfp4_codes = False

    def _pack_experts(self) -> None:
        """With ``experts="mxfp4"``: each MoE layer's routed experts checked to hold MXFP4
        values (``weights.mxfp4_experts``, or a checkpoint loaded from MXFP4), as every path
        checks them; a path that ``keeps_mxfp4_codes`` takes the codes (``keep_codes``)."""
        if self.experts == "bf16":
            return
        for i in range(1, self.c.n_layers):
            for name in ("w13", "w2"):
                codes = mxfp4_codes(self.packed[i][name], f"layer {i}'s routed experts "
                                    f"({name})", keep=self.keeps_mxfp4_codes)
                if codes is not None:
                    self.keep_codes(i, name, codes)

    def keep_codes(self, i: int, name: str, codes: Mxfp4) -> None:
        """Layer i's routed experts ``name`` as MXFP4 codes (``keeps_mxfp4_codes``)."""
        raise NotImplementedError

    # -- bookkeeping ----------------------------------------------------------------------

    def launch(self, name: str) -> None:
        if self.launches is not None:
            self.launches.append((self.layer, name))
        if self.annotate_ops:
            self.end_op()
            self._open_op = annotate(f"op:{name}")
            self._open_op.__enter__()

    @contextlib.contextmanager
    def layer_scope(self, i: int, layer_hook: Callable[[int], object] | None):
        """Layer i: launches are recorded under i, inside the hook's range when there is one;
        the open op range closes before the layer's does."""
        self.layer = i
        hook = layer_hook(i) if layer_hook else None
        with hook or contextlib.nullcontext():
            try:
                yield
            finally:
                self.end_op()

    def end_op(self) -> None:
        """Close the open op range (before a layer's range closes)."""
        if self._open_op is not None:
            self._open_op.__exit__(None, None, None)
            self._open_op = None

    def _all_reduce(self, x: torch.Tensor, name: str = "all_reduce") -> torch.Tensor:
        if self.all_reduce is None:
            return x
        self.launch(name)
        return self.all_reduce(x)

    def positions(self, state: DecodeState, T: int) -> torch.Tensor:
        """Cache positions [B, T] of this step's tokens; refuses a step the cache cannot hold
        (unless graph-safe: reading the lengths would wait on the device)."""
        capacity = state.kv_capacity
        if (capacity is not None and not self.graph_safe
                and int(state.lengths.max()) + T > capacity):
            raise ValueError(f"KV cache holds {capacity} tokens; this step needs "
                             f"{int(state.lengths.max()) + T}")
        return state.lengths[:, None] + torch.arange(T, device=self.device)

    def new_state(self, batch: int, max_len: int, kv_dtype: torch.dtype | None = None,
                  kv_scale: float = 1.0, max_verify: int = 0, q_scale: float = 1.0
                  ) -> DecodeState:
        """Caches for ``batch`` sequences of up to ``max_len`` tokens; ``max_verify``: room
        for speculative verify steps of up to that many tokens per sequence. An fp8 cache
        (``kv_dtype``) stores values / ``kv_scale``, its fp8 q̂ values / ``q_scale`` (vLLM's
        are 1 unless a checkpoint gives them)."""
        return DecodeState.empty(self.c, batch, max_len, kv_dtype or self.dtype, self.dtype,
                                 self.device, kv_scale, max_verify, q_scale)

    # -- forward --------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, state: DecodeState, observer: Observer | None = None,
                verify: bool = False,
                layer_hook: Callable[[int], object] | None = None,
                last_logits: bool = False) -> torch.Tensor:
        """Logits [B, T, vocab] (fp32) for tokens [B, T]; advances ``state`` by T positions.

        ``verify``: a speculative verify step, whose tokens ``state.accept`` then keeps or
        drops (the state needs room for it: ``new_state(..., max_verify)``).
        ``layer_hook(i)`` returns a context manager entered around layer i (NVTX ranges).
        ``last_logits``: only the last position's [B, 1, vocab], as a server's prefill makes
        them (a K3 prompt's logits for every position take B·T·655 kB).
        """
        c = self.c
        check_tokens(tokens)
        B, T = tokens.shape
        check_batch(tokens, state, c.vocab, self.graph_safe)
        if verify:
            state.check_verify(T)
        positions = self.positions(state, T)                                       # [B, T]
        self.layer = -1
        prefix = self.w["model.embed_tokens.weight"][tokens]                       # [B, T, h]
        blocks = prefix.new_empty(B, T, math.ceil(c.n_layers / c.attn_res_block), c.hidden)
        delta = None
        for i in range(c.n_layers):
            with self.layer_scope(i, layer_hook):
                p = layer_prefix(i)
                boundary = i % c.attn_res_block == 0
                self.launch("attn_res_pre")
                if delta is not None:
                    prefix = (prefix.float() + delta.float()).to(self.dtype)
                if boundary:
                    blocks[:, :, i // c.attn_res_block] = prefix
                n_done = math.ceil(i / c.attn_res_block)
                x = self._attn_res(blocks[:, :, :n_done], prefix, p + "self_attention_res",
                                   p + "input_layernorm.weight")
                if c.is_mla(i):
                    a = self._mla(i, x, state, positions)
                else:
                    a = self._kda(i, x, state, verify)
                self.launch("attn_res_post")
                prefix = a if boundary else (prefix.float() + a.float()).to(self.dtype)
                h = self._attn_res(blocks[:, :, : n_done + int(boundary)], prefix,
                                   p + "mlp_res", p + "post_attention_layernorm.weight")
                m, chosen = self._dense(h) if i == 0 else self._moe(i, h)
                if observer is not None:
                    observer.record(i, a, m, chosen, B, T)
                delta = m
        self.layer = c.n_layers
        self.launch("attn_res_final")
        prefix = (prefix.float() + delta.float()).to(self.dtype)
        out = self._attn_res(blocks, prefix, "model.output_attn_res", None)
        if last_logits:
            out = out[:, -1:]
        self.launch("final_norm")
        out = _rms_norm(out, self.w["model.norm.weight"], c.rms_eps)
        self.launch("lm_head")
        logits = out.float() @ self.w["lm_head.weight"].float().T
        self.end_op()
        state.advance(T, verify)
        return logits

    # -- attention residuals ----------------------------------------------------------------

    def _attn_res(self, blocks: torch.Tensor, prefix: torch.Tensor, name: str,
                  norm: str | None) -> torch.Tensor:
        """One fused kernel in vLLM: depth-softmax over [blocks..., prefix], then RMSNorm."""
        eps = self.c.rms_eps
        v = torch.cat([blocks, prefix[:, :, None]], dim=2).float()             # [B, T, S, h]
        qk = self.w[name + "_norm.weight"] * self.w[name + "_proj.weight"].float().reshape(-1)
        logits = (v * qk).sum(-1) * torch.rsqrt(v.pow(2).mean(-1) + eps)       # [B, T, S]
        mix = (torch.softmax(logits, dim=-1)[..., None] * v).sum(2)
        if norm is not None:
            mix = mix * torch.rsqrt(mix.pow(2).mean(-1, keepdim=True) + eps) * self.w[norm]
        return mix.to(self.dtype)

    # -- KDA ------------------------------------------------------------------------------

    def _kda(self, i: int, x: torch.Tensor, state: DecodeState, verify: bool) -> torch.Tensor:
        c = self.c
        a = layer_prefix(i) + "self_attn."
        H, d = c.kda_heads_local, c.kda_head_dim
        proj = H * d
        self.launch("in_proj_qkvgfab")
        z = x @ self.packed[i]["in_proj"].T
        pad = z.shape[-1] - (4 * proj + c.f_rank + H)
        qkv, g, f_a, b, _ = z.split([3 * proj, proj, c.f_rank, H, pad], dim=-1)
        self.launch("f_b_proj")
        f = f_a @ self.w[a + "f_b_proj.weight"].T
        self.launch("fused_kda_decode")
        o = self._fused_kda(i, qkv, g, f, b, state, verify)
        self.launch("o_proj")
        out = o @ self.w[a + "o_proj.weight"].T
        return self._all_reduce(out)

    def _fused_kda(self, i: int, qkv: torch.Tensor, g: torch.Tensor, f: torch.Tensor,
                   b: torch.Tensor, state: DecodeState, verify: bool) -> torch.Tensor:
        """vLLM's ``fused_kda_decode`` as one function: conv, gates, recurrence, o_norm."""
        c = self.c
        a = layer_prefix(i) + "self_attn."
        B, T, _ = qkv.shape
        H, d = c.kda_heads_local, c.kda_head_dim
        start, history = self._fold_pending(i, state)
        # Causal depthwise conv over [history, new tokens]; the state keeps raw inputs.
        window = torch.cat([history, qkv.transpose(1, 2)], dim=-1)             # [B, C, 3+T]
        taps = window.float().unfold(-1, c.conv_size, 1)                       # [B, C, T, 4]
        mixed = F.silu((taps * self.packed[i]["conv"][:, None, :]).sum(-1))    # [B, C, T]
        mixed = mixed.transpose(1, 2).reshape(B, T, 3, H, d)
        q, k, v = mixed.unbind(2)
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * d ** -0.5
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        A = torch.exp(self.w[a + "A_log"].float())[:, None]
        gate = c.gate_lower_bound * torch.sigmoid(
            A * (f.float() + self.w[a + "dt_bias"]).reshape(B, T, H, d))
        decay = torch.exp(gate)
        beta = torch.sigmoid(b.float())                                        # [B, T, H]
        S = start
        outs, corrections = [], []
        for t in range(T):
            S = S * decay[:, t, :, None, :]
            u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhvk,bhk->bhv", S, k[:, t]))
            S = S + u[..., None] * k[:, t, :, None, :]
            outs.append(torch.einsum("bhvk,bhk->bhv", S, q[:, t]))
            corrections.append(u)
        if verify:
            # the state stays where the step found it; the step's positions are recorded
            state.kda[i].copy_(start)
            state.conv[i].copy_(history)
            self._record(i, state, torch.stack([k, decay, torch.stack(corrections, 1)], 3),
                         qkv)
        else:
            state.kda[i].copy_(S)
            state.conv[i].copy_(window[..., -(c.conv_size - 1):])
        o = torch.stack(outs, dim=1)                                           # [B, T, H, V]
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + c.rms_eps)
        o = o * self.w[a + "o_norm.weight"] * torch.sigmoid(g.float().reshape(B, T, H, d))
        return o.reshape(B, T, H * d).to(self.dtype)

    @staticmethod
    def _fold_pending(i: int, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's KDA and conv states with the positions a verify step left pending folded
        in, a position at a time as the kernels replay them (S <- S * decay + u k^T), each
        sequence its own count (masked: no wait on the device)."""
        S, conv = state.kda[i], state.conv[i]
        # A graph replays a step after any other: it folds as many as a verify step records.
        capturing = S.is_cuda and torch.cuda.is_current_stream_capturing()
        positions = state.max_verify if capturing else state.pending_tokens
        if state.pending is None or not positions:
            return S, conv
        half = state.half.long()
        records = state.records[i].index_select(0, half)[0]                   # [B, H, T, 3, d]
        inputs = state.inputs[i].index_select(0, half)[0]                     # [B, T, C]
        for t in range(positions):
            key, decay, u = records[:, :, t].unbind(2)                         # [B, H, d]
            folded = S * decay[..., None, :] + u[..., None] * key[..., None, :]
            S = torch.where((t < state.pending)[:, None, None, None], folded, S)
        history = torch.cat([conv, inputs.transpose(1, 2)], dim=-1)           # [B, C, 3+T]
        newest = state.pending.long()[:, None, None] + torch.arange(conv.shape[-1],
                                                                    device=conv.device)
        return S, history.gather(-1, newest.expand(-1, history.shape[1], -1))

    @staticmethod
    def _record(i: int, state: DecodeState, positions: torch.Tensor, qkv: torch.Tensor) -> None:
        """A verify step's positions [B, T, H, 3, d] (key, decay, correction) and conv
        inputs [B, T, C] into the half of layer i's records that the step did not read."""
        T = qkv.shape[1]
        written = (1 - state.half).long()   # (on the device: no wait for it)
        # Only the step's T positions: a fold reads no further than the accepted count.
        state.records[i][:, :, :, :T].index_copy_(0, written, positions.transpose(1, 2)[None])
        state.inputs[i][:, :, :T].index_copy_(0, written, qkv[None])

    # -- gated MLA, absorbed over the latent cache -----------------------------------------

    def _mla(self, i: int, x: torch.Tensor, state: DecodeState, positions: torch.Tensor
             ) -> torch.Tensor:
        c = self.c
        a = layer_prefix(i) + "self_attn."
        p = self.packed[i]
        B, T, _ = x.shape
        H = c.mla_heads_local
        self.launch("fused_qkv_a_proj")
        qkv_a = x @ p["qkv_a"].T
        self.launch("g_proj")  # on vLLM's aux stream
        gate = x @ self.w[a + "g_proj.weight"].T
        self.launch("fused_q_kv_rmsnorm")
        q_c = _rms_norm(qkv_a[..., : c.q_lora], self.w[a + "q_a_layernorm.weight"], c.rms_eps)
        kv_c = _rms_norm(qkv_a[..., c.q_lora: c.q_lora + c.kv_lora],
                         self.w[a + "kv_a_layernorm.weight"], c.rms_eps)
        k_pe = qkv_a[..., c.q_lora + c.kv_lora:]
        self.launch("q_b_proj")
        q = (q_c @ self.w[a + "q_b_proj.weight"].T).reshape(B, T, H, c.qk_nope + c.qk_rope)
        q_nope, q_pe = q.split([c.qk_nope, c.qk_rope], dim=-1)
        self.launch("bmm_w_uk")
        ql = torch.einsum("bthn,hnl->bthl", q_nope, p["w_uk"])                 # [B,T,H,512]
        self.launch("q_concat_kv_cache_insert")
        q_hat = torch.cat([ql, q_pe], dim=-1)
        entry = torch.cat([kv_c, k_pe], dim=-1)
        cache = state.kv[i]
        if cache.dtype == FP8:   # an fp8 cache, an fp8 query (vLLM's policy)
            q_hat = _to_fp8(q_hat, state.q_scale)
            entry = _to_fp8(entry, state.kv_scale)
        cache[torch.arange(B, device=self.device)[:, None], positions] = entry.to(cache.dtype)
        self.launch("mla_decode")
        o_lat = self._mqa(q_hat, cache, state, positions)                       # [B,T,H,512]
        self.launch("bmm_w_uv")
        o = torch.einsum("bthl,hlv->bthv", o_lat, p["w_uv"]).reshape(B, T, H * c.v_head)
        self.launch("gate_sigmoid_mul")
        o = (o.float() * torch.sigmoid(gate.float())).to(self.dtype)
        self.launch("o_proj")
        out = o @ self.w[a + "o_proj.weight"].T
        return self._all_reduce(out)

    def _mqa(self, q_hat: torch.Tensor, cache: torch.Tensor, state: DecodeState,
             positions: torch.Tensor) -> torch.Tensor:
        """Attention of every head over one latent head: keys are the 576-wide cache
        entries, values their first kv_lora entries; token t sees positions <= its own."""
        c = self.c
        length = cache.shape[1] if self.graph_safe else int(positions.max()) + 1
        kv = cache[:, :length].float()
        q = q_hat.float()
        if cache.dtype == FP8:
            kv = kv * state.kv_scale
            q = q * state.q_scale
        scores = torch.einsum("bthd,bsd->bths", q, kv)
        scores = scores * (c.qk_nope + c.qk_rope) ** -0.5
        visible = torch.arange(length, device=self.device) <= positions[:, :, None]  # [B,T,S]
        scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("bths,bsl->bthl", probs, kv[..., : c.kv_lora]).to(self.dtype)

    # -- MLPs -----------------------------------------------------------------------------

    def situ_activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        c = self.c
        gate, up = gate_up.float().chunk(2, dim=-1)
        act = (c.situ_beta * torch.tanh(gate / c.situ_beta) * torch.sigmoid(gate)) * (
            c.situ_beta_linear * torch.tanh(up / c.situ_beta_linear))
        return act.to(self.dtype)

    def _dense(self, h: torch.Tensor) -> tuple[torch.Tensor, None]:
        m = layer_prefix(0) + "mlp."
        self.launch("dense_gate_up")
        gu = h @ self.packed[0]["gate_up"].T
        self.launch("dense_situ_and_mul")
        act = self.situ_activation(gu)
        self.launch("dense_down")
        out = act @ self.w[m + "down_proj.weight"].T
        return self._all_reduce(out), None

    def _moe(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.c
        m = layer_prefix(i) + "mlp."
        p = self.packed[i]
        B, T, hidden = h.shape
        tokens = h.reshape(B * T, hidden)
        self.launch("router_gemm")
        logits = tokens.float() @ self.w[m + "gate.weight"].float().T
        self.launch("latent_down_proj")  # on vLLM's aux stream, beside the router
        latent = tokens @ self.w[m + "routed_expert_down_proj.weight"].T
        self.launch("topk")
        scores = torch.sigmoid(logits)
        chosen = torch.topk(scores + self.w[m + "gate.e_score_correction_bias"], c.top_k,
                            dim=-1).indices
        weights = scores.gather(-1, chosen)
        # (routed_scale, 1.0 in K3, where vLLM applies it: the latent norm after the experts
        # cancels any uniform scale)
        weights = weights / weights.sum(-1, keepdim=True) * c.routed_scale
        # Routed experts as grouped GEMMs (vLLM's fused_moe): the (token, slot) rows sorted by
        # expert, each expert's group ending where a device-side histogram says; no host
        # sync, so a CUDA graph can capture it.
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(c.n_experts, dtype=torch.int32, device=self.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        group_ends = counts.cumsum(0, dtype=torch.int32)
        expert_of_row = flat[order]
        self.launch("moe_fc1_situ")
        gate_up = _expert_matmul(latent[order // c.top_k], p["w13"], group_ends, expert_of_row)
        act = self.situ_activation(gate_up)
        self.launch("moe_fc2")
        down = _expert_matmul(act, p["w2"], group_ends, expert_of_row)
        self.launch("moe_finalize")
        per_slot = torch.empty(B * T * c.top_k, c.latent, dtype=torch.float32,
                               device=self.device)
        per_slot.index_copy_(0, order, down.float())
        routed = (per_slot.reshape(B * T, c.top_k, c.latent) * weights[..., None]).sum(1)
        self.launch("shared_gate_up")
        gu = tokens @ p["shared_gate_up"].T
        self.launch("shared_situ_and_mul")
        act = self.situ_activation(gu)
        self.launch("shared_down")
        shared = act @ self.w[m + "shared_experts.down_proj.weight"].T
        routed = self._all_reduce(routed.to(self.dtype), "latent_all_reduce")
        self.launch("latent_rmsnorm")
        routed = _rms_norm(routed, self.w[m + "routed_expert_norm.weight"], c.rms_eps)
        self.launch("latent_up_proj")
        up = routed @ self.w[m + "routed_expert_up_proj.weight"].T
        shared = self._all_reduce(shared, "shared_all_reduce")
        self.launch("moe_add")
        out = (up.float() + shared.float()).to(self.dtype)
        return out.reshape(B, T, hidden), chosen.reshape(B, T, c.top_k)


def _expert_matmul(x: torch.Tensor, w: torch.Tensor, group_ends: torch.Tensor,
                   expert_of_row: torch.Tensor) -> torch.Tensor:
    """``x[i] @ w[expert_of_row[i]].T`` for rows ``x`` sorted by expert (``group_ends``: where
    each expert's rows end): one grouped GEMM. On a GPU, ``torch._grouped_mm`` runs its own
    kernel only for bf16; other dtypes take a fallback that reads the group ends on the host,
    which a CUDA graph capture forbids, so there each row gathers its expert's weights."""
    if x.dtype == torch.bfloat16 or x.device.type == "cpu":
        return torch._grouped_mm(x, w.transpose(1, 2), offs=group_ends)
    return _gathered_expert_matmul(x, w, expert_of_row)


def _gathered_expert_matmul(x: torch.Tensor, w: torch.Tensor, expert_of_row: torch.Tensor
                            ) -> torch.Tensor:
    return torch.bmm(w[expert_of_row], x.unsqueeze(-1)).squeeze(-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def _to_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """e4m3 of x / scale, saturated at ±448 (a plain cast saturates on some devices and
    torch releases, and gives NaN beyond it on others)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
