"""Performance and memory keys: each reaches megatron-core's config objects, the GPU fast
paths default on for a (simulated) CUDA machine and off on CPU, every refusal names its
key, and a short CPU run with several of them set trains like one without."""

import dataclasses
import math
import sys
import warnings

import pytest
import torch
from helpers import DEMO_CONFIG, FIXTURES, ROOT, TINY_RUN_OVERRIDES, run_distributed

from megatron_lns.config import ConfigError, load_config, validate
from megatron_lns.config.fast_paths import (
    FastPathError,
    FastPathRequest,
    MachineFacts,
    resolve_fast_paths,
)
from megatron_lns.config.loader import NemoKeysIgnoredWarning
from megatron_lns.config.performance import resolved_fast_paths
from megatron_lns.training.build import (
    ddp_config,
    model_config,
    optim_settings,
    parallel_layout,
)
from megatron_lns.training.machine import check_environment

NEMO = FIXTURES / "nemo_megatron_gpt_config.yaml"
CPU = MachineFacts(cuda=False)
H100_TE_APEX = MachineFacts(
    cuda=True, transformer_engine=True, softmax_kernels=True, wgrad_accumulation_kernel=True
)
H100_PLAIN = MachineFacts(cuda=True)  # CUDA without Transformer Engine or Apex
FUSIONS = (
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "masked_softmax_fusion",
    "apply_rope_fusion",
    "gradient_accumulation_fusion",
    "cross_entropy_loss_fusion",
)


def _cfg(*overrides, world_size=None):
    cfg = load_config(DEMO_CONFIG, list(overrides))
    validate(cfg, world_size=world_size, check_files=False)
    return cfg


# --- The decision, on simulated machines ---


def test_unset_switches_are_on_on_a_cuda_machine_with_the_kernels():
    te = resolve_fast_paths(
        FastPathRequest(
            transformer_engine=True, distributed_optimizer=True, pipeline_parallel=True
        ),
        H100_TE_APEX,
    )
    assert all(getattr(te, name) for name in FUSIONS if name != "masked_softmax_fusion")
    assert not te.masked_softmax_fusion  # TE's attention fuses its own softmax
    assert te.attention_backend == "auto"  # TE picks flash or cuDNN fused attention
    assert te.overlap_grad_reduce and te.overlap_param_gather and te.batch_p2p_comm
    local = resolve_fast_paths(FastPathRequest(), H100_TE_APEX)
    assert local.masked_softmax_fusion and not local.apply_rope_fusion  # RoPE fusion is TE's
    assert not local.overlap_param_gather  # no distributed optimizer


def test_unset_switches_are_off_on_cpu():
    for request in (FastPathRequest(), FastPathRequest(pipeline_parallel=True)):
        cpu = resolve_fast_paths(request, CPU)
        assert not any(getattr(cpu, name) for name in FUSIONS)
        assert not cpu.overlap_grad_reduce and not cpu.overlap_param_gather
    assert not resolve_fast_paths(FastPathRequest(pipeline_parallel=True), CPU).batch_p2p_comm


def test_without_apex_or_te_only_the_kernels_that_exist_default_on():
    plain = resolve_fast_paths(FastPathRequest(), H100_PLAIN)
    assert plain.bias_activation_fusion and plain.bias_dropout_fusion
    assert plain.cross_entropy_loss_fusion and plain.overlap_grad_reduce
    assert not plain.masked_softmax_fusion and not plain.gradient_accumulation_fusion
    assert not plain.apply_rope_fusion


def test_a_user_setting_wins_both_ways():
    off = resolve_fast_paths(
        FastPathRequest(
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            gradient_accumulation_fusion=False,
            overlap_grad_sync=False,
            batch_p2p_comm=False,
        ),
        H100_TE_APEX,
    )
    assert not (off.bias_activation_fusion or off.masked_softmax_fusion)
    assert not (off.gradient_accumulation_fusion or off.overlap_grad_reduce or off.batch_p2p_comm)
    # The TorchScript fusions and DDP overlap run on CPU too: asked for, they are on.
    on_cpu = resolve_fast_paths(
        FastPathRequest(
            bias_activation_fusion=True,
            bias_dropout_add_fusion=True,
            cross_entropy_loss_fusion=True,
            overlap_grad_sync=True,
            bucket_cap_mb=1.0,
        ),
        CPU,
    )
    assert on_cpu.bias_activation_fusion and on_cpu.bias_dropout_fusion
    assert on_cpu.cross_entropy_loss_fusion and on_cpu.overlap_grad_reduce


