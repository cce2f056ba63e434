"""Policy registries: immutable name -> policy-class maps, passed to tables by reference.

There is deliberately no process-wide mutable registry.  ``register_admit_policy`` and
``register_filter_policy`` return a *new* :class:`PolicyRegistry` (the built-ins plus the
addition) and leave the one they extend untouched; a table is given its registry
(``HashTable(..., policies=...)``, default :data:`DEFAULT_POLICIES`) and keeps that
reference.  So registering never changes the behaviour of another table, two threads
registering cannot race, and nothing global keeps tables or policy objects alive:
registries hold classes, each table holds its own policy instances.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final, TypeVar

from .builtin_policies import GlobalStepFilter, ReadOnly
from .policy import AdmitPolicy, FilterPolicy
from .policy_spec import AdmitHook, FilterHook

__all__ = ["PolicyRegistry", "DEFAULT_POLICIES", "register_admit_policy", "register_filter_policy"]

_P = TypeVar("_P", AdmitPolicy, FilterPolicy)


def _extended(
    table: Mapping[str, type[Any]],
    name: str,
    cls: type[Any],
    base: type[Any],
    kind: str,
    replace: bool,
) -> Mapping[str, type[Any]]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} policy name: expected a non-empty str, got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(
            f"{kind} policy {name!r}: expected a subclass of {base.__name__}, got {cls!r}"
        )
    if name in table and not replace:
        raise ValueError(
            f"{kind} policy {name!r} is already registered (to {table[name].__name__}); "
            "pass replace=True to override it"
        )
    return MappingProxyType({**table, name: cls})


def _build(table: Mapping[str, type[_P]], hook: AdmitHook | FilterHook, kind: str) -> _P:
    cls = table.get(hook.name)
    if cls is None:
        raise ValueError(
            f"{type(hook).__name__}.name: unknown {kind} policy {hook.name!r}; "
            f"registered: {', '.join(sorted(table)) or '(none)'}"
        )
    try:
        return cls(**hook.params)
    except TypeError as exc:  # unexpected / missing keyword
        raise ValueError(f"{type(hook).__name__}({hook.name!r}).params: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{type(hook).__name__}({hook.name!r}).params: {exc}") from None


class PolicyRegistry:
    """An immutable set of admission and filter policy classes, by name.

    Args:
        admit: admission policy classes by name.
        filter: filter policy classes by name.

    Raises:
        TypeError: a class that does not implement its policy protocol.
        ValueError: an empty or duplicate name.
    """

    __slots__ = ("_admit", "_filter")

    def __init__(
        self,
        admit: Mapping[str, type[AdmitPolicy]] | None = None,
        filter: Mapping[str, type[FilterPolicy]] | None = None,
    ) -> None:
        for field, given in (("admit", admit), ("filter", filter)):
            if given is not None and not isinstance(given, Mapping):
                raise ValueError(
                    f"PolicyRegistry({field}=...): expected a mapping of name -> policy class "
                    f"or None, got {type(given).__name__}"
                )
        a: Mapping[str, type[Any]] = MappingProxyType({})
        f: Mapping[str, type[Any]] = MappingProxyType({})
        for name, admit_cls in (admit or {}).items():
            a = _extended(a, name, admit_cls, AdmitPolicy, "admit", False)
        for name, filter_cls in (filter or {}).items():
            f = _extended(f, name, filter_cls, FilterPolicy, "filter", False)
        self._admit = a
        self._filter = f

    @classmethod
    def builtin(cls) -> PolicyRegistry:
        """A registry with ``ReadOnly`` admission and ``GlobalStepFilter`` filtering."""
        return cls({"ReadOnly": ReadOnly}, {"GlobalStepFilter": GlobalStepFilter})

    @property
    def admit_names(self) -> tuple[str, ...]:
        return tuple(sorted(self._admit))

    @property
    def filter_names(self) -> tuple[str, ...]:
        return tuple(sorted(self._filter))

    def with_admit(
        self, name: str, cls: type[AdmitPolicy], *, replace: bool = False
    ) -> PolicyRegistry:
        """A new registry that also maps ``name`` to the admission policy ``cls``."""
        new = PolicyRegistry.__new__(PolicyRegistry)
        new._admit = _extended(self._admit, name, cls, AdmitPolicy, "admit", replace)
        new._filter = self._filter
        return new

    def with_filter(
        self, name: str, cls: type[FilterPolicy], *, replace: bool = False
    ) -> PolicyRegistry:
        """A new registry that also maps ``name`` to the filter policy ``cls``."""
        new = PolicyRegistry.__new__(PolicyRegistry)
        new._admit = self._admit
        new._filter = _extended(self._filter, name, cls, FilterPolicy, "filter", replace)
        return new

    def admit_policy(self, hook: AdmitHook) -> AdmitPolicy:
        """A fresh policy object for ``hook``; ``ValueError`` if its name is unknown."""
        if not isinstance(hook, AdmitHook):
            raise ValueError(f"admit_hook: expected an AdmitHook, got {type(hook).__name__}")
        return _build(self._admit, hook, "admit")

    def filter_policy(self, hook: FilterHook) -> FilterPolicy:
        """A fresh policy object for ``hook``; ``ValueError`` if its name is unknown."""
        if not isinstance(hook, FilterHook):
            raise ValueError(f"filter_hook: expected a FilterHook, got {type(hook).__name__}")
        return _build(self._filter, hook, "filter")

    def __reduce__(self) -> tuple[Any, ...]:
        return (PolicyRegistry, (dict(self._admit), dict(self._filter)))

    def __repr__(self) -> str:
        return f"PolicyRegistry(admit={list(self.admit_names)}, filter={list(self.filter_names)})"


#: The built-in policies.  Immutable: extending it returns a new registry.
DEFAULT_POLICIES: Final = PolicyRegistry.builtin()


def register_admit_policy(
    name: str,
    cls: type[AdmitPolicy],
    registry: PolicyRegistry = DEFAULT_POLICIES,
    *,
    replace: bool = False,
) -> PolicyRegistry:
    """Return ``registry`` extended with admission policy ``cls`` under ``name``.

    The returned registry is what you pass to tables (``HashTable(..., policies=...)``,
    ``EmbeddingOption(..., policies=...)``); ``registry`` itself is unchanged.
    """
    return registry.with_admit(name, cls, replace=replace)


def register_filter_policy(
    name: str,
    cls: type[FilterPolicy],
    registry: PolicyRegistry = DEFAULT_POLICIES,
    *,
    replace: bool = False,
) -> PolicyRegistry:
    """Return ``registry`` extended with filter policy ``cls`` under ``name``."""
    return registry.with_filter(name, cls, replace=replace)
