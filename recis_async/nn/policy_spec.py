"""Policy descriptions for hash tables: which admission or filter policy, with which params.

:class:`AdmitHook` and :class:`FilterHook` are plain, immutable descriptions (a registered
policy name plus JSON-able parameters).  A table turns them into policy objects through its
:class:`~recis_async.nn.PolicyRegistry`, so one description can configure many tables and
each table owns its own policy state.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

__all__ = ["AdmitHook", "FilterHook"]


class _PolicyHook:
    __slots__ = ("_name", "_params")

    def __init__(self, name: str, params: Mapping[str, Any] | None = None) -> None:
        """Describe the policy registered as ``name`` with ``params``.

        Args:
            name: a policy registered in the table's :class:`PolicyRegistry`.
            params: its JSON-able parameters (copied and frozen).

        Raises:
            ValueError: an empty ``name``, ``params`` that are not a mapping of JSON-able
                values.
        """
        kind = type(self).__name__
        if not isinstance(name, str) or not name:
            raise ValueError(f"{kind}.name: expected a non-empty str, got {name!r}")
        if params is not None and not isinstance(params, Mapping):
            raise ValueError(f"{kind}.params: expected a dict or None, got {type(params).__name__}")
        frozen = dict(params or {})
        try:
            json.dumps(frozen, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{kind}.params: expected JSON-serialisable values ({exc})") from None
        self._name = name
        self._params: Mapping[str, Any] = MappingProxyType(frozen)

    @property
    def name(self) -> str:
        """The registered policy name, e.g. ``"ReadOnly"``."""
        return self._name

    @property
    def params(self) -> dict[str, Any]:
        """The policy's parameters (a copy: the description itself never changes)."""
        return dict(self._params)

    def __str__(self) -> str:
        return json.dumps({"name": self._name, "params": dict(self._params)}, sort_keys=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._name!r}, {dict(self._params)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._name, dict(self._params)))

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, _PolicyHook)
        return str(self) == str(other)

    def __hash__(self) -> int:
        return hash((type(self).__name__, str(self)))


class AdmitHook(_PolicyHook):
    """Admission policy of a table: decides whether unseen ids get a row.

    ``AdmitHook("ReadOnly")`` never inserts: unknown ids read as zeros.

    """

    __slots__ = ()

    @property
    def type(self) -> Literal["admit"]:
        return "admit"


class FilterHook(_PolicyHook):
    """Filter (eviction) policy of a table: decides which rows are dropped.

    ``FilterHook("GlobalStepFilter", {"filter_step": 20})`` evicts ids not looked up in
    training for more than 20 steps.

    """

    __slots__ = ()

    @property
    def type(self) -> Literal["filter"]:
        return "filter"
