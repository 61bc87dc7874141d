"""Starting or joining Ray, the one place that decides how.

Under ``ray job submit`` the driver finds its cluster through ``RAY_ADDRESS``; otherwise we start
an in-process local Ray (the embedded default) sized by ``num_cpus``.

A local Ray makes no network attempt beyond loopback:

- it runs on ``127.0.0.1`` when this process imports Ray through :func:`prefer_loopback_ray` (the
  entry points call it first; :func:`init_ray` too): ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which Ray
  reads once at import, is its single-machine mode. A process that imported Ray before keeps Ray's
  default: it finds the machine's address by a UDP ``connect`` to 8.8.8.8 (no packet is sent) and
  listens on that address;
- usage statistics are off (``RAY_USAGE_STATS_ENABLED=0``) and the dashboard's web UI is not started;
- Ray's dashboard process still loads its usage-stats module, which asks the cloud metadata services
  (``169.254.169.254``, ``metadata.google.internal``) what cloud it runs on -- whether usage stats are
  on or not (``ray/dashboard/modules/usage_stats/usage_stats_head.py`` calls
  ``get_cluster_config_to_report``, which probes when ``~/ray_bootstrap_config.yaml`` is absent).
  No Ray setting turns that off, so the processes Ray starts get an HTTP(S) proxy on a closed
  loopback port (:data:`NO_EGRESS_PROXY`) with loopback exempt: their HTTP clients fail at once,
  on loopback. Ray's own gRPC ignores proxy variables (``RAY_grpc_enable_http_proxy`` is off by
  default), and our stages read only local files. The driver's own environment is restored after
  start-up.

Local session folders: Ray keeps one ``session_*`` folder per start under its temp root. Each local
start marks its folder (:data:`SESSION_MARK`, the driver's pid), and then removes the marked folders
of earlier runs whose driver has exited, keeping the newest :data:`KEEP_SESSIONS` (a local Ray's
processes end with its driver, so a folder whose driver is gone is no longer used). Folders of
other sessions (``ray start`` heads, other programs) are never touched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

#: proxy of every HTTP(S) client in a local Ray's processes: a closed loopback port
NO_EGRESS_PROXY = "http://127.0.0.1:9"
#: environment of a local Ray's processes (and of the driver while it starts them)
LOCAL_RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_USAGE_STATS_PROMPT_ENABLED": "0",
    **{name: NO_EGRESS_PROXY for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")},
    **{name: "127.0.0.1,localhost,::1" for name in ("no_proxy", "NO_PROXY")},
}
SESSION_MARK = "adbatch_driver.json"
KEEP_SESSIONS = 5


#: read by Ray when it is imported: "0" makes ``get_node_ip_address`` answer 127.0.0.1 (the
#: Windows / macOS single-machine mode) instead of asking the routing table by a UDP connect to 8.8.8.8
LOOPBACK_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def prefer_loopback_ray() -> bool:
    """In a process that will start a local Ray (no ``RAY_ADDRESS``): import Ray now, with
    :data:`LOOPBACK_NODE_ENV` = "0" for that moment (unless the user set it), so the Ray this process
    starts runs on 127.0.0.1. Returns whether it will: False when Ray was imported before (then it keeps
    finding the machine's address) or when the process joins a cluster. Called by the entry points
    before anything imports Ray, and by :func:`init_ray`."""
    if os.environ.get("RAY_ADDRESS"):
        return False
    if "ray" not in sys.modules:
        with _environ({LOOPBACK_NODE_ENV: os.environ.get(LOOPBACK_NODE_ENV, "0")}):
            import ray  # noqa: F401  (Ray reads the setting once, at import)
    return _ray_reads_loopback()


def _ray_reads_loopback() -> bool:
    constants = sys.modules.get("ray._private.ray_constants")
    return constants is not None and getattr(constants, "ENABLE_RAY_CLUSTER", True) is False


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: Ray Train's placement-group cleaner asks the state API (served by the dashboard) every second whether
#: the train controller lives, and warns each time it cannot. A local cluster here runs without the
#: dashboard, so the answer never comes: ~200 identical lines in one example refresh, none of them news.
_CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
_CLEANER_NOISE = "Failed to query Ray Train Controller actor state"


class _DropStateApiNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_CLEANER_NOISE)


def quiet_state_api_warnings() -> None:
    """Worker setup hook of the local cluster: drops that one warning (only it; the cleaner's other
    messages and every other logger are untouched). The cleaner still runs and still cleans up."""
    logger = logging.getLogger(_CLEANER_LOGGER)
    if not any(isinstance(f, _DropStateApiNoise) for f in logger.filters):
        logger.addFilter(_DropStateApiNoise())


def init_ray(num_cpus: int | None = None, address: str | None = None) -> None:
    if not address:
        prefer_loopback_ray()  # before the first `import ray` of this process, if this is it
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        log.info("joining Ray cluster at %s", address)
        ray.init(address=address, log_to_driver=True)
        return
    # address="local" always starts a fresh in-process cluster; a bare ray.init() would
    # silently join a stray `ray start` head left on the machine.
    log.info("starting local Ray with num_cpus=%s", num_cpus)
    env = dict(LOCAL_RAY_ENV)
    if _ray_reads_loopback():  # the processes Ray starts must agree with this driver on the address
        env[LOOPBACK_NODE_ENV] = "0"
    with _environ(env):
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True,
                 runtime_env={"worker_process_setup_hook": quiet_state_api_warnings})
    session = _session_dir()
    if session is not None:
        _mark_session(session)
        prune_sessions(session.parent, keep=KEEP_SESSIONS, current=session)


def _session_dir() -> Path | None:
    """This driver's local session folder (Ray keeps it on its private node object)."""
    try:
        import ray._private.worker as worker

        return Path(worker._global_node.get_session_dir_path())
    except (AttributeError, TypeError) as exc:  # another Ray version: no pruning, nothing else changes
        log.debug("Ray session folder unknown (%s): old sessions are not pruned", exc)
        return None


def _mark_session(session: Path) -> None:
    try:
        (session / SESSION_MARK).write_text(json.dumps({"pid": os.getpid()}) + "\n")
    except OSError as exc:
        log.debug("could not mark %s: %s", session, exc)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def prune_sessions(root: Path, keep: int, current: Path | None = None) -> list[Path]:
    """Remove the ``session_*`` folders under ``root`` that a local adbatch run marked and whose driver
    has exited, all but the newest ``keep`` of them (by name, which starts with the start time);
    returns the removed folders."""
    ended = []
    for d in sorted(Path(root).glob("session_*")):
        if d.is_symlink() or not d.is_dir() or (current is not None and d == current):
            continue
        try:
            pid = int(json.loads((d / SESSION_MARK).read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours (or unreadable): never touched
        if not _pid_alive(pid):
            ended.append(d)
    removed = ended[:max(0, len(ended) - keep)]
    for d in removed:
        shutil.rmtree(d, ignore_errors=True)
    if removed:
        log.info("removed %d old local Ray session folder(s) under %s", len(removed), root)
    return removed
