"""MoE step metrics: megatron's router losses and the expert load, checked against the
router's own inputs, and what a training run logs with and without experts."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, fixed_microbatches, run_distributed, tiny_config
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.utils import get_model_config
from reference_moe import load_balancing_loss, z_loss

from megatron_lns.config import load_config, validate
from megatron_lns.config.hybrid_pattern import gpt_key_to_hybrid
from megatron_lns.model.language_model import unwrap
from megatron_lns.runtime import ParallelLayout
from megatron_lns.training.build import build_trainable
from megatron_lns.training.moe_metrics import MoEMetrics
from megatron_lns.training.optim import OptimSettings
from megatron_lns.training.step import forward_backward

MOE_LAYERS = [2, 3, 4]  # moe_layer_freq [0, 1, 1, 1]
EXPERTS, TOPK = 4, 2


@pytest.fixture()
def clean_moe_globals():
    """megatron's metrics tracker and aux-loss gradient scale are process-global."""
    saved = MoEAuxLossAutoScaler.main_loss_backward_scale
    get_moe_metrics_tracker().clear()
    yield
    MoEAuxLossAutoScaler.main_loss_backward_scale = saved
    get_moe_metrics_tracker().clear()


def _moe_model(
    per_layer=True, architecture="gpt", num_layers=4, hybrid_layer_pattern=None, **extra
):
    cfg = tiny_config(
        architecture=architecture,
        num_layers=num_layers,
        hybrid_layer_pattern=hybrid_layer_pattern,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_layer_freq=[0, 1, 1, 1],
        moe_ffn_hidden_size=48,
        extra_transformer_config=dict(
            moe_token_dispatcher_type="allgather",
            moe_aux_loss_coeff=0.1,
            moe_z_loss_coeff=0.01,
            moe_per_layer_logging=per_layer,
            **extra,
        ),
    )
    trainable = build_trainable(cfg, ParallelLayout(), torch.device("cpu"), OptimSettings(), 10)
    return cfg, trainable.model


def _capture_router_logits(model):
    """Per layer, the router logits of every training forward (from the router's input)."""
    logits = {}

    def hook(router, args, _output):
        if router.training and torch.is_grad_enabled():
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            logits.setdefault(router.layer_number, []).append(x @ router.weight.detach().float().T)

    for module in model[0].modules():
        if isinstance(module, TopKRouter):
            module.register_forward_hook(hook)
    return logits


def _tracked(name):
    return get_moe_metrics_tracker().metrics[name].values.clone()


def test_step_metrics_are_the_routers_losses_and_loads(seeded, clean_moe_globals):
    cfg, model = _moe_model()
    metrics = MoEMetrics(model, get_model_config(model[0]))
    logits = _capture_router_logits(model)
    batches = fixed_microbatches(cfg.vocab_size, cfg.seq_length, num_microbatches=2)

    metrics.start_step()
    forward_backward(model, batches)
    tracked = {name: _tracked(name) for name in ("load_balancing_loss", "z_loss")}
    summary, per_layer = metrics.report(num_microbatches=len(batches))

    assert sorted(logits) == MOE_LAYERS and all(len(v) == 2 for v in logits.values())
    highest, lowest = [], []
    for layer in MOE_LAYERS:
        expected_lb = sum(load_balancing_loss(z, TOPK) for z in logits[layer]) / 2
        expected_z = sum(z_loss(z) for z in logits[layer]) / 2
        lb, zl = (
            per_layer[f"moe/load_balancing_loss/layer_{layer}"],
            per_layer[f"moe/z_loss/layer_{layer}"],
        )
        # megatron's tracker: the sum over micro-batches, reported as their mean.
        assert lb == pytest.approx(float(tracked["load_balancing_loss"][layer - 1]) / 2)
        assert zl == pytest.approx(float(tracked["z_loss"][layer - 1]) / 2)
        assert lb == pytest.approx(float(expected_lb), rel=1e-5)
        assert zl == pytest.approx(float(expected_z), rel=1e-5)
        chosen = torch.cat([z.topk(TOPK, dim=-1).indices for z in logits[layer]])
        load = F.one_hot(chosen, EXPERTS).sum(dim=(0, 1)).double()
        assert load.sum() == 2 * 2 * cfg.seq_length * TOPK  # every token's k choices
        high, low = float(load.max() / load.mean()), float(load.min() / load.mean())
        assert per_layer[f"moe/expert_load_max/layer_{layer}"] == pytest.approx(high)
        assert per_layer[f"moe/expert_load_min/layer_{layer}"] == pytest.approx(low)
        highest.append(high)
        lowest.append(low)
    mean_lb = sum(per_layer[f"moe/load_balancing_loss/layer_{x}"] for x in MOE_LAYERS) / 3
    assert summary["moe/load_balancing_loss"] == pytest.approx(mean_lb)
    assert summary["moe/expert_load_max"] == pytest.approx(max(highest))
    assert summary["moe/expert_load_min"] == pytest.approx(min(lowest))
    assert not any(key.endswith("/layer_1") for key in per_layer)  # layer 1 is dense


