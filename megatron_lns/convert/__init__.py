"""Hugging Face conversion: megatron checkpoints <-> stock ``transformers`` models.

Export folds LNS into the pre-norm weights, so the result is a stock architecture
(``LlamaForCausalLM``, ``StableLmForCausalLM``, and for mixture-of-experts models
``MixtralForCausalLM`` or ``Qwen2MoeForCausalLM``; one module each in
:mod:`~megatron_lns.convert.architectures`) that loads without custom code. Import
reverses it for continued pretraining. See docs/conversion.md.
"""

from megatron_lns.convert.errors import ConversionError
from megatron_lns.convert.hf_export import export_hf
from megatron_lns.convert.hf_import import import_hf

__all__ = ["ConversionError", "export_hf", "import_hf"]
