"""The optional packages the integrations need, each from an extra of pyproject.toml."""

from __future__ import annotations

import importlib
from typing import Any

from neuronode.errors import ConfigError


def need(module: str, *, extra: str, what: str) -> Any:
    """Import `module`, or stop with one line saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"{what} needs the {extra} extra ({exc.name or module} is not installed): from a "
                          f"clone, pip install '.[{extra}]' (torch first: it does not pull torch)") from exc
