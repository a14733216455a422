"""Hugging Face export / import: logit parity with stock transformers, round trips,
tokenizer ids, and refusal of bad inputs with nothing half-written."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest
import torch
from helpers import run_distributed
from hf_parity import (
    HF_TINY,
    SEQ,
    VOCAB,
    assert_architecture_round_trips,
    assert_nothing_written,
    assert_parity,
    export_then_import,
    import_refuses_edited_config,
    run_config,
    safetensors_tensors,
    silent,
)

from megatron_lns.config import load_config, to_yaml
from megatron_lns.convert import ConversionError, export_hf, import_hf
from megatron_lns.convert.architectures import (
    ARCHITECTURES,
    Architecture,
    architecture_for_hf_config,
    architecture_for_model_config,
)
from megatron_lns.data.tokenizer import ByteTokenizer
from megatron_lns.model.language_model import build_model
from megatron_lns.runtime import ParallelLayout
from megatron_lns.training.build import model_config
from megatron_lns.training.checkpoint import load_model_weights, save_model_weights


def perturb(model: torch.nn.Module, seed: int = 1) -> None:
    """Norm weights start at 1 and biases at 0: perturb them so every mapping is exercised."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name or name.endswith("bias"):
                param.add_(0.3 * torch.randn(param.shape, generator=gen))


def save_run(root: Path, cfg, layout: ParallelLayout = ParallelLayout(), load_from=None) -> Path:
    """Save a checkpoint of ``cfg`` as training does (iter dir, config.yaml, complete.json).

    Fresh perturbed weights, or the weights of ``load_from``, at ``layout``; called on
    every rank of a world that fits the layout (in-process: the world of one).
    """
    import torch.distributed as dist

    from megatron_lns.runtime import init_distributed

    if layout != ParallelLayout():
        init_distributed(layout, device="cpu")
    chunks = build_model(model_config(cfg, VOCAB), layout)
    if load_from is None:
        for chunk in chunks:
            perturb(chunk)
    else:
        load_model_weights(chunks, load_from)
    path = root / "checkpoints" / "iter_0000001"
    save_model_weights(chunks, path)
    if not dist.is_initialized() or dist.get_rank() == 0:
        (path / "config.yaml").write_text(to_yaml(cfg))
        (path / "complete.json").write_text('{"iteration": 1, "consumed_samples": 8}\n')
    if dist.is_initialized():
        dist.barrier()
    return path


PARITY_CASES = {
    # LLaMA-style LNS with GQA (4 heads, 2 query groups), untied embeddings.
    "rmsnorm-lns-gqa": dict(),
    "rmsnorm-preln-tied": dict(norm_scaling="none", share_embeddings_and_output_weights=True),
    "rmsnorm-lns-bias-mha": dict(bias=True, num_query_groups=4),
    "rmsnorm-nonparametric-lns": dict(norm_affine=False),
    # OLMo-style parameter-free LayerNorm -> StableLM with the factor as the norm weight.
    "layernorm-nonparametric-lns": dict(normalization="layernorm", norm_affine=False),
    "layernorm-affine-lns-tied": dict(
        normalization="layernorm", share_embeddings_and_output_weights=True
    ),
    "layernorm1p-lns": dict(normalization="layernorm1p"),
    # Llama's head_dim: four 24-channel heads (96 wide) over a 64-wide residual stream.
    "rmsnorm-lns-kv-channels": dict(kv_channels=24),
}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_export_matches_megatron_logits(seeded, tmp_path, case):
    cfg = run_config(**PARITY_CASES[case])
    checkpoint = save_run(tmp_path / "run", cfg)
    out = export_hf(tmp_path / "run", tmp_path / "hf", progress=silent)
    config = json.loads((out / "config.json").read_text())
    expected = "LlamaForCausalLM" if cfg.model.normalization == "rmsnorm" else "StableLmForCausalLM"
    assert config["architectures"] == [expected]
    assert config["vocab_size"] == VOCAB and config["eos_token_id"] == ByteTokenizer().eod
    assert config["tie_word_embeddings"] == cfg.model.share_embeddings_and_output_weights
    if expected == "LlamaForCausalLM":
        assert config["head_dim"] == (cfg.model.kv_channels or 16)
    assert_parity(checkpoint, cfg, out)


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_export_folds_exactly_what_baked_state_dict_folds(seeded, tmp_path, precision):
    from megatron_lns.model.layer import baked_state_dict

    cfg = run_config(precision)
    checkpoint = save_run(tmp_path / "run", cfg)
    out = export_hf(checkpoint, tmp_path / "hf", progress=silent)
    model = build_model(model_config(cfg, VOCAB))
    load_model_weights(model, checkpoint)
    baked = baked_state_dict(model[0])
    exported = safetensors_tensors(out)
    dtype = torch.float32 if precision == "32" else torch.bfloat16
    assert {tensor.dtype for tensor in exported.values()} == {dtype}
    assert json.loads((out / "config.json").read_text())["dtype"] == str(dtype).split(".")[1]
    for i in range(cfg.model.num_layers):
        for megatron, hf in (
            ("input_layernorm", "input_layernorm"),
            ("pre_mlp_layernorm", "post_attention_layernorm"),
        ):
            folded = baked[f"decoder.layers.{i}.{megatron}.weight"]
            assert torch.equal(exported[f"model.layers.{i}.{hf}.weight"], folded)
            if i > 0:  # the factor is really there: 1/sqrt(l) != 1 from block 2 on
                raw = model[0].state_dict()[f"decoder.layers.{i}.{megatron}.weight"]
                assert not torch.equal(folded, raw)


