"""Build argparse options from a config dataclass, and merge file values with CLI overrides.

Precedence: dataclass defaults < config file (YAML/TOML) < CLI flags. Nested config fields become
dotted flags (``--cluster.branching 10``) and nested tables in the file (``[index.cluster]``).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import typing
from pathlib import Path
from typing import Any

from adbatch.config import LOG_FORMAT, ConfigBase, ConfigError, load_config_file

_MISSING = object()


def _flag_type(hint: Any) -> tuple[Any, dict[str, Any]]:
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is getattr(__import__("types"), "UnionType", None):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return _flag_type(args[0])
    if origin in (list, tuple):
        args = typing.get_args(hint)
        inner = args[0] if args and args[0] is not Ellipsis else str
        inner_type, _ = _flag_type(inner)
        return inner_type, {"nargs": "+"}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return str, {"choices": [m.value for m in hint]}
    if hint is bool:
        return str, {"metavar": "{true,false}"}
    if hint in (int, float, str):
        return hint, {}
    if hint is Path:
        return str, {"metavar": "PATH"}
    return str, {}


def add_config_arguments(parser: argparse.ArgumentParser, cls: type[ConfigBase], prefix: str = "") -> None:
    """Add one ``--field`` per dataclass field (recursively for nested configs)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name.startswith("_"):
            continue
        hint = hints[f.name]
        inner = hint
        if typing.get_origin(hint) is typing.Union:
            nn = [a for a in typing.get_args(hint) if a is not type(None)]
            inner = nn[0] if len(nn) == 1 else hint
        if isinstance(inner, type) and issubclass(inner, ConfigBase):
            add_config_arguments(parser, inner, prefix=f"{prefix}{f.name}.")
            continue
        ftype, extra = _flag_type(hint)
        default = f.default if f.default is not dataclasses.MISSING else None
        if isinstance(default, enum.Enum):
            default = default.value
        help_text = f.metadata.get("help", "")
        parser.add_argument(
            f"--{prefix}{f.name}".replace("_", "-"),
            dest=f"{prefix}{f.name}",
            type=ftype,
            default=_MISSING,
            # argparse %-formats help strings: a literal % (e.g. "~4% of the examples") must be doubled
            help=f"{help_text} (default: {default})".strip().replace("%", "%%"),
            **extra,
        )


def _set_nested(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    cur = data
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
        if not isinstance(cur, dict):
            raise ConfigError(f"config key {p!r} must be a table to hold {dotted!r}")
    cur[parts[-1]] = value


def config_from_args(
    cls: type[ConfigBase], args: argparse.Namespace, section: str | None = None
) -> ConfigBase:
    """Defaults < ``--config`` file (its ``[section]`` table if present) < explicit CLI flags."""
    data: dict[str, Any] = {}
    cfg_file = getattr(args, "config", None)
    if cfg_file:
        file_data = load_config_file(cfg_file)
        table = file_data.get(section) if section else None
        if isinstance(table, dict):
            # `adbatch train`'s config has a nested `train` table (TrainConfig) too, and `index` and
            # `compress` likewise: `[<section>]` is the subcommand's own table only when every key
            # in it is a field of the job config; otherwise it is that nested table
            names = {f.name for f in dataclasses.fields(cls)}
            if section not in names or (table and set(table) <= names):
                file_data = table
        data.update(file_data)
    for key, value in vars(args).items():
        if key in ("config", "command", "log_level", "debug") or value is _MISSING:
            continue
        _set_nested(data, key, value)
    return cls.from_dict(data)




def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config FILE``, ``--log-level`` and ``--debug``, shared by every entrypoint."""
    parser.add_argument("--config", metavar="FILE", help="YAML or TOML config; CLI flags override it")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    add_debug_argument(parser)


def add_debug_argument(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: a sub-command's parser must not reset a --debug given before the sub-command
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on a user error, print the traceback too (default: one line, exit status 2)")


#: exit status of a user error (config, schema, integrity, ownership, a missing input), as argparse's
EXIT_USER_ERROR = 2
#: the exception types that mean "the input or the config is wrong", by module: a type counts only once
#: its module is loaded (an exception of it can only exist then), so nothing heavy is imported for this
USER_ERROR_TYPES = (
    ("adbatch.config", "ConfigError"),  # OutputOwnershipError, OutputLockedError derive from it
    ("adbatch.artifacts", "OutputWriteError"),  # a full disk, a read-only --out: the user's to fix
    ("adbatch.artifacts", "ArtifactIntegrityError"),  # an input artifact's file differs from its manifest
    ("adbatch.index.corpus", "CorpusSchemaError"),
    ("adbatch.index.dense", "DenseChannelError"),  # no dense channel in the index, or another query embedder
    ("adbatch.serving.requests", "RequestSchemaError"),
    ("adbatch.index.trie", "TrieFormatError"),
    ("adbatch.models", "ModelFolderError"),  # UnsafeCheckpointError derives from it
    ("adbatch.compress.checkpoint", "CheckpointError"),
    ("adbatch.training.checkpoint", "IndexMismatchError"),
)


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` reports a mistake in the user's input (shown as one line), not a failure of ours."""
    import sys

    if isinstance(exc, (FileNotFoundError, NotADirectoryError, IsADirectoryError)):
        return True
    for module, name in USER_ERROR_TYPES:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(exc, cls):
            return True
    return False


def report_user_error(prog: str, exc: BaseException) -> int:
    """Print ``exc`` as one line on stderr (``<prog>: error: ...``); returns :data:`EXIT_USER_ERROR`."""
    import sys

    text = " ".join(str(exc).split()) or type(exc).__name__
    print(f"{prog}: error: {text} (--debug shows the traceback)", file=sys.stderr)
    return EXIT_USER_ERROR


def run_entrypoint(main: Any, prog: str, argv: list[str] | None = None,
                   show: Any = None) -> int:
    """Run a script's ``main(argv) -> summary``: print the summary (``show``, default JSON) and return 0,
    or, on a user error without ``--debug``, one line on stderr and :data:`EXIT_USER_ERROR`."""
    import json
    import sys

    from pipelines.ray_runtime import prefer_loopback_ray

    prefer_loopback_ray()  # before the job imports Ray
    argv = sys.argv[1:] if argv is None else argv
    front = argparse.ArgumentParser(add_help=False)
    add_debug_argument(front)
    debug = getattr(front.parse_known_args(argv)[0], "debug", False)
    try:
        result = main(argv)
    except Exception as exc:
        if debug or not is_user_error(exc):
            raise
        return report_user_error(prog, exc)
    (show or (lambda r: print(json.dumps(r, indent=2, sort_keys=True, default=str))))(result)
    return 0


def setup_logging(level: str) -> None:
    import logging

    logging.basicConfig(level=getattr(logging, str(level).upper(), logging.INFO), format=LOG_FORMAT)


def parse_job_config(cls: type[ConfigBase], argv: list[str] | None, section: str,
                     description: str) -> ConfigBase:
    """The whole entrypoint front: parse ``argv`` for ``cls``, set up logging, build the config."""
    parser = argparse.ArgumentParser(description=description)
    add_common_arguments(parser)
    add_config_arguments(parser, cls)
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    return config_from_args(cls, args, section=section)