@pytest.mark.parametrize(
    ("request_", "facts", "message"),
    [
        (
            FastPathRequest(masked_softmax_fusion=True),
            CPU,
            "model.masked_softmax_fusion=true needs Apex's fused softmax CUDA kernels",
        ),
        (
            FastPathRequest(gradient_accumulation_fusion=True),
            H100_PLAIN,
            "model.gradient_accumulation_fusion=true needs Apex's fused_weight_gradient_mlp_cuda",
        ),
        (
            FastPathRequest(apply_rope_fusion=True),
            H100_TE_APEX,  # the local backend
            "model.apply_rope_fusion=true needs Transformer Engine's fused RoPE",
        ),
        (
            FastPathRequest(apply_rope_fusion=True, rope=False, transformer_engine=True),
            H100_TE_APEX,
            "model.apply_rope_fusion=true needs model.position_embedding_type=rope",
        ),
        (
            FastPathRequest(use_flash_attention=True),
            H100_TE_APEX,
            "model.use_flash_attention=true needs model.transformer_engine=true",
        ),
        (
            FastPathRequest(bias_activation_fusion=True, gelu_without_bias=True),
            H100_TE_APEX,
            "model.bias_activation_fusion=true needs model.bias=true with model.activation=gelu",
        ),
        (
            FastPathRequest(overlap_param_sync=True),
            H100_TE_APEX,
            "model.optim.overlap_param_sync=true needs model.optim.name=distributed_fused_adam",
        ),
        (
            FastPathRequest(
                overlap_param_sync=True, overlap_grad_sync=False, distributed_optimizer=True
            ),
            H100_TE_APEX,
            "model.optim.overlap_param_sync=true needs model.optim.overlap_grad_sync=true",
        ),
        (
            FastPathRequest(bucket_cap_mb=50.0),
            CPU,
            "model.optim.bucket_cap_mb=50.0 needs model.optim.overlap_grad_sync=true",
        ),
        (
            FastPathRequest(batch_p2p_comm=True, pipeline_parallel=True),
            CPU,
            "model.batch_p2p_comm=true is wrong on gloo",
        ),
        (
            FastPathRequest(batch_p2p_comm=True, overlap_p2p_comm=True),
            H100_TE_APEX,
            "model.batch_p2p_comm=true and model.overlap_p2p_comm=true cannot both be on",
        ),
    ],
)
def test_a_setting_that_cannot_run_is_refused_by_name(request_, facts, message):
    with pytest.raises(FastPathError) as info:
        resolve_fast_paths(request_, facts)
    assert str(info.value).startswith(message), info.value


def test_flash_attention_maps_onto_megatrons_attention_backend():
    def backend(value):
        request = FastPathRequest(use_flash_attention=value, transformer_engine=True)
        return resolve_fast_paths(request, H100_TE_APEX).attention_backend

    assert (backend(None), backend(True), backend(False)) == ("auto", "flash", "fused")


def test_overlapped_pipeline_communication_is_unbatched_by_default():
    paths = resolve_fast_paths(
        FastPathRequest(overlap_p2p_comm=True, pipeline_parallel=True), H100_TE_APEX
    )
    assert paths.overlap_p2p_comm and not paths.batch_p2p_comm


# --- From the YAML keys to megatron-core's config objects ---