def test_export_without_the_factor_fails_parity(seeded, tmp_path, monkeypatch):
    """Negative control: the parity check is sensitive to a missing LNS fold."""
    cfg = run_config()
    checkpoint = save_run(tmp_path / "run", cfg)
    monkeypatch.setattr(Architecture, "norm_scale", lambda self, layer_number: 1.0)
    out = export_hf(checkpoint, tmp_path / "hf", progress=silent)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_parity(checkpoint, cfg, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dividing_the_factor_out_recovers_a_weight_that_folds_back_bitwise(dtype):
    from megatron_lns.convert.mapping import effective_norm_weight, invert_exactly
    from megatron_lns.model.scaling import lns_factor

    gen = torch.Generator().manual_seed(0)
    for layer_number in (2, 3, 7, 48, 96):
        scale = lns_factor(layer_number)
        gamma = (1 + 0.5 * torch.randn(4096, generator=gen)).to(dtype)
        folded = effective_norm_weight(gamma, scale, zero_centered=False)
        naive = (folded.double() / scale).to(dtype)
        recovered, inexact = invert_exactly(
            folded, lambda g, s=scale: effective_norm_weight(g, s, False), naive
        )
        assert inexact == 0
        assert torch.equal(effective_norm_weight(recovered, scale, False), folded)
        if dtype == torch.float32:  # plain division alone would not do
            assert not torch.equal(effective_norm_weight(naive, scale, False), folded)


def _resave_at_tp2_pp2_vp2(root: str, cfg_yaml: str, load_from: str) -> None:
    from omegaconf import OmegaConf

    cfg = load_config(OmegaConf.create(cfg_yaml))
    layout = ParallelLayout(tensor=2, pipeline=2, virtual_pipeline=2)
    save_run(Path(root), cfg, layout, Path(load_from))


@pytest.mark.slow
def test_import_for_tp2_pp2_vp2_loads_there_and_that_checkpoint_exports(seeded, tmp_path):
    """An export imported for a TP=2 x PP=2 x VP=2 run loads at that layout; saved again
    there (four ranks), it exports bitwise identically, with logit parity."""
    cfg = run_config()
    save_run(tmp_path / "run", cfg)
    first = export_hf(tmp_path / "run", tmp_path / "hf", progress=silent)
    parallel = ["model.tensor_model_parallel_size=2", "model.pipeline_model_parallel_size=2"]
    parallel += ["model.virtual_pipeline_model_parallel_size=2", "trainer.devices=4"]
    config = import_hf(first, tmp_path / "imported", parallel, lns=True, progress=silent)
    imported = load_config(config)
    assert (
        imported.model.tensor_model_parallel_size,
        imported.model.pipeline_model_parallel_size,
    ) == (2, 2)
    run_distributed(
        _resave_at_tp2_pp2_vp2,
        4,
        tmp_path,
        str(tmp_path / "resaved"),
        to_yaml(imported),
        str(tmp_path / "imported" / "checkpoints" / "iter_0000000"),
    )
    resaved = tmp_path / "resaved" / "checkpoints" / "iter_0000001"
    second = export_hf(resaved, tmp_path / "hf2", progress=silent)
    assert_same_files(first, second)
    assert_parity(resaved, imported, second)


def assert_same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize(
    "model",
    [dict(), dict(normalization="layernorm", norm_affine=False), dict(kv_channels=24)],
    ids=["llama", "olmo", "llama-kv-channels"],
)
def test_export_import_export_is_bitwise_identical(seeded, tmp_path, model):
    cfg = run_config(**model)
    save_run(tmp_path / "run", cfg)
    first, imported = export_then_import(tmp_path / "run", tmp_path)
    assert imported.model.kv_channels == (cfg.model.kv_channels or 16)
    second = export_hf(tmp_path / "imported", tmp_path / "hf2", progress=silent)
    assert_same_files(first, second)


def test_exported_and_imported_files_are_readable_as_the_umask_allows(seeded, tmp_path):
    """safetensors writes its files 0600; a published model gets what ``open()`` would give."""
    import stat

    save_run(tmp_path / "run", run_config())
    umask = os.umask(0o022)
    try:
        exported = export_hf(tmp_path / "run", tmp_path / "hf", progress=silent)
        imported = import_hf(exported, tmp_path / "imported", lns=True, progress=silent).parent
    finally:
        os.umask(umask)
    modes = {
        str(path.relative_to(tmp_path)): oct(stat.S_IMODE(path.stat().st_mode))
        for out in (exported, imported)
        for path in out.rglob("*")
        if path.is_file()
    }
    assert "hf/model.safetensors" in modes
    assert {path: mode for path, mode in modes.items() if mode != "0o644"} == {}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_import_of_an_export_restores_the_trained_vocabulary_padding_rows(seeded, tmp_path, tied):
    """The export keeps megatron's padding rows (257 -> 384) apart; imported back, they are
    the run's, not zeros, so the imported model's softmax over the padded vocabulary (the
    run's loss) is the run's (issue 32: the loss of an analysed export was 0.03 off)."""
    from megatron_lns.convert.checkpoint_reader import CheckpointReader
    from megatron_lns.convert.hf_export import PADDING_FILE
    from megatron_lns.convert.mapping import EMBEDDING, OUTPUT_LAYER

    cfg = run_config(share_embeddings_and_output_weights=tied)
    original = save_run(tmp_path / "run", cfg)
    hf = export_hf(tmp_path / "run", tmp_path / "hf", progress=silent)
    assert (hf / PADDING_FILE).is_file() and not list(hf.glob("vocab_padding*.safetensors"))
    import_hf(hf, tmp_path / "imported", lns=True, progress=silent)
    imported = tmp_path / "imported" / "checkpoints" / "iter_0000000"
    keys = [EMBEDDING] if tied else [EMBEDDING, OUTPUT_LAYER]
    for key in keys:
        want = CheckpointReader(original).read_rows(key, 384)
        got = CheckpointReader(imported).read_rows(key, 384)
        assert want[VOCAB:].abs().sum() > 0
        assert torch.equal(got, want), key


def test_export_shards_with_an_index_of_exactly_the_written_tensors(seeded, tmp_path):
    from safetensors import safe_open

    save_run(tmp_path / "run", run_config())
    out = export_hf(tmp_path / "run", tmp_path / "hf", max_shard_bytes=200_000, progress=silent)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    stored = {}
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as f:
            stored |= dict.fromkeys(f.keys(), shard)
    assert stored == index["weight_map"]
    single = export_hf(tmp_path / "run", tmp_path / "hf1", progress=silent)
    assert (single / "model.safetensors").is_file()
    one = safetensors_tensors(single)
    many = safetensors_tensors(out)
    assert one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)


