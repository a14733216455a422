"""NeMo-style config: loading, overrides, validation errors, dry run, round trip."""

import dataclasses
import subprocess
import sys
import warnings

import pytest
from helpers import FIXTURES, ROOT, bundled_config_inputs, fresh_launch_env, read_only
from omegaconf import OmegaConf

from megatron_lns.config import ConfigError, load_config, to_yaml, validate
from megatron_lns.config.loader import SCHEMA_PATHS, NemoKeysIgnoredWarning, override_key
from megatron_lns.config.nemo_compat import NEMO_KEYS, Inert, nemo_rule
from megatron_lns.config.schema import ExperimentConfig
from megatron_lns.config.settings import declaration

DEMO = ROOT / "nemo_configs" / "tiny_cpu_demo.yaml"
NEMO = FIXTURES / "nemo_megatron_gpt_config.yaml"


def _load(*overrides, source=DEMO):
    return load_config(source, list(overrides))


def _invalid(*overrides, world_size=None):
    cfg = _load(*overrides)
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_demo_config_loads_and_validates():
    cfg = _load()
    validate(cfg)
    assert cfg.model.num_layers == 16
    assert cfg.model.max_position_embeddings == 128  # ${.encoder_seq_length}
    assert cfg.model.data.seq_length == 128  # ${model.encoder_seq_length}


def test_unknown_key_is_an_error_with_did_you_mean():
    raw = OmegaConf.load(DEMO)
    raw.model.num_layer = 3
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'model.num_layer' \(did you mean 'model.num_layers'\?\)",
    ):
        load_config(raw)


def test_unknown_section_is_an_error():
    raw = OmegaConf.load(DEMO)
    raw.modle = {"x": 1}
    with pytest.raises(ConfigError, match="unknown config key 'modle'"):
        load_config(raw)


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"model\.num_layers"):
        _load("model.num_layers=many")


def test_missing_mandatory_value_names_the_key():
    raw = OmegaConf.load(DEMO)
    raw.model.data.data_prefix = "???"
    with pytest.raises(ConfigError, match=r"'model.data.data_prefix' is required"):
        load_config(raw)


def test_overrides_set_add_and_delete():
    cfg = _load("model.num_layers=8", "trainer.max_steps=50", "model.optim.betas=[0.8,0.9]")
    assert (cfg.model.num_layers, cfg.trainer.max_steps, cfg.model.optim.betas) == (
        8,
        50,
        [0.8, 0.9],
    )
    # Interpolations follow overrides.
    assert _load("model.encoder_seq_length=64").model.data.seq_length == 64
    # '+' adds a key absent from the YAML (here a schema key with a default).
    assert _load("+model.rotary_base=500000").model.rotary_base == 500000
    # '~' deletes a YAML key, leaving the schema default.
    assert _load("~model.ffn_hidden_size").model.ffn_hidden_size is None


def test_delete_with_a_value_deletes_only_a_key_of_that_value():
    """Hydra's ~key=value: the key goes only when the value is its own, else it refuses."""
    assert _load("~model.hidden_size=128").model.hidden_size == 768  # the schema default
    with pytest.raises(ConfigError) as info:
        _load("~model.hidden_size=999")
    assert str(info.value).startswith(
        "override '~model.hidden_size=999': model.hidden_size is 128, not 999"
    )


def test_double_plus_sets_a_key_whether_or_not_the_yaml_has_it():
    """Hydra's ++key=value, which NeMo's examples use: it read as a key named '+trainer'."""
    cfg = _load("++trainer.max_steps=50", "++model.rotary_base=500000")
    assert (cfg.trainer.max_steps, cfg.model.rotary_base) == (50, 500000)
    with pytest.raises(ConfigError, match=r"unknown config key 'model\.foo'"):
        _load("++model.foo=1")
    with pytest.raises(ConfigError, match=r"^override '\+\+model.num_layers' is not key=value"):
        _load("++model.num_layers")


def test_override_key_is_the_key_whatever_the_prefix():
    keys = ["a.b=1", "+a.b=1", "++a.b=1", "~a.b", "~a.b=1", " a.b =1"]
    assert {override_key(o) for o in keys} == {"a.b"}


def test_a_required_key_left_unset_can_be_deleted():
    """OmegaConf's `in` does not see a ??? value: '~' said there was no such key."""
    raw = OmegaConf.load(DEMO)
    raw.model.tokenizer.model = "???"
    assert load_config(raw, ["~model.tokenizer.model"]).model.tokenizer.model is None


def test_override_of_unknown_key_says_how_to_add():
    with pytest.raises(
        ConfigError,
        match=r"no key 'model.num_layer'.*did you mean 'model.num_layers'.*\+model.num_layer",
    ):
        _load("model.num_layer=3")
    with pytest.raises(ConfigError, match=r"unknown config key 'model\.foo'"):
        _load("+model.foo=1")
    with pytest.raises(ConfigError, match="not key=value"):
        _load("model.num_layers")


def test_a_nemo_key_is_suggested_as_an_override_would_take_it():
    """A suggested NeMo key absent from the config was named bare, which a plain
    override refuses as 'no key': it is named with the '+' that adds it."""
    with pytest.raises(ConfigError, match=r"did you mean '\+model.megatron_amp_O2'\?"):
        _load("model.megatron_amp_o2=true")
    raw = OmegaConf.load(DEMO)
    raw.model.megatron_amp_O2 = False
    with pytest.raises(ConfigError, match=r"did you mean 'model.megatron_amp_O2'\?"):
        load_config(raw, ["model.megatron_amp_o2=true"])


