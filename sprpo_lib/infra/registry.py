"""One small registry type for every pluggable family (methods, advantage estimators,
policy losses, perturbation families, environments, demonstrators, engines).

A new method, estimator or family is a new entry, not a flag; an unknown name is one
clear error that lists the valid ones.
"""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> object, with a decorator to add entries and helpful lookup errors.

    ``kind`` names the family in messages ("method", "policy loss", ...); ``option``
    names the config key that selects an entry (e.g. ``method.name``), so the error
    says which option was wrong and what to write instead.
    """

    def __init__(self, kind: str, option: str | None = None):
        self.kind = kind
        self.option = option
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REG.register("name")``; a different object under a taken name raises."""

        def deco(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        if name not in self._items:
            where = f" ({self.option})" if self.option else ""
            raise ValueError(f"unknown {self.kind} {name!r}{where}; expected one of {sorted(self._items)}")
        return self._items[name]

    __getitem__ = get

    def __delitem__(self, name: str) -> None:
        del self._items[name]

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def names(self) -> list[str]:
        return sorted(self._items)

    def items(self):
        return sorted(self._items.items())