def _tiny_hf_llama(path: Path, tied: bool = False, head_dim: int | None = None) -> Path:
    """A random LlamaForCausalLM saved with stock transformers, with the byte tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_lns.convert.hf_tokenizer import byte_tokenizer_fast

    torch.manual_seed(0)
    config = LlamaConfig(
        **HF_TINY,
        intermediate_size=96,
        num_hidden_layers=3,
        rope_theta=50000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        head_dim=head_dim,
    )
    model = LlamaForCausalLM(config)
    perturb(model)
    model.save_pretrained(path)
    byte_tokenizer_fast().save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("tied", "head_dim"),
    [(False, None), (True, None), (False, 24)],
    ids=["untied", "tied", "head-dim-24"],
)
def test_hf_model_import_export_is_bitwise_identical(seeded, tmp_path, tied, head_dim):
    source = _tiny_hf_llama(tmp_path / "source", tied, head_dim)
    config = import_hf(source, tmp_path / "imported", progress=silent)
    cfg = load_config(config)
    assert cfg.model.norm_scaling == "none" and cfg.model.rotary_base == 50000
    assert cfg.model.num_query_groups == 2 and cfg.model.layernorm_epsilon == 1e-6
    assert cfg.model.kv_channels == (head_dim or 16)
    checkpoint = tmp_path / "imported" / "checkpoints" / "iter_0000000"
    assert_parity(checkpoint, cfg, source)
    out = export_hf(tmp_path / "imported", tmp_path / "hf", progress=silent)
    original, exported = safetensors_tensors(source), safetensors_tensors(out)
    assert original.keys() == exported.keys()
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_exported_tokenizer_gives_training_ids_and_generate_runs(seeded, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_lns.data.demo_corpus import demo_documents

    save_run(tmp_path / "run", run_config())
    out = export_hf(tmp_path / "run", tmp_path / "hf", progress=silent)
    tokenizer = AutoTokenizer.from_pretrained(out)
    training = ByteTokenizer()
    documents = demo_documents()
    encoded = tokenizer(documents)["input_ids"]
    assert encoded == [training.encode(doc) for doc in documents]
    assert tokenizer.eos_token_id == training.eod
    assert tokenizer.decode(encoded[0]) == documents[0]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    prompt = tokenizer("The assert statement", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert generated.shape == (1, prompt["input_ids"].shape[1] + 6)
    assert int(generated.max()) < VOCAB


def test_sentencepiece_tokenizer_is_exported_with_training_ids_and_generate_runs(
    seeded, tmp_path, factory
):
    """SentencePiece: the export carries a tokenizer.json that gives the training ids,
    generate runs on it and decodes back to the prompt; --no-tokenizer exports the
    weights alone. (More models and texts: test_hf_tokenizer_sentencepiece.py.)"""
    import sentencepiece
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_lns.data.demo_corpus import demo_documents

    documents = demo_documents()[:400]  # among the model's training documents
    sp_model = str(factory.sentencepiece("llama"))  # BPE, byte fallback, no normalization
    cfg = run_config(tokenizer={"library": "sentencepiece", "model": sp_model})
    processor = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    model = build_model(model_config(cfg, processor.get_piece_size()))
    path = tmp_path / "run" / "checkpoints" / "iter_0000001"
    save_model_weights(model, path)
    (path / "config.yaml").write_text(to_yaml(cfg))
    (path / "complete.json").write_text("{}")
    out = export_hf(path, tmp_path / "hf", progress=silent)
    assert (out / "tokenizer.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer(documents)["input_ids"] == [processor.encode(doc) for doc in documents]
    assert tokenizer.eos_token_id == processor.eos_id()
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    prompt = "The assert statement"
    inputs = tokenizer(prompt, return_tensors="pt")
    generated = exported.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert generated.shape == (1, inputs["input_ids"].shape[1] + 6)
    assert tokenizer.decode(generated[0], skip_special_tokens=True).startswith(prompt)
    out = export_hf(path, tmp_path / "weights", progress=silent, tokenizer=False)
    assert not list(out.glob("tokenizer*"))
    config = json.loads((out / "config.json").read_text())
    vocab = processor.get_piece_size()  # the SentencePiece model's, unpadded
    assert (config["vocab_size"], config["eos_token_id"]) == (vocab, processor.eos_id())


def test_imported_weights_only_checkpoint_resumes_with_a_fresh_optimizer(seeded, tmp_path):
    from helpers import fixed_microbatches

    from megatron_lns.training.build import wrap_with_ddp
    from megatron_lns.training.checkpoint import latest_complete_checkpoint, load_checkpoint
    from megatron_lns.training.optim import OptimSettings, build_optimizer_and_scheduler
    from megatron_lns.training.step import train_step

    source = _tiny_hf_llama(tmp_path / "source")
    base = tmp_path / "base.yaml"  # non-architecture settings come from the user's base
    base.write_text("model:\n  optim:\n    lr: 0.01\n")
    cfg = load_config(import_hf(source, tmp_path / "imported", base_config=base, progress=silent))
    assert cfg.model.optim.lr == 0.01
    model = wrap_with_ddp(build_model(model_config(cfg, VOCAB)))
    optimizer, scheduler = build_optimizer_and_scheduler(model, OptimSettings(warmup_steps=1), 10)
    checkpoint = latest_complete_checkpoint(tmp_path / "imported" / "checkpoints")
    state = load_checkpoint(checkpoint, model, optimizer, scheduler)
    assert (state.iteration, state.consumed_samples) == (0, 0)
    embedding = model[0].module.embedding.word_embeddings.weight
    assert torch.equal(embedding[:VOCAB], safetensors_tensors(source)["model.embed_tokens.weight"])
    assert not embedding[VOCAB:].any()  # vocabulary padding
    result = train_step(model, optimizer, fixed_microbatches(VOCAB, SEQ))
    assert torch.isfinite(torch.tensor(result.loss))


@pytest.mark.long
@pytest.mark.slow
def test_cli_import_then_train_resumes_from_the_import(tmp_path):
    import subprocess
    import sys

    from helpers import fresh_launch_env

    source = _tiny_hf_llama(tmp_path / "source")
    env = fresh_launch_env(MEGATRON_LNS_CACHE=str(tmp_path / "cache"))
    cli = [sys.executable, "-m", "megatron_lns.cli"]
    out = tmp_path / "run"
    subprocess.run([*cli, "import-hf", str(source), str(out)], env=env, check=True)
    train = [*cli, "train", str(out / "config.yaml"), "model.data.data_prefix=[builtin:pydoc]"]
    train += ["trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1"]
    train += ["model.micro_batch_size=2", "model.global_batch_size=2", "model.data.num_workers=0"]
    done = subprocess.run(train, env=env, check=True, capture_output=True, text=True)
    assert f"resumed from {out / 'checkpoints' / 'iter_0000000'} (step 0)" in done.stdout
    assert (out / "checkpoints" / "iter_0000002" / "complete.json").is_file()


# ----------------------------------------------------------------------------- bad inputs
def test_missing_and_incomplete_checkpoints_are_refused(seeded, tmp_path):
    out = tmp_path / "hf"
    with pytest.raises(ConversionError, match=r"checkpoint .*missing does not exist"):
        export_hf(tmp_path / "missing", out, progress=silent)
    checkpoint = save_run(tmp_path / "run", run_config())
    (checkpoint / "complete.json").unlink()
    with pytest.raises(ConversionError, match=r"iter_0000001 is not a complete checkpoint"):
        export_hf(checkpoint, out, progress=silent)
    with pytest.raises(ConversionError, match=r"no complete checkpoint .* in .*run"):
        export_hf(tmp_path / "run", out, progress=silent)
    assert_nothing_written(out)


def test_config_that_disagrees_with_the_checkpoint_is_refused(seeded, tmp_path):
    checkpoint = save_run(tmp_path / "run", run_config())
    (checkpoint / "config.yaml").write_text(to_yaml(run_config(ffn_hidden_size=128)))
    with pytest.raises(
        ConversionError,
        match=r"'decoder.layers.mlp.linear_fc1.weight' has shape \(4, 192, 64\), its config.yaml implies \(4, 256, 64\)",
    ):
        export_hf(checkpoint, tmp_path / "hf", progress=silent)
    (checkpoint / "config.yaml").write_text(to_yaml(run_config(bias=True)))
    with pytest.raises(
        ConversionError, match=r"no tensor 'decoder.layers.self_attention.linear_qkv.bias'"
    ):
        export_hf(checkpoint, tmp_path / "hf", progress=silent)
    assert_nothing_written(tmp_path / "hf")


def test_corrupt_checkpoint_fails_mid_export_and_leaves_nothing(seeded, tmp_path):
    checkpoint = save_run(tmp_path / "run", run_config())
    for shard in checkpoint.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ConversionError, match=r"could not read .* from checkpoint"):
        export_hf(checkpoint, tmp_path / "hf", progress=silent)
    assert_nothing_written(tmp_path / "hf")


def test_unexportable_settings_name_the_setting(seeded, tmp_path):
    cfg = run_config(activation="gelu")
    save_run(tmp_path / "run", cfg)
    with pytest.raises(ConversionError, match=r"model.activation=gelu cannot be exported"):
        export_hf(tmp_path / "run", tmp_path / "hf", progress=silent)
    with pytest.raises(
        ConversionError, match=r"model.normalization=layernorm with model.bias=true"
    ):
        architecture_for_model_config(run_config(normalization="layernorm", bias=True).model)
    with pytest.raises(ConversionError, match=r"model.qk_layernorm=true cannot be exported"):
        architecture_for_model_config(run_config(qk_layernorm=True).model)


@pytest.mark.parametrize(
    "arch", [arch for arch in ARCHITECTURES if not arch.moe], ids=lambda arch: arch.hf_class
)
def test_each_architecture_reads_back_the_config_json_it_writes(tmp_path, arch):
    """The config.json a dense architecture writes comes back through AutoConfig and the
    registry as the same architecture; export picks the first dense one with the model's
    norm (the MoE ones: tests/convert/test_convert_moe.py)."""
    model = run_config(normalization=arch.norm, rotary_base=50000).model
    first = next(o for o in ARCHITECTURES if o.norm == arch.norm and not o.moe)
    assert type(architecture_for_model_config(model)) is first
    assert_architecture_round_trips(arch, model, tmp_path)


def test_an_unknown_architecture_is_named_with_the_supported_ones():
    config = types.SimpleNamespace(architectures=["MistralForCausalLM"])
    with pytest.raises(
        ConversionError,
        match=r"^config.json: architectures=\['MistralForCausalLM'\] is not supported; import reads ",
    ) as refused:
        architecture_for_hf_config(config, lns=False)
    assert all(arch.hf_class in str(refused.value) for arch in ARCHITECTURES)


def test_import_hf_help_names_every_architecture_import_reads(capsys):
    """``import-hf --help`` named Llama and StableLM only; it names the registry's classes."""
    from megatron_lns.cli import main
    from megatron_lns.commands.import_hf import HF_CLASSES

    assert tuple(arch.hf_class for arch in ARCHITECTURES) == HF_CLASSES
    with pytest.raises(SystemExit):
        main(["import-hf", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert f"a local {' / '.join(HF_CLASSES)} directory" in shown


def test_stablelm_refuses_a_head_size_other_than_hidden_over_heads(seeded, tmp_path):
    """StableLM's attention always has hidden_size / heads channels per head."""
    stablelm = dict(normalization="layernorm", norm_affine=False)
    cfg = run_config(kv_channels=24, **stablelm)
    save_run(tmp_path / "run", cfg)
    with pytest.raises(
        ConversionError,
        match=r"^model.kv_channels=24 cannot be exported with model.normalization=layernorm: "
        r"StableLM's attention has hidden_size / num_attention_heads channels per head",
    ):
        export_hf(tmp_path / "run", tmp_path / "hf", progress=silent)
    assert_nothing_written(tmp_path / "hf")
    # kv_channels equal to hidden / heads is the same model, and exports.
    save_run(tmp_path / "same", run_config(kv_channels=16, **stablelm))
    source = export_hf(tmp_path / "same", tmp_path / "stablelm", progress=silent)
    import_refuses_edited_config(
        source,
        {"head_dim": 24},
        r"config.json: head_dim=24 x num_attention_heads=4 != hidden_size=64: StableLM",
    )


def test_truncated_safetensors_is_refused_and_nothing_written(seeded, tmp_path):
    source = _tiny_hf_llama(tmp_path / "source")
    weights = source / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(
        ConversionError, match=r"model.safetensors is not a readable safetensors file"
    ):
        import_hf(source, tmp_path / "imported", progress=silent)
    assert_nothing_written(tmp_path / "imported")


def test_missing_shard_and_index_listing_absent_tensors_are_refused(seeded, tmp_path):
    save_run(tmp_path / "run", run_config())
    source = export_hf(tmp_path / "run", tmp_path / "hf", max_shard_bytes=200_000, progress=silent)
    index_path = source / "model.safetensors.index.json"
    original = index_path.read_text()
    index = json.loads(original)
    first, second = sorted(set(index["weight_map"].values()))[:2]
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = first
    index_path.write_text(json.dumps(index))
    with pytest.raises(
        ConversionError, match=rf"{first} lacks model.layers.9.mlp.up_proj.weight which the index"
    ):
        import_hf(source, tmp_path / "imported", progress=silent)
    index_path.write_text(original)
    (source / second).unlink()
    with pytest.raises(ConversionError, match=rf"safetensors file .*{second} is missing"):
        import_hf(source, tmp_path / "imported", progress=silent)
    assert_nothing_written(tmp_path / "imported")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"intermediate_size": 128},
            r"tensor 'model.layers.0.mlp.gate_proj.weight' has shape \(96, 64\), config.json implies \(128, 64\)",
        ),
        (
            {"architectures": ["MistralForCausalLM"]},
            r"architectures=\['MistralForCausalLM'\] is not supported",
        ),
    ],
    ids=["shape-mismatch-names-the-tensor", "unknown-architecture"],
)
def test_an_edited_llama_config_json_is_refused(seeded, tmp_path, changes, message):
    import_refuses_edited_config(_tiny_hf_llama(tmp_path / "source"), changes, message)