@pytest.mark.parametrize(
    ("overrides", "world_size", "expected"),
    [
        (
            [
                "model.num_attention_heads=6",
                "model.hidden_size=132",
                "model.tensor_model_parallel_size=4",
                "trainer.devices=4",
            ],
            None,
            "model.num_attention_heads (6) is not divisible by model.tensor_model_parallel_size (4)",
        ),
        (
            ["model.hidden_size=130"],
            None,
            "model.hidden_size (130) is not divisible by model.num_attention_heads (4)",
        ),
        (
            ["model.num_query_groups=3"],
            None,
            "model.num_attention_heads (4) is not divisible by model.num_query_groups (3)",
        ),
        (
            ["model.kv_channels=15"],
            None,
            "model.kv_channels=15 is odd: model.position_embedding_type=rope rotates pairs",
        ),
        (
            ["model.hidden_size=72", "model.num_attention_heads=8"],
            None,
            "the head size hidden_size / num_attention_heads = 9 is odd",
        ),
        (
            [
                "model.pipeline_model_parallel_size=3",
                "trainer.devices=3",
                "model.global_batch_size=12",
            ],
            None,
            "model.num_layers (16) is not divisible by model.pipeline_model_parallel_size x virtual_pipeline_model_parallel_size (3 x 1)",
        ),
        (
            [
                "model.pipeline_model_parallel_size=2",
                "model.virtual_pipeline_model_parallel_size=3",
                "trainer.devices=2",
            ],
            None,
            "model.num_layers (16) is not divisible by model.pipeline_model_parallel_size x virtual_pipeline_model_parallel_size (2 x 3)",
        ),
        (
            ["model.virtual_pipeline_model_parallel_size=2"],
            None,
            "needs model.pipeline_model_parallel_size > 1",
        ),
        (
            [
                "model.pipeline_model_parallel_size=2",
                "model.virtual_pipeline_model_parallel_size=2",
                "model.micro_batch_size=2",
                "model.global_batch_size=6",
                "trainer.devices=2",
            ],
            None,
            "model.global_batch_size / (model.micro_batch_size x data-parallel size) = 3 "
            "micro-batches per step is not a multiple of model.pipeline_model_parallel_size (2)",
        ),
        (
            ["model.global_batch_size=10"],
            2,
            "model.global_batch_size (10) is not divisible by model.micro_batch_size x data-parallel size (4 x 2)",
        ),
        (
            ["model.tensor_model_parallel_size=2"],
            3,
            "world size 3 (trainer.num_nodes x trainer.devices) is not divisible by tensor x pipeline x context parallel size (2 x 1 x 1)",
        ),
        (
            ["model.sequence_parallel=true"],
            None,
            "model.sequence_parallel needs model.tensor_model_parallel_size > 1",
        ),
        (
            ["model.data.seq_length=64"],
            None,
            "model.data.seq_length (64) differs from model.encoder_seq_length (128)",
        ),
        (
            ["model.norm_scaling=LNS"],
            None,
            "model.norm_scaling='LNS' is not one of ['lns', 'none']",
        ),
        (["trainer.precision=fp8"], None, "trainer.precision='fp8' is not one of"),
        (["model.fp8=delayed"], None, "model.fp8 needs model.transformer_engine=true"),
        (
            ["model.layer_variant=post_ln"],
            None,
            "model.norm_scaling=lns scales pre-norm outputs and model.layer_variant=post_ln has",
        ),
        (
            ["model.layer_variant=sandwich"],
            None,
            "model.layer_variant='sandwich' is not one of",
        ),
        (
            [
                "model.layer_variant=mix_ln",
                "model.norm_scaling=none",
                "model.mix_ln_post_fraction=2",
            ],
            None,
            "model.mix_ln_post_fraction",
        ),
        (
            ["model.layer_variant=skipinit", "model.transformer_engine=true"],
            None,
            "model.layer_variant=skipinit needs model.transformer_engine=false",
        ),
        (
            ["model.optim.sched.warmup_steps=300"],
            None,
            "model.optim.sched.warmup_steps + constant_steps (300 + 0) must be smaller than trainer.max_steps (300)",
        ),
        (
            ["model.data.data_prefix=[/nonexistent/corpus]"],
            None,
            "model.data.data_prefix: /nonexistent/corpus.bin does not exist",
        ),
        (
            ["model.data.data_prefix=[0.5,a,b]"],
            None,
            "model.data.data_prefix must be [path, ...] or [weight, path, weight, path, ...]",
        ),
        (
            ["model.tokenizer.library=huggingface"],
            None,
            "model.tokenizer.type must be the local directory",
        ),
        (
            ["model.tokenizer.library=huggingface", "model.tokenizer.type=/no/such/dir"],
            None,
            "model.tokenizer.type: /no/such/dir does not exist",
        ),
    ],
)
def test_validation_errors_name_the_key(overrides, world_size, expected):
    assert expected in _invalid(*overrides, world_size=world_size)


