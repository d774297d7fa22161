"""The base of the run config's sections (rsclip_ds.config): `Strict`, which every section subclasses, and
`ConfigError`. A leaf module, importing nothing of the package: the modules that hold a section of their own
(precision.py, faults.py, runtime/distributed.py, runtime/compilation.py, distill/config.py) import it, and
config.py imports them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A run config, profile or batch setting that cannot work; the message names the fix. ``note``: a short
    form for a table where one exists (`rsclip-ds plan`'s refused rows), else the message."""

    def __init__(self, message: str = "", *, note: str | None = None):
        super().__init__(message)
        self.note = note or message


class Strict(BaseModel):
    """Every section of the run config: unknown keys rejected, values frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())
