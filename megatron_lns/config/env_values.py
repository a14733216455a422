"""``cluster.env_vars`` values as YAML spells them, before the schema makes them strings.

The schema's ``dict[str, str]`` would turn YAML's ``true`` into Python's ``True``; a
batch script exports the value a user wrote. Booleans become ``true`` / ``false`` and
integers their digits; a float is refused (``1.50`` and ``1.5`` read the same, so its
spelling is lost: quoted, it is exported as written), and so is null (a variable is
either set or left out).
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf


def spell_env_values(raw: DictConfig) -> None:
    """Rewrite ``raw``'s ``cluster.env_vars`` scalars as YAML spells them; ValueError with
    a one-line message naming the key for a value that cannot be exported as written."""
    cluster = raw.get("cluster")  # what is not a mapping is the schema's to refuse
    env = cluster.get("env_vars") if isinstance(cluster, DictConfig) else None
    if not isinstance(env, DictConfig):
        return
    for name in list(env.keys()):
        if OmegaConf.is_interpolation(env, name):
            continue
        value = env[name]
        key = f"cluster.env_vars.{name}"
        if isinstance(value, bool):
            env[name] = "true" if value else "false"
        elif isinstance(value, int):
            env[name] = str(value)
        elif isinstance(value, float):
            raise ValueError(
                f"{key}={value!r}: a YAML number whose spelling is lost (1.50 reads as 1.5): "
                "quote it to export it as written"
            )
        elif value is None:
            raise ValueError(f"{key} is null: give it a value, or leave it out")