def test_kv_channels_sets_the_head_size_apart_from_hidden_size():
    """A head size other than hidden / heads (Gemma-style) reaches the megatron config, and
    hidden_size then need not divide by the heads."""
    from megatron_lns.training.build import model_config

    cfg = _load("model.hidden_size=130", "model.kv_channels=48")
    validate(cfg, check_files=False)
    tf = model_config(cfg, tokenizer_vocab_size=257).transformer_config()
    assert (tf.kv_channels, tf.hidden_size, tf.num_attention_heads) == (48, 130, 4)
    default = model_config(_load(), tokenizer_vocab_size=257).transformer_config()
    assert default.kv_channels == default.hidden_size // default.num_attention_heads
    # NeMo's key of the same name (its megatron_gpt_config.yaml sets it to null).
    assert _load_nemo()[0].model.kv_channels is None
    assert _load_nemo("model.kv_channels=128")[0].model.kv_channels == 128


def test_resolved_config_round_trips(tmp_path):
    cfg = _load("model.num_layers=8", "model.optim.lr=0.01")
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    again = load_config(path)
    assert again == cfg
    assert to_yaml(again) == to_yaml(cfg)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "megatron_lns.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=fresh_launch_env(),
    )


def test_dry_run_prints_resolved_config_and_exits():
    out = _cli("train", str(DEMO), "model.num_layers=6", "--dry-run")
    assert out.returncode == 0, out.stderr
    printed = OmegaConf.create(out.stdout.split("# resolved config\n", 1)[1])
    assert printed.model.num_layers == 6
    assert printed.model.data.seq_length == 128


def test_cli_reports_config_errors_in_one_line():
    out = _cli(
        "train",
        str(DEMO),
        "model.num_layers=5",
        "model.pipeline_model_parallel_size=2",
        "trainer.devices=2",
        "--dry-run",
    )
    assert out.returncode == 2
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .startswith("error: model.num_layers (5) is not divisible")
    )


@pytest.mark.parametrize(
    "path", sorted((ROOT / "nemo_configs").glob("*.yaml")), ids=lambda p: p.stem
)
def test_shipped_configs_load_and_validate(path):
    overrides = bundled_config_inputs(path)
    cfg = load_config(path, overrides)
    validate(cfg, check_files=False)
    assert cfg.model.norm_scaling == "lns"
    assert cfg.model.output_layer_init == "normal"  # same init for the Pre-LN override
    # The Pre-LN baseline is one override away.
    validate(load_config(path, [*overrides, "model.norm_scaling=none"]), check_files=False)


def test_paper_recipes_match_the_reference_table():
    expected = {  # hidden, layers, heads, ffn, lr, steps, warmup (REFERENCE.md)
        "llama_130m": (768, 12, 12, 2048, 1e-3, 20_000, 2_000),
        "llama_250m": (768, 24, 16, 2560, 1e-3, 40_000, 4_000),
        "llama_350m": (1024, 24, 16, 2736, 5e-4, 60_000, 6_000),
        "llama_1b": (2048, 24, 32, 5461, 5e-4, 100_000, 1_000),
    }
    for name, values in expected.items():
        cfg = load_config(
            ROOT / "nemo_configs" / f"{name}.yaml",
            ["model.data.data_prefix=[/d]", "model.tokenizer.model=/t"],
        )
        m = cfg.model
        assert (
            m.hidden_size,
            m.num_layers,
            m.num_attention_heads,
            m.ffn_hidden_size,
            m.optim.lr,
            cfg.trainer.max_steps,
            m.optim.sched.warmup_steps,
        ) == values
        assert (m.encoder_seq_length, m.global_batch_size, m.optim.weight_decay) == (256, 512, 0.0)
        assert m.optim.sched.min_lr == pytest.approx(m.optim.lr / 10)
        assert cfg.trainer.gradient_clip_val == 0.0 and cfg.trainer.precision == "bf16-mixed"


def test_every_schema_key_is_documented():
    from megatron_lns.config.loader import SCHEMA_PATHS

    doc = (ROOT / "docs" / "configuration.md").read_text()
    defaults = OmegaConf.structured(
        __import__("megatron_lns.config.schema", fromlist=["x"]).ExperimentConfig
    )
    leaves = [
        p
        for p, free in SCHEMA_PATHS.items()
        if free or not OmegaConf.is_dict(OmegaConf.select(defaults, p))
    ]
    missing = [p for p in leaves if f"`{p}`" not in doc]
    assert not missing, missing


