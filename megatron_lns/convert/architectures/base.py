"""What every Hugging Face architecture says, and the mapping they all share.

A registered architecture is one stock ``transformers`` causal LM that a megatron-lns
decoder (RoPE, SwiGLU, pre-norms, optional LNS) is *exactly*. The base holds what they
have in common: the decoder's shape and numerics (the dataclass fields), the refusals
of that shared design, the ``config.json`` fields every one of them has, and the
tensor mapping of the Llama layout (``model.layers.i.self_attn.q_proj``, ...) with the
fused QKV and gate/up splits, the LNS fold and the branch-gain fold. A subclass, one
module per architecture, says only what differs (the class attributes and hooks below):
its class name, which norm it has, its own ``config.json`` fields, and what it refuses
and why.

The tensors of block ``l`` (1-based) map as docs/conversion.md tabulates; the two
pre-norms carry the LNS factor ``1/sqrt(l)`` folded in with the rules of
:mod:`megatron_lns.model.scaling`, exactly as the megatron forward pass folds it, so the
exported weights are the ones megatron multiplies with. A LayerScale or SkipInit run's
branch gains fold into the last linear of each branch
(:meth:`Architecture.fold_branch_gains`), so those runs export as the same stock classes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from megatron_lns.config.hybrid_pattern import gpt_key_to_hybrid
from megatron_lns.config.layer_variants import REGISTRY as LAYER_VARIANTS
from megatron_lns.config.schema import ModelConfig
from megatron_lns.convert.checkpoint_reader import CheckpointReader
from megatron_lns.convert.errors import ConversionError
from megatron_lns.convert.mapping import (
    ATTN_NORM_BIAS,
    ATTN_NORM_WEIGHT,
    BRANCH_GAINS,
    FC1_BIAS,
    FC1_WEIGHT,
    FC2_BIAS,
    FC2_WEIGHT,
    HF_FINAL_NORM,
    LAYERS,
    MLP_NORM_BIAS,
    MLP_NORM_WEIGHT,
    PROJ_BIAS,
    PROJ_WEIGHT,
    QKV_BIAS,
    QKV_WEIGHT,
    effective_norm_weight,
    hf_layer_prefix,
    hf_rope_parameters,
    invert_exactly,
    layer_prefix,
)
from megatron_lns.model.scaling import fold_scale_into_beta, norm_output_scale

# model.normalization -> the Hugging Face norm that computes it once the fold has
# turned a zero-centred gamma into a plain one.
HF_NORM_OF = {"rmsnorm": "rmsnorm", "layernorm": "layernorm", "layernorm1p": "layernorm"}


def listed(names: Iterable[str], sep: str = " and ") -> str:
    """``"A"``, ``"A and B"``, ``"A, B and C"``: names in a message."""
    names = list(names)
    return ", ".join(names[:-1]) + sep + names[-1] if len(names) > 1 else "".join(names)


# The layer variants that no stock architecture computes, and why (their registration in
# config/layer_variants.py says): each normalises or scales where the stock decoders (which
# normalise only a branch's input) do not. pre_ln exports as it is, and variants with branch
# gains with those folded into o_proj / down_proj (BRANCH_GAINS); a test requires every
# layer_variant to be one of these.
UNEXPORTABLE_VARIANTS = {
    name: info.hf_refusal for name, info in LAYER_VARIANTS.items() if info.hf_refusal
}


def refuse_unshared_design(m: ModelConfig, names: list[str]) -> None:
    """Refuse what none of the architectures ``names`` computes: the base mapping
    assumes RoPE, a gated SiLU MLP, Pre-LN blocks (with or without branch gains) and
    real-valued weights."""
    if m.position_embedding_type != "rope":
        raise ConversionError(
            f"model.position_embedding_type={m.position_embedding_type} cannot be exported: "
            f"the supported stock architectures ({', '.join(names)}) use rope"
        )
    if m.activation != "swiglu":
        raise ConversionError(
            f"model.activation={m.activation} cannot be exported: {listed(names)} "
            "use a gated SiLU MLP (swiglu); no stock architecture here has RoPE with a "
            "plain GELU MLP"
        )
    if m.layer_variant in UNEXPORTABLE_VARIANTS:
        raise ConversionError(
            f"model.layer_variant={m.layer_variant} cannot be exported: "
            f"{UNEXPORTABLE_VARIANTS[m.layer_variant]}, and the stock architectures "
            f"({', '.join(names)}) normalise only each branch's input (Pre-LN)"
        )
    if m.qk_layernorm:
        raise ConversionError(
            f"model.qk_layernorm=true cannot be exported: the supported stock architectures "
            f"({', '.join(names)}) have no per-head query/key norm"
        )
    if m.fp8_param:
        raise ConversionError(
            "model.fp8_param=true: the checkpoint holds FP8 weights, which export does "
            "not dequantize; save a checkpoint trained with model.fp8_param=false"
        )


def refuse_head_size_other_than_hidden_over_heads(config, head_dim: int, why: str) -> None:
    """For architectures whose attention heads are always ``hidden_size / heads`` wide
    (no ``head_dim`` of their own): a ``config.json`` that says otherwise is refused."""
    heads = config.num_attention_heads
    if head_dim * heads != config.hidden_size:
        raise ConversionError(
            f"config.json: head_dim={head_dim} x num_attention_heads={heads} != "
            f"hidden_size={config.hidden_size}: {why}"
        )


@dataclass(frozen=True)
class Architecture:
    """The shape and numerics of a decoder, as both sides need them for conversion.

    Subclasses set the class attributes and override the hooks (``check_model_config``,
    ``check_hf_config``, ``read_hf_bias``, ``hf_config_fields``) where they differ.
    """

    # --- what each architecture says (class attributes, not fields)
    hf_class: ClassVar[str]  # its name in config.json's ``architectures``
    name: ClassVar[str]  # its name in messages
    hf_config_class: ClassVar[str]  # the ``transformers`` config class
    norm: ClassVar[str]  # "rmsnorm" (a weight) or "layernorm" (a weight and a bias)
    hf_eps_key: ClassVar[str]  # the config.json key of the norm epsilon
    # config.json switches the megatron-lns decoder needs at one value: written on
    # export, and any other value refused on import.
    hf_fixed_switches: ClassVar[dict[str, bool]] = {}
    # Whether its layers are mixture-of-experts layers (a model with model.num_moe_experts
    # exports only to one that is, a dense model only to one that is not).
    moe: ClassVar[bool] = False
    # Whether its config.json holds a hidden (residual) dropout (model.hidden_dropout).
    hf_hidden_dropout: ClassVar[bool] = False

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int  # channels per attention head (model.kv_channels, Llama's head_dim)
    norm_affine: bool
    zero_centered_gamma: bool
    bias: bool
    lns: bool
    tied_embeddings: bool
    eps: float
    rotary_base: float
    max_position_embeddings: int
    # The run is megatron-core's HybridModel with the GPT-equivalent pattern: the same
    # tensors, each attention and MLP under its own sublayer's keys (checkpoint_key).
    hybrid: bool = False
    # The run's branch gains ("layerscale" or "skipinit", keys of BRANCH_GAINS), which
    # export folds away; None for Pre-LN and for every imported model.
    branch_gain: str | None = None
    # How the run trained, which config.json records (attention_dropout, initializer_range,
    # hidden_dropout where the class has it): taken from the run on export, and the
    # imported run's defaults (training_settings) on import.
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    hidden_dropout: float | None = None

    @property
    def rmsnorm(self) -> bool:
        return self.norm == "rmsnorm"

    @property
    def norm_has_bias(self) -> bool:
        """Whether the checkpoint's norms have a bias (an affine LayerNorm)."""
        return not self.rmsnorm and self.norm_affine

    def norm_scale(self, layer_number: int) -> float:
        """The LNS factor of block ``layer_number`` (1-based): ``1/sqrt(l)``, or 1 for Pre-LN."""
        return norm_output_scale("lns" if self.lns else "none", layer_number)

    # ------------------------------------------------------------------ hooks
    @classmethod
    def exports_model(cls, m: ModelConfig) -> bool:
        """Whether export picks this architecture for ``m`` among those of its norm and
        kind (dense or MoE); the first that does is chosen."""
        return True

    @classmethod
    def check_model_config(cls, m: ModelConfig, head_dim: int) -> None:
        """Refuse a ``model:`` section this architecture cannot compute exactly."""

    @classmethod
    def check_hf_config(cls, config, head_dim: int) -> None:
        """Refuse a ``config.json`` of this class that megatron-lns cannot compute."""

    @classmethod
    def read_hf_bias(cls, config) -> bool:
        """Whether the linear layers have biases (``model.bias``); none by default."""
        return False

    def hf_config_fields(self) -> dict:
        """The ``config.json`` fields of this architecture beyond the shared ones."""
        return {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_model_config(cls, m: ModelConfig) -> Architecture:
        """This architecture for a megatron-lns ``model:`` section, which the registry
        chose by its normalization; refuses what the architecture cannot compute."""
        head_dim = m.kv_channels or m.hidden_size // m.num_attention_heads
        cls.check_model_config(m, head_dim)
        return cls(
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
            num_attention_heads=m.num_attention_heads,
            num_query_groups=m.num_query_groups or m.num_attention_heads,
            head_dim=head_dim,
            norm_affine=m.norm_affine,
            zero_centered_gamma=m.normalization == "layernorm1p",
            bias=m.bias,
            lns=m.norm_scaling == "lns",
            tied_embeddings=m.share_embeddings_and_output_weights,
            eps=m.layernorm_epsilon,
            rotary_base=float(m.rotary_base),
            max_position_embeddings=m.max_position_embeddings or m.encoder_seq_length,
            branch_gain=m.layer_variant if m.layer_variant in BRANCH_GAINS else None,
            attention_dropout=m.attention_dropout,
            init_method_std=m.init_method_std,
            hidden_dropout=m.hidden_dropout if cls.hf_hidden_dropout else None,
        )

    @classmethod
    def from_hf_config(cls, config, lns: bool) -> Architecture:
        """This architecture for a Hugging Face ``config.json`` of its class."""
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
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        cls.check_hf_config(config, head_dim)
        for key, needed in cls.hf_fixed_switches.items():
            if bool(getattr(config, key, False)) != needed:
                raise ConversionError(
                    f"config.json: {key}={getattr(config, key)} is not supported "
                    f"(megatron-lns needs {key}={str(needed).lower()})"
                )
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            ffn_hidden_size=config.intermediate_size,
            num_attention_heads=heads,
            num_query_groups=config.num_key_value_heads or heads,
            head_dim=head_dim,
            norm_affine=True,
            zero_centered_gamma=False,
            bias=cls.read_hf_bias(config),
            lns=lns,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            eps=float(getattr(config, cls.hf_eps_key)),
            rotary_base=float(rope["rope_theta"]),
            max_position_embeddings=config.max_position_embeddings,
            attention_dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0),
            init_method_std=float(config.initializer_range),
            hidden_dropout=float(config.hidden_dropout) if cls.hf_hidden_dropout else None,
        )

    def training_settings(self) -> dict:
        """The ``model.*`` keys of how the model was trained that ``config.json`` records:
        an imported run's defaults (the user's base config and overrides win), not fixed
        like :meth:`model_settings`."""
        settings = {
            "attention_dropout": self.attention_dropout,
            "init_method_std": self.init_method_std,
        }
        if self.hidden_dropout is not None:
            settings["hidden_dropout"] = self.hidden_dropout
        return settings

    def model_settings(self) -> dict:
        """The ``model.*`` keys of the YAML that describe this architecture."""
        return {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "ffn_hidden_size": self.ffn_hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_query_groups": self.num_query_groups,
            "kv_channels": self.head_dim,
            "normalization": self.norm,
            "norm_affine": self.norm_affine,
            "layernorm_epsilon": self.eps,
            "bias": self.bias,
            "activation": "swiglu",
            "position_embedding_type": "rope",
            "rotary_base": int(self.rotary_base),
            "share_embeddings_and_output_weights": self.tied_embeddings,
            # A stock model has no branch gains or post-norms: any other variant would
            # add parameters the Hugging Face model has no values for.
            "layer_variant": "pre_ln",
        }

    def hf_config(self, vocab_size: int, dtype: torch.dtype, bos: int | None, eos: int):
        """The ``transformers`` config object of the export."""
        import transformers

        fields = dict(
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
            attention_dropout=self.attention_dropout,
            initializer_range=self.init_method_std,
        )
        dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        fields[dtype_key] = str(dtype).removeprefix("torch.")
        fields[self.hf_eps_key] = self.eps
        fields |= self.hf_fixed_switches | self.hf_config_fields()
        return getattr(transformers, self.hf_config_class)(**fields)

    # ------------------------------------------------------------------ tensors
    # The checkpoint side of one layer, by its GPT model keys: megatron stacks the layers
    # of a homogeneous GPT model on a leading axis (``decoder.layers.<name>``), and saves
    # those of an MoE or hybrid model one by one (``stacked_layers``, ``checkpoint_key``).
    def norm_keys(self, index: int) -> tuple[tuple[str, str, str], ...]:
        """(checkpoint weight key, bias key, Hugging Face norm name) of the two pre-norms
        of layer ``index``, attention first."""
        return (
            (ATTN_NORM_WEIGHT, ATTN_NORM_BIAS, "input_layernorm."),
            (MLP_NORM_WEIGHT, MLP_NORM_BIAS, "post_attention_layernorm."),
        )

    def layer_shapes(self, index: int) -> dict[str, tuple[int, ...]]:
        """Checkpoint key (relative to the layer) -> shape of each tensor of layer ``index``."""
        h, hd = self.hidden_size, self.head_dim
        qkv = (self.num_attention_heads + 2 * self.num_query_groups) * hd
        shapes: dict[str, tuple[int, ...]] = {
            QKV_WEIGHT: (qkv, h),
            PROJ_WEIGHT: (h, self.num_attention_heads * hd),
        }
        if self.bias:
            shapes |= {QKV_BIAS: (qkv,), PROJ_BIAS: (h,)}
        shapes |= self.mlp_shapes(index)
        for weight_key, bias_key, _ in self.norm_keys(index):
            if self.norm_affine:
                shapes[weight_key] = (h,)
            if self.norm_has_bias:
                shapes[bias_key] = (h,)
        if self.branch_gain is not None:
            width = h if LAYER_VARIANTS[self.branch_gain].per_channel_gain else 1
            shapes |= {key: (width,) for key in BRANCH_GAINS[self.branch_gain]}
        return shapes

    def mlp_shapes(self, index: int) -> dict[str, tuple[int, ...]]:
        """The MLP's part of :meth:`layer_shapes` (without its norm): a dense SwiGLU MLP."""
        h, ffn = self.hidden_size, self.ffn_hidden_size
        shapes: dict[str, tuple[int, ...]] = {FC1_WEIGHT: (2 * ffn, h), FC2_WEIGHT: (h, ffn)}
        if self.bias:
            shapes |= {FC1_BIAS: (2 * ffn,), FC2_BIAS: (h,)}
        return shapes

    @property
    def stacked_layers(self) -> bool:
        """Whether the checkpoint stacks the layers on a leading axis: megatron's GPT model
        does when its layers are alike; an MoE GPT model saves each layer under its own
        keys (``decoder.layers.N.<name>``), a hybrid model each sublayer."""
        return not (self.moe or self.hybrid)

    def checkpoint_key(self, key: str) -> str:
        """Where the run's checkpoint and model hold what the GPT model calls ``key``:
        ``key`` itself, or in a hybrid run its sublayer's key
        (:func:`~megatron_lns.config.hybrid_pattern.gpt_key_to_hybrid`: layer ``i``'s attention is
        sublayer ``2i``, its MLP ``2i+1``, the final norm ``decoder.final_norm``)."""
        return gpt_key_to_hybrid(key) if self.hybrid else key

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every per-layer tensor of the checkpoint: full key -> global shape."""
        if self.stacked_layers:
            layers = self.num_layers
            return {LAYERS + key: (layers, *shape) for key, shape in self.layer_shapes(0).items()}
        return {
            self.checkpoint_key(layer_prefix(index) + key): shape
            for index in range(self.num_layers)
            for key, shape in self.layer_shapes(index).items()
        }

    def read_layer(self, reader: CheckpointReader, index: int) -> dict[str, Tensor]:
        """Layer ``index``'s tensors from the checkpoint, by key relative to the layer."""
        if self.stacked_layers:
            stacked = reader.read_layer([LAYERS + key for key in self.layer_shapes(index)], index)
            return {key.removeprefix(LAYERS): tensor for key, tensor in stacked.items()}
        relative = {
            self.checkpoint_key(layer_prefix(index) + key): (key, shape)
            for key, shape in self.layer_shapes(index).items()
        }
        requests = {full: ((0,) * len(shape), shape) for full, (_, shape) in relative.items()}
        return {relative[full][0]: tensor for full, tensor in reader.read(requests).items()}

    def branch_outputs(self, index: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The tensors of layer ``index`` that make its attention branch's output and its
        MLP branch's output, each with the output channels on its second-to-last axis
        (a weight) or last axis (a bias): what a branch gain multiplies."""
        attention = (PROJ_WEIGHT, PROJ_BIAS) if self.bias else (PROJ_WEIGHT,)
        return attention, self.mlp_outputs(index)

    def mlp_outputs(self, index: int) -> tuple[str, ...]:
        """The MLP's part of :meth:`branch_outputs`: ``linear_fc2`` (and its bias)."""
        return (FC2_WEIGHT, FC2_BIAS) if self.bias else (FC2_WEIGHT,)

    def fold_branch_gains(self, tensors: dict[str, Tensor], index: int) -> dict[str, Tensor]:
        """Layer ``index``'s tensors with its branch gains folded into the branch outputs.

        ``ResidualBranch`` computes ``h + g * (W x + b)`` (``g`` per channel, or a scalar;
        dropout is off at inference), which is ``h + (diag(g) W) x + g * b``: row ``i`` of
        ``linear_proj`` / ``linear_fc2`` (of every expert and the shared expert in an MoE
        layer) and bias element ``i`` are multiplied by ``g_i``, the attention branch's
        gain for the one and the MLP branch's for the other. Each product is taken in
        float32, where the product of two fp32/bf16/fp16 numbers rounds once (bf16 and
        fp16 products are exact), then rounded to the checkpoint's dtype. The gain
        tensors themselves are dropped.
        """
        if self.branch_gain is None:
            return tensors
        tensors = dict(tensors)
        gains = [tensors.pop(key) for key in BRANCH_GAINS[self.branch_gain]]
        for gain, outputs in zip(gains, self.branch_outputs(index), strict=True):
            compute = torch.promote_types(gain.dtype, torch.float32)
            for key in outputs:
                tensor = tensors[key]
                per_row = gain.to(compute) if tensor.dim() == 1 else gain.to(compute)[:, None]
                tensors[key] = (tensor.to(compute) * per_row).to(tensor.dtype)
        return tensors

    def layer_to_hf(self, tensors: dict[str, Tensor], index: int) -> dict[str, Tensor]:
        """One megatron layer (0-based ``index``) as Hugging Face tensors, LNS and the
        branch gains folded in."""
        tensors = self.fold_branch_gains(tensors, index)
        prefix = hf_layer_prefix(index)
        scale = self.norm_scale(index + 1)
        out: dict[str, Tensor] = {}
        dtype = tensors[QKV_WEIGHT].dtype
        for weight_key, bias_key, hf_norm in self.norm_keys(index):
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
        attn = prefix + "self_attn."
        q, k, v = self.split_qkv(tensors[QKV_WEIGHT])
        out |= {attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v}
        out[attn + "o_proj.weight"] = tensors[PROJ_WEIGHT]
        if self.bias:
            q, k, v = self.split_qkv(tensors[QKV_BIAS])
            out |= {attn + "q_proj.bias": q, attn + "k_proj.bias": k, attn + "v_proj.bias": v}
            out[attn + "o_proj.bias"] = tensors[PROJ_BIAS]
        out |= self.mlp_to_hf(tensors, index)
        return {name: tensor.contiguous() for name, tensor in out.items()}

    def mlp_to_hf(self, tensors: dict[str, Tensor], index: int) -> dict[str, Tensor]:
        """The MLP's part of :meth:`layer_to_hf`: ``linear_fc1`` rows ``[:f]`` are the
        gate, ``[f:]`` the up projection."""
        mlp = hf_layer_prefix(index) + "mlp."
        out: dict[str, Tensor] = {}
        for suffix, fc1_key, fc2_key in (
            ("weight", FC1_WEIGHT, FC2_WEIGHT),
            ("bias", FC1_BIAS, FC2_BIAS),
        ):
            if suffix == "bias" and not self.bias:
                continue
            gate, up = tensors[fc1_key].chunk(2, dim=0)
            out |= {f"{mlp}gate_proj.{suffix}": gate, f"{mlp}up_proj.{suffix}": up}
            out[f"{mlp}down_proj.{suffix}"] = tensors[fc2_key]
        return out

    def hf_layer_shapes(self, index: int) -> dict[str, tuple[int, ...]]:
        """Hugging Face name -> shape of every tensor of layer ``index``."""
        prefix = hf_layer_prefix(index)
        h, hd = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_query_groups * hd
        shapes = {}
        for _, _, norm in self.norm_keys(index):
            shapes[prefix + norm + "weight"] = (h,)
            if not self.rmsnorm:
                shapes[prefix + norm + "bias"] = (h,)
        outputs = {
            "self_attn.q_proj.": (q, h),
            "self_attn.k_proj.": (kv, h),
            "self_attn.v_proj.": (kv, h),
            "self_attn.o_proj.": (h, q),
        }
        for name, (rows, cols) in outputs.items():
            shapes[prefix + name + "weight"] = (rows, cols)
            if self.bias:
                shapes[prefix + name + "bias"] = (rows,)
        return shapes | self.hf_mlp_shapes(index)

    def hf_mlp_shapes(self, index: int) -> dict[str, tuple[int, ...]]:
        """The MLP's part of :meth:`hf_layer_shapes`."""
        mlp = hf_layer_prefix(index) + "mlp."
        h, ffn = self.hidden_size, self.ffn_hidden_size
        shapes = {}
        for name, (rows, cols) in {
            "gate_proj.": (ffn, h),
            "up_proj.": (ffn, h),
            "down_proj.": (h, ffn),
        }.items():
            shapes[mlp + name + "weight"] = (rows, cols)
            if self.bias:
                shapes[mlp + name + "bias"] = (rows,)
        return shapes

    def layer_from_hf(self, hf: dict[str, Tensor], index: int) -> tuple[dict[str, Tensor], int]:
        """One layer's Hugging Face tensors as megatron tensors, by name relative to the
        layer (the checkpoint names of :meth:`layer_shapes`, except where
        :meth:`mlp_from_hf` says otherwise), with the LNS factor divided out exactly when
        ``lns``. Also returns the number of norm elements that had no exact preimage (see
        :func:`invert_exactly`)."""
        prefix = hf_layer_prefix(index)
        scale = self.norm_scale(index + 1)
        out: dict[str, Tensor] = {}
        inexact = 0
        for weight_key, bias_key, hf_norm in self.norm_keys(index):
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
        attn = prefix + "self_attn."
        for suffix, qkv_key, proj_key in (
            ("weight", QKV_WEIGHT, PROJ_WEIGHT),
            ("bias", QKV_BIAS, PROJ_BIAS),
        ):
            if suffix == "bias" and not self.bias:
                continue
            out[qkv_key] = self.merge_qkv(
                hf[f"{attn}q_proj.{suffix}"],
                hf[f"{attn}k_proj.{suffix}"],
                hf[f"{attn}v_proj.{suffix}"],
            )
            out[proj_key] = hf[f"{attn}o_proj.{suffix}"]
        return out | self.mlp_from_hf(hf, index), inexact

    def mlp_from_hf(self, hf: dict[str, Tensor], index: int) -> dict[str, Tensor]:
        """The MLP's part of :meth:`layer_from_hf`."""
        mlp = hf_layer_prefix(index) + "mlp."
        out = {}
        for suffix, fc1_key, fc2_key in (
            ("weight", FC1_WEIGHT, FC2_WEIGHT),
            ("bias", FC1_BIAS, FC2_BIAS),
        ):
            if suffix == "bias" and not self.bias:
                continue
            out[fc1_key] = torch.cat([hf[f"{mlp}gate_proj.{suffix}"], hf[f"{mlp}up_proj.{suffix}"]])
            out[fc2_key] = hf[f"{mlp}down_proj.{suffix}"]
        return out

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
