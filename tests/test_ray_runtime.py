"""The local Ray cluster's worker setup: Ray Train's state-API warning (which a dashboard-less local
cluster can never stop producing) is dropped, and nothing else."""

from __future__ import annotations

import logging

import pytest

from pipelines.ray_runtime import quiet_state_api_warnings

CLEANER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"


def test_only_the_state_api_warning_is_dropped(caplog):
    quiet_state_api_warnings()
    quiet_state_api_warnings()  # idempotent: one filter
    logger = logging.getLogger(CLEANER)
    assert len(logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=CLEANER):
        logger.warning("Failed to query Ray Train Controller actor state. State API may be temporarily unavailable.")
        logger.warning("Failed to clean up placement group: boom")
        logging.getLogger("ray.other").warning("Failed to query Ray Train Controller actor state.")
    assert [r.getMessage() for r in caplog.records] == [
        "Failed to clean up placement group: boom", "Failed to query Ray Train Controller actor state."]


def test_local_cluster_workers_run_the_hook():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray cluster of another test is running")
    from pipelines.ray_runtime import init_ray

    init_ray(num_cpus=1)
    try:
        @ray.remote
        def filters() -> list[str]:
            return [type(f).__name__ for f in logging.getLogger(CLEANER).filters]

        assert ray.get(filters.remote()) == ["_DropStateApiNoise"]
    finally:
        ray.shutdown()
