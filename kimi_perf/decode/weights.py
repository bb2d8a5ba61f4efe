"""Weights of the Kimi-K3-style model under K3's checkpoint tensor names.

``random_weights`` draws a full (unsharded) checkpoint from a seed; ``load_safetensors`` reads a
local directory of ``*.safetensors`` files with the same names, or K3's release's
(``checkpoint_name``), reading only the tensors the config needs (routed experts may be MXFP4:
``weight_packed`` uint8 pairs of E2M1 values plus ``weight_scale`` uint8 E8M0 exponents per
group of 32, as compressed-tensors stores them). ``shard`` cuts a full checkpoint into one
tensor-parallel rank's weights, laid out as vLLM lays them out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from kimi_perf.decode import choose_triton_backend
from kimi_perf.decode.config import K3Config, mxfp4_problem

choose_triton_backend()    # before kimi_perf_kernels imports triton (model imports this first)

from kimi_perf_kernels import mxfp4  # noqa: E402

Weights = dict[str, torch.Tensor]


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def weight_shapes(c: K3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of the full (unsharded) checkpoint and its shape, [out, in] for matrices."""
    h, d = c.hidden, c.kda_head_dim
    kda = c.kda_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab, h)}
    for i in range(c.n_layers):
        p = layer_prefix(i)
        for name in ("self_attention_res_norm", "mlp_res_norm", "input_layernorm",
                     "post_attention_layernorm"):
            shapes[p + name + ".weight"] = (h,)
        shapes[p + "self_attention_res_proj.weight"] = (1, h)
        shapes[p + "mlp_res_proj.weight"] = (1, h)
        a = p + "self_attn."
        if c.is_mla(i):
            shapes |= {
                a + "q_a_proj.weight": (c.q_lora, h),
                a + "kv_a_proj_with_mqa.weight": (c.kv_lora + c.qk_rope, h),
                a + "q_a_layernorm.weight": (c.q_lora,),
                a + "kv_a_layernorm.weight": (c.kv_lora,),
                a + "q_b_proj.weight": (c.mla_heads * (c.qk_nope + c.qk_rope), c.q_lora),
                a + "kv_b_proj.weight": (c.mla_heads * (c.qk_nope + c.v_head), c.kv_lora),
                a + "g_proj.weight": (c.mla_heads * c.v_head, h),
                a + "o_proj.weight": (h, c.mla_heads * c.v_head),
            }
        else:
            shapes |= {a + f"{n}_proj.weight": (kda, h) for n in "qkvg"}
            shapes |= {a + f"{n}_conv1d.weight": (kda, 1, c.conv_size) for n in "qkv"}
            shapes |= {
                a + "f_a_proj.weight": (c.f_rank, h),
                a + "f_b_proj.weight": (kda, c.f_rank),
                a + "b_proj.weight": (c.kda_heads, h),
                a + "A_log": (c.kda_heads,),
                a + "dt_bias": (kda,),
                a + "o_norm.weight": (d,),
                a + "o_proj.weight": (h, kda),
            }
        m = p + "mlp."
        if i == 0:
            shapes |= {m + "gate_proj.weight": (c.dense_intermediate, h),
                       m + "up_proj.weight": (c.dense_intermediate, h),
                       m + "down_proj.weight": (h, c.dense_intermediate)}
            continue
        shapes |= {
            m + "gate.weight": (c.n_experts, h),
            m + "gate.e_score_correction_bias": (c.n_experts,),
            m + "routed_expert_down_proj.weight": (c.latent, h),
            m + "routed_expert_norm.weight": (c.latent,),
            m + "routed_expert_up_proj.weight": (h, c.latent),
            m + "shared_experts.gate_proj.weight": (c.shared_intermediate, h),
            m + "shared_experts.up_proj.weight": (c.shared_intermediate, h),
            m + "shared_experts.down_proj.weight": (h, c.shared_intermediate),
        }
        for e in range(c.n_experts):
            shapes |= {m + f"experts.{e}.w1.weight": (c.moe_intermediate, c.latent),
                       m + f"experts.{e}.w3.weight": (c.moe_intermediate, c.latent),
                       m + f"experts.{e}.w2.weight": (c.latent, c.moe_intermediate)}
    shapes |= {"model.output_attn_res_norm.weight": (h,),
               "model.output_attn_res_proj.weight": (1, h),
               "model.norm.weight": (h,), "lm_head.weight": (c.vocab, h)}
    return shapes


# How the routed experts are stored: in the model's dtype, or as K3's checkpoint stores them,
# MXFP4 (their values rounded to it, as MXFP4 can hold them; the kernel paths then stream
# the codes and scales: ``build_model(..., experts="mxfp4")``).
EXPERT_STORAGES = ("bf16", "mxfp4")


