"""Where a node's configuration comes from: flags, `NEURONODE_*` environment variables and
`--config node.toml`, each value turned into its field's type, merged default < config file <
environment < flags into a validated `NodeConfig` (neuronode.config)."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from typing import Any

from neuronode.config import NodeConfig, flag_name
from neuronode.errors import ConfigError

ENV_PREFIX = "NEURONODE_"


def convert(name: str, raw: Any, source: str) -> Any:
    """Turn a string (flag, env) or TOML value into the field's type."""
    ftype = FIELD_TYPES[name]
    try:
        if ftype == "tuple[str, ...]":
            if isinstance(raw, (list, tuple)):
                return tuple(str(x) for x in raw)
            return tuple(p.strip() for p in str(raw).split(",") if p.strip())
        if ftype == "bool":
            if isinstance(raw, bool):
                return raw
            lowered = str(raw).strip().lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError
            return lowered in ("1", "true", "yes", "on")
        if ftype == "int":
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            return int(raw)
        if ftype == "float":
            return float(raw)
        return str(raw)
    except ValueError:
        kind = {"int": "an integer", "float": "a number", "bool": "true or false"}.get(ftype, "a value")
        raise ConfigError(f"{flag_name(name)}: '{raw}' from {source} is not {kind}") from None


FIELD_TYPES: dict[str, str] = {f.name: str(f.type) for f in dataclasses.fields(NodeConfig)}


def read_toml(path: str) -> dict[str, Any]:
    """Read --config FILE into field names; unknown keys are errors."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--config: file '{path}' does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"--config: cannot read '{path}': {exc}") from None
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in FIELD_TYPES:
            raise ConfigError(f"--config: unknown key '{key}' in {path}")
        out[name] = convert(name, value, path)
    return out


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """Read NEURONODE_<FIELD> variables (e.g. NEURONODE_INNER_STEPS=20)."""
    out: dict[str, Any] = {}
    for name in FIELD_TYPES:
        var = ENV_PREFIX + name.upper()
        if var in environ and environ[var] != "":
            out[name] = convert(name, environ[var], f"${var}")
    return out


def build_config(
    flags: Mapping[str, Any],
    *,
    config_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> NodeConfig:
    """Merge default < config file < environment < flags into a validated NodeConfig."""
    values: dict[str, Any] = {}
    if config_file:
        values.update(read_toml(config_file))
    values.update(read_env(os.environ if environ is None else environ))
    values.update({k: convert(k, v, flag_name(k)) for k, v in flags.items() if v is not None})
    return NodeConfig(**values)