def test_every_honoured_key_reaches_megatron_cores_configs():
    cfg = _cfg(
        "+model.bias_activation_fusion=false",
        "+model.bias_dropout_add_fusion=true",
        "+model.masked_softmax_fusion=true",
        "+model.gradient_accumulation_fusion=true",
        "+model.cross_entropy_loss_fusion=false",
        "+model.fp32_residual_connection=true",
        "+model.apply_query_key_layer_scaling=true",
        "+model.do_layer_norm_weight_decay=true",
        "+model.optim.overlap_grad_sync=true",
        "+model.optim.bucket_cap_mb=10",
        "+model.optim.grad_sync_dtype=bf16",
        "trainer.precision=bf16-mixed",
    )
    fast = resolved_fast_paths(cfg, H100_TE_APEX)
    tf = model_config(cfg, 256, fast).transformer_config(parallel_layout(cfg), cpu_init=True)
    assert not tf.bias_activation_fusion and tf.bias_dropout_fusion
    assert tf.masked_softmax_fusion and tf.gradient_accumulation_fusion
    assert not tf.cross_entropy_loss_fusion
    assert tf.fp32_residual_connection and tf.apply_query_key_layer_scaling
    ddp = ddp_config(cfg, fast)
    assert ddp.overlap_grad_reduce and not ddp.grad_reduce_in_fp32
    assert ddp.bucket_size == 10 * 2**20 // 2  # bf16 gradients: 2 bytes each
    assert optim_settings(cfg).decay_norms_and_biases


def test_a_bucket_holds_as_many_gradients_as_its_megabytes_fit_in_the_reduced_dtype():
    """``bucket_cap_mb`` is NeMo's size in MB; megatron counts a bucket in gradients, 4 bytes
    each reduced in fp32 (also what null means), 2 in bf16 (as `plan` counts their memory)."""
    for grad_sync_dtype, gradient_bytes in [("bf16", 2), ("fp32", 4), ("null", 4)]:
        cfg = _cfg(
            "+model.optim.overlap_grad_sync=true",
            "+model.optim.bucket_cap_mb=10",
            f"+model.optim.grad_sync_dtype={grad_sync_dtype}",
            "trainer.precision=bf16-mixed",
        )
        ddp = ddp_config(cfg, resolved_fast_paths(cfg, H100_TE_APEX))
        assert ddp.bucket_size == 10 * 2**20 // gradient_bytes, grad_sync_dtype


def test_fp16_loss_scaling_keys_reach_the_optimizer_config():
    cfg = _cfg(
        "trainer.precision=16-mixed",
        "+model.native_amp_init_scale=65536",
        "+model.native_amp_growth_interval=200",
        "+model.hysteresis=4",
    )
    opt = optim_settings(cfg).megatron_config(torch.float16)
    assert (opt.initial_loss_scale, opt.loss_scale_window, opt.hysteresis) == (65536, 200, 4)


def test_context_parallel_reaches_the_layout_and_transformer_config():
    cfg = _cfg(
        "model.transformer_engine=true",
        "+model.context_parallel_size=2",
        "model.tensor_model_parallel_size=2",
        "model.global_batch_size=8",
        world_size=8,
    )
    layout = parallel_layout(cfg)
    assert layout.context == 2 and layout.data_parallel(8) == 2
    # The local-spec config (TE is not installed here) carries CP to megatron-core.
    gpt = dataclasses.replace(model_config(cfg, 256), backend="local")
    assert gpt.transformer_config(layout, cpu_init=True).context_parallel_size == 2


def test_pipeline_communication_keys_reach_the_transformer_config():
    cfg = _cfg(
        "model.num_layers=4",
        "model.pipeline_model_parallel_size=2",
        "model.virtual_pipeline_model_parallel_size=2",
        "+model.overlap_p2p_comm=true",
        world_size=2,
    )
    tf = model_config(cfg, 256, resolved_fast_paths(cfg, H100_TE_APEX)).transformer_config(
        parallel_layout(cfg), cpu_init=True
    )
    assert tf.overlap_p2p_comm and not tf.batch_p2p_comm