def check_expert_storage(experts: str) -> None:
    if experts not in EXPERT_STORAGES:
        raise ValueError(f"experts: {' or '.join(EXPERT_STORAGES)}, not {experts!r}")


def random_weights(c: K3Config, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                   device: torch.device | str = "cpu", experts: str = "bf16") -> Weights:
    """Weights drawn from ``seed``, scaled so activations stay O(1) through depth; with
    ``experts="mxfp4"`` the routed experts' values are MXFP4 ones (``mxfp4_experts``).

    For ``c.tp == 1`` this is the full checkpoint (``shard`` cuts ranks from it, so all ranks
    share one model). For a sharded config it draws one rank's shapes directly, on
    ``device``: a K3 rank's experts are too large to draw whole and then cut.
    """
    check_expert_storage(experts)
    if experts == "mxfp4" and (problem := mxfp4_problem(c)):
        raise ValueError(problem)
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = weight_shapes(c) if c.tp == 1 else local_weight_shapes(c)
    out: Weights = {}
    for name, shape in shapes.items():
        out[name] = _init(name, shape, gen, c, device).to(_storage_dtype(shape, dtype))
        if experts == "mxfp4" and is_routed_expert(name):   # (one at a time: no second copy)
            out[name] = _mxfp4_values(out[name])
    return out


def is_routed_expert(name: str) -> bool:
    """Whether a tensor is a routed expert's matrix (``...mlp.experts.<e>.w1.weight``)."""
    return re.search(r"\.mlp\.experts\.\d+\.w[123]\.weight$", name) is not None


def mxfp4_experts(weights: Weights) -> Weights:
    """``weights`` with each routed expert's matrix rounded to MXFP4's values (groups of 32
    along its input, as K3's checkpoint holds them), kept in its dtype: every path and the
    reference then compute on the values an MXFP4 checkpoint holds. A checkpoint loaded from
    MXFP4 (``load_safetensors``) already holds them."""
    return {name: _mxfp4_values(t) if is_routed_expert(name) else t
            for name, t in weights.items()}


def _mxfp4_values(t: torch.Tensor) -> torch.Tensor:
    return mxfp4.dequantize(mxfp4.quantize(t)).to(t.dtype)


