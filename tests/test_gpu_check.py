"""The GPU check's harness on CPU (its numbers need a GPU: benchmarks/gpu_check.py)."""

import json
import math
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, fresh_launch_env, tiny_config

from megatron_lns.model.language_model import build_model

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check


def test_switching_lns_off_in_place_is_the_pre_ln_model(seeded):
    """The throughput part times Pre-LN by switching the factors off on the LNS model."""
    lns = build_model(tiny_config(num_layers=4))[0]
    pre_ln = build_model(tiny_config(num_layers=4, norm_scaling="none"))[0]
    pre_ln.load_state_dict(lns.state_dict())
    tokens = torch.randint(0, 128, (2, 16))
    positions = torch.arange(16).expand(2, -1)
    with_lns = lns(tokens, positions, None)
    gpu_check.set_norm_scaling([lns], "none")
    assert torch.equal(lns(tokens, positions, None), pre_ln(tokens, positions, None))
    gpu_check.set_norm_scaling([lns], "lns")
    assert torch.equal(lns(tokens, positions, None), with_lns)


def test_relative_differences_names_the_worst_tensor():
    ref = (torch.ones(4), {"a": torch.ones(3), "b": torch.ones(3)})
    other = (torch.ones(4) * 1.5, {"a": torch.ones(3), "b": torch.ones(3) * 2})
    diff = gpu_check.relative_differences(ref, other)
    assert diff["logits"] == pytest.approx(0.5)
    assert diff["grads"] == pytest.approx(math.sqrt(3 / 6))
    assert (diff["worst_grad"], diff["worst_grad_name"]) == (pytest.approx(1.0), "b")


@pytest.mark.slow
def test_cpu_smoke_runs_every_part_and_writes_the_report(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--cpu-smoke", "--output-dir", str(tmp_path)],
        cwd=ROOT,
        env=fresh_launch_env(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check_cpu_smoke.json").read_text())
    assert report["machine"]["host"] and report["machine"]["gpu"] is None
    agreement = report["te_vs_local"]
    assert agreement["status"] == "smoke" and agreement["candidate"] == "local"
    for case in agreement["cases"].values():
        assert case["agreement"]["logits"] == 0.0  # local vs local: the harness only
        assert case["control"]["logits"] > 0.05 and case["control"]["grads"] > 0.05
        assert case["bf16_noise"]["logits"] > 0.0
    zero_centered = report["zero_centered_gamma"]
    assert zero_centered["te_skipped"] == "no CUDA device"
    local = zero_centered["results"]["local_zero_centered"]
    assert local["max_relative_error"] <= 2**-8 + 1e-5 < local["folded_form_error"]
    throughput = report["throughput"]
    assert throughput["te_bf16"] == {"status": "skip", "reason": "no CUDA device"}
    assert throughput["te_fp8_delayed"]["status"] == "skip"
    local_bf16 = throughput["local_bf16"]
    assert local_bf16["status"] == "smoke" and local_bf16["losses_finite"]
    for arm in ("lns", "pre_ln"):
        assert local_bf16[arm]["tokens_per_s_per_gpu"] > 0
        assert local_bf16[arm]["mfu"] is None
    assert (tmp_path / "gpu_check_cpu_smoke.md").read_text().startswith("# GPU check: CPU smoke")


def test_without_cuda_the_full_check_refuses_clearly():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gpu_check.main([]) == 2
