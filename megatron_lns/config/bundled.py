"""The NeMo-style configs shipped with the package (``nemo_configs/`` in the repository).

They travel inside the wheel as package data, so ``megatron-lns demo`` and
``megatron-lns train llama_130m`` work from any working directory after
``pip install megatron-lns``, not only from a checkout.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from megatron_lns.config.loader import ConfigError

DEMO_CONFIG_NAME = "tiny_cpu_demo"


def bundled_config_dir() -> Path:
    return Path(str(resources.files("megatron_lns") / "nemo_configs"))


def bundled_config_names() -> list[str]:
    return sorted(p.stem for p in bundled_config_dir().glob("*.yaml"))


def resolve_config_path(name_or_path: str | Path) -> Path:
    """An existing file as given; otherwise a bundled config by name (``llama_130m``,
    ``llama_130m.yaml`` or ``nemo_configs/llama_130m.yaml``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    bundled = bundled_config_dir() / (path.stem + ".yaml")
    names_bundled = path.suffix in ("", ".yaml") and path.parent.name in ("", "nemo_configs")
    if names_bundled and bundled.is_file():
        return bundled
    raise ConfigError(
        f"config file {name_or_path} does not exist (bundled configs: "
        + ", ".join(bundled_config_names())
        + ")"
    )