def mxfp4_codes(stack: torch.Tensor, what: str, keep: bool = True) -> mxfp4.Mxfp4 | None:
    """Routed experts ``stack`` [E, N, K] as MXFP4 codes and scales, one expert at a time (a
    K3 layer's stack is 2.5e9 values); a ValueError naming ``what`` where the stack holds
    values MXFP4 cannot (packing them would lose them). ``keep=False``: checked alone, no
    codes stored (None)."""
    e, n, k = stack.shape
    q = mxfp4.Mxfp4(stack.new_empty(e, n, k // 2, dtype=torch.uint8),
                    stack.new_empty(e, n, k // mxfp4.GROUP, dtype=torch.uint8),
                    stack.dtype) if keep else None
    for expert in range(e):
        one = mxfp4.quantize(stack[expert])
        if not torch.equal(mxfp4.dequantize(one), stack[expert].float()):
            raise ValueError(f"experts='mxfp4': {what} hold values MXFP4 cannot; round them "
                             "first (weights.mxfp4_experts)")
        if q is not None:
            q.packed[expert], q.scale[expert] = one.packed, one.scale
    return q


def check_weight_shapes(c: K3Config, weights: Mapping[str, torch.Tensor]) -> None:
    """A ValueError naming the first tensor of ``c`` that ``weights`` lacks or holds in
    another shape (one rank's shapes where ``c.tp`` > 1): said here, not deep in a kernel."""
    shapes = weight_shapes(c) if c.tp == 1 else local_weight_shapes(c)
    for name, expected in shapes.items():
        if name not in weights:
            raise ValueError(f"weights: no {name}")
        if tuple(weights[name].shape) != expected:
            rank = (f" (one rank's shapes at TP {c.tp}: shard(weights, rank_config, rank) cuts "
                    "them from the whole model's)" if c.tp > 1 else "")
            raise ValueError(f"weights: {name} has shape {tuple(weights[name].shape)}, "
                             f"expected {expected}{rank}")


def local_weight_shapes(c: K3Config) -> dict[str, tuple[int, ...]]:
    """One rank's tensor shapes, as ``shard`` produces them."""
    full = dataclasses.replace(c, tp=1)
    shapes: dict[str, tuple[int, ...]] = {}
    # (a tensor's split does not depend on its layer or expert number: K3 has 250k tensors)
    split: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
    for name, shape in weight_shapes(full).items():
        key = (re.sub(r"\.\d+\.", ".#.", name), shape)
        if key not in split:
            probe = torch.empty(shape, device="meta")
            split[key] = tuple(shard({name: probe}, c, 0)[name].shape)
        shapes[name] = split[key]
    return shapes


def weight_bytes(c: K3Config, dtype: torch.dtype = torch.bfloat16) -> int:
    """The bytes of ``random_weights(c, dtype=dtype)``, without drawing them."""
    shapes = weight_shapes(c) if c.tp == 1 else local_weight_shapes(c)
    return sum(math.prod(shape) * _storage_dtype(shape, dtype).itemsize
               for shape in shapes.values())


def weight_values(c: K3Config) -> int:
    """How many values ``random_weights(c)`` holds, whatever their dtype (a float64 copy of
    them all, the reference's, is 8 bytes each)."""
    shapes = weight_shapes(c) if c.tp == 1 else local_weight_shapes(c)
    return sum(math.prod(shape) for shape in shapes.values())


def _storage_dtype(shape: tuple[int, ...], dtype: torch.dtype) -> torch.dtype:
    """Matrices in the model dtype; vectors (norms, biases, gates) and conv taps in fp32."""
    return dtype if len(shape) == 2 else torch.float32


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator, c: K3Config,
          device: torch.device | str = "cpu") -> torch.Tensor:
    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device) * std

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(shape, generator=gen, device=device)

    # The decay gate: A = U(1, 16) as KDA initialises it (flash-linear-attention), dt_bias the
    # inverse softplus of dt = exp(U(ln 0.001, ln 10)), KDA's range (to 0.1) widened: about
    # a third of the channels forget within a step, the rest keep their state for many steps
    # (decay near 1), where the fp32 state's accumulation shows.
    if name.endswith("A_log"):
        return torch.log(uniform(1.0, 16.0))
    if name.endswith("dt_bias"):
        dt = torch.exp(uniform(math.log(1e-3), math.log(10.0)))
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith("conv1d.weight"):
        return normal(1.0 / math.sqrt(c.conv_size))
    if name.endswith("e_score_correction_bias"):
        return normal(0.02)
    if name.endswith("res_proj.weight"):
        return normal(1.0 / math.sqrt(c.hidden))
    if len(shape) == 1:  # norm weights
        return 1.0 + normal(0.1)
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    fan_in = shape[-1]
    # Sub-layer outputs write into the residual stream: keep them smaller than its O(1) scale.
    out_scale = 0.5 if name.endswith(("o_proj.weight", "down_proj.weight", "w2.weight",
                                      "up_proj.weight")) and "shared" not in name else 1.0
    return normal(out_scale / math.sqrt(fan_in))


def shard(full: Weights, c: K3Config, rank: int) -> Weights:
    """One rank's weights for ``c.tp`` ranks (``c`` is the sharded config)."""
    tp = c.tp
    if tp == 1:
        return dict(full)

    def rows(t: torch.Tensor, parts: int = 1) -> torch.Tensor:
        """Split dim 0 into ``parts`` equal blocks and take this rank's slice of each."""
        blocks = t.chunk(parts, dim=0)
        return torch.cat([b.chunk(tp, dim=0)[rank] for b in blocks])

    def cols(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, dim=1)[rank].contiguous()

    out: Weights = {}
    for name, t in full.items():
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
        if ".self_attn." in name:
            if leaf in ("q_proj", "k_proj", "v_proj", "g_proj", "f_b_proj", "b_proj",
                        "q_b_proj", "kv_b_proj", "q_conv1d", "k_conv1d", "v_conv1d",
                        "A_log", "dt_bias"):
                out[name] = rows(t).contiguous()
            elif leaf == "o_proj":
                out[name] = cols(t)
            else:  # f_a_proj, q_a_proj, kv_a_proj_with_mqa, norms: replicated
                out[name] = t
        elif ".experts." in name or "shared_experts" in name or (
                ".mlp." in name and leaf in ("gate_proj", "up_proj", "down_proj")):
            out[name] = cols(t) if leaf in ("w2", "down_proj") else rows(t).contiguous()
        else:  # embeddings, norms, AttnRes, router, latent projections: replicated
            out[name] = t
    return out


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors MXFP4 (``weight_packed``, ``weight_scale``) -> fp32 values."""
    return mxfp4.dequantize(mxfp4.Mxfp4(packed, scale))


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``dequantize_mxfp4``: (``weight_packed``, ``weight_scale``)."""
    q = mxfp4.quantize(weight)
    return q.packed, q.scale