def test_validation_and_unlogged_steps_leave_nothing_behind(seeded, clean_moe_globals):
    cfg, model = _moe_model(per_layer=False)
    metrics = MoEMetrics(model, get_model_config(model[0]))
    batches = fixed_microbatches(cfg.vocab_size, cfg.seq_length, num_microbatches=1)

    metrics.start_step()
    forward_backward(model, batches)  # a step that is not logged: nothing reported
    metrics.start_step()  # the next step starts from zero
    assert not any(_tracked(n).any() for n in ("load_balancing_loss", "z_loss"))
    assert not metrics.counts.any()

    model[0].eval()
    forward_backward(model, batches, forward_only=True)  # validation records nothing
    model[0].train()
    assert not any(_tracked(n).any() for n in ("load_balancing_loss", "z_loss"))
    assert not metrics.counts.any()

    forward_backward(model, batches)
    summary, per_layer = metrics.report(num_microbatches=1)
    assert per_layer == {}  # without moe_per_layer_logging
    assert set(summary) == {
        "moe/load_balancing_loss",
        "moe/z_loss",
        "moe/expert_load_max",
        "moe/expert_load_min",
    }
    assert all(math.isfinite(v) for v in summary.values())
    assert summary["moe/expert_load_max"] >= 1 >= summary["moe/expert_load_min"]
    assert not _tracked("z_loss").any()  # report clears the tracker


def _step_metrics(model, cfg):
    get_moe_metrics_tracker().metrics.clear()  # entries sized for the previous model
    metrics = MoEMetrics(model, get_model_config(model[0]))
    metrics.start_step()
    forward_backward(model, fixed_microbatches(cfg.vocab_size, cfg.seq_length))
    summary, per_layer = metrics.report(num_microbatches=2)
    metrics.close()
    return summary, per_layer


def test_a_gpt_equivalent_hybrid_model_logs_the_gpt_models_metrics(seeded, clean_moe_globals):
    """HybridModel numbers sublayers (MoE ones are 4, 6, 8 here): counts and losses are
    indexed by that number, and logged under the GPT model's layer (the block)."""
    cfg, gpt = _moe_model()
    hybrid_cfg, hybrid = _moe_model(architecture="hybrid")
    state = unwrap(gpt[0]).state_dict()
    unwrap(hybrid[0]).load_state_dict({gpt_key_to_hybrid(k): v for k, v in state.items()})
    expected = _step_metrics(gpt, cfg)
    got = _step_metrics(hybrid, hybrid_cfg)
    assert sorted(expected[1]) == sorted(got[1])
    assert {key for key in got[1] if key.startswith("moe/z_loss/")} == {
        f"moe/z_loss/layer_{layer}" for layer in MOE_LAYERS
    }
    for logged, reference in zip(got, expected, strict=True):
        assert logged == pytest.approx(reference, rel=1e-6)


def test_hybrid_moe_sublayers_of_one_block_are_named_apart(seeded, clean_moe_globals):
    cfg, model = _moe_model(architecture="hybrid", num_layers=5, hybrid_layer_pattern="*EE*E")
    summary, per_layer = _step_metrics(model, cfg)
    names = {key.removeprefix("moe/z_loss/") for key in per_layer if "z_loss/" in key}
    assert names == {"layer_1_sublayer_2", "layer_1_sublayer_3", "layer_2"}
    assert all(math.isfinite(value) for value in (*summary.values(), *per_layer.values()))


def test_a_dense_model_has_no_moe_metrics(seeded):
    cfg = tiny_config()
    trainable = build_trainable(cfg, ParallelLayout(), torch.device("cpu"), OptimSettings(), 10)
    model = trainable.model
    assert MoEMetrics.for_model(model, get_model_config(model[0])) is None


# --- What a training run logs ---

DEMO = ROOT / "nemo_configs" / "tiny_cpu_demo.yaml"
TINY = [
    "model.num_layers=4",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.ffn_hidden_size=64",
    "model.encoder_seq_length=16",
    "model.micro_batch_size=2",
    "model.global_batch_size=4",
    "model.optim.sched.warmup_steps=1",
    "trainer.max_steps=2",
    "trainer.limit_val_batches=1",
    "trainer.val_check_interval=1",
    "trainer.log_every_n_steps=2",
    "exp_manager.create_tensorboard_logger=false",
]
MOE = [
    "model.num_moe_experts=4",
    "model.moe_ffn_hidden_size=32",
    "model.moe_aux_loss_coeff=0.01",
    "model.moe_z_loss_coeff=0.001",
    "model.moe_layer_freq=[0,1,1,1]",
]


def _fit_and_read_metrics(configs):
    from megatron_lns.training.trainer import Trainer

    rows = []
    for cfg in configs:
        summary = Trainer(cfg).fit()
        lines = (summary.run_dir / "metrics.jsonl").read_text().splitlines()
        rows.append([json.loads(line) for line in lines])
    return rows


@pytest.mark.slow
def test_training_logs_moe_metrics_at_logged_steps_only_for_moe_runs(tmp_path):
    runs = {
        "dense": [],
        "moe": MOE,
        "moe_per_layer": [*MOE, "model.moe_per_layer_logging=true"],
    }
    configs = []
    for name, overrides in runs.items():
        cfg = load_config(DEMO, [*TINY, *overrides, f"exp_manager.exp_dir={tmp_path / name}"])
        validate(cfg)
        configs.append(cfg)
    dense, moe, per_layer = run_distributed(_fit_and_read_metrics, 1, tmp_path, configs)[0]

    def keys(rows, step):
        return {k for row in rows if row["step"] == step for k in row if k.startswith("moe/")}

    assert keys(dense, 1) == keys(dense, 2) == set()
    means = {"moe/load_balancing_loss", "moe/z_loss", "moe/expert_load_max", "moe/expert_load_min"}
    assert keys(moe, 1) == set()  # step 1 is not a logged step
    assert keys(moe, 2) == means
    layer_keys = {f"{k}/layer_{layer}" for k in means for layer in MOE_LAYERS}
    assert keys(per_layer, 2) == means | layer_keys
    for rows in (moe, per_layer):
        for row in rows:
            assert all(math.isfinite(v) for k, v in row.items() if k.startswith("moe/"))
