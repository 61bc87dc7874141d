"""Validated, versioned config dataclasses with JSON round-trip, and config-file loading.

Every transform takes one config dataclass (STYLE.md habit 1). Configs derive from
:class:`ConfigBase`, which gives them ``to_dict``/``from_dict`` (JSON-safe), a ``version`` field that
is stored inside the artifact they produced, and a ``validate`` hook called on construction.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, TypeVar

C = TypeVar("C", bound="ConfigBase")

#: every adbatch process's log lines (the CLI driver and the Ray actors it starts): timestamped, so one
#: job's log reads as a timeline across processes
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class ConfigError(ValueError):
    """A config value is missing, of the wrong type, or out of range."""


#: the integers a config may hold: every count, size and seed ends up in an int64 somewhere (numpy,
#: pyarrow, torch), so a larger one would fail later as an OverflowError deep inside a stage
INT_RANGE = (-(2**63), 2**63 - 1)


@dataclasses.dataclass
class ConfigBase:
    """Base of all adbatch configs. Subclasses are ``@dataclass`` with defaults for every field."""

    CONFIG_VERSION: ClassVar[int] = 1

    def __post_init__(self) -> None:
        self._coerce_types()
        self.validate()

    def validate(self) -> None:  # overridden by subclasses
        """Raise :class:`ConfigError` with a message naming the field when a value is invalid."""

    def _coerce_types(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            setattr(self, f.name, _coerce(value, hints[f.name], f"{type(self).__name__}.{f.name}"))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"config_type": type(self).__name__, "version": self.CONFIG_VERSION}
        for f in dataclasses.fields(self):
            out[f.name] = _jsonable(getattr(self, f.name))
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls: type[C], data: dict[str, Any]) -> C:
        data = dict(data)
        data.pop("config_type", None)
        version = data.pop("version", cls.CONFIG_VERSION)
        if version != cls.CONFIG_VERSION:
            raise ConfigError(
                f"{cls.__name__}: stored config version {version} != supported {cls.CONFIG_VERSION}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"{cls.__name__}: unknown field(s) {unknown}; known: {sorted(names)}")
        return cls(**data)

    @classmethod
    def from_json(cls: type[C], text: str) -> C:
        return cls.from_dict(json.loads(text))

    def replace(self: C, **changes: Any) -> C:
        return dataclasses.replace(self, **changes)


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, ConfigBase):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Turn JSON/TOML/CLI values into the annotated type (enums, paths, nested configs)."""
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            if args[0] is Path and value == "":
                return None  # TOML has no null: an empty path switches an optional input off
            return _coerce(value, args[0], where)
        return value
    if isinstance(hint, type):
        if issubclass(hint, enum.Enum):
            if isinstance(value, hint):
                return value
            try:
                return hint(value)
            except ValueError:
                allowed = [m.value for m in hint]
                raise ConfigError(f"{where}: {value!r} is not one of {allowed}") from None
        if issubclass(hint, ConfigBase):
            if isinstance(value, hint):
                return value
            if isinstance(value, dict):
                return hint.from_dict(value)
            raise ConfigError(f"{where}: expected a table of {hint.__name__} settings, got {value!r}")
        if hint is Path:
            if isinstance(value, (str, os.PathLike)) and str(value) != "":
                return Path(value)
            raise ConfigError(f"{where}: expected a path, got {value!r}")
        if hint is bool:
            if isinstance(value, str):
                low = value.lower()
                if low in ("1", "true", "yes", "on"):
                    return True
                if low in ("0", "false", "no", "off"):
                    return False
                raise ConfigError(f"{where}: expected a boolean, got {value!r}")
            return bool(value)
        if hint in (int, float, str):
            if isinstance(value, bool) or (hint is str and isinstance(value, (list, tuple, dict))):
                raise ConfigError(f"{where}: expected {hint.__name__}, got {value!r}")
            if hint is int and isinstance(value, float) and not value.is_integer():
                raise ConfigError(f"{where}: expected int, got {value!r}")
            try:
                out = hint(value)
            except (TypeError, ValueError, OverflowError):
                raise ConfigError(f"{where}: expected {hint.__name__}, got {value!r}") from None
            # a NaN or infinity passes every `x < lo` range check of a validate() and poisons the results
            # (a NaN length penalty made every score NaN); an int beyond int64 overflows deep in a stage
            if hint is float and not math.isfinite(out):
                raise ConfigError(f"{where}: expected a finite number, got {value!r}")
            if hint is int and not INT_RANGE[0] <= out <= INT_RANGE[1]:
                raise ConfigError(f"{where}: {value!r} is out of range (a config integer must fit in 64 bits)")
            return out
    if origin in (tuple, list) and not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where}: expected a list, got {value!r}")
    if origin in (tuple, list) and isinstance(value, (list, tuple)):
        args = typing.get_args(hint)
        inner = args[0] if args else Any
        items = [_coerce(v, inner, where) if inner is not Any else v for v in value]
        return tuple(items) if origin is tuple else items
    return value


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``) or TOML (``.toml``) file into a dict.

    The format is chosen by the suffix the user gave explicitly, which is the file's declared
    format (not a guess from its content).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".toml":
        try:
            with path.open("rb") as fh:
                return tomllib.load(fh)
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    if suffix in (".yaml", ".yml"):
        import yaml

        try:
            with path.open() as fh:
                data = yaml.safe_load(fh) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as exc:  # ParserError, ScannerError, ...: all YAMLErrors
            raise ConfigError(f"{path}: not valid YAML ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        return data
    raise ConfigError(f"{path}: config files must end in .toml, .yaml or .yml")
