"""What the two kernel-built decode paths share: the standard path's kernel form
(``standard_kernels``) and the latency-specialized path (``specialized``).

A decode or verify step runs as launches of kernels from ``kernels/`` (and, for the standard
path, cuBLAS GEMMs), one per ``launch`` annotation; a step these kernels do not take (a
prefill, a batch over 64, a verify of more than 8 tokens) runs the standard path's PyTorch
ops, and ``fallbacks`` says which calls did and why (``kimi_perf.decode.fallbacks``). The
forward loop below is the model's (embedding, then per layer: attention residuals,
attention, attention residuals, MLP; final residual mix and the LM head); a path gives the
layers.
"""

from __future__ import annotations

import math
import os

import torch

from kimi_perf.decode.config import K3Config
from kimi_perf.decode.model import DecodeState, K3Model, check_batch, check_tokens
from kimi_perf.decode.reference import Observer
from kimi_perf.decode.weights import Weights, layer_prefix

# Without a GPU the kernels need Triton's interpreter (importing the model chose it, unless
# triton was imported first).
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    raise ImportError("the kernel-built decode paths need a GPU, or TRITON_INTERPRET=1 set "
                      "before triton is imported")

from kimi_perf_kernels import mxfp4
from kimi_perf_kernels.attn_res import attn_res
from kimi_perf_kernels.common import programmatic_launch
from kimi_perf_kernels.kda_decode import KdaRecords, kda_decode
from kimi_perf_kernels.mla_attention import mla_splits

MAX_BATCH = 64
MAX_VERIFY_TOKENS = 8