# --- Declared value rules: each bad value fails before training, naming its key ---


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trainer.num_nodes=0", "trainer.num_nodes must be positive, got 0"),
        ("trainer.devices=-1", "trainer.devices must be positive, got -1"),
        ("trainer.max_steps=0", "trainer.max_steps must be positive, got 0"),
        ("trainer.val_check_interval=0", "trainer.val_check_interval must be positive"),
        ("trainer.log_every_n_steps=0", "trainer.log_every_n_steps must be positive"),
        ("trainer.limit_val_batches=-1", "trainer.limit_val_batches must be >= 0, got -1"),
        ("trainer.gradient_clip_val=-0.5", "trainer.gradient_clip_val must be >= 0, got -0.5"),
        ("trainer.exit_interval=0", "trainer.exit_interval must be positive, got 0"),
        ("trainer.accelerator=tpu", "trainer.accelerator='tpu' is not one of"),
        (
            "exp_manager.checkpoint_callback_params.every_n_train_steps=0",
            "exp_manager.checkpoint_callback_params.every_n_train_steps must be positive",
        ),
        ("exp_manager.name=' '", "exp_manager.name must be a non-empty name"),
        ("model.micro_batch_size=0", "model.micro_batch_size must be positive, got 0"),
        ("model.global_batch_size=-8", "model.global_batch_size must be positive, got -8"),
        ("model.num_layers=0", "model.num_layers must be positive, got 0"),
        ("model.hidden_size=0", "model.hidden_size must be positive, got 0"),
        ("model.ffn_hidden_size=-1", "model.ffn_hidden_size must be positive, got -1"),
        ("model.kv_channels=0", "model.kv_channels must be positive, got 0"),
        ("model.num_attention_heads=0", "model.num_attention_heads must be positive"),
        ("model.num_query_groups=0", "model.num_query_groups must be positive, got 0"),
        ("model.encoder_seq_length=0", "model.encoder_seq_length must be positive"),
        ("model.max_position_embeddings=0", "model.max_position_embeddings must be positive"),
        ("model.tensor_model_parallel_size=0", "model.tensor_model_parallel_size must be"),
        ("model.pipeline_model_parallel_size=0", "model.pipeline_model_parallel_size must be"),
        (
            "model.virtual_pipeline_model_parallel_size=0",
            "model.virtual_pipeline_model_parallel_size must be positive, got 0",
        ),
        ("model.hidden_dropout=1.0", "model.hidden_dropout must be a probability in [0, 1)"),
        ("model.attention_dropout=-0.1", "model.attention_dropout must be a probability in"),
        ("model.layernorm_epsilon=0", "model.layernorm_epsilon must be positive, got 0"),
        ("+model.rotary_base=0", "model.rotary_base must be positive, got 0"),
        ("model.init_method_std=0", "model.init_method_std must be positive, got 0"),
        ("+model.init_method_std=.nan", "model.init_method_std must be positive, got nan"),
        ("+model.make_vocab_size_divisible_by=0", "model.make_vocab_size_divisible_by must be"),
        ("model.seed=-1", "model.seed must be an integer in [0, 2**32), got -1"),
        ("model.seed=4294967296", "model.seed must be an integer in [0, 2**32)"),
        ("model.activation=relu", "model.activation='relu' is not one of"),
        ("model.position_embedding_type=alibi", "model.position_embedding_type='alibi' is not"),
        ("model.normalization=batchnorm", "model.normalization='batchnorm' is not one of"),
        ("model.output_layer_init=xavier", "model.output_layer_init='xavier' is not one of"),
        ("+model.fp8_margin=-1", "model.fp8_margin must be >= 0, got -1"),
        ("+model.fp8_amax_history_len=0", "model.fp8_amax_history_len must be positive"),
        ("model.tokenizer.library=tiktoken", "model.tokenizer.library='tiktoken' is not one"),
        ("model.optim.name=lion", "model.optim.name='lion' is not one of"),
        ("model.optim.lr=0", "model.optim.lr must be positive, got 0.0"),
        ("model.optim.lr=-1e-3", "model.optim.lr must be positive, got -0.001"),
        ("model.optim.betas=[0.9]", "model.optim.betas must be [beta1, beta2] with each in"),
        ("model.optim.betas=[0.9,0.95,0.99]", "model.optim.betas must be [beta1, beta2]"),
        ("model.optim.betas=[0.9,1.0]", "model.optim.betas must be [beta1, beta2] with each"),
        ("+model.optim.eps=0", "model.optim.eps must be positive, got 0.0"),
        ("model.optim.weight_decay=-0.1", "model.optim.weight_decay must be >= 0, got -0.1"),
        ("model.optim.sched.name=Noam", "model.optim.sched.name='Noam' is not one of"),
        ("model.optim.sched.min_lr=-1e-5", "model.optim.sched.min_lr must be >= 0"),
        ("model.optim.sched.warmup_steps=-1", "model.optim.sched.warmup_steps must be >= 0"),
        ("model.optim.sched.constant_steps=-1", "model.optim.sched.constant_steps must be >= 0"),
        ("model.data.num_workers=-1", "model.data.num_workers must be >= 0, got -1"),
        ("model.data.splits_string=99,1", "model.data.splits_string must be three comma-sep"),
        ("model.data.splits_string='0,0,0'", "model.data.splits_string must be three comma-s"),
        ("model.data.splits_string='9,-1,0'", "model.data.splits_string must be three comma-s"),
        ("model.data.splits_string=a,b,c", "model.data.splits_string must be three comma-sep"),
    ],
)
def test_bad_values_are_refused_naming_the_key(override, expected):
    assert expected in _invalid(override)


@pytest.mark.parametrize("split", ["949,50,1", "900, 50, 50", "1,0,0", "0.98,0.02,0"])
def test_split_strings_megatron_reads_are_accepted(split):
    validate(
        _load(f"model.data.splits_string='{split}'", "trainer.limit_val_batches=0"),
        check_files=False,
    )


def test_a_split_without_validation_data_is_refused_where_validation_is_asked_for():
    """megatron builds no validation split from a zero weight, and the run skipped its
    validation without a word."""
    assert _invalid("model.data.splits_string='1,0,0'", "trainer.limit_val_batches=8") == (
        "model.data.splits_string=1,0,0 leaves validation no data but "
        "trainer.limit_val_batches=8 asks for it: give the second (valid) weight a share, or "
        "set trainer.limit_val_batches=0 to train without validation"
    )


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model.num_layers=many", "'model.num_layers': Value 'many' of type 'str' could not"),
        ("model.num_layers=1.5", "'model.num_layers': Value '1.5' of type 'float' could not"),
        ("model.optim.lr=fast", "'model.optim.lr': Value 'fast' of type 'str' could not"),
        ("model.optim.betas=0.9", "'model.optim.betas'"),
        ("model.sequence_parallel=maybe", "'model.sequence_parallel'"),
    ],
)
def test_values_of_the_wrong_type_name_the_key(override, expected):
    with pytest.raises(ConfigError) as info:
        _load(override)
    assert expected in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("number", ["2", "0", "1.5"])
