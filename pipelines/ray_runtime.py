"""Starting or joining Ray, the one place that decides how.

Under ``ray job submit`` the driver finds its cluster through ``RAY_ADDRESS``; otherwise we start
an in-process local Ray (the embedded default) sized by ``num_cpus``.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def init_ray(num_cpus: int | None = None, address: str | None = None) -> None:
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        log.info("joining Ray cluster at %s", address)
        ray.init(address=address, log_to_driver=True)
    else:
        # address="local" always starts a fresh in-process cluster; a bare ray.init() would
        # silently join a stray `ray start` head left on the machine.
        log.info("starting local Ray with num_cpus=%s", num_cpus)
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