def checkpoint_name(name: str) -> str:
    """A tensor's name here, from its name in a checkpoint: K3's release wraps the language
    model in a multimodal model (``language_model.``; its layers also stored without
    ``model.``), and names the MoE block ``block_sparse_moe`` (vLLM's module), where this
    model's names say ``mlp``."""
    if name.startswith("language_model."):
        name = name[len("language_model."):]
        if not name.startswith(("model.", "lm_head.")):
            name = "model." + name
    return name.replace(".block_sparse_moe.", ".mlp.")


def load_safetensors(directory: str | Path, c: K3Config,
                     dtype: torch.dtype = torch.bfloat16) -> Weights:
    """Read the tensors of ``c`` from a checkpoint in ``directory/*.safetensors``, under K3's
    names (``checkpoint_name``). Only the tensors the config needs are read, each from its
    file's memory map: a few layers of a full K3 checkpoint load without reading the rest
    (its other layers, the vision tower, the MTP layer)."""
    from safetensors import safe_open

    from kimi_perf.errors import TraceError

    if c.tp > 1:   # (a checkpoint holds the whole model; weight_shapes are its shapes)
        raise ValueError(f"c: the whole model's config (tp=1), not one rank's (tp={c.tp}); "
                         "shard(weights, rank_config, rank) cuts a rank's weights from the whole "
                         "model's")
    directory = Path(directory)
    if not directory.is_dir():
        raise TraceError(directory, "no such directory" if not directory.exists() else
                                    "not a directory (a checkpoint is a folder of *.safetensors)")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise TraceError(directory, "no *.safetensors files")
    with contextlib.ExitStack() as stack:
        where = {}      # our name -> (file, open handle, its name there)
        for f in files:
            try:
                handle = stack.enter_context(safe_open(str(f), framework="pt"))
                keys = list(handle.keys())
            except Exception as exc:  # safetensors raises its own error types
                raise TraceError(f, f"unreadable safetensors file ({exc})") from None
            for key in keys:
                where.setdefault(checkpoint_name(key), (f, handle, key))

        def read(name: str) -> torch.Tensor:
            f, handle, key = where[name]
            try:
                return handle.get_tensor(key)
            except Exception as exc:
                raise TraceError(f, f"unreadable tensor {key} ({exc})") from None

        out: Weights = {}
        for name, shape in weight_shapes(c).items():
            out[name] = _checkpoint_tensor(directory, name, shape, where, read, dtype)
    return out


def _checkpoint_tensor(directory: Path, name: str, shape: tuple[int, ...],
                       where: Mapping[str, object], read: Callable[[str], torch.Tensor],
                       dtype: torch.dtype) -> torch.Tensor:
    """``name`` from a checkpoint whose tensors ``where`` holds (our names), read by ``read``:
    MXFP4 routed experts dequantised, K3's padded A_log cut to its heads, a conv weight
    without its middle axis given one, its shape checked."""
    from kimi_perf.errors import TraceError

    if name in where:
        t = read(name)
        # an integer or 8-bit tensor is a quantized one, whose scale this name does not read:
        # cast, it would load as its codes
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            raise TraceError(directory, f"{name} is {t.dtype}, not a float tensor (bf16, fp16, "
                                        "fp32; quantized only as MXFP4 weight_packed and "
                                        "weight_scale)")
    elif name.endswith(".weight") and name[:-7] + ".weight_packed" in where:
        base = name[:-7]
        if base + ".weight_scale" not in where:
            raise TraceError(directory, f"checkpoint lacks {base}.weight_scale")
        q = mxfp4.Mxfp4(read(base + ".weight_packed"), read(base + ".weight_scale"))
        try:
            q.check(base)
        except ValueError as exc:
            raise TraceError(directory, str(exc)) from None
        t = mxfp4.dequantize(q)
    else:
        raise TraceError(directory, f"checkpoint lacks {name}")
    if name.endswith("A_log") and t.numel() >= shape[0]:
        # K3 pads its per-head A_log to 128 entries with zeros, stored flat or as
        # [1, 1, heads, 1] (vLLM takes both); anything else there would be another layout (per
        # channel), which dropping the tail would silently misread
        t = t.reshape(-1)
        if t[shape[0]:].any():
            raise TraceError(directory, f"{name} has {t.numel()} entries, nonzero past its "
                                        f"{shape[0]} heads: not K3's per-head layout")
        t = t[: shape[0]]
    if name.endswith("conv1d.weight") and tuple(t.shape) == (shape[0], shape[2]):
        t = t.unsqueeze(1)    # [channels, taps], as vLLM's loader also takes it
    if tuple(t.shape) != shape:
        raise TraceError(directory, f"{name} has shape {tuple(t.shape)}, expected {shape}")
    return t.to(_storage_dtype(shape, dtype))
