"""MMEngine's named priority levels; lower values run first."""

from __future__ import annotations

from enum import IntEnum

__all__ = ["Priority", "priority_value"]


class Priority(IntEnum):
    HIGHEST = 0
    VERY_HIGH = 10
    HIGH = 30
    ABOVE_NORMAL = 40
    NORMAL = 50
    BELOW_NORMAL = 60
    LOW = 70
    VERY_LOW = 90
    LOWEST = 100


def priority_value(priority: int | str | Priority, *, field: str = "priority") -> int:
    """Normalise a priority given as a level, a level name (``"HIGH"``) or an int."""
    if isinstance(priority, str):
        try:
            return int(Priority[priority.upper()])
        except KeyError:
            names = ", ".join(p.name for p in Priority)
            raise ValueError(
                f"{field}: expected an int or one of {names}, got {priority!r}"
            ) from None
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(
            f"{field}: expected an int or Priority, got {type(priority).__name__} ({priority!r})"
        )
    return int(priority)


def priority_label(value: int) -> str:
    """``"NORMAL(50)"`` for named levels, ``"45"`` otherwise."""
    try:
        return f"{Priority(value).name}({value})"
    except ValueError:
        return str(value)