def test_a_number_for_a_boolean_key_is_refused_not_read_as_true_or_false(number):
    """OmegaConf read model.bias=2 as true; its string forms say what they mean."""
    with pytest.raises(ConfigError, match=rf"^'model.bias' must be true or false, got {number}$"):
        _load(f"model.bias={number}")
    assert _load("model.bias='false'").model.bias is False


def _fields(cls, prefix=""):
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from _fields(type(default), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, default


def test_every_number_and_choice_declares_its_rule():
    """The value rules live next to the fields: no number or NeMo vocabulary goes unchecked."""
    unchecked = [
        path
        for path, f, default in _fields(ExperimentConfig)
        if isinstance(default, (int, float))
        and not isinstance(default, bool)
        and declaration(f).check is None
    ]
    assert not unchecked, unchecked


# --- YAML syntax and command-line interpolations ---


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_steps: 10\nmodel:\n  optim: {lr: 1e-3\n  num_layers: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    message = str(info.value)
    assert message.startswith(f"config file {bad}: line 5, column ") and "\n" not in message
    assert "from line 4" in message
    dup = tmp_path / "dup.yaml"
    dup.write_text("model:\n  num_layers: 2\n  num_layers: 3\n")
    with pytest.raises(ConfigError, match=r"dup.yaml: line 3, column 3: found duplicate key"):
        load_config(dup)
    flat = tmp_path / "list.yaml"
    flat.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"list.yaml must be a mapping"):
        load_config(flat)
    text = tmp_path / "notes.txt"  # one plain scalar: OmegaConf made it a key
    text.write_text("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin\n")
    with pytest.raises(ConfigError, match=r"notes.txt must be a mapping"):
        load_config(text)


def test_yaml_values_python_cannot_read_are_one_line(tmp_path):
    """An integer of more digits than Python converts is refused, not a traceback; a
    value PyYAML alone reads as an (invalid) date is OmegaConf's string, checked as one."""
    digits = "9" * 5000
    big = tmp_path / "big.yaml"
    big.write_text(f"model:\n  hidden_size: {digits}\n")
    with pytest.raises(ConfigError, match=r"big.yaml: Exceeds the limit \(4300 digits\)"):
        load_config(big)
    with pytest.raises(ConfigError, match=r"^override of 'model.hidden_size': Exceeds the limit"):
        _load(f"model.hidden_size={digits}")
    date = tmp_path / "date.yaml"
    date.write_text("trainer:\n  max_steps: 2024-13-45\n")
    with pytest.raises(ConfigError, match=r"^'trainer.max_steps': Value '2024-13-45'"):
        load_config(date)


def test_interpolations_on_the_command_line():
    cfg = _load(
        "model.encoder_seq_length=64", "model.max_position_embeddings=${model.encoder_seq_length}"
    )
    assert cfg.model.max_position_embeddings == 64
    # Resolved against the final config: a later override still flows through.
    cfg = _load(
        "model.max_position_embeddings=${model.encoder_seq_length}", "model.encoder_seq_length=32"
    )
    assert cfg.model.max_position_embeddings == 32
    with pytest.raises(ConfigError) as info:
        _load("model.max_position_embeddings=${model.no_such_key}")
    assert str(info.value) == (
        "override 'model.max_position_embeddings=${model.no_such_key}': "
        "Interpolation key 'model.no_such_key' not found"
    )
    with pytest.raises(ConfigError, match=r"override 'model.optim.betas=\[0.9,'"):
        _load("model.optim.betas=[0.9,")


@pytest.mark.parametrize(
    "override, cut",
    [("cluster.account=acc #x", "'acc'"), ("cluster.qos=#x", "None"), ("name=a\t# b", "'a'")],
)
def test_an_override_that_yaml_would_cut_at_a_comment_is_refused(override, cut):
    """In a file a '#' comment is visible; on a command line it silently shortens the value."""
    with pytest.raises(ConfigError) as info:
        _load(override)
    message = str(info.value)
    assert message.startswith(f"override '{override}': YAML reads ' #' as the start of a comment")
    assert f"cuts the value to {cut}" in message and "\n" not in message


def test_a_hash_that_yaml_keeps_is_kept():
    assert _load("cluster.account='acc #x'").cluster.account == "acc #x"
    assert _load("cluster.account=acc#x").cluster.account == "acc#x"


# --- Paths the run writes ---


def _paths_error(tmp_path, *overrides):
    cfg = _load(*overrides)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_run_directory_that_cannot_be_created_is_refused(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    message = _paths_error(tmp_path, f"exp_manager.exp_dir={blocker}/runs")
    assert message.startswith("exp_manager.exp_dir / exp_manager.name: run directory")
    assert f"{blocker} is not a directory" in message


def test_checkpoint_directory_that_is_a_file_is_refused(tmp_path):
    run = tmp_path / "runs" / "lns"
    run.mkdir(parents=True)
    (run / "checkpoints").write_text("")
    message = _paths_error(tmp_path, f"exp_manager.exp_dir={tmp_path}/runs", "exp_manager.name=lns")
    assert message == (
        f"exp_manager.exp_dir: checkpoint directory {run}/checkpoints is not writable: "
        f"{run}/checkpoints is not a directory"
    )


def test_read_only_checkpoint_directory_is_refused(tmp_path):
    checkpoints = tmp_path / "runs" / "lns" / "checkpoints"
    checkpoints.mkdir(parents=True)
    with read_only(checkpoints):
        message = _paths_error(
            tmp_path, f"exp_manager.exp_dir={tmp_path}/runs", "exp_manager.name=lns"
        )
    assert message.startswith(f"exp_manager.exp_dir: checkpoint directory {checkpoints} is not")
    assert "Read-only file system" in message or "Permission denied" in message


def test_data_caches_that_cannot_be_written_are_refused(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    runs = f"exp_manager.exp_dir={tmp_path}/runs"
    message = _paths_error(tmp_path, runs, f"+model.data.index_mapping_dir={blocker}/idx")
    assert message.startswith(f"model.data.index_mapping_dir: {blocker}/idx is not writable")
    monkeypatch.setenv("MEGATRON_LNS_CACHE", str(blocker / "cache"))
    message = _paths_error(tmp_path, runs, "model.data.data_prefix=[builtin:pydoc]")
    assert message.startswith("model.data.data_prefix=builtin:pydoc is prepared in the cache")
    assert f"{blocker}/cache is not writable" in message
    monkeypatch.setenv("MEGATRON_LNS_CACHE", str(tmp_path / "cache"))
    validate(_load(runs, "model.data.data_prefix=[builtin:pydoc]"))
    assert not (tmp_path / "runs").exists()  # checking creates nothing


# --- Through the CLI: exit code 2, one line, no traceback ---


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["model.optim.betas=[0.9,1.0]"], "error: model.optim.betas must be [beta1, beta2]"),
        (
            ["model.max_position_embeddings=${model.nope}"],
            "error: override 'model.max_position_embeddings=${model.nope}': Interpolation key",
        ),
        (
            ["+model.context_parallel_size=2"],
            "error: model.context_parallel_size=2 needs model.transformer_engine=true",
        ),
    ],
)
def test_cli_bad_values_exit_2_with_one_line(args, expected):
    out = _cli("train", str(DEMO), *args, "--dry-run")
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(expected), out.stderr