@pytest.mark.parametrize(
    ("overrides", "world_size", "message"),
    [
        (
            ["+model.context_parallel_size=2"],
            2,
            "model.context_parallel_size=2 needs model.transformer_engine=true",
        ),
        (
            ["model.transformer_engine=true", "+model.context_parallel_size=3"],
            3,
            "model.encoder_seq_length (128) is not divisible by 2 x model.context_parallel_size (6)",
        ),
        (
            ["model.transformer_engine=true", "+model.context_parallel_size=2"],
            3,
            "world size 3 (trainer.num_nodes x trainer.devices) is not divisible by tensor x "
            "pipeline x context parallel size (1 x 1 x 2)",
        ),
        (
            ["+model.overlap_p2p_comm=true"],
            None,
            "model.overlap_p2p_comm=true needs model.virtual_pipeline_model_parallel_size",
        ),
        (
            ["+model.optim.overlap_param_sync=true"],
            None,
            "model.optim.overlap_param_sync=true needs model.optim.name=distributed_fused_adam",
        ),
        (
            ["trainer.precision=16-mixed", "+model.optim.grad_sync_dtype=bf16"],
            None,
            "model.optim.grad_sync_dtype=bf16 needs trainer.precision=bf16-mixed",
        ),
        (
            ["trainer.precision=bf16-mixed", "+model.hysteresis=4"],
            None,
            "model.hysteresis=4 applies to fp16 loss scaling only",
        ),
        (
            ["+model.use_flash_attention=true"],
            None,
            "model.use_flash_attention=true needs model.transformer_engine=true",
        ),
    ],
)
def test_combinations_that_cannot_work_are_refused_by_name(overrides, world_size, message):
    with pytest.raises(ConfigError) as info:
        _cfg(*overrides, world_size=world_size)
    assert str(info.value).startswith(message), info.value


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machine's refusals")
def test_this_cpu_machine_refuses_a_cuda_only_fusion_by_name():
    check_environment(_cfg("+model.bias_activation_fusion=true"))  # TorchScript: runs on CPU
    with pytest.raises(ConfigError, match=r"^model.masked_softmax_fusion=true needs Apex"):
        check_environment(_cfg("+model.masked_softmax_fusion=true"))
    with pytest.raises(ConfigError, match=r"^model.gradient_accumulation_fusion=true needs"):
        check_environment(_cfg("+model.gradient_accumulation_fusion=true"))


# --- NeMo spellings ---


def _nemo(*overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NemoKeysIgnoredWarning)
        return load_config(NEMO, ["model.data.data_prefix=[x]", *overrides])


def test_nemos_yaml_values_of_the_performance_keys_are_read():
    m = _nemo().model
    # NeMo's megatron_gpt_config.yaml sets these explicitly.
    assert m.bias_activation_fusion and m.bias_dropout_add_fusion and m.masked_softmax_fusion
    assert m.apply_rope_fusion is False and m.gradient_accumulation_fusion is False
    assert m.batch_p2p_comm is True and m.overlap_p2p_comm is False
    assert m.use_flash_attention is False and m.context_parallel_size == 1
    assert (m.native_amp_init_scale, m.native_amp_growth_interval, m.hysteresis) == (
        2**32,
        1000,
        2,
    )


def test_grad_allreduce_chunk_size_is_named_in_the_inert_warning():
    with pytest.warns(NemoKeysIgnoredWarning, match=r"model.grad_allreduce_chunk_size_mb"):
        load_config(NEMO, ["model.data.data_prefix=[x]"])


# --- A short CPU run with the honoured keys set ---

PERF_KEYS = [
    "+model.optim.overlap_grad_sync=true",
    "+model.optim.bucket_cap_mb=0.05",  # several buckets for this model
    "+model.do_layer_norm_weight_decay=true",
    "+model.bias_activation_fusion=true",
    "+model.bias_dropout_add_fusion=true",
    "+model.cross_entropy_loss_fusion=true",
]


def _fit(cfg):
    from megatron_lns.training.trainer import Trainer

    trainer = Trainer(cfg)
    ddp, tf = trainer.model[0].ddp_config, trainer.model[0].config
    settings = {
        "overlap": ddp.overlap_grad_reduce,
        "bucket_size": ddp.bucket_size,
        "buckets": len(trainer.model[0].bucket_groups),
        "fused": (tf.bias_activation_fusion, tf.bias_dropout_fusion, tf.cross_entropy_loss_fusion),
        "wd_mults": sorted({g["wd_mult"] for g in trainer.optimizer.param_groups}),
    }
    summary = trainer.fit()
    return [loss for _, loss in summary.train_losses], settings


