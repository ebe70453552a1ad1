"""The engine's request errors: each names what was wrong, and the engine serves on. No torch here, so a
front door can map them to its own error codes without loading the engine."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request field is missing or out of range; the message names the field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.reason = message


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound: the server is overloaded."""


class UnknownRequestError(KeyError):
    def __str__(self) -> str:
        return f"request_id: no unfinished request {self.args[0]!r}"


class EngineDeadError(RuntimeError):
    """The engine is not running (its thread died, it failed to build, or the server is shutting down)."""