@pytest.mark.slow
def test_cli_yaml_syntax_error_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  num_layers: [2\n")
    out = _cli("train", str(bad), "--dry-run")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"error: config file {bad}: line ")


# --- NeMo 1.x: NeMo's own megatron_gpt_config.yaml ---

NEMO_READY = [
    "model.data.data_prefix=[builtin:pydoc]",
    "model.tokenizer.library=byte",
    "model.tokenizer.type=null",
]


def _load_nemo(*overrides):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = load_config(NEMO, [*NEMO_READY, *overrides])
    return cfg, [str(w.message) for w in record if w.category is NemoKeysIgnoredWarning]


def test_nemo_megatron_gpt_config_loads_with_one_warning_of_inert_keys():
    cfg, messages = _load_nemo()
    assert len(messages) == 1
    listed = messages[0].split(": ", 1)[1].split(", ")
    assert all(isinstance(nemo_rule(key), Inert) for key in listed), listed
    for key in (
        "trainer.logger",
        "model.megatron_amp_O2",
        "model.data.skip_warmup",
    ):
        assert key in listed
    # Keys at the value megatron-lns runs anyway are accepted without a word.
    for key in (
        "model.transformer_block_type",
        "model.rotary_percentage",
        "model.context_parallel_size",
        "model.data.data_impl",
        "model.fp8_hybrid",
        # Honoured: megatron's timers (off in NeMo's YAML, its kwargs read).
        "model.enable_megatron_timers",
        "model.megatron_timer_kwargs",
        "model.megatron_timer_kwargs.log_mode",
    ):
        assert key not in listed
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.normalization, m.activation, m.bias) == (
        12,
        768,
        "layernorm",
        "gelu",
        True,
    )
    assert m.position_embedding_type == "learned_absolute" and m.share_embeddings_and_output_weights
    assert m.fp8 is None  # NeMo's fp8: False
    assert not m.enable_megatron_timers
    timer_kwargs = m.megatron_timer_kwargs
    assert (timer_kwargs.log_every_n_steps, timer_kwargs.log_mode) == (10, "minmax")
    assert m.output_layer_init == "scaled"  # use_scaled_init_method: True, honoured
    assert (m.optim.betas, m.optim.sched.constant_steps) == ([0.9, 0.98], 50000)
    assert m.data.splits_string == "900,50,50" and m.data.seq_length == 512
    validate(cfg, check_files=False)


def test_nemo_tokenizer_library_megatron_is_refused_by_validation():
    with pytest.warns(NemoKeysIgnoredWarning):
        cfg = load_config(NEMO, ["model.data.data_prefix=[x]"])
    with pytest.raises(ConfigError, match=r"model.tokenizer.library='megatron' is not one of"):
        validate(cfg, check_files=False)


