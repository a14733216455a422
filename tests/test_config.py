"""NeMo-style config: loading, overrides, validation errors, dry run, round trip."""

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import fresh_launch_env
from omegaconf import OmegaConf

from megatron_lns.config import ConfigError, load_config, to_yaml, validate
from megatron_lns.config.loader import NemoKeysIgnoredWarning

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "nemo_configs" / "tiny_cpu_demo.yaml"
NEMO = Path(__file__).parent / "data" / "nemo_megatron_gpt_config.yaml"


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


def test_nemo_1x_config_loads_with_one_warning_listing_ignored_keys():
    with pytest.warns(NemoKeysIgnoredWarning) as record:
        cfg = _load(source=NEMO)
    assert len(record) == 1
    message = str(record[0].message)
    for key in (
        "trainer.logger",
        "model.megatron_amp_O2",
        "model.nsys_profile",
        "exp_manager.checkpoint_callback_params.model_parallel_size",
        "model.data.data_impl",
    ):
        assert key in message
    # Keys that map onto megatron-core are honoured.
    assert cfg.model.optim.betas == [0.9, 0.98]
    assert cfg.model.optim.sched.constant_steps == 20
    assert cfg.model.num_layers == 4
    validate(cfg)


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
            ["model.global_batch_size=10"],
            2,
            "model.global_batch_size (10) is not divisible by model.micro_batch_size x data-parallel size (4 x 2)",
        ),
        (
            ["model.tensor_model_parallel_size=2"],
            3,
            "world size 3 (trainer.num_nodes x trainer.devices) is not divisible by tensor x pipeline parallel size (2 x 1)",
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
    raw = OmegaConf.load(path)
    overrides = []
    if OmegaConf.is_missing(raw.model.data, "data_prefix"):
        overrides.append("model.data.data_prefix=[/data/corpus_text_document]")
    for key in raw.model.tokenizer.keys():  # noqa: SIM118 - `in` skips ??? values
        if OmegaConf.is_missing(raw.model.tokenizer, key):
            overrides.append(f"model.tokenizer.{key}=/models/tokenizer")
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
