"""LNS specs for people on Megatron-LM (``--spec``) or Megatron-Bridge (a provider's
``transformer_layer_spec`` callable), built on CPU the way those frameworks build them."""

import inspect
import re
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch
from helpers import ROOT, tiny_config
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec, import_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lns.model.language_model import build_model
from megatron_lns.model.layer import LNSTransformerLayer
from megatron_lns.runtime import ParallelLayout

DOC = ROOT / "docs" / "megatron_integration.md"
VOCAB, SEQ = 128, 16


def _tf_config() -> TransformerConfig:
    return tiny_config().transformer_config(ParallelLayout(), cpu_init=True)


def _gpt(spec, config: TransformerConfig) -> GPTModel:
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
    )


def _logits(model: GPTModel) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ).expand(2, SEQ)
    with torch.no_grad():
        return model(tokens, positions, None)


def _assert_lns_layers(model: GPTModel) -> None:
    layers = model.decoder.layers
    assert [type(layer) for layer in layers] == [LNSTransformerLayer] * len(layers)
    for layer in layers:
        expected = 1 / layer.layer_number**0.5
        assert layer.input_layernorm.output_scale == pytest.approx(expected)
        assert layer.pre_mlp_layernorm.output_scale == pytest.approx(expected)


def test_megatron_lm_spec_import_builds_an_lns_model(seeded):
    # Megatron-LM: --spec megatron_lns.model.specs lns_layer_spec -> args.spec, a list of two.
    spec = import_module(["megatron_lns.model.specs", "lns_layer_spec"])
    assert isinstance(spec, ModuleSpec)
    model = _gpt(spec, _tf_config())
    _assert_lns_layers(model)
    # Same parameters (names and shapes) as megatron-lns's own model, and same outputs.
    ours = build_model(tiny_config(), ParallelLayout())[0]
    assert {k: v.shape for k, v in model.state_dict().items() if "_extra_state" not in k} == {
        k: v.shape for k, v in ours.state_dict().items() if "_extra_state" not in k
    }
    ours.load_state_dict(model.state_dict())
    torch.testing.assert_close(_logits(model), _logits(ours), rtol=1e-5, atol=1e-5)


def test_block_spec_callable_follows_the_provider_contract(seeded):
    """Bridge and Megatron-LM's model builder call it with the config, and with
    ``vp_stage=`` because its signature has one."""
    from megatron_lns.model.specs import lns_block_spec

    assert "vp_stage" in inspect.signature(lns_block_spec).parameters
    config = _tf_config()
    config.transformer_impl = "local"
    spec = lns_block_spec(config, vp_stage=None)
    assert isinstance(spec, TransformerBlockSubmodules)
    assert len(spec.layer_specs) == config.num_layers
    _assert_lns_layers(_gpt(spec, config))

    @dataclass
    class Holder:  # Megatron-LM's GPTModelConfig holds the TransformerConfig
        transformer: TransformerConfig

    assert len(lns_block_spec(Holder(config)).layer_specs) == config.num_layers
    config.transformer_impl = "inference_optimized"
    with pytest.raises(ValueError, match="transformer_impl='inference_optimized' has no LNS"):
        lns_block_spec(config)


def test_block_spec_callable_builds_moe_layers_where_the_config_says(seeded):
    """A provider with ``num_moe_experts`` gets megatron's MoELayer in the layers
    ``moe_layer_freq`` picks, every layer with its LNS factor."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_lns.model.specs import lns_block_spec

    config = tiny_config(
        num_moe_experts=4, moe_layer_freq=[0, 1, 0, 1], moe_ffn_hidden_size=32
    ).transformer_config(ParallelLayout(), cpu_init=True)
    config.transformer_impl = "local"
    model = _gpt(lns_block_spec(config), config)
    _assert_lns_layers(model)
    assert [isinstance(layer.mlp, MoELayer) for layer in model.decoder.layers] == [
        False,
        True,
        False,
        True,
    ]


def _bridge_models_module() -> ModuleType:
    """``megatron.bridge.models`` for a machine without Bridge: a ``GPTModelProvider`` that
    is a TransformerConfig and calls its ``transformer_layer_spec`` as Bridge's
    ``provide()`` does (with ``vp_stage=`` when the callable takes it)."""

    @dataclass
    class GPTModelProvider(TransformerConfig):
        transformer_layer_spec: object = None
        vocab_size: int | None = None
        seq_length: int = 1024

        def provide(self, pre_process=None, post_process=None, vp_stage=None) -> GPTModel:
            spec = self.transformer_layer_spec
            if not isinstance(spec, ModuleSpec):
                if "vp_stage" in inspect.signature(spec).parameters:
                    spec = spec(self, vp_stage=vp_stage)
                else:
                    spec = spec(self)
            return GPTModel(
                config=self,
                transformer_layer_spec=spec,
                vocab_size=self.vocab_size,
                max_sequence_length=self.seq_length,
                position_embedding_type=self.position_embedding_type,
                vp_stage=vp_stage,
            )

    module = ModuleType("megatron.bridge.models")
    module.GPTModelProvider = GPTModelProvider
    return module


def test_bridge_provider_snippet_in_the_docs_builds_an_lns_model(seeded, monkeypatch):
    snippet = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    bridge = ModuleType("megatron.bridge")
    monkeypatch.setitem(__import__("sys").modules, "megatron.bridge", bridge)
    monkeypatch.setitem(
        __import__("sys").modules, "megatron.bridge.models", _bridge_models_module()
    )
    namespace: dict = {"__name__": "docs_snippet"}
    exec(compile(snippet, str(DOC), "exec"), namespace)
    provider = namespace["LNSGPTModelProvider"](
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=96,
        activation_func=torch.nn.functional.silu,
        use_cpu_initialization=True,
        transformer_impl="local",
        vocab_size=VOCAB,
        seq_length=SEQ,
    )
    model = provider.provide()
    _assert_lns_layers(model)
    assert _logits(model).shape == (2, SEQ, VOCAB)


@pytest.mark.parametrize("name", ["lns_layer_spec", "lns_block_spec"])
def test_megatron_lm_model_builder_builds_an_lns_model_from_the_spec(seeded, name):
    """Megatron-LM's own path: ``--spec`` -> ``import_module`` -> ``GPTModelConfig`` ->
    ``GPTModelBuilder.build_model`` (a ModuleSpec, or a callable it calls with the config)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig

    config = _tf_config()
    config.transformer_impl = "local"
    model_config = GPTModelConfig(
        transformer=config,
        transformer_layer_spec=import_module(["megatron_lns.model.specs", name]),
        vocab_size=VOCAB,
        seq_length=SEQ,
        position_embedding_type="rope",
    )
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    model = GPTModelBuilder(model_config).build_model(pg_collection, True, True)
    _assert_lns_layers(model)
    assert _logits(model).shape == (2, SEQ, VOCAB)
