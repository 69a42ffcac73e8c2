"""The agent's browser actions, as one flat typed record.

A flat model (kind + optional arguments) rather than a union of classes, because it maps to one Arrow
struct column and one SQL-friendly shape; the validator enforces which arguments each kind needs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from schemas.arrow import Int64

ActionKind = Literal["click", "type", "press", "scroll", "goto", "answer", "stop", "invalid"]

_REQUIRED: dict[str, tuple[str, ...]] = {
    "type": ("text",),
    "press": ("key",),
    "scroll": ("dx", "dy"),
    "goto": ("url",),
    "answer": ("text",),
    "invalid": ("reason",),
}


class Action(BaseModel):
    """One browser action. `click`/`type` target either pixel (x, y) or a Set-of-Mark id."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: ActionKind
    x: Int64 | None = None
    y: Int64 | None = None
    mark: Int64 | None = None
    """Set-of-Mark element id, instead of coordinates."""
    text: str | None = None
    key: str | None = None
    dx: Int64 | None = None
    dy: Int64 | None = None
    url: str | None = None
    reason: str | None = None
    """For `invalid`: why the model output could not be turned into an action."""

    @model_validator(mode="after")
    def _arguments_present(self) -> Action:
        missing = [f for f in _REQUIRED.get(self.kind, ()) if getattr(self, f) is None]
        if self.kind == "click" and self.mark is None and (self.x is None or self.y is None):
            missing.append("x and y, or mark")
        if missing:
            raise ValueError(f"action '{self.kind}' needs {', '.join(missing)}")
        return self
