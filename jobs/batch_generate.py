"""Batch generation alone: ``python jobs/batch_generate.py --task targets --requests R --index I --out O``.

The same job as ``adbatch generate``, shaped for ``ray job submit -- python jobs/batch_generate.py
...``: under a job submission Ray is joined through ``RAY_ADDRESS`` (pipelines.ray_runtime), in a
plain run a local Ray starts in-process. ``main(argv)`` returns the run summary (the metrics).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script (``python jobs/batch_generate.py`` / ray job submit)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipelines.generate import GenerateJobConfig, run_generate


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from jobs.config_cli import parse_job_config

    return run_generate(parse_job_config(GenerateJobConfig, argv, "generate", __doc__.splitlines()[0]))


if __name__ == "__main__":
    from jobs.config_cli import run_entrypoint

    sys.exit(run_entrypoint(main, "batch_generate"))
