"""An independent plain-PyTorch LLaMA with LNS, written from the paper, not from megatron.

Norm outputs are multiplied by ``1/sqrt(l)`` explicitly after the norm (the
reference implementation's way), so comparing it with megatron_lns checks the
folding, the layer numbering and megatron's wiring all at once. Weights are taken
from a megatron GPTModel state dict (TP=1, PP=1) under megatron's parameter names;
fused tensors are split here with our own reading of megatron's layout
(``linear_qkv`` rows grouped per query group as [q heads | k | v], ``linear_fc1`` rows
[gate | up]).

It also implements the LNS paper's other variants from their published definitions
(``variant``): Post-LN ``h = LN(h + f(h))``; DeepNorm ``h = LN(alpha*h + f(h))`` with
``alpha = (2N)^(1/4)``; Mix-LN (Post-LN in the first ``mix_ln_post_layers`` layers, Pre-LN
after); LayerScale ``h = h + diag(g) f(LN(h))``; SkipInit ``h = h + a f(LN(h))``; Peri-LN
``h = h + LN_out(f(LN_in(h)))``; GPAS ``h' = h + f(LN(h)), h = h' - SiLU(a_l) sg(h')`` with one
``a_l`` per layer for both adds (the authors' code). Their extra parameters use
megatron_lns's names so weights load by name.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def reference_sizes(cfg) -> dict[str, int]:
    """The reference's sizes for a megatron model config (``GPTModelConfig``): layers,
    width, heads, query groups (one per head where it has none), MLP width, vocabulary."""
    return dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups or cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn_hidden_size,
        vocab_size=cfg.vocab_size,
    )


class ReferenceLlama(nn.Module):
    def __init__(
        self,
        num_layers: int,
        hidden_size: int,
        num_heads: int,
        num_query_groups: int,
        ffn_hidden_size: int,
        vocab_size: int,
        lns: bool,
        normalization: str = "RMSNorm",
        eps: float = 1e-5,
        rotary_base: int = 10000,
        variant: str = "pre_ln",
        mix_ln_post_layers: int = 0,
        head_dim: int | None = None,
    ):
        super().__init__()
        self.num_layers, self.hidden = num_layers, hidden_size
        self.heads, self.groups = num_heads, num_query_groups
        self.head_dim = head_dim or hidden_size // num_heads
        self.lns, self.normalization, self.eps = lns, normalization, eps
        self.rotary_base = rotary_base
        self.variant = variant
        self.post_layers = {
            "post_ln": num_layers,
            "deepnorm": num_layers,
            "mix_ln": mix_ln_post_layers,
        }.get(variant, 0)
        self.alpha = (2 * num_layers) ** 0.25 if variant == "deepnorm" else 1.0
        qkv_rows = (num_heads + 2 * num_query_groups) * self.head_dim
        p: dict[str, nn.Parameter] = {}
        p["embedding.word_embeddings.weight"] = nn.Parameter(torch.empty(vocab_size, hidden_size))
        for i in range(num_layers):
            pre = f"decoder.layers.{i}."
            if i < self.post_layers:
                p[pre + "self_attn_bda.norm.weight"] = nn.Parameter(torch.ones(hidden_size))
                p[pre + "mlp_bda.norm.weight"] = nn.Parameter(torch.ones(hidden_size))
            else:
                p[pre + "input_layernorm.weight"] = nn.Parameter(torch.ones(hidden_size))
                p[pre + "pre_mlp_layernorm.weight"] = nn.Parameter(torch.ones(hidden_size))
            gain_shape = {"layerscale": (hidden_size,), "skipinit": (1,)}.get(variant)
            if gain_shape is not None:
                gain = "layerscale" if variant == "layerscale" else "gate"
                p[pre + f"self_attn_bda.{gain}"] = nn.Parameter(torch.zeros(gain_shape))
                p[pre + f"mlp_bda.{gain}"] = nn.Parameter(torch.zeros(gain_shape))
            if variant == "peri_ln":
                p[pre + "self_attn_bda.output_norm.weight"] = nn.Parameter(torch.ones(hidden_size))
                p[pre + "mlp_bda.output_norm.weight"] = nn.Parameter(torch.ones(hidden_size))
            if variant == "gpas":
                p[pre + "gpas.alpha"] = nn.Parameter(torch.zeros(1))
            p[pre + "self_attention.linear_qkv.weight"] = nn.Parameter(
                torch.empty(qkv_rows, hidden_size)
            )
            p[pre + "self_attention.linear_proj.weight"] = nn.Parameter(
                torch.empty(hidden_size, num_heads * self.head_dim)
            )
            p.update(self._mlp_parameters(i, hidden_size, ffn_hidden_size))
        p["decoder.final_layernorm.weight"] = nn.Parameter(torch.ones(hidden_size))
        p["output_layer.weight"] = nn.Parameter(torch.empty(vocab_size, hidden_size))
        # ParameterDict keys cannot contain dots; keep megatron's names in a view.
        self.params = nn.ParameterDict({name.replace(".", "/"): t for name, t in p.items()})
        self.p = {name: self.params[name.replace(".", "/")] for name in p}

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.normalization == "RMSNorm":
            normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        else:
            normed = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(
                x.var(-1, keepdim=True, unbiased=False) + self.eps
            )
        return normed * weight

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        # x: [b, heads, s, d]; rotate-half (non-interleaved), as Hugging Face Llama.
        seq, dim = x.shape[2], x.shape[3]
        inv_freq = 1.0 / (self.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
        cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
        sin = torch.cat([angles.sin(), angles.sin()], dim=-1)
        x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def _attention(self, x: torch.Tensor, i: int) -> torch.Tensor:
        b, s, _ = x.shape
        hd, groups = self.head_dim, self.groups
        per_group = self.heads // groups
        qkv = x @ self.p[f"decoder.layers.{i}.self_attention.linear_qkv.weight"].T
        qkv = qkv.view(b, s, groups, (per_group + 2) * hd)
        q, k, v = qkv.split([per_group * hd, hd, hd], dim=-1)
        q = q.reshape(b, s, self.heads, hd).transpose(1, 2)
        k = k.reshape(b, s, groups, hd).transpose(1, 2).repeat_interleave(per_group, dim=1)
        v = v.reshape(b, s, groups, hd).transpose(1, 2).repeat_interleave(per_group, dim=1)
        q, k = self._rope(q), self._rope(k)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        out = (probs @ v).transpose(1, 2).reshape(b, s, self.heads * hd)
        return out @ self.p[f"decoder.layers.{i}.self_attention.linear_proj.weight"].T

    def _mlp_parameters(self, i: int, hidden_size: int, ffn_hidden_size: int) -> dict:
        """Layer ``i``'s MLP weights (a subclass may give a layer another MLP)."""
        pre = f"decoder.layers.{i}.mlp."
        return {
            pre + "linear_fc1.weight": nn.Parameter(torch.empty(2 * ffn_hidden_size, hidden_size)),
            pre + "linear_fc2.weight": nn.Parameter(torch.empty(hidden_size, ffn_hidden_size)),
        }

    def _swiglu(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        """``fc2(silu(gate) * up)`` with ``[gate | up] = fc1(x)``, weights under ``prefix``."""
        gate, up = (x @ self.p[prefix + "linear_fc1.weight"].T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.p[prefix + "linear_fc2.weight"].T

    def _mlp(self, x: torch.Tensor, i: int) -> torch.Tensor:
        return self._swiglu(x, f"decoder.layers.{i}.mlp.")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[b, s, vocab]``."""
        h = F.embedding(tokens, self.p["embedding.word_embeddings.weight"])
        for i in range(self.num_layers):
            scale = 1.0 / math.sqrt(i + 1) if self.lns else 1.0
            pre = f"decoder.layers.{i}."
            if i < self.post_layers:
                h = self._norm(
                    self.alpha * h + self._attention(h, i),
                    self.p[pre + "self_attn_bda.norm.weight"],
                )
                h = self._norm(
                    self.alpha * h + self._mlp(h, i), self.p[pre + "mlp_bda.norm.weight"]
                )
                continue
            attn = self._attention(self._norm(h, self.p[pre + "input_layernorm.weight"]) * scale, i)
            h = self._gpas(
                h
                + self._branch_gain(pre + "self_attn_bda")
                * self._peri(attn, pre + "self_attn_bda"),
                pre,
            )
            mlp = self._mlp(self._norm(h, self.p[pre + "pre_mlp_layernorm.weight"]) * scale, i)
            h = self._gpas(
                h + self._branch_gain(pre + "mlp_bda") * self._peri(mlp, pre + "mlp_bda"), pre
            )
        h = self._norm(h, self.p["decoder.final_layernorm.weight"])
        return h @ self.p["output_layer.weight"].T

    def _peri(self, branch: torch.Tensor, prefix: str) -> torch.Tensor:
        """Peri-LN's output norm on a branch before its add; other variants: the branch."""
        if self.variant != "peri_ln":
            return branch
        return self._norm(branch, self.p[prefix + ".output_norm.weight"])

    def _gpas(self, stream: torch.Tensor, prefix: str) -> torch.Tensor:
        """GPAS after an add: the value times 1 - SiLU(a), the gradient unscaled."""
        if self.variant != "gpas":
            return stream
        return stream - F.silu(self.p[prefix + "gpas.alpha"]) * stream.detach()

    def _branch_gain(self, prefix: str) -> torch.Tensor | float:
        if self.variant == "layerscale":
            return self.p[prefix + ".layerscale"]
        if self.variant == "skipinit":
            return self.p[prefix + ".gate"]
        return 1.0

    def load_megatron_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, param in self.p.items():
                param.copy_(state_dict[name])
