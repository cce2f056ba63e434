"""Built-in hooks; each does its slow work in background services, off the step."""

from __future__ import annotations

from .hash_table_filter import HashTableFilterHook

__all__ = ["HashTableFilterHook"]
