"""Transformer Engine and FP8 without a GPU: clear errors, and config checks."""

import pytest
import torch
from helpers import ROOT, tiny_config

from megatron_lns.config import ConfigError, load_config, validate
from megatron_lns.model.te import TransformerEngineUnavailable, te_available
from megatron_lns.training.machine import check_environment

DEMO = ROOT / "nemo_configs" / "tiny_cpu_demo.yaml"
TE_FP8 = [
    "model.transformer_engine=true",
    "model.fp8=delayed",
    "trainer.precision=bf16-mixed",
    "trainer.accelerator=gpu",
]


def _simulate_installed_te(monkeypatch, version: str = "2.10") -> None:
    """A CUDA machine with Transformer Engine ``version`` installed, as the launch check
    sees it."""
    import megatron.core.utils as mcore_utils
    from packaging.version import Version

    import megatron_lns.model.te as te

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(te, "te_available", lambda: True)
    monkeypatch.setattr(mcore_utils, "get_te_version", lambda: Version(version))
    monkeypatch.setattr(
        mcore_utils, "is_te_min_version", lambda wanted: Version(version) >= Version(wanted)
    )


def test_transformer_engine_older_than_2_8_is_refused_at_launch(monkeypatch):
    _simulate_installed_te(monkeypatch, "2.5")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    with pytest.raises(
        ConfigError,
        match=r"^model.transformer_engine=true needs Transformer Engine >= 2.8 \(installed: "
        r"2.5\)",
    ):
        check_environment(load_config(DEMO, TE_FP8))


@pytest.mark.skipif(te_available(), reason="Transformer Engine is installed")
def test_te_spec_without_te_says_how_to_install():
    from megatron_lns.model.specs import get_lns_layer_spec

    with pytest.raises(
        TransformerEngineUnavailable, match=r"pip install 'megatron-lns\[te\]'.*NGC"
    ):
        get_lns_layer_spec(backend="te")


def test_unknown_backend_is_a_clear_error():
    from megatron_lns.model.specs import get_lns_layer_spec

    with pytest.raises(ValueError, match="backend must be one of"):
        get_lns_layer_spec(backend="apex")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.fp8=delayed"], "model.fp8 needs model.transformer_engine=true"),
        (["model.transformer_engine=true", "model.fp8=fp4"], "model.fp8='fp4' is not one of"),
        (
            ["model.transformer_engine=true", "model.fp8=delayed", "trainer.precision=32"],
            "model.fp8 needs trainer.precision=bf16-mixed (got 32)",
        ),
        (
            [
                "model.transformer_engine=true",
                "model.fp8=delayed",
                "trainer.precision=bf16-mixed",
                "model.fp8_format=e5m2",
            ],
            "model.fp8_format='e5m2' is not one of",
        ),
    ],
)
def test_fp8_config_validation(overrides, expected):
    with pytest.raises(ConfigError, match=None) as info:
        validate(load_config(DEMO, overrides))
    assert expected in str(info.value)


def test_fp8_maps_onto_megatron_transformer_config():
    cfg = tiny_config(
        precision="bf16",
        fp8="tensorwise",
        fp8_margin=1,
        fp8_amax_history_len=16,
        fp8_amax_compute_algo="most_recent",
    )
    tf = cfg.transformer_config(cpu_init=True)
    assert (
        tf.fp8,
        tf.fp8_recipe,
        tf.fp8_margin,
        tf.fp8_amax_history_len,
        tf.fp8_amax_compute_algo,
        tf.fp8_param,
        tf.bf16,
    ) == ("hybrid", "tensorwise", 1, 16, "most_recent", False, True)


def test_environment_check_without_cuda():
    cfg = load_config(DEMO, TE_FP8)
    validate(cfg)
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match=r"trainer\.accelerator=gpu but CUDA is not available"):
        check_environment(cfg)
    with pytest.raises(ConfigError, match=r"model\.transformer_engine=true needs a CUDA GPU"):
        check_environment(load_config(DEMO, [*TE_FP8[:-1], "trainer.accelerator=auto"]))


def test_environment_check_rejects_te_missing_and_old_gpus(monkeypatch):
    import megatron_lns.model.te as te

    cfg = load_config(DEMO, TE_FP8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(te, "te_available", lambda: False)
    with pytest.raises(
        ConfigError, match=r"model.transformer_engine=true: Transformer Engine is not installed"
    ):
        check_environment(cfg)

    _simulate_installed_te(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    with pytest.raises(
        ConfigError,
        match=r"model.fp8=delayed needs compute capability >= 8.9, this machine has NVIDIA A100 \(compute capability 8.0\)",
    ):
        check_environment(cfg)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    check_environment(cfg)  # H100: delayed scaling is fine
    with pytest.raises(ConfigError, match=r"model.fp8=mxfp8 needs compute capability >= 10.0"):
        check_environment(load_config(DEMO, [*TE_FP8, "model.fp8=mxfp8"]))


def test_distributed_optimizer_without_te_or_apex_is_refused(monkeypatch):
    import megatron.core.optimizer.distrib_optimizer as dopt

    cfg = load_config(DEMO, ["model.optim.name=distributed_fused_adam"])
    validate(cfg)
    monkeypatch.setattr(dopt, "HAVE_APEX_OR_TE", False)
    with pytest.raises(
        ConfigError,
        match=r"model\.optim\.name=distributed_fused_adam needs Transformer Engine or Apex",
    ):
        check_environment(cfg)
    monkeypatch.setattr(dopt, "HAVE_APEX_OR_TE", True)
    check_environment(cfg)


def test_blockwise_fp8_needs_hopper_and_cuda_12_9(monkeypatch):

    cfg = load_config(DEMO, [*TE_FP8, "model.fp8=blockwise"])
    _simulate_installed_te(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(
        ConfigError,
        match=r"model.fp8=blockwise needs CUDA >= 12.9, this PyTorch is built with CUDA 12.8",
    ):
        check_environment(cfg)
    for version in ("12.9", "12.10", "13.0"):
        monkeypatch.setattr(torch.version, "cuda", version)
        check_environment(cfg)
    monkeypatch.setattr(torch.version, "cuda", None)  # a ROCm or CPU build
    with pytest.raises(
        ConfigError, match=r"needs CUDA >= 12.9, this PyTorch is not built with CUDA"
    ):
        check_environment(cfg)
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))
    with pytest.raises(ConfigError, match=r"model.fp8=blockwise needs compute capability >= 9.0"):
        check_environment(cfg)
    check_environment(load_config(DEMO, TE_FP8))  # delayed scaling: no CUDA-version floor