@pytest.mark.slow
def test_a_run_with_the_fast_paths_on_trains_like_one_without(tmp_path, private_corpus_cache):
    common = [
        *TINY_RUN_OVERRIDES,
        "trainer.devices=2",
        "trainer.max_steps=4",
        "trainer.limit_val_batches=0",
        "model.optim.weight_decay=0.1",
        "exp_manager.checkpoint_callback_params.every_n_train_steps=4",
    ]

    def run(name, *extra):
        cfg = load_config(DEMO_CONFIG, [*common, f"exp_manager.exp_dir={tmp_path / name}", *extra])
        validate(cfg)
        check_environment(cfg)
        return run_distributed(_fit, 2, tmp_path / name, cfg)

    fast = run("fast", *PERF_KEYS)
    plain = run("plain", "+model.do_layer_norm_weight_decay=true")
    (losses, settings), (other_rank_losses, _) = fast
    assert settings["overlap"] and settings["buckets"] > 1
    assert settings["bucket_size"] == int(0.05 * 2**20 / 4)
    assert settings["fused"] == (True, True, True)
    assert settings["wd_mults"] == [1.0]  # norms and biases decay too (megatron: [0.0, 1.0])
    assert not plain[0][1]["overlap"] and plain[0][1]["fused"] == (False, False, False)
    assert losses == other_rank_losses and len(losses) == 4
    assert all(math.isfinite(loss) for loss in losses)
    # Overlapped bucketed reduction and the fused kernels compute the same numbers.
    assert losses == pytest.approx(plain[0][0], rel=1e-5)


# --- The OLMo-7B production config ---

OLMO = ROOT / "nemo_configs" / "olmo_7b_lns_20b.yaml"
OLMO_TOKENIZER_VOCAB = 50280  # GPT-NeoX / OLMo tokenizer (docs/REFERENCE: padded 50304)


