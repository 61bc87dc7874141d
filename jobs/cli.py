"""The ``adbatch`` console script: one subcommand per stage, each with ``--config FILE``.

Subcommands resolve lazily to ``(module, config class, run function)`` so ``adbatch --help`` stays
fast and a stage's heavy imports load only when that stage runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any, Callable

from jobs.config_cli import (add_common_arguments, add_config_arguments, add_debug_argument, config_from_args,
                             is_user_error, report_user_error, setup_logging)

#: subcommand -> (module, config class, run function, one-line help)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "index": ("pipelines.index", "IndexJobConfig", "run_index",
              "build the hierarchical semantic-ID index and trie of an ad corpus"),
    "train": ("pipelines.train", "TrainJobConfig", "run_train",
              "train the ad index into the model (DSI), optionally with progressive N:M sparsity"),
    "compress": ("pipelines.compress", "CompressJobConfig", "run_compress",
                 "compress a causal LM: adaptive INT4 + layer-adaptive 2:4/1:4, packed 2bit-CSR"),
    "generate": ("pipelines.generate", "GenerateJobConfig", "run_generate",
                 "batch generation: targets (query -> ads) or creatives (ad -> headline)"),
    "eval": ("pipelines.evaluate", "EvalJobConfig", "run_eval",
             "evaluate targeting and creatives quality and speed; writes report.md + plots"),
    "refresh": ("jobs.nightly_refresh", "RefreshConfig", "run_refresh",
                "the nightly refresh: index -> train -> compress -> generate -> eval"),
}


def _load(command: str) -> tuple[type, Callable[[Any], dict[str, Any]]]:
    module_name, cls_name, fn_name, _ = COMMANDS[command]
    module = importlib.import_module(module_name)
    return getattr(module, cls_name), getattr(module, fn_name)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser. ``only``: the subcommand being run; the others get their help line but not
    their config flags, so running one stage does not import every stage's modules (importing them
    all cost ``adbatch generate``'s driver seconds of start-up: torch, transformers, faiss)."""
    parser = argparse.ArgumentParser(prog="adbatch", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    add_debug_argument(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, _, _, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_common_arguments(p)
        if only is not None and name != only:
            continue
        try:
            cls, _ = _load(name)
        except ImportError as exc:  # the stage's module is unavailable in this install
            p.description = f"{help_text} [unavailable: {exc}]"
            continue
        add_config_arguments(p, cls)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one sub-command: 0 with its summary as JSON on stdout; 2 with one line on stderr for a user
    error (config, schema, integrity, ownership, a missing input; ``--debug`` re-raises it with its
    traceback); any other failure propagates with its traceback."""
    from pipelines.ray_runtime import prefer_loopback_ray

    prefer_loopback_ray()  # before any stage module imports Ray
    argv = sys.argv[1:] if argv is None else list(argv)
    # the first word naming a subcommand is the one that runs (no option of ours takes such a value)
    parser = build_parser(only=next((a for a in argv if a in COMMANDS), None))
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    try:
        cls, run = _load(args.command)
        config = config_from_args(cls, args, section=args.command)
        result = run(config)
    except Exception as exc:
        if getattr(args, "debug", False) or not is_user_error(exc):
            raise
        return report_user_error(f"adbatch {args.command}", exc)
    print(json.dumps(result, indent=2, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
