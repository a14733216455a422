"""What LNS's 1/sqrt(l) on the pre-MLP norm does to MoE routing at initialisation.

    PYTHONPATH=. .venv/bin/python benchmarks/moe_routing_at_init.py [--layers 16 ...]
        [--router-init-std S] [--output benchmarks/results/moe_routing_at_init.json]

Builds one tiny all-MoE model (every layer MoE), loads the same initial weights into an
LNS and a Pre-LN model, each with a softmax and a sigmoid router, runs one batch of random
tokens through each (forward only) and records every router's input. From the router
logits ``z = x @ W_r^T`` (fp32) it reports per layer:

* ``logit_std``: the std of the router logits (predicted ``router_std * sqrt(hidden / l)``
  with LNS and ``router_std * sqrt(hidden)`` without, as norm weights start at 1);
* softmax router: the entropy of ``softmax(z)`` over all experts divided by ``log E``
  (1 = uniform), the largest probability, the first of the two renormalised top-2 weights
  (megatron's default routing), the Switch load-balancing loss and the z-loss (both
  without their coefficients, as megatron logs them);
* sigmoid router: the mean top-1 score ``sigmoid(z)`` and the first renormalised top-2
  weight;
* ``same_topk``: in the LNS model, the fraction of tokens whose top-k experts are the same
  for ``z`` and for ``sqrt(l) * z`` (what the unscaled norm would give on the same residual
  stream); 1.0 by construction, checked.

``--router-init-std`` re-draws only the router weights (default: ``--init-std``), so one
can give a narrow model the router logit scale of a wide one: what matters at init is
``router_std * sqrt(hidden)``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from megatron_lns.model.language_model import GPTModelConfig, build_model
from megatron_lns.runtime import ParallelLayout, init_distributed


def model_config(args: argparse.Namespace, norm_scaling: str, score_function: str):
    return GPTModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn,
        vocab_size=args.vocab,
        seq_length=args.seq,
        init_method_std=args.init_std,
        norm_scaling=norm_scaling,
        # The same initial weights in both arms: megatron's plain N(0, std) everywhere.
        output_layer_init="normal",
        num_moe_experts=args.experts,
        moe_router_topk=args.topk,
        moe_layer_freq=1,
        moe_ffn_hidden_size=args.ffn,
        extra_transformer_config=dict(
            moe_token_dispatcher_type="allgather", moe_router_score_function=score_function
        ),
    )


def router_inputs(model: torch.nn.Module, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each MoE layer's router input ``[tokens, hidden]`` for one forward pass."""
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.router.register_forward_pre_hook(
            lambda module, args, n=layer.layer_number: seen.__setitem__(
                n, args[0].detach().reshape(-1, args[0].shape[-1]).float()
            )
        )
        for layer in model.decoder.layers
    ]
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        model(tokens, positions, None)
    for hook in hooks:
        hook.remove()
    return seen


def softmax_statistics(logits: torch.Tensor, topk: int) -> dict[str, float]:
    experts = logits.shape[-1]
    probs = logits.softmax(-1)
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    top2 = logits.topk(2, -1).values.softmax(-1)
    chosen = probs.topk(topk, -1).indices
    choices = torch.nn.functional.one_hot(chosen, experts).sum((0, 1)).float()
    balance = experts * ((choices / (logits.shape[0] * topk)) * probs.mean(0)).sum()
    return {
        "entropy_over_log_e": (entropy.mean() / math.log(experts)).item(),
        "max_prob": probs.max(-1).values.mean().item(),
        "top2_first_weight": top2[:, 0].mean().item(),
        "load_balancing_loss": balance.item(),
        "z_loss": logits.logsumexp(-1).square().mean().item(),
    }


def sigmoid_statistics(logits: torch.Tensor) -> dict[str, float]:
    top2 = logits.sigmoid().topk(2, -1).values
    return {
        "top1_score": top2[:, 0].mean().item(),
        "top2_first_weight": (top2[:, 0] / top2.sum(-1)).mean().item(),
    }


