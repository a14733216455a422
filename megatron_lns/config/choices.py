"""The vocabularies of the model's settings, and the rules that relate them.

The components (``scaling.py``, ``variants/``, ``language_model.py``) type their arguments with
these literals, and the config layer checks YAML values against the same tuples. This
module imports only the torch-free registries (``norm_scalings.py``, ``layer_variants.py``,
``output_inits.py``), so loading and
validating a config does not import torch or megatron-core. (The tokenizer libraries are
the data layer's: ``data/tokenizer.py``.)
"""

from __future__ import annotations

from typing import Literal, get_args

from megatron_lns.config.layer_variants import LAYER_VARIANTS as LAYER_VARIANTS
from megatron_lns.config.layer_variants import LNS_VARIANTS
from megatron_lns.config.layer_variants import lns_combines_with as lns_combines_with
from megatron_lns.config.norm_scalings import NORM_SCALINGS
from megatron_lns.config.output_inits import OUTPUT_INITS

# Names registered in norm_scalings.py, layer_variants.py and output_inits.py (registries,
# not literals: a new rule is one entry).
NormScaling = str
# megatron-core's decoder-only language models: GPTModel, or HybridModel (a layer pattern).
Architecture = Literal["gpt", "hybrid"]
LayerVariant = str
Activation = Literal["swiglu", "gelu"]
PositionEmbedding = Literal["rope", "learned_absolute"]
OutputLayerInit = str
RecomputeGranularity = Literal["selective", "full"]
RecomputeMethod = Literal["uniform", "block"]
DecayStyle = Literal["cosine", "linear", "constant", "WSD", "inverse-square-root"]
# megatron-core 0.19's MoE vocabularies (TransformerConfig's docs and checks).
MoELoadBalancing = Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"]
MoEScoreFunction = Literal["softmax", "sigmoid"]
MoEDispatcher = Literal["allgather", "alltoall", "flex"]
MoEDropPolicy = Literal["probs", "position"]
MoERouterDtype = Literal["fp32", "fp64"]
# megatron's selective-recompute modules this model has (MLA's and GDN's are other models').
RecomputeModule = Literal["core_attn", "mlp", "moe", "moe_act", "shared_experts", "layernorm"]

NORM_SCALING_CHOICES: tuple[str, ...] = NORM_SCALINGS
ARCHITECTURES: tuple[str, ...] = get_args(Architecture)
ACTIVATIONS: tuple[str, ...] = get_args(Activation)
POSITION_EMBEDDINGS: tuple[str, ...] = get_args(PositionEmbedding)
OUTPUT_LAYER_INITS: tuple[str, ...] = OUTPUT_INITS
RECOMPUTE_GRANULARITIES: tuple[str, ...] = get_args(RecomputeGranularity)
RECOMPUTE_METHODS: tuple[str, ...] = get_args(RecomputeMethod)
MOE_LOAD_BALANCING: tuple[str, ...] = get_args(MoELoadBalancing)
MOE_SCORE_FUNCTIONS: tuple[str, ...] = get_args(MoEScoreFunction)
MOE_DISPATCHERS: tuple[str, ...] = get_args(MoEDispatcher)
MOE_DROP_POLICIES: tuple[str, ...] = get_args(MoEDropPolicy)
MOE_ROUTER_DTYPES: tuple[str, ...] = get_args(MoERouterDtype)
RECOMPUTE_MODULES: tuple[str, ...] = get_args(RecomputeModule)

# The variants LNS applies to (layer_variants.py decides): kept under their old name.
PRE_NORM_VARIANTS: tuple[str, ...] = LNS_VARIANTS


def warmup_fits(warmup_steps: int, decay_steps: int, decay_style: DecayStyle) -> bool:
    """The schedule rule: a decaying schedule must finish its warmup before decay ends."""
    return decay_style == "constant" or warmup_steps < decay_steps