class KernelPathModel(K3Model):
    def __init__(self, c: K3Config, weights: Weights, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", all_reduce=None, experts: str = "bf16"):
        super().__init__(c, weights, dtype=dtype, device=device, all_reduce=all_reduce,
                         experts=experts)
        self.fallbacks: list[str] = []
        self.calls = 0
        # Splits of the MLA attention over the cache positions; None: by the GPU's size
        # (``mla_splits``; 1 on a CPU).
        self.attention_splits: int | None = None
        # Launch the kernels with programmatic dependent launch (``programmatic_launch``), the
        # skinny linears reading this many bytes of their weights into L2 before the wait.
        self.pdl = False
        self.pdl_prefetch_bytes = 0
        # kda_decode's per-head arrival counters: zeros it leaves zero, kept so that a launch
        # needs no memset of its own (one launch at a time: its layers run in turn on one
        # stream; launches that could overlap would each need their own)
        self.kda_arrivals = torch.zeros(MAX_BATCH * c.kda_heads_local, dtype=torch.int32,
                                        device=device)
        # the attention residuals' query folded into their RMSNorm weight, as attn_res takes it
        for i in range(c.n_layers):
            p = layer_prefix(i)
            for name in ("self_attention_res", "mlp_res"):
                self.packed[i][name + "_qk"] = (
                    self.w[p + name + "_norm.weight"]
                    * self.w[p + name + "_proj.weight"].float().reshape(-1))
        self.final_qk = (self.w["model.output_attn_res_norm.weight"]
                         * self.w["model.output_attn_res_proj.weight"].float().reshape(-1))

    keeps_mxfp4_codes = True

    def keep_codes(self, i: int, name: str, codes: mxfp4.Mxfp4) -> None:
        """The MXFP4 codes and scales the expert launches stream (0.53 bytes a weight); the
        stacks in the model's dtype stay for the steps that fall back to PyTorch ops."""
        self.packed[i][name + "_mxfp4"] = codes

    def expert_weights(self, i: int, name: str) -> torch.Tensor | mxfp4.Mxfp4:
        """Layer i's routed experts ``w13`` or ``w2`` as the expert launches stream them."""
        return self.packed[i][name + "_mxfp4" if self.experts == "mxfp4" else name]

    @property
    def pdl(self) -> bool:
        return self._pdl

    @pdl.setter
    def pdl(self, enabled: bool) -> None:
        if enabled and self.device.type == "cuda" and \
                torch.cuda.get_device_capability(self.device)[0] < 9:
            raise ValueError("programmatic dependent launch (pdl) needs sm_90 or newer")
        self._pdl = enabled

    def unsupported(self, tokens: torch.Tensor, verify: bool) -> str | None:
        """Why a step must take the standard path's PyTorch ops, or None when it need not."""
        B, T = tokens.shape
        if B > MAX_BATCH:
            return f"batch {B} > {MAX_BATCH}"
        if T > 1 and not verify:
            return f"a prompt of {T} tokens"
        if T > MAX_VERIFY_TOKENS:
            return f"verify of {T} tokens > {MAX_VERIFY_TOKENS}"
        return None

    def forward(self, tokens: torch.Tensor, state: DecodeState, observer: Observer | None = None,
                verify: bool = False, layer_hook=None,
                last_logits: bool = False) -> torch.Tensor:
        check_tokens(tokens)   # (before unsupported reads its shape)
        call = self.calls
        self.calls += 1
        reason = self.unsupported(tokens, verify)
        if reason is not None:
            self.fallbacks.append(f"{self.call_name or f'call {call}'}: {reason}")
            return super().forward(tokens, state, observer, verify, layer_hook,
                                   last_logits)
        with programmatic_launch(self.pdl, self.pdl_prefetch_bytes):
            return self.kernel_forward(tokens, state, observer, verify, layer_hook,
                                       last_logits)

    def kernel_forward(self, tokens: torch.Tensor, state: DecodeState,
                       observer: Observer | None, verify: bool, layer_hook,
                       last_logits: bool) -> torch.Tensor:
        """A step the kernels take (``forward`` has checked that they do)."""
        c = self.c
        B, T = tokens.shape
        check_batch(tokens, state, c.vocab, self.graph_safe)
        if verify:
            state.check_verify(T)
        M = B * T
        positions = self.positions(state, T)
        eps = c.rms_eps
        self.layer = -1
        prefix = self.w["model.embed_tokens.weight"][tokens.reshape(M)].contiguous()
        blocks = prefix.new_empty(M, math.ceil(c.n_layers / c.attn_res_block), c.hidden)
        delta = None
        for i in range(c.n_layers):
            with self.layer_scope(i, layer_hook):
                p = layer_prefix(i)
                packed = self.packed[i]
                boundary = i % c.attn_res_block == 0
                n_done = math.ceil(i / c.attn_res_block)
                self.launch("attn_res_pre")
                x = attn_res(prefix, delta, blocks, n_done,
                             i // c.attn_res_block if boundary else -1,
                             packed["self_attention_res_qk"], self.w[p + "input_layernorm.weight"],
                             eps)
                if c.is_mla(i):
                    a = self.mla_layer(i, x, state, positions.reshape(M), T)
                else:
                    a = self.kda_layer(i, x, state, B, T, verify)
                self.launch("attn_res_post")
                h = attn_res(prefix, a, blocks, n_done + int(boundary), -1, packed["mlp_res_qk"],
                             self.w[p + "post_attention_layernorm.weight"], eps, reset=boundary)
                m, chosen = self.dense_mlp(h) if i == 0 else self.moe(i, h)
                if observer is not None:
                    observer.record(i, a, m, chosen, B, T)
                delta = m
        self.layer = c.n_layers
        self.launch("attn_res_final")
        out = attn_res(prefix, delta, blocks, blocks.shape[1], -1, self.final_qk, None, eps)
        if last_logits:
            out = out.view(B, T, -1)[:, -1].contiguous()
        logits = self.lm_head(out)
        self.end_op()
        state.advance(T, verify)
        return logits.view(B, 1 if last_logits else T, -1)

    def fused_kda_decode(self, i: int, z: torch.Tensor, state: DecodeState, B: int, T: int,
                         verify: bool, f: torch.Tensor | None = None) -> torch.Tensor:
        """The KDA decode kernel on layer i's in_proj output z [B·T, rows] (``f``: the f_b
        projection when a GEMM of its own took it): the output [B, T, H·d]. It folds in what
        a verify step left pending; a verify step (``verify``) records its positions."""
        c = self.c
        a = layer_prefix(i) + "self_attn."
        records = (KdaRecords(state.records[i], state.inputs[i], state.pending, state.half)
                   if state.pending is not None else None)
        return kda_decode(
            z.view(B, T, -1), c.kda_heads_local, c.kda_head_dim, c.f_rank,
            self.w[a + "f_b_proj.weight"], self.w[a + "dt_bias"], self.w[a + "A_log"],
            self.packed[i]["conv"], self.w[a + "o_norm.weight"], state.conv[i], state.kda[i],
            c.rms_eps, c.gate_lower_bound, f=f, arrivals=self.kda_arrivals, records=records,
            record=verify)

    def mla_splits_for(self, B: int, T: int, state: DecodeState, layer: int) -> int:
        return self.attention_splits or mla_splits(B, T, self.c.mla_heads_local,
                                                    state.kv[layer].shape[1], self.device)

    # -- what a path gives: x [M, hidden] in, [M, hidden] out -------------------------------

    def kda_layer(self, i: int, x: torch.Tensor, state: DecodeState, B: int, T: int,
                  verify: bool) -> torch.Tensor:
        raise NotImplementedError

    def mla_layer(self, i: int, x: torch.Tensor, state: DecodeState, positions: torch.Tensor,
                  T: int) -> torch.Tensor:
        raise NotImplementedError

    def dense_mlp(self, h: torch.Tensor) -> tuple[torch.Tensor, None]:
        raise NotImplementedError

    def moe(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, the experts each token chose)"""
        raise NotImplementedError

    def lm_head(self, out: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm and the LM head: fp32 logits [M, vocab]."""
        raise NotImplementedError