def test_import_refuses_settings_that_conflict_with_the_config_json(seeded, tmp_path):
    source = _tiny_hf_llama(tmp_path / "source")
    with pytest.raises(
        ConversionError, match=r"model.num_layers=8 conflicts with .*config.json, which gives 3"
    ):
        import_hf(source, tmp_path / "imported", ["model.num_layers=8"], progress=silent)
    with pytest.raises(ConversionError, match=r"model.kv_channels=32 conflicts with .*gives 16"):
        import_hf(source, tmp_path / "imported", ["model.kv_channels=32"], progress=silent)
    with pytest.raises(ConversionError, match=r"--lns says .* model.norm_scaling=none"):
        import_hf(
            source, tmp_path / "imported", ["model.norm_scaling=none"], lns=True, progress=silent
        )
    with pytest.raises(
        ConversionError, match=r"world size 1 .* not divisible by tensor x pipeline"
    ):
        import_hf(
            source, tmp_path / "imported", ["model.tensor_model_parallel_size=2"], progress=silent
        )
    base = tmp_path / "base.yaml"
    base.write_text("model:\n  hidden_size: 128\n  optim:\n    lr: 0.01\n")
    with pytest.raises(ConversionError, match=r"model.hidden_size=128 conflicts with .*gives 64"):
        import_hf(source, tmp_path / "imported", base_config=base, progress=silent)


