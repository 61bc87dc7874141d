"""Package faces whose members load at first access (PEP 562).

A package that re-exports both light configs and torch-backed verbs would make every importer pay for
torch. ``__getattr__ = lazy_members(__name__, {...})`` in its ``__init__`` defers the heavy members:
the submodule is imported when a name is first read, and the value is then cached in the package.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping


def lazy_members(package: str, members: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``members`` maps a public name to the submodule
    (relative to ``package``) that defines it."""

    def __getattr__(name: str) -> Any:
        module = members.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
