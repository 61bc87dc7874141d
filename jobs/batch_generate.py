"""Batch generation alone: ``python jobs/batch_generate.py --task targets --requests R --index I --out O``.

The same job as ``adbatch generate``, shaped for ``ray job submit -- python jobs/batch_generate.py
...``: under a job submission Ray is joined through ``RAY_ADDRESS`` (pipelines.ray_runtime), in a
plain run a local Ray starts in-process. ``main(argv)`` returns the run summary (the metrics).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script (``python jobs/batch_generate.py`` / ray job submit)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipelines.generate import GenerateJobConfig, run_generate


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import argparse

    from jobs.config_cli import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", metavar="FILE", help="TOML or YAML config; CLI flags override it")
    parser.add_argument("--log-level", default="INFO")
    add_config_arguments(parser, GenerateJobConfig)
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(GenerateJobConfig, args, section="generate")
    return run_generate(config)


if __name__ == "__main__":
    result = main()
    print(json.dumps(result, indent=2, sort_keys=True, default=str))