def test_a_null_that_means_the_config_jsons_value_is_no_conflict(seeded, tmp_path):
    source = _tiny_hf_llama(tmp_path / "source")  # 4 heads of 16 channels, 2 KV groups
    config_path = import_hf(
        source, tmp_path / "imported", ["model.kv_channels=null"], progress=silent
    )
    assert load_config(config_path).model.kv_channels is None
    # null query groups would mean one per head (4), not config.json's 2.
    with pytest.raises(
        ConversionError, match=r"model.num_query_groups=None conflicts with .*gives 2"
    ):
        import_hf(source, tmp_path / "other", ["model.num_query_groups=null"], progress=silent)


def test_existing_output_is_kept_unless_overwrite(seeded, tmp_path):
    save_run(tmp_path / "run", run_config())
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(
        ConversionError, match=r"output directory .*hf is not empty; pass --overwrite"
    ):
        export_hf(tmp_path / "run", out, progress=silent)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    export_hf(tmp_path / "run", out, overwrite=True, progress=silent)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".hf.*"))
    with pytest.raises(ConversionError, match=r"output directory .*run contains the input"):
        export_hf(tmp_path / "run", tmp_path / "run", overwrite=True, progress=silent)
    assert (tmp_path / "run" / "checkpoints" / "iter_0000001" / "complete.json").is_file()


