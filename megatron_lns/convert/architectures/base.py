"""What every Hugging Face architecture says, and the ``config.json`` they all share.

A registered architecture is one stock ``transformers`` causal LM that a megatron-lns
decoder (RoPE, SwiGLU, pre-norms, optional LNS) is *exactly*. The base holds what they
have in common: the decoder's shape and its tensor mapping of the Llama layout
(:class:`~.layout.DecoderLayout`, which it extends), how the run trained, the
``config.json`` fields every one of them has, both ways, and the hooks through which a
subclass, one module per architecture, says only what differs: its class name, which
norm it has, its own ``config.json`` fields, and what it refuses and why (with the
refusals of the shared design in :mod:`.refusals`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from megatron_lns.config import model_derived
from megatron_lns.config.norm_scalings import imported_norm_scaling
from megatron_lns.config.schema import ModelConfig
from megatron_lns.convert.architectures.layout import DecoderLayout
from megatron_lns.convert.architectures.refusals import refuse_unshared_hf_design
from megatron_lns.convert.errors import ConversionError
from megatron_lns.convert.mapping import BRANCH_GAINS, hf_rope_parameters

# model.normalization -> the Hugging Face norm that computes it once the fold has
# turned a zero-centred gamma into a plain one.
HF_NORM_OF = {"rmsnorm": "rmsnorm", "layernorm": "layernorm", "layernorm1p": "layernorm"}


@dataclass(frozen=True)
class Architecture(DecoderLayout):
    """A stock Hugging Face causal LM: the decoder and its ``config.json``, as both
    sides need them for conversion.

    Subclasses set the class attributes (and ``norm``, ``moe`` of the layout) and
    override the hooks (``check_model_config``, ``check_hf_config``, ``read_hf_bias``,
    ``hf_config_fields``) where they differ.
    """

    # --- what each architecture says (class attributes, not fields)
    hf_class: ClassVar[str]  # its name in config.json's ``architectures``
    name: ClassVar[str]  # its name in messages
    hf_config_class: ClassVar[str]  # the ``transformers`` config class
    hf_eps_key: ClassVar[str]  # the config.json key of the norm epsilon
    # config.json switches the megatron-lns decoder needs at one value: written on
    # export, and any other value refused on import.
    hf_fixed_switches: ClassVar[dict[str, bool]] = {}
    # Whether its config.json holds a hidden (residual) dropout (model.hidden_dropout).
    hf_hidden_dropout: ClassVar[bool] = False
    # config.json fields of the class that the converter need not read, since the model
    # computes the same function whatever they hold (given what it refuses), and why:
    # import accounts for them (convert/hf_fields.py).
    hf_inert_fields: ClassVar[dict[str, str]] = {}

    # How the run trained, which config.json records (attention_dropout, initializer_range,
    # hidden_dropout where the class has it): taken from the run on export, and the
    # imported run's defaults (training_settings) on import.
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    hidden_dropout: float | None = None

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
        head_dim = model_derived.head_size(m)
        cls.check_model_config(m, head_dim)
        return cls(
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            ffn_hidden_size=model_derived.ffn_hidden_size(m),
            num_attention_heads=m.num_attention_heads,
            num_query_groups=model_derived.query_groups(m),
            head_dim=head_dim,
            norm_affine=m.norm_affine,
            zero_centered_gamma=m.normalization == "layernorm1p",
            bias=m.bias,
            norm_scaling=m.norm_scaling,
            tied_embeddings=m.share_embeddings_and_output_weights,
            eps=m.layernorm_epsilon,
            rotary_base=float(m.rotary_base),
            max_position_embeddings=model_derived.max_positions(m, m.encoder_seq_length),
            branch_gain=m.layer_variant if m.layer_variant in BRANCH_GAINS else None,
            attention_dropout=m.attention_dropout,
            init_method_std=m.init_method_std,
            hidden_dropout=m.hidden_dropout if cls.hf_hidden_dropout else None,
        )

    @classmethod
    def from_hf_config(cls, config, lns: bool) -> Architecture:
        """This architecture for a Hugging Face ``config.json`` of its class."""
        refuse_unshared_hf_design(config)
        rope = hf_rope_parameters(config)
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
            norm_scaling=imported_norm_scaling(lns),
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
