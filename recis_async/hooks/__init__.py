"""Built-in hooks."""

from .trace import TraceHook, TraceToOdpsHook

__all__ = ["TraceHook", "TraceToOdpsHook"]