def _memory_module():
    import importlib.util

    path = ROOT / "benchmarks" / "memory_per_gpu.py"
    spec = importlib.util.spec_from_file_location("memory_per_gpu", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_olmo_7b_config_validates_and_quotes_its_current_memory_arithmetic():
    memory = _memory_module()
    cfg = memory.load_for_estimate(OLMO)
    validate(cfg, check_files=False)
    m = cfg.model
    assert m.optim.name == "distributed_fused_adam" and m.optim.overlap_param_sync
    assert m.optim.overlap_grad_sync and m.context_parallel_size == 1 and m.fp8 == "delayed"
    assert m.activations_checkpoint_granularity is None
    block = memory.comment_block(cfg, OLMO_TOKENIZER_VOCAB)
    assert block in OLMO.read_text(), "rerun benchmarks/memory_per_gpu.py and update the YAML"
    estimate = memory.estimate(cfg, OLMO_TOKENIZER_VOCAB)
    assert estimate.total_gb < 80  # an H100 (80 GB)
    # The arithmetic's pieces: 16 layers of 202M parameters over TP=2, plus half the
    # padded embedding (50304 x 4096 / 2); 36 = (2(PP-1) + (VP-1)PP + 1) chunks x 4 layers.
    assert estimate.parameters == 16 * (4 * 4096**2 + 3 * 4096 * 11008) // 2 + 50304 * 4096 // 2
    assert estimate.layer_microbatches == 36


def test_memory_arithmetic_follows_recomputation():
    memory = _memory_module()
    base = ["model.tokenizer.type=x", "model.data.data_prefix=[x]"]
    kept = memory.estimate(load_config(OLMO, base), OLMO_TOKENIZER_VOCAB).activations_gb
    full = memory.estimate(
        load_config(
            OLMO,
            [
                *base,
                "model.activations_checkpoint_granularity=full",
                "+model.activations_checkpoint_method=uniform",
                "+model.activations_checkpoint_num_layers=1",
            ],
        ),
        OLMO_TOKENIZER_VOCAB,
    ).activations_gb
    assert full < kept / 5


# --- model.dist_ckpt_parallel_load ---


def _save_then_load_in_parallel(checkpoint_root):
    from helpers import fixed_microbatches, tiny_config

    from megatron_lns.runtime import ParallelLayout, init_distributed
    from megatron_lns.training.build import build_trainable
    from megatron_lns.training.checkpoint import (
        TrainingState,
        load_checkpoint,
        load_strategy,
        save_checkpoint,
    )
    from megatron_lns.training.optim import OptimSettings
    from megatron_lns.training.step import train_step

    layout = ParallelLayout()  # DP = 2
    device = init_distributed(layout, device="cpu", seed=1)
    config = tiny_config()
    trained = build_trainable(config, layout, device, OptimSettings(lr=1e-2), total_steps=10)
    batches = fixed_microbatches(config.vocab_size, config.seq_length)
    train_step(trained.model, trained.optimizer, batches)
    path = save_checkpoint(
        checkpoint_root,
        trained.model,
        trained.optimizer,
        trained.scheduler,
        TrainingState(1, 4),
        "",
    )
    init_distributed(layout, device="cpu", seed=2)  # other initial weights
    fresh = build_trainable(config, layout, device, OptimSettings(lr=1e-2), total_steps=10)
    state = load_checkpoint(
        path, fresh.model, fresh.optimizer, fresh.scheduler, strategy=load_strategy(parallel=True)
    )
    same_weights = all(
        torch.equal(a, b)
        for a, b in zip(
            trained.model[0].module.parameters(), fresh.model[0].module.parameters(), strict=True
        )
    )
    # The next step from the loaded state matches the next step of the original.
    after_trained = train_step(trained.model, trained.optimizer, batches).loss
    after_fresh = train_step(fresh.model, fresh.optimizer, batches).loss
    return same_weights, state.iteration, after_trained, after_fresh


@pytest.mark.slow
def test_parallel_load_restores_what_was_saved(tmp_path):
    results = run_distributed(_save_then_load_in_parallel, 2, tmp_path, str(tmp_path / "ckpt"))
    for same_weights, iteration, after_trained, after_fresh in results:
        assert same_weights and iteration == 1
        assert after_fresh == after_trained


# --- Context parallelism at run time: what CPU can check without Transformer Engine ---


def _cp_rank_batch():
    from megatron.core import parallel_state

    from megatron_lns.runtime import ParallelLayout, init_distributed
    from megatron_lns.training.step import lm_forward_step, make_batch

    init_distributed(ParallelLayout(context=2), device="cpu")
    tokens = torch.arange(17).unsqueeze(0)  # one sequence of 16 inputs + 1
    seen = {}

    def model(tokens, position_ids, attention_mask, labels):
        seen.update(tokens=tokens.tolist(), labels=labels.tolist())
        return torch.zeros(labels.shape)

    lm_forward_step(iter([make_batch(tokens)]), model)
    dp_cp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    return parallel_state.get_context_parallel_rank(), seen, dp_cp


@pytest.mark.slow
def test_each_context_parallel_rank_gets_its_two_load_balanced_chunks(tmp_path):
    results = run_distributed(_cp_rank_batch, 2, tmp_path)
    chunks = {rank: seen for rank, seen, _ in results}
    # 16 positions in 2 x CP = 4 chunks of 4: rank 0 holds chunks 0 and 3, rank 1 1 and 2.
    assert chunks[0]["tokens"] == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert chunks[1]["tokens"] == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert chunks[0]["labels"] == [[1, 2, 3, 4, 13, 14, 15, 16]]
    # The loss is summed over data x context parallel ranks: both CP ranks here.
    assert all(dp_cp == 2 for _, _, dp_cp in results)


def test_timing_benchmarks_use_the_fast_paths_a_training_run_gets(monkeypatch):
    from helpers import tiny_config

    from megatron_lns.training import benchmark

    cfg = tiny_config()
    on_cpu = benchmark.with_default_fast_paths(cfg, torch.device("cpu"))
    assert not any(getattr(on_cpu, name) for name in FUSIONS)
    monkeypatch.setattr(benchmark, "detect_machine", lambda cuda: H100_TE_APEX)
    on_gpu = benchmark.with_default_fast_paths(cfg, torch.device("cuda", 0))
    assert all(getattr(on_gpu, name) for name in FUSIONS if name != "apply_rope_fusion")
    assert not on_gpu.apply_rope_fusion  # TE's fused RoPE; tiny_config is the local backend
