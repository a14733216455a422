"""The routing-at-init measurement (benchmarks/moe_routing_at_init.py, docs/design.md "LNS and routing at initialisation")
on a small model: its statistics on known logits, and its two arms built as it says."""

import argparse
import math
import sys

import pytest
import torch
from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import moe_routing_at_init as routing


def test_statistics_of_equal_logits_are_the_uniform_values():
    experts, topk = 8, 2
    softmax = routing.softmax_statistics(torch.full((5, experts), 0.3), topk)
    assert softmax["entropy_over_log_e"] == pytest.approx(1.0)
    assert softmax["max_prob"] == pytest.approx(1 / experts)
    assert softmax["top2_first_weight"] == pytest.approx(0.5)
    # Equal probabilities: E * sum_i f_i / E = 1 whatever the choices.
    assert softmax["load_balancing_loss"] == pytest.approx(1.0)
    assert softmax["z_loss"] == pytest.approx((math.log(experts) + 0.3) ** 2)
    sigmoid = routing.sigmoid_statistics(torch.zeros(5, experts))
    assert sigmoid == pytest.approx({"top1_score": 0.5, "top2_first_weight": 0.5})


def test_layer_one_is_the_same_in_both_arms_and_top_k_never_changes(megatron_world1):
    args = argparse.Namespace(
        layers=3,
        hidden=32,
        heads=4,
        ffn=32,
        experts=4,
        topk=2,
        vocab=64,
        seq=16,
        batch=2,
        init_std=0.05,
        router_init_std=None,
        seed=7,
        output=None,
    )
    layers = routing.measure(args)["layers"]
    assert [row["layer"] for row in layers] == [1, 2, 3]
    assert layers[0]["lns"] == layers[0]["pre_ln"]  # factor 1 in layer 1
    assert layers[1]["lns"] != layers[1]["pre_ln"]
    assert all(row["same_topk"] == 1.0 for row in layers)
    for row in layers:
        assert row["lns"]["predicted_logit_std"] == pytest.approx(
            0.05 * math.sqrt(32 / row["layer"])
        )
