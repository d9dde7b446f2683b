"""The base every config model derives from: strict, typed, documented in one place."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A config section that rejects unknown keys.

    A silently ignored key is a lost run (a typo in `learning_rate` trains with the default),
    so every section forbids extras; the loader turns the error into a "did you mean" line.
    """

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        validate_default=True,
        use_attribute_docstrings=True,
        protected_namespaces=(),
    )