def measure(args: argparse.Namespace) -> dict:
    init_distributed(ParallelLayout(), device="cpu", seed=args.seed)
    base = build_model(model_config(args, "lns", "softmax"))[0]
    if args.router_init_std is not None:
        generator = torch.Generator().manual_seed(args.seed + 1)
        with torch.no_grad():
            for layer in base.decoder.layers:
                weight = layer.mlp.router.weight
                weight.copy_(torch.randn(weight.shape, generator=generator) * args.router_init_std)
    state = base.state_dict()
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)

    logits: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    weights = {
        layer.layer_number: layer.mlp.router.weight.detach().float()
        for layer in base.decoder.layers
    }
    for norm_scaling in ("lns", "none"):
        for score_function in ("softmax", "sigmoid"):
            model = build_model(model_config(args, norm_scaling, score_function))[0]
            model.load_state_dict(state)
            inputs = router_inputs(model, tokens)
            logits[norm_scaling, score_function] = {n: x @ weights[n].T for n, x in inputs.items()}

    router_std = args.router_init_std if args.router_init_std is not None else args.init_std
    layers = []
    for n in range(1, args.layers + 1):
        row: dict = {"layer": n, "factor": 1 / math.sqrt(n)}
        for arm, norm_scaling in (("lns", "lns"), ("pre_ln", "none")):
            z_soft = logits[norm_scaling, "softmax"][n]
            z_sig = logits[norm_scaling, "sigmoid"][n]
            predicted = router_std * math.sqrt(args.hidden / (n if arm == "lns" else 1))
            row[arm] = {
                "logit_std": z_soft.std().item(),
                "predicted_logit_std": predicted,
                "softmax": softmax_statistics(z_soft, args.topk),
                "sigmoid": sigmoid_statistics(z_sig),
            }
        z = logits["lns", "softmax"][n]
        same = (
            z.topk(args.topk, -1).indices.sort(-1).values
            == (z * math.sqrt(n)).topk(args.topk, -1).indices.sort(-1).values
        )
        row["same_topk"] = same.all(-1).float().mean().item()
        if row["same_topk"] != 1.0:
            raise AssertionError(f"layer {n}: a positive scale changed a top-{args.topk} choice")
        layers.append(row)
    return {"settings": vars(args), "layers": layers}


def print_table(result: dict) -> None:
    e = result["settings"]["experts"]
    print(
        f"| l | logit std LNS / Pre-LN | softmax H/log{e} LNS / Pre-LN | max prob LNS / Pre-LN "
        "| top-2 first weight LNS / Pre-LN | load-bal. loss LNS / Pre-LN "
        "| sigmoid top-1 score LNS / Pre-LN | same top-k |"
    )
    print("|---" * 8 + "|")
    for row in result["layers"]:
        lns, pre = row["lns"], row["pre_ln"]
        cells = [
            f"{lns['logit_std']:.3f} / {pre['logit_std']:.3f}",
            f"{lns['softmax']['entropy_over_log_e']:.4f} / "
            f"{pre['softmax']['entropy_over_log_e']:.4f}",
            f"{lns['softmax']['max_prob']:.4f} / {pre['softmax']['max_prob']:.4f}",
            f"{lns['softmax']['top2_first_weight']:.4f} / "
            f"{pre['softmax']['top2_first_weight']:.4f}",
            f"{lns['softmax']['load_balancing_loss']:.4f} / "
            f"{pre['softmax']['load_balancing_loss']:.4f}",
            f"{lns['sigmoid']['top1_score']:.4f} / {pre['sigmoid']['top1_score']:.4f}",
            f"{row['same_topk']:.0%}",
        ]
        print(f"| {row['layer']} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=128, help="each expert's FFN width")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--init-std", type=float, default=0.02)
    parser.add_argument("--router-init-std", type=float, default=None)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--output", default=None, help="write results as JSON here")
    args = parser.parse_args(argv)
    result = measure(args)
    print_table(result)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
