"""The error a user can fix, shared by the stages and the layers they call
(the vLLM servers and engines, the hidden-state files)."""

from __future__ import annotations


class StageError(Exception):
    """A problem the user can fix: reported as an `error` event with a hint."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint
