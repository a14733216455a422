"""Which stock Hugging Face architecture a megatron-lns model is, and the tensor mapping.

A megatron-lns decoder (RoPE, SwiGLU, pre-norms, optional LNS) is exactly one of:

* RMSNorm (affine or not)              -> ``LlamaForCausalLM`` (``head_dim`` = the head size)
* LayerNorm, no linear biases          -> ``StableLmForCausalLM`` (``partial_rotary_factor``
  1.0, ``use_parallel_residual`` false, ``use_qkv_bias`` false): its LayerNorms have a
  weight and a bias, so they can carry the LNS factor and OLMo's parameter-free norm;
  its heads are always hidden_size / num_attention_heads wide

Anything else is refused with the setting that prevents it (see
:meth:`Architecture.from_model_config`). The tensors of block ``l`` (1-based) map as
docs/conversion.md tabulates; the two pre-norms carry the LNS factor ``1/sqrt(l)``
folded in with the rules of :mod:`megatron_lns.scaling`, exactly as the megatron
forward pass folds it, so the exported weights are the ones megatron multiplies with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_lns.config.schema import ModelConfig
from megatron_lns.convert.errors import ConversionError
from megatron_lns.scaling import fold_scale_into_beta, fold_scale_into_gamma, norm_output_scale

LLAMA = "LlamaForCausalLM"
STABLELM = "StableLmForCausalLM"

# Checkpoint keys (megatron's sharded keys). Per-layer tensors are stacked on a leading
# layer axis under LAYERS + name; the local spec's separate norms are saved under the
# names of the norms fused into linear_qkv / linear_fc1.
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM_WEIGHT = "decoder.final_layernorm.weight"
FINAL_NORM_BIAS = "decoder.final_layernorm.bias"
LAYERS = "decoder.layers."
ATTN_NORM_WEIGHT = "self_attention.linear_qkv.layer_norm_weight"
ATTN_NORM_BIAS = "self_attention.linear_qkv.layer_norm_bias"
QKV_WEIGHT = "self_attention.linear_qkv.weight"
QKV_BIAS = "self_attention.linear_qkv.bias"
PROJ_WEIGHT = "self_attention.linear_proj.weight"
PROJ_BIAS = "self_attention.linear_proj.bias"
MLP_NORM_WEIGHT = "mlp.linear_fc1.layer_norm_weight"
MLP_NORM_BIAS = "mlp.linear_fc1.layer_norm_bias"
FC1_WEIGHT = "mlp.linear_fc1.weight"
FC1_BIAS = "mlp.linear_fc1.bias"
FC2_WEIGHT = "mlp.linear_fc2.weight"
FC2_BIAS = "mlp.linear_fc2.bias"

# Hugging Face names (Llama and StableLM agree on all of them).
HF_EMBEDDING = "model.embed_tokens.weight"
HF_LM_HEAD = "lm_head.weight"
HF_FINAL_NORM = "model.norm."
# Buffers some older checkpoints carry; derived from the config, never weights.
HF_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_layer_prefix(index: int) -> str:
    return f"model.layers.{index}."


def effective_norm_weight(weight: Tensor, scale: float, zero_centered: bool) -> Tensor:
    """The plain-form gamma a norm multiplies with: LNS folded in, zero-centring removed.

    The same expression as ``LocalNorm.effective_gamma``, so the result is bitwise the
    weight the megatron forward pass uses.
    """
    gamma = fold_scale_into_gamma(weight, scale, zero_centered)
    return gamma + 1.0 if zero_centered else gamma


def invert_exactly(
    target: Tensor, forward: Callable[[Tensor], Tensor], guess: Tensor, max_ulps: int = 4
) -> tuple[Tensor, int]:
    """A ``source`` with ``forward(source) == target`` bitwise, elementwise, near ``guess``.

    Dividing by the factor and multiplying again need not give back the same float, so
    the quotient is corrected by up to ``max_ulps`` ulps in either direction. Every
    tensor that ``forward`` produced has an exact preimage, so an export re-imported
    exports bitwise identically. Returns the source and the number of elements with no
    exact preimage (there the closest one is taken).
    """
    best = guess.clone()
    best_error = (forward(best).double() - target.double()).abs()
    for direction in (float("inf"), float("-inf")):
        candidate = guess
        for _ in range(max_ulps):
            if not bool((best_error > 0).any()):
                return best, 0
            candidate = torch.nextafter(candidate, torch.full_like(candidate, direction))
            error = (forward(candidate).double() - target.double()).abs()
            better = error < best_error
            best = torch.where(better, candidate, best)
            best_error = torch.where(better, error, best_error)
    return best, int((best_error > 0).sum())


@dataclass(frozen=True)
class Architecture:
    """The shape and numerics of a decoder, as both sides need them for conversion."""

    hf_class: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int  # channels per attention head (model.kv_channels, Llama's head_dim)
    rmsnorm: bool
    norm_affine: bool
    zero_centered_gamma: bool
    bias: bool
    lns: bool
    tied_embeddings: bool
    eps: float
    rotary_base: float
    max_position_embeddings: int

    @property
    def norm_has_bias(self) -> bool:
        return not self.rmsnorm and self.norm_affine

    def norm_scale(self, layer_number: int) -> float:
        """The LNS factor of block ``layer_number`` (1-based): ``1/sqrt(l)``, or 1 for Pre-LN."""
        return norm_output_scale("lns" if self.lns else "none", layer_number)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_model_config(cls, m: ModelConfig) -> Architecture:
        """The architecture of a megatron-lns ``model:`` section; refuses what no stock
        Hugging Face architecture computes exactly."""
        if m.position_embedding_type != "rope":
            raise ConversionError(
                f"model.position_embedding_type={m.position_embedding_type} cannot be exported: "
                "the supported stock architectures (Llama, StableLM) use rope"
            )
        if m.activation != "swiglu":
            raise ConversionError(
                f"model.activation={m.activation} cannot be exported: Llama and StableLM "
                "use a gated SiLU MLP (swiglu); no stock architecture here has RoPE with a "
                "plain GELU MLP"
            )
        if m.layer_variant != "pre_ln":
            raise ConversionError(
                f"model.layer_variant={m.layer_variant} cannot be exported: the stock "
                "architectures (Llama, StableLM) are Pre-LN without branch gains"
            )
        if m.fp8_param:
            raise ConversionError(
                "model.fp8_param=true: the checkpoint holds FP8 weights, which export does "
                "not dequantize; save a checkpoint trained with model.fp8_param=false"
            )
        rmsnorm = m.normalization == "rmsnorm"
        if not rmsnorm and m.bias:
            raise ConversionError(
                f"model.normalization={m.normalization} with model.bias=true cannot be "
                "exported: StableLM (the stock LayerNorm + RoPE + SwiGLU architecture) has no "
                "output-projection or MLP biases; Llama (with biases) needs "
                "model.normalization=rmsnorm"
            )
        heads = m.num_attention_heads
        head_dim = m.kv_channels or m.hidden_size // heads
        if not rmsnorm and head_dim * heads != m.hidden_size:
            raise ConversionError(
                f"model.kv_channels={head_dim} cannot be exported with model.normalization="
                f"{m.normalization}: StableLM's attention has hidden_size / num_attention_heads "
                f"channels per head ({m.hidden_size} / {heads}); Llama "
                "(model.normalization=rmsnorm) carries its own head_dim"
            )
        ffn = m.ffn_hidden_size or 4 * m.hidden_size
        return cls(
            hf_class=LLAMA if rmsnorm else STABLELM,
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            ffn_hidden_size=ffn,
            num_attention_heads=m.num_attention_heads,
            num_query_groups=m.num_query_groups or m.num_attention_heads,
            head_dim=head_dim,
            rmsnorm=rmsnorm,
            norm_affine=m.norm_affine,
            zero_centered_gamma=m.normalization == "layernorm1p",
            bias=m.bias,
            lns=m.norm_scaling == "lns",
            tied_embeddings=m.share_embeddings_and_output_weights,
            eps=m.layernorm_epsilon,
            rotary_base=float(m.rotary_base),
            max_position_embeddings=m.max_position_embeddings or m.encoder_seq_length,
        )

    @classmethod
    def from_hf_config(cls, config, lns: bool) -> Architecture:
        """The architecture of a Hugging Face ``config.json`` (Llama or StableLM)."""
        architectures = list(getattr(config, "architectures", None) or [])
        if architectures not in ([LLAMA], [STABLELM]):
            raise ConversionError(
                f"config.json: architectures={architectures} is not supported; import reads "
                f"{LLAMA} and {STABLELM}"
            )
        hf_class = architectures[0]
        rope = hf_rope_parameters(config)
        if rope.get("rope_type", "default") != "default":
            raise ConversionError(
                f"config.json: rope scaling '{rope['rope_type']}' is not supported (megatron-lns "
                "uses plain RoPE)"
            )
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ConversionError(
                f"config.json: partial_rotary_factor={rope['partial_rotary_factor']} is not "
                "supported (megatron-lns rotates the whole head)"
            )
        if not float(rope["rope_theta"]).is_integer():
            raise ConversionError(
                f"config.json: rope_theta={rope['rope_theta']} is not an integer "
                "(model.rotary_base is one)"
            )
        if config.hidden_act != "silu":
            raise ConversionError(
                f"config.json: hidden_act={config.hidden_act} is not supported (swiglu only)"
            )
        heads = config.num_attention_heads
        # Llama's config always has head_dim (hidden_size // heads unless set), and its
        # attention uses it; StableLM's attention always uses hidden_size / heads.
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        if hf_class == STABLELM and head_dim * heads != config.hidden_size:
            raise ConversionError(
                f"config.json: head_dim={head_dim} x num_attention_heads={heads} != "
                f"hidden_size={config.hidden_size}: StableLM's attention has hidden_size / "
                "num_attention_heads channels per head, so model.kv_channels cannot differ"
            )
        if hf_class == LLAMA:
            attention_bias = bool(getattr(config, "attention_bias", False))
            mlp_bias = bool(getattr(config, "mlp_bias", False))
            if attention_bias != mlp_bias:
                raise ConversionError(
                    f"config.json: attention_bias={attention_bias} with mlp_bias={mlp_bias}: "
                    "megatron-lns has one switch (model.bias) for all linear biases"
                )
            bias, eps = attention_bias, config.rms_norm_eps
        else:
            for key, supported in (
                ("use_parallel_residual", False),
                ("qk_layernorm", False),
                ("use_qkv_bias", False),
            ):
                if bool(getattr(config, key, False)) != supported:
                    raise ConversionError(
                        f"config.json: {key}={getattr(config, key)} is not supported "
                        f"(megatron-lns needs {key}={str(supported).lower()})"
                    )
            bias, eps = False, config.layer_norm_eps
        return cls(
            hf_class=hf_class,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            ffn_hidden_size=config.intermediate_size,
            num_attention_heads=heads,
            num_query_groups=config.num_key_value_heads or heads,
            head_dim=head_dim,
            rmsnorm=hf_class == LLAMA,
            norm_affine=True,
            zero_centered_gamma=False,
            bias=bias,
            lns=lns,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            eps=float(eps),
            rotary_base=float(rope["rope_theta"]),
            max_position_embeddings=config.max_position_embeddings,
        )

    def model_settings(self) -> dict:
        """The ``model.*`` keys of the YAML that describe this architecture."""
        return {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "ffn_hidden_size": self.ffn_hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_query_groups": self.num_query_groups,
            "kv_channels": self.head_dim,
            "normalization": "rmsnorm" if self.rmsnorm else "layernorm",
            "norm_affine": self.norm_affine,
            "layernorm_epsilon": self.eps,
            "bias": self.bias,
            "activation": "swiglu",
            "position_embedding_type": "rope",
            "rotary_base": int(self.rotary_base),
            "share_embeddings_and_output_weights": self.tied_embeddings,
        }

    def hf_config(self, vocab_size: int, dtype: torch.dtype, bos: int | None, eos: int):
        """The ``transformers`` config object of the export."""
        import transformers

        common = dict(
            architectures=[self.hf_class],
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.ffn_hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_query_groups,
            hidden_act="silu",
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rotary_base,
            tie_word_embeddings=self.tied_embeddings,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=None,
            attention_dropout=0.0,
        )
        dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        common[dtype_key] = str(dtype).removeprefix("torch.")
        if self.hf_class == LLAMA:
            return transformers.LlamaConfig(
                **common,
                head_dim=self.head_dim,
                rms_norm_eps=self.eps,
                attention_bias=self.bias,
                mlp_bias=self.bias,
            )
        return transformers.StableLmConfig(
            **common,
            layer_norm_eps=self.eps,
            partial_rotary_factor=1.0,
            use_parallel_residual=False,
            use_qkv_bias=False,
            qk_layernorm=False,
            hidden_dropout=0.0,
        )

    # ------------------------------------------------------------------ tensors
    def layer_keys(self) -> list[str]:
        """The per-layer checkpoint keys of this architecture (relative to LAYERS)."""
        keys = [QKV_WEIGHT, PROJ_WEIGHT, FC1_WEIGHT, FC2_WEIGHT]
        if self.norm_affine:
            keys += [ATTN_NORM_WEIGHT, MLP_NORM_WEIGHT]
        if self.norm_has_bias:
            keys += [ATTN_NORM_BIAS, MLP_NORM_BIAS]
        if self.bias:
            keys += [QKV_BIAS, PROJ_BIAS, FC1_BIAS, FC2_BIAS]
        return keys

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of one layer's slice of each per-layer checkpoint tensor."""
        h, ffn, hd = self.hidden_size, self.ffn_hidden_size, self.head_dim
        qkv = (self.num_attention_heads + 2 * self.num_query_groups) * hd
        shapes = {
            QKV_WEIGHT: (qkv, h),
            PROJ_WEIGHT: (h, self.num_attention_heads * hd),
            FC1_WEIGHT: (2 * ffn, h),
            FC2_WEIGHT: (h, ffn),
            ATTN_NORM_WEIGHT: (h,),
            MLP_NORM_WEIGHT: (h,),
            ATTN_NORM_BIAS: (h,),
            MLP_NORM_BIAS: (h,),
            QKV_BIAS: (qkv,),
            PROJ_BIAS: (h,),
            FC1_BIAS: (2 * ffn,),
            FC2_BIAS: (h,),
        }
        return {key: shapes[key] for key in self.layer_keys()}

    def layer_to_hf(self, tensors: dict[str, Tensor], index: int) -> dict[str, Tensor]:
        """One megatron layer (0-based ``index``) as Hugging Face tensors, LNS folded in."""
        prefix = hf_layer_prefix(index)
        scale = self.norm_scale(index + 1)
        out: dict[str, Tensor] = {}
        dtype = tensors[QKV_WEIGHT].dtype
        for weight_key, bias_key, hf_norm in (
            (ATTN_NORM_WEIGHT, ATTN_NORM_BIAS, "input_layernorm."),
            (MLP_NORM_WEIGHT, MLP_NORM_BIAS, "post_attention_layernorm."),
        ):
            if self.norm_affine:
                weight = effective_norm_weight(tensors[weight_key], scale, self.zero_centered_gamma)
            else:
                # A parameter-free norm with LNS multiplies by the constant s (LocalNorm).
                weight = torch.full((self.hidden_size,), scale, dtype=dtype)
            out[prefix + hf_norm + "weight"] = weight
            if not self.rmsnorm:
                bias = (
                    fold_scale_into_beta(tensors[bias_key], scale)
                    if self.norm_affine
                    else torch.zeros(self.hidden_size, dtype=dtype)
                )
                out[prefix + hf_norm + "bias"] = bias
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        q, k, v = self.split_qkv(tensors[QKV_WEIGHT])
        out |= {attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v}
        out[attn + "o_proj.weight"] = tensors[PROJ_WEIGHT]
        gate, up = tensors[FC1_WEIGHT].chunk(2, dim=0)
        out |= {mlp + "gate_proj.weight": gate, mlp + "up_proj.weight": up}
        out[mlp + "down_proj.weight"] = tensors[FC2_WEIGHT]
        if self.bias:
            q, k, v = self.split_qkv(tensors[QKV_BIAS])
            out |= {attn + "q_proj.bias": q, attn + "k_proj.bias": k, attn + "v_proj.bias": v}
            out[attn + "o_proj.bias"] = tensors[PROJ_BIAS]
            gate, up = tensors[FC1_BIAS].chunk(2, dim=0)
            out |= {mlp + "gate_proj.bias": gate, mlp + "up_proj.bias": up}
            out[mlp + "down_proj.bias"] = tensors[FC2_BIAS]
        return {name: tensor.contiguous() for name, tensor in out.items()}

    def hf_layer_shapes(self, index: int) -> dict[str, tuple[int, ...]]:
        """Hugging Face name -> shape of every tensor of layer ``index``."""
        prefix = hf_layer_prefix(index)
        h, ffn, hd = self.hidden_size, self.ffn_hidden_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_query_groups * hd
        outputs = {
            "self_attn.q_proj.": (q, h),
            "self_attn.k_proj.": (kv, h),
            "self_attn.v_proj.": (kv, h),
            "self_attn.o_proj.": (h, q),
            "mlp.gate_proj.": (ffn, h),
            "mlp.up_proj.": (ffn, h),
            "mlp.down_proj.": (h, ffn),
        }
        shapes = {}
        for norm in ("input_layernorm.", "post_attention_layernorm."):
            shapes[prefix + norm + "weight"] = (h,)
            if not self.rmsnorm:
                shapes[prefix + norm + "bias"] = (h,)
        for name, (rows, cols) in outputs.items():
            shapes[prefix + name + "weight"] = (rows, cols)
            if self.bias:
                shapes[prefix + name + "bias"] = (rows,)
        return shapes

    def layer_from_hf(self, hf: dict[str, Tensor], index: int) -> tuple[dict[str, Tensor], int]:
        """One layer's Hugging Face tensors as megatron checkpoint tensors (relative keys),
        with the LNS factor divided out exactly when ``lns``. Also returns the number of
        norm elements that had no exact preimage (see :func:`invert_exactly`)."""
        prefix = hf_layer_prefix(index)
        scale = self.norm_scale(index + 1)
        out: dict[str, Tensor] = {}
        inexact = 0
        for weight_key, bias_key, hf_norm in (
            (ATTN_NORM_WEIGHT, ATTN_NORM_BIAS, "input_layernorm."),
            (MLP_NORM_WEIGHT, MLP_NORM_BIAS, "post_attention_layernorm."),
        ):
            weight = hf[prefix + hf_norm + "weight"]
            guess = (weight.double() / scale - float(self.zero_centered_gamma)).to(weight.dtype)
            out[weight_key], missed = invert_exactly(
                weight,
                lambda g: effective_norm_weight(g, scale, self.zero_centered_gamma),
                guess,
            )
            inexact += missed
            if not self.rmsnorm:
                bias = hf[prefix + hf_norm + "bias"]
                out[bias_key], missed = invert_exactly(
                    bias,
                    lambda b: fold_scale_into_beta(b, scale),
                    (bias.double() / scale).to(bias.dtype),
                )
                inexact += missed
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        for suffix, qkv_key, proj_key, fc1_key, fc2_key in (
            ("weight", QKV_WEIGHT, PROJ_WEIGHT, FC1_WEIGHT, FC2_WEIGHT),
            ("bias", QKV_BIAS, PROJ_BIAS, FC1_BIAS, FC2_BIAS),
        ):
            if suffix == "bias" and not self.bias:
                continue
            out[qkv_key] = self.merge_qkv(
                hf[f"{attn}q_proj.{suffix}"],
                hf[f"{attn}k_proj.{suffix}"],
                hf[f"{attn}v_proj.{suffix}"],
            )
            out[proj_key] = hf[f"{attn}o_proj.{suffix}"]
            out[fc1_key] = torch.cat([hf[f"{mlp}gate_proj.{suffix}"], hf[f"{mlp}up_proj.{suffix}"]])
            out[fc2_key] = hf[f"{mlp}down_proj.{suffix}"]
        return out, inexact

    def final_norm_to_hf(self, weight: Tensor | None, bias: Tensor | None, dtype) -> dict:
        """The final norm (never scaled by LNS) in plain form."""
        h = self.hidden_size
        out = {
            HF_FINAL_NORM + "weight": (
                effective_norm_weight(weight, 1.0, self.zero_centered_gamma)
                if weight is not None
                else torch.ones(h, dtype=dtype)
            )
        }
        if not self.rmsnorm:
            out[HF_FINAL_NORM + "bias"] = bias if bias is not None else torch.zeros(h, dtype=dtype)
        return out

    # The fused QKV projection holds, for each query group in turn, the group's query
    # heads, then its key head, then its value head (``head_dim`` rows each).
    def split_qkv(self, fused: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        groups, hd = self.num_query_groups, self.head_dim
        per_group = self.num_attention_heads // groups
        grouped = fused.reshape(groups, (per_group + 2) * hd, *fused.shape[1:])
        q, k, v = grouped.split([per_group * hd, hd, hd], dim=1)
        rest = fused.shape[1:]
        return (
            q.reshape(groups * per_group * hd, *rest),
            k.reshape(groups * hd, *rest),
            v.reshape(groups * hd, *rest),
        )

    def merge_qkv(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        groups, hd = self.num_query_groups, self.head_dim
        per_group = self.num_attention_heads // groups
        rest = q.shape[1:]
        grouped = torch.cat(
            [
                q.reshape(groups, per_group * hd, *rest),
                k.reshape(groups, hd, *rest),
                v.reshape(groups, hd, *rest),
            ],
            dim=1,
        )
        return grouped.reshape(-1, *rest)


def hf_rope_parameters(config) -> dict:
    """RoPE settings of a ``transformers`` config, from 4.x (``rope_theta``,
    ``rope_scaling``, ``partial_rotary_factor``) or 5.x (``rope_parameters``)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in rope:
        scaling = getattr(config, "rope_scaling", None) or {}
        rope = {
            "rope_theta": config.rope_theta,
            "rope_type": scaling.get("rope_type", scaling.get("type", "default")),
            "partial_rotary_factor": getattr(config, "partial_rotary_factor", 1.0),
        }
    return rope
