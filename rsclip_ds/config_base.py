"""What every section of the run config shares (config.py assembles the tree): the error type and
the strict base class. Its own module so that sections can live outside config.py (config_faults.py)
without an import cycle."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A run config, profile or batch setting that cannot work; the message names the fix."""


class Strict(BaseModel):
    """A config section: unknown keys are errors, values are frozen once validated."""
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())