def test_nemo_data_prefix_is_required():
    with pytest.raises(ConfigError, match=r"'model.data.data_prefix' is required but not set"):
        load_config(NEMO)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "model.transformer_block_type=post_ln",
            "model.transformer_block_type='post_ln' is not supported (blocks are pre-LN",
        ),
        (
            "model.transformer_block_type=normformer",
            "model.transformer_block_type='normformer' is not supported",
        ),
        (
            "model.rotary_percentage=0.5",
            "model.rotary_percentage=0.5 is not supported (RoPE rotates",
        ),
        (
            "model.resume_from_checkpoint=/ckpt/step100",
            "model.resume_from_checkpoint='/ckpt/step100' is not supported (NeMo's Lightning",
        ),
        (
            "restore_from_path=/models/gpt.nemo",
            "restore_from_path='/models/gpt.nemo' is not supported",
        ),
        ("model.mcore_gpt=false", "model.mcore_gpt=False is not supported"),
        ("model.headscale=true", "model.headscale=True is not supported"),
        ("model.openai_gelu=true", "model.openai_gelu=True is not supported"),
        (
            "model.normalize_attention_scores=false",
            "model.normalize_attention_scores=False is not supported",
        ),
        ("model.ffn_dropout=0.1", "model.ffn_dropout=0.1 is not supported"),
        (
            "model.num_micro_batches_with_partial_activation_checkpoints=2",
            "model.num_micro_batches_with_partial_activation_checkpoints=2 is not supported "
            "(megatron-core 0.19's pipeline schedules",
        ),
        ("model.fp8_interval=4", "model.fp8_interval=4 is not supported (FP8 scaling factors"),
        (
            "model.fp16_lm_cross_entropy=true",
            "model.fp16_lm_cross_entropy=True is not supported (megatron-core 0.19's GPTModel",
        ),
        ("model.fp8=true", "model.fp8=True: here model.fp8 names the FP8 recipe"),
        (
            "model.tokenizer.vocab_file=/t/vocab.json",
            "model.tokenizer.vocab_file='/t/vocab.json' is not supported",
        ),
        ("model.data.data_impl=mock", "model.data.data_impl='mock' is not supported"),
        (
            "model.data.dataloader_type=cyclic",
            "model.data.dataloader_type='cyclic' is not supported",
        ),
        (
            "model.data.no_seqlen_plus_one_input_tokens=true",
            "model.data.no_seqlen_plus_one_input_tokens=True is not supported",
        ),
        (
            "model.data.shuffle_documents=false",
            "model.data.shuffle_documents=False is not supported",
        ),
        (
            "model.data.pad_samples_to_global_batch_size=true",
            "model.data.pad_samples_to_global_batch_size=True is not supported",
        ),
        (
            "+model.optim.sched.max_steps=5000",
            "model.optim.sched.max_steps=5000 is not supported (the schedule spans trainer.max_steps)",
        ),
        ("trainer.max_epochs=0", "trainer.max_epochs=0 is not supported"),
        ("+trainer.max_time=00:04:00:00", "trainer.max_time='00:04:00:00' is not supported"),
        ("trainer.accumulate_grad_batches=4", "trainer.accumulate_grad_batches=4 is not supported"),
        (
            "exp_manager.explicit_log_dir=/logs",
            "exp_manager.explicit_log_dir='/logs' is not supported",
        ),
        (
            "exp_manager.create_checkpoint_callback=false",
            "exp_manager.create_checkpoint_callback=False is not supported",
        ),
        (
            "exp_manager.checkpoint_callback_params.always_save_nemo=true",
            "always_save_nemo=True is not supported",
        ),
        ("model.use_scaled_init_method=true", None),  # honoured (scaled init)
        (
            "+model.output_layer_init=normal",
            "model.use_scaled_init_method=True contradicts model.output_layer_init='normal'",
        ),
    ],
)
def test_nemo_keys_that_change_the_model_or_run_are_refused_by_name(override, expected):
    if expected is None:
        _load_nemo(override)
        return
    with pytest.raises(ConfigError) as info:
        _load_nemo(override)
    message = str(info.value)
    assert expected in message and "\n" not in message, message


def test_post_ln_blocks_are_refused_pointing_at_the_settings_that_build_them():
    """NeMo's post_ln was refused as 'blocks are pre-LN', though model.layer_variant=post_ln
    builds them: the refusal names it, and what it names loads and validates."""
    with pytest.raises(ConfigError) as info:
        _load_nemo("model.transformer_block_type=post_ln")
    named = "model.layer_variant=post_ln, which needs model.norm_scaling=none and "
    assert f"{named}model.transformer_engine=false;" in str(info.value)
    cfg, _ = _load_nemo(
        "model.layer_variant=post_ln", "model.norm_scaling=none", "model.transformer_engine=false"
    )
    validate(cfg, check_files=False)
    assert cfg.model.layer_variant == "post_ln"


def test_nemo_keys_depending_on_other_settings():
    _load_nemo("+model.optim.sched.max_steps=100000")  # = trainer.max_steps
    fp8 = ["model.fp8=delayed", "model.fp8_format=hybrid", "trainer.precision=bf16-mixed"]
    assert _load_nemo(*fp8)[0].model.fp8 == "delayed"
    with pytest.raises(
        ConfigError, match=r"model.fp8_e4m3=True contradicts model.fp8_format='hybrid'"
    ):
        _load_nemo(*fp8, "model.fp8_e4m3=true")
    # NeMo's precedence: fp8_e4m3 wins over its YAML's fp8_hybrid: True.
    assert _load_nemo("model.fp8=delayed", "model.fp8_e4m3=true")[0].model.fp8_format == "e4m3"
    assert _load_nemo("model.fp8=delayed")[0].model.fp8_format is None  # = hybrid
    cfg, _ = _load_nemo("model.use_scaled_init_method=false")
    assert cfg.model.output_layer_init == "normal"


