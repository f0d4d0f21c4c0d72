"""Things registered by name (advantage estimators, policy losses, tasks) and looked up from
config. A registry is a dict, so ``for name in registry`` and ``registry[name]`` work; ``get``
turns an unknown name into a ValueError that lists what exists."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Registry(dict[str, T]):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator adding the decorated object under ``name``; a name is registered once."""

        def deco(obj: T) -> T:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:  # type: ignore[override]
        try:
            return self[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; expected one of {sorted(self)}"
            ) from None