def test_cli_reports_conversion_errors_in_one_line(seeded, tmp_path, capsys):
    from megatron_lns.cli import main

    assert main(["export-hf", str(tmp_path / "missing"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: checkpoint {tmp_path / 'missing'} does not exist"
    assert main(["import-hf", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_import_base_config_may_be_a_run_directory(tmp_path):
    """import-hf --config takes the sources every command takes: a run directory's
    config.yaml is its base."""
    from megatron_lns.convert.hf_import import _read_base_config

    (tmp_path / "config.yaml").write_text("trainer:\n  max_steps: 7\n")
    assert _read_base_config(tmp_path).trainer.max_steps == 7
    assert _read_base_config(tmp_path / "config.yaml").trainer.max_steps == 7


def test_an_unwritable_output_directory_is_one_line_for_export_and_import(seeded, tmp_path, capsys):
    """Both ended in a PermissionError / read-only file system traceback."""
    from helpers import read_only

    from megatron_lns.cli import main

    save_run(tmp_path / "run", run_config())
    hf = tmp_path / "hf"
    assert main(["export-hf", str(tmp_path / "run"), str(hf)]) == 0
    locked = tmp_path / "locked"
    locked.mkdir()
    capsys.readouterr()
    with read_only(locked):
        assert main(["export-hf", str(tmp_path / "run"), str(locked / "hf")]) == 2
        assert main(["import-hf", str(hf), str(locked / "run")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert [line for line in lines if line.startswith("error")] == [
        f"error: cannot write {locked / name}: "
        + ("read-only file system" if os.geteuid() == 0 else "permission denied")
        + f"; no {locked / name} written"
        for name in ("hf", "run")
    ], lines
    assert list(locked.iterdir()) == []


def test_export_of_a_run_whose_newest_checkpoint_lost_a_file_names_it(seeded, tmp_path):
    checkpoint = save_run(tmp_path / "run", run_config())
    (checkpoint / ".metadata").unlink()
    with pytest.raises(
        ConversionError, match=r"iter_0000001 is not a complete checkpoint: it is damaged: "
    ):
        export_hf(tmp_path / "run", tmp_path / "hf", progress=silent)


def test_export_and_import_onto_a_full_disk_are_one_line_and_write_nothing(seeded, tmp_path):
    """Each conversion writes half of what it needs, then stops with one line naming its
    OUT_DIR; the staging directory is gone (its space given back), OUT_DIR as it was."""
    from helpers import directory_bytes, small_filesystem

    from megatron_lns.base.disk import DiskFullError

    save_run(tmp_path / "run", run_config())
    exported = export_hf(tmp_path / "run", tmp_path / "hf", progress=silent)
    imported = import_hf(exported, tmp_path / "imported", progress=silent).parent
    for convert, needed in (
        (lambda out, **kw: export_hf(tmp_path / "run", out, progress=silent, **kw), exported),
        (lambda out, **kw: import_hf(exported, out, progress=silent, **kw), imported),
    ):
        size_kib = directory_bytes(needed) // 2048
        with small_filesystem(tmp_path / "disk", size_kib) as disk:
            with pytest.raises(DiskFullError) as info:
                convert(disk / "out")
            assert str(info.value).startswith(f"cannot write {disk / 'out'}: no space left on")
            assert str(info.value).endswith(f"; no {disk / 'out'} written")
            assert_nothing_written(disk / "out")
            (disk / "out").mkdir()
            (disk / "out" / "kept").write_text("an earlier export\n")
            with pytest.raises(DiskFullError, match="left as it was"):
                convert(disk / "out", overwrite=True)
            assert [p.name for p in disk.iterdir()] == ["out"]
            assert (disk / "out" / "kept").read_text() == "an earlier export\n"