def test_hydra_defaults_that_compose_a_group_are_refused():
    raw = OmegaConf.load(NEMO)
    raw.defaults = ["_self_", {"tp_overlap@model.ub_tp_comm_overlap_cfg": "ub_cfg_h100"}]
    with pytest.raises(ConfigError, match=r"defaults=.* is not supported \(Hydra config groups"):
        load_config(raw, NEMO_READY)


def test_nemo_checkpoint_io_keys_are_honoured():
    cfg, _ = _load_nemo(
        "exp_manager.checkpoint_callback_params.async_save=true",
        "+model.dist_ckpt_parallel_save=true",
        "+model.dist_ckpt_parallel_load=true",
    )
    assert cfg.exp_manager.checkpoint_callback_params.async_save
    assert cfg.model.dist_ckpt_parallel_save and cfg.model.dist_ckpt_parallel_load


def test_nemo_table_and_schema_do_not_overlap_and_are_documented():
    overlap = [key for key in NEMO_KEYS if key.removesuffix(".*") in SCHEMA_PATHS]
    assert not overlap, overlap
    doc = (ROOT / "docs" / "configuration.md").read_text()
    missing = [key for key in NEMO_KEYS if f"`{key.removesuffix('.*')}`" not in doc]
    assert not missing, missing


def _container_keys(cls=ExperimentConfig, prefix=""):
    """(key, what it holds) for every section, mapping and list key of the schema."""
    import typing

    for name, hint in typing.get_type_hints(cls).items():
        key = f"{prefix}{name}"
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = options[0] if typing.get_origin(hint) is not list and len(options) == 1 else hint
        if dataclasses.is_dataclass(hint):
            yield key, "a section of keys"
            yield from _container_keys(hint, key + ".")
        elif typing.get_origin(hint) is dict:
            yield key, "a mapping"
        elif typing.get_origin(hint) is list:
            yield key, "a list"


# One value of another kind for each: a list for a mapping or section, a mapping for a list.
_OTHER_KIND = {"a section of keys": "[1, 2]", "a mapping": "[A, B]", "a list": "{a: 1}"}


@pytest.mark.parametrize(("key", "holds"), list(_container_keys()), ids=lambda x: str(x))
def test_a_value_of_another_kind_than_a_section_mapping_or_list_names_the_key(key, holds):
    """OmegaConf's merge ended in 'TypeError: Cannot merge incompatible container types' for
    a list onto a mapping, named '?' for a section, and read a mapping onto a list as
    unknown keys below it."""
    with pytest.raises(ConfigError) as info:
        _load(f"{key}={_OTHER_KIND[holds]}")
    assert str(info.value).startswith(f"'{key}' must be {holds}") or (
        key == "model.data.data_prefix" and "per-split form" in str(info.value)
    ), info.value


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("cluster.env_vars={A: [1]}", "'cluster.env_vars.A' must be a single value, not a list"),
        ("model.optim.betas=[[0.9], 0.95]", "'model.optim.betas[0]' must be a single value"),
        ("model.num_layers={a: 1}", "'model.num_layers' must be a single value, not a mapping"),
        (
            "model.data.data_prefix={train: [a], validation: [b], test: [c]}",
            "NeMo's per-split form of model.data.data_prefix (train/validation/test) is not "
            "supported",
        ),
    ],
)
def test_elements_of_another_kind_name_the_key(override, expected):
    with pytest.raises(ConfigError) as info:
        _load(override)
    assert str(info.value).startswith(expected), info.value


_PER_SPLIT = (
    "NeMo's per-split form of model.data.data_prefix (train/validation/test) is not supported: "
    "give one list of prefixes (with weights if blended) and split it with "
    "model.data.splits_string"
)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model.data.data_prefix.train=[a]", _PER_SPLIT),
        ("+model.data.data_prefix.validation=[a]", _PER_SPLIT),
        (
            "model.optim.betas.beta1=0.8",
            "model.optim.betas is a list: 'beta1' is no element of it (number one, "
            "model.optim.betas.0=..., or give the whole list, model.optim.betas=[...])",
        ),
    ],
)
def test_a_dotted_key_that_names_an_element_of_a_list_is_one_line(override, expected):
    """NeMo's ``data_prefix.train=...`` form ended in OmegaConf's ConfigTypeError and its
    traceback ('Index 'train' (str) is not an int')."""
    with pytest.raises(ConfigError) as info:
        _load(override)
    assert str(info.value) == f"override '{override}': {expected}"


def test_a_dotted_key_that_numbers_an_element_of_a_list_sets_it():
    assert _load("model.optim.betas.0=0.8").model.optim.betas == [0.8, 0.95]


@pytest.mark.parametrize(
    "args",
    [
        ["train", str(DEMO), "exp_manager.wandb_logger_kwargs=[1,2]", "--dry-run"],
        ["submit", str(DEMO), "cluster.env_vars=[A,B]", "--dry-run"],
    ],
    ids=["train", "submit"],
)
def test_a_list_where_a_mapping_belongs_is_one_line_on_the_command_line(args):
    out = _cli(*args)
    key = args[2].split("=")[0]
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"error: '{key}' must be a mapping (key: value), not a list"), line
