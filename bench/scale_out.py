#!/usr/bin/env python3
"""Scale-out on one multi-GPU host: the generate and train jobs on 1 GPU vs N GPUs, and an actor killed mid-run.

A benchmark script, not a test. It calls the library's own entry points with their defaults, on one
local Ray started by the first of them (``pipelines.ray_runtime.init_ray``: every GPU of the host):

1. **generate** (``--phases generate``): ``pipelines.generate.run_generate(GenerateJobConfig(executor="ray",
   concurrency=N))`` for N = 1 and N = ``--gpus`` (default: every GPU ``nvidia-smi`` lists), targets for
   ``--requests`` (``request_id, query``) over ``--index`` and, with ``--creative-requests``, creatives. Per
   run: requests/s (the job's generate phase, and end to end around the call), a sha256 of the sorted output
   rows (targets ``request_id, rank, ad_id``; creatives ``request_id, variant, headline``) so the 1-GPU and
   N-GPU answers can be compared (with the number of requests whose rows differ), and each GPU's median
   utilisation, sampled by ``nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 500``
   in a background process during the run. ``verify=auto`` (the default) reads a cost model measured once
   before the runs (``bench.generate_gpu.calibrate_once``), so every actor decides alike.
2. **train** (``--phases train``): ``pipelines.train.run_train(TrainJobConfig(num_workers=N))`` for the same
   N, the same epochs (``--epochs``, default ``TrainConfig``'s) and ``TrainConfig`` overrides (``--train``,
   ``bench.train_throughput.parse_variant``'s syntax). From the training record (``adbatch_training.json``):
   tokens/s of rank 0 and of the whole job (``tokens_per_s_all_ranks``), examples and tokens over all ranks
   (the same at every N: each rank trains on its share), seconds, the loss curve (``losses``, rank 0's;
   ``$OUT/scale_out_loss.png`` when matplotlib is installed); recall@10 of the trained model
   (``bench.train_eval.evaluate``: trie-constrained beam search, 10 beams, over ``--eval-queries``
   (``query, ad_id[, grade]``), else over ``--eval-titles`` ad titles -> their ad: how much of the index it
   learned); utilisation per GPU as above.
3. **kill** (``--phases kill``): the generate job at N actors with ``pipelines.generate.FAULT_KILL_ENV``
   naming a flag file: the first actor to reach its second batch deletes it and exits hard; Ray restarts it
   and retries its batch. Checks every accepted request is answered exactly once (no (request_id, rank)
   twice, none missing), and compares the rows with the undisturbed N-actor run's. The batch size is the
   job's default unless that gives an actor fewer than two batches (then the largest that gives three per
   actor: the hook fires on a second batch).

Results: a markdown table on stdout, ``$OUT/scale_out.json`` (``$OUT`` default ``bench/out``) and
``$OUT/scale_out.md``. The phases of one ``--work`` folder accumulate in its ``state.json``, so a device's
10-minute calls can run them one at a time (``--phases generate``, then ``--phases train,kill``).

    # the device (nvidia-h200-x2/x4), after `source scripts/device_ray_setup.sh`:
    python3 bench/scale_out.py --requests REQ.parquet --index INDEX_DIR --model MODEL [--ads CORPUS.parquet]
    # here, on CPU workers (a plumbing check: tiny random model, generated corpus, index and requests):
    .venv/bin/python bench/scale_out.py --smoke
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

log = logging.getLogger("bench.scale_out")

PHASES = ("generate", "train", "kill")
NVIDIA_SMI_QUERY = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
#: the columns of an output row, by task (the hash is over the sorted rows)
ROW_KEYS = {"targets": ("request_id", "rank", "ad_id"), "creatives": ("request_id", "variant", "headline")}


# --- GPUs ------------------------------------------------------------------------------------------
def visible_gpus() -> int:
    """GPUs ``nvidia-smi`` lists (0 without it): no torch, no CUDA initialised in this process."""
    try:
        out = subprocess.run(NVIDIA_SMI_QUERY, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return len([ln for ln in out.stdout.splitlines() if ln.strip()]) if out.returncode == 0 else 0


def median_utilisation(lines: list[str], gpus: int) -> list[float | None]:
    """Median utilisation (%) per GPU from ``nvidia-smi --query-gpu=utilization.gpu ... -l*`` output: each
    sample is one line per GPU in index order, so line ``i`` is GPU ``i % gpus``. A sample line that is not
    a number (``[N/A]``, a cut last line) is skipped, keeping the lines' places."""
    per: list[list[float]] = [[] for _ in range(gpus)]
    for i, ln in enumerate(lines):
        try:
            per[i % gpus].append(float(ln.strip()))
        except ValueError:
            continue
    return [round(statistics.median(v), 1) if v else None for v in per]


class GpuSampler:
    """``nvidia-smi ... -lms 500`` in a background process while the ``with`` block runs; ``result``: the
    median utilisation per GPU, the number of samples, or why there are none."""

    def __init__(self, gpus: int, interval_ms: int = 500) -> None:
        self.gpus, self.interval_ms = gpus, interval_ms
        self.result: dict[str, Any] = {}

    def __enter__(self) -> "GpuSampler":
        self.proc = None
        if self.gpus < 1 or shutil.which("nvidia-smi") is None:
            self.result = {"sampled": False, "why": "no GPU" if self.gpus < 1 else "nvidia-smi not found"}
            return self
        # a file, not a pipe: a pipe nobody reads would fill and stall nvidia-smi
        self.file = tempfile.NamedTemporaryFile("w+", prefix="nvidia-smi-", suffix=".csv", delete=False)
        self.proc = subprocess.Popen([*NVIDIA_SMI_QUERY, "-lms", str(self.interval_ms)], stdout=self.file,
                                     stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.file.close()
        lines = [ln for ln in Path(self.file.name).read_text().splitlines() if ln.strip()]
        os.unlink(self.file.name)
        self.result = {"sampled": True, "samples_per_gpu": len(lines) // self.gpus,
                       "median_util_pct": median_utilisation(lines, self.gpus)}


# --- outputs ---------------------------------------------------------------------------------------
def output_rows(folder: Path, task: str) -> dict[str, list[list[Any]]]:
    """request_id -> its output rows (the :data:`ROW_KEYS` columns but the id), sorted: of a generate
    job's ``<out>/<task>/part-*.parquet``."""
    import pyarrow.parquet as pq

    table = pq.read_table(Path(folder) / task, columns=list(ROW_KEYS[task]))
    rows: dict[str, list[list[Any]]] = {}
    for rid, *rest in zip(*(table.column(c).to_pylist() for c in ROW_KEYS[task])):
        rows.setdefault(rid, []).append(rest)
    return {rid: sorted(r) for rid, r in rows.items()}


def compare_rows(a: dict[str, list], b: dict[str, list]) -> dict[str, Any]:
    """How two runs' answers differ: requests answered by only one, and requests whose rows differ."""
    both = set(a) & set(b)
    return {"only_first": len(set(a) - set(b)), "only_second": len(set(b) - set(a)),
            "requests_differing": sum(a[r] != b[r] for r in both), "identical": a == b}


def exactly_once(folder: Path, task: str, accepted: list[str]) -> dict[str, Any]:
    """Whether every accepted request has its answer once: its rows present, none repeated (targets: one
    row per (request_id, rank); creatives: per (request_id, variant)), no answer to another id."""
    import pyarrow.parquet as pq

    table = pq.read_table(Path(folder) / task, columns=list(ROW_KEYS[task][:2]))
    keys = list(zip(*(table.column(c).to_pylist() for c in ROW_KEYS[task][:2])))
    ids = {k[0] for k in keys}
    want = set(accepted)
    out = {"rows": len(keys), "repeated_rows": len(keys) - len(set(keys)), "missing": len(want - ids),
           "unexpected": len(ids - want)}
    out["every_request_once"] = out["repeated_rows"] == out["missing"] == out["unexpected"] == 0
    return out


# --- the three phases ------------------------------------------------------------------------------
def generate_config(args: argparse.Namespace, task: str, n: int, out: Path, **over: Any) -> Any:
    from pipelines.generate import GenerateJobConfig

    return GenerateJobConfig(task=task, requests=args.requests if task == "targets" else args.creative_requests,
                             index=args.index if task == "targets" else None, model=args.model, out=out,
                             executor="ray", concurrency=n, progress=False, overwrite=True,
                             # the synthetic indexes hold random vectors with no query embedder: the trie alone
                             **({"targets": {"fusion": "generative"}} if task == "targets" else {}), **over)


def run_generate_once(args: argparse.Namespace, task: str, n: int, out: Path, **over: Any) -> dict[str, Any]:
    from pipelines.generate import run_generate

    shutil.rmtree(out, ignore_errors=True)  # a fresh run: a resumed one would skip every partition
    with GpuSampler(args.gpus_visible) as gpu:
        t0 = time.perf_counter()
        res = run_generate(generate_config(args, task, n, out, **over))
        wall = time.perf_counter() - t0
    from bench.generate_gpu import _digest

    rows = output_rows(out, task)
    return {"task": task, "concurrency": n, "out": str(out), "counts": res["counts"],
            "requests_per_s": res["throughput"]["requests_per_s"],
            "requests_per_s_end_to_end": round(res["counts"]["answered"] / wall, 4) if wall > 0 else 0.0,
            "wall_s": round(wall, 3), "timings_s": res["timings_s"], "throughput": res["throughput"],
            "rows_sha256": _digest(rows), "gpu": gpu.result}


def calibrate(args: argparse.Namespace) -> float:
    """The ``verify=auto`` cost model, measured once before the timed runs (``bench.generate_gpu.calibrate_once``).
    On a GPU its key names the GPU, so every actor reads this one. A CPU's key names the torch threads,
    which differ by actor count: it is measured at the threads the job gives its actors at each N (the
    actors would each measure their own, and decide verification differently)."""
    from adbatch.serving.generators import DeviceChoice

    from bench.generate_gpu import calibrate_once

    if not args.cpu:
        return calibrate_once(args.model, DeviceChoice.AUTO)
    import torch

    from pipelines.generate import _actor_resources
    from pipelines.ray_runtime import init_ray

    init_ray()  # the local Ray the jobs join: its CPUs decide the actors' threads
    threads = torch.get_num_threads()
    seconds = 0.0
    try:
        for n in args.counts:
            torch.set_num_threads(_actor_resources(generate_config(args, "targets", n, Path("unused")))[1])
            seconds += calibrate_once(args.model, DeviceChoice.AUTO)
    finally:
        torch.set_num_threads(threads)
    return round(seconds, 2)


def prepare_model(args: argparse.Namespace, state: dict[str, Any], decoding: bool) -> None:
    """Before a phase's timed runs: the model resolved (a GGUF converted once, cached, not by every actor or
    worker at once) and, for decoding with ``verify=auto`` (the default), its cost model measured."""
    from adbatch.models import resolve_model

    resolve_model(args.model)
    from pipelines.generate import GenerateJobConfig

    if decoding and GenerateJobConfig().targets.verify.value == "auto":
        state["calibration_s"] = calibrate(args)


def phase_generate(args: argparse.Namespace, work: Path, state: dict[str, Any]) -> None:
    prepare_model(args, state, decoding=True)
    tasks = ["targets"] + (["creatives"] if args.creative_requests else [])
    for task in tasks:
        runs = state.setdefault("generate", {}).setdefault(task, {})
        for n in args.counts:
            log.info("generate %s with %d actor(s)", task, n)
            runs[str(n)] = run_generate_once(args, task, n, work / f"{task}_n{n}")
            _save(work, state)
        if len(args.counts) > 1:
            first, last = (output_rows(work / f"{task}_n{n}", task) for n in (args.counts[0], args.counts[-1]))
            runs["compare"] = compare_rows(first, last)


def train_config(args: argparse.Namespace) -> Any:
    from adbatch.training import TrainConfig

    from bench.train_throughput import parse_variant, with_overrides

    cfg = with_overrides(TrainConfig(), parse_variant(args.train)) if args.train else TrainConfig()
    return cfg.replace(epochs=args.epochs) if args.epochs is not None else cfg


def recall_at_10(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """recall@10 (and the other metrics of ``evaluate_targeting``) of a trained model folder, through
    ``bench.train_eval.evaluate`` (10 beams, top 10)."""
    import torch

    from adbatch.index.build import load_index
    from adbatch.training import default_ad_texts

    from bench.train_eval import evaluate, load_base, title_qrels
    from pipelines.train import read_ad_texts, read_validation_qrels

    index = load_index(args.index)
    if args.eval_queries:
        qrels, what = read_validation_qrels(args.eval_queries), f"queries of {args.eval_queries}"
    else:
        columns = (index.manifest.get("config") or {}).get("columns")
        texts = read_ad_texts(args.ads, columns) if args.ads else default_ad_texts(index)
        qrels = title_qrels(index.ad_ids, texts, args.eval_titles)
        what = f"{len(qrels)} ad titles -> their ad (indexing recall)"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = load_base(str(model_dir), False, device)
    t0 = time.perf_counter()
    metrics = evaluate(model.to(device).eval(), tok, index, qrels, None, 10)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"qrels": what, "seconds": round(time.perf_counter() - t0, 2),
            **{k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}}


def phase_train(args: argparse.Namespace, work: Path, state: dict[str, Any]) -> None:
    from adbatch.training import read_training_record

    from pipelines.train import TrainJobConfig, run_train

    prepare_model(args, state, decoding=False)
    cfg = train_config(args)
    state["train_config"] = cfg.to_dict()
    runs = state.setdefault("train", {})
    for n in args.counts:
        out = work / f"model_n{n}"
        shutil.rmtree(out, ignore_errors=True)
        job = TrainJobConfig(index=args.index, out=out, init_model=args.model, ads=args.ads, queries=args.queries,
                             num_workers=n, use_gpu=False if args.cpu else None, train=cfg)
        log.info("train with %d worker(s)", n)
        with GpuSampler(args.gpus_visible) as gpu:
            t0 = time.perf_counter()
            res = run_train(job)
            wall = time.perf_counter() - t0
        rec = read_training_record(out)
        tr = rec["train"]
        run = {"workers": n, "world_size": rec.get("world_size"), "wall_s": round(wall, 3),
               "seconds": tr["seconds"], "steps": tr["steps"], "epochs_done": tr["epochs_done"],
               "tokens_per_s_rank0": tr["tokens_per_s"], "tokens_per_s": tr.get("tokens_per_s_all_ranks"),
               "examples": tr.get("examples_all_ranks"), "tokens": tr.get("tokens_all_ranks"),
               "mfu_rank0": tr.get("mfu"), "first_loss": tr["first_loss"], "final_loss": tr["final_loss"],
               "losses": rec.get("losses") or [], "job": {k: v for k, v in res.items() if not k.startswith("train_")},
               "gpu": gpu.result}
        if not args.no_eval:
            run["eval"] = recall_at_10(args, out)
        runs[str(n)] = run
        _save(work, state)
    if len(args.counts) > 1:
        one, many = runs[str(args.counts[0])], runs[str(args.counts[-1])]
        runs["same_examples"] = one["examples"] == many["examples"] and one["tokens"] == many["tokens"]
        if one.get("tokens_per_s") and many.get("tokens_per_s"):
            runs["speedup_tokens_per_s"] = round(many["tokens_per_s"] / one["tokens_per_s"], 3)


def kill_batch_size(accepted: int, actors: int, default: int) -> int | None:
    """None (the job's default batch) when it gives every actor at least two blocks, else the largest
    batch whose blocks give three per actor (the fault hook fires on an actor's second call, and an actor call
    maps a block of ``BLOCK_BATCHES`` batches: adbatch.serving.generators.block_rows)."""
    from adbatch.serving.generators import BLOCK_BATCHES, block_rows

    if accepted >= 2 * actors * block_rows(default):
        return None
    return max(1, accepted // (3 * actors * BLOCK_BATCHES))


def phase_kill(args: argparse.Namespace, work: Path, state: dict[str, Any]) -> None:
    import pipelines.generate as pg
    from adbatch.serving.generators import default_batch_size
    from adbatch.serving.requests import GenerateTask, RequestValidationConfig, validate_requests

    prepare_model(args, state, decoding=True)
    n = args.counts[-1]
    accepted = validate_requests(args.requests, GenerateTask.TARGETS, RequestValidationConfig()).accepted
    ids = accepted.column("request_id").to_pylist()
    batch = kill_batch_size(len(ids), n, default_batch_size("cuda" if args.gpus_visible and not args.cpu else "cpu"))
    flag = work / "kill-once.flag"
    flag.write_text("the first generation actor to reach its second batch deletes this and exits\n")
    os.environ[pg.FAULT_KILL_ENV] = str(flag)
    try:
        res = run_generate_once(args, "targets", n, work / "targets_kill", batch_size=batch)
    finally:
        os.environ.pop(pg.FAULT_KILL_ENV, None)
    res.update(batch_size=batch or "default", actor_killed=not flag.exists(),
               **exactly_once(work / "targets_kill", "targets", ids))
    undisturbed = work / f"targets_n{n}"
    if (undisturbed / "targets").is_dir():
        res["same_as_undisturbed_run"] = compare_rows(output_rows(undisturbed, "targets"),
                                                      output_rows(work / "targets_kill", "targets"))
    flag.unlink(missing_ok=True)
    state["kill"] = res


# --- report ----------------------------------------------------------------------------------------
def _util(gpu: dict[str, Any]) -> str:
    if not gpu.get("sampled"):
        return f"- ({gpu.get('why', 'not sampled')})"
    return " / ".join("-" if u is None else f"{u:.0f}%" for u in gpu["median_util_pct"])


def report(state: dict[str, Any]) -> str:
    lines = [f"## Scale-out: {state.get('device', '?')}, 1 vs {state.get('gpus', '?')} "
             f"{'CPU actors / workers' if state.get('cpu') else 'GPUs (one per actor / worker)'}", ""]
    gen = state.get("generate") or {}
    if gen:
        lines += ["| generate | actors | requests | requests/s (job) | requests/s (end to end) | rows sha256 | "
                  "median GPU util |", "|---|---|---|---|---|---|---|"]
        for task, runs in gen.items():
            for n, r in runs.items():
                if n == "compare":
                    continue
                lines.append(f"| {task} | {n} | {r['counts']['answered']} | {r['requests_per_s']:.2f} | "
                             f"{r['requests_per_s_end_to_end']:.2f} | {r['rows_sha256'][:12]} | {_util(r['gpu'])} |")
        for task, runs in gen.items():
            c = runs.get("compare")
            if c:
                lines.append(f"\n{task}: 1 vs N actors {'IDENTICAL' if c['identical'] else 'DIFFER'} "
                             f"({c['requests_differing']} requests differ, {c['only_first'] + c['only_second']} "
                             "answered by one run only)"
                             + ("; on CPU the actors' torch threads differ by N, and with them the verify=auto "
                                "cost model (keyed by threads) that picks the beams verified"
                                if state.get("cpu") and task == "targets" and not c["identical"] else ""))
        lines.append("")
    tr = state.get("train") or {}
    if tr:
        lines += ["| train workers (world size) | tokens/s (job) | tokens/s (rank 0) | examples | seconds | wall s | "
                  "loss first -> final | recall@10 | median GPU util |", "|---|---|---|---|---|---|---|---|---|"]
        for n, r in tr.items():
            if not isinstance(r, dict):
                continue
            ev = r.get("eval") or {}
            rec = ev.get("recall@10")
            lines.append(f"| {n} ({r['world_size']}) | {r['tokens_per_s'] or 0:,.0f} | "
                         f"{r['tokens_per_s_rank0']:,.0f} | {r['examples']} | {r['seconds']:.1f} | {r['wall_s']:.1f} | "
                         f"{r['first_loss']:.3f} -> {r['final_loss']:.3f} | {'-' if rec is None else f'{rec:.4f}'} | "
                         f"{_util(r['gpu'])} |")
        if "same_examples" in tr:
            lines.append(f"\nsame examples and tokens at every worker count: {tr['same_examples']}; "
                         f"speedup (job tokens/s): {tr.get('speedup_tokens_per_s', '-')}")
        lines.append("")
    k = state.get("kill")
    if k:
        lines.append(f"kill test ({k['concurrency']} actors, batch {k['batch_size']}): actor killed "
                     f"{k['actor_killed']}; every request answered once {k['every_request_once']} "
                     f"({k['rows']} rows, {k['repeated_rows']} repeated, {k['missing']} missing, "
                     f"{k['counts']['duplicate_answers_dropped']} duplicate answers dropped by the job)"
                     + (f"; same rows as the undisturbed run: {k['same_as_undisturbed_run']['identical']}"
                        if "same_as_undisturbed_run" in k else ""))
    return "\n".join(lines).rstrip() + "\n"


def plot_losses(state: dict[str, Any], path: Path) -> str:
    """The training loss (rank 0's logged steps) of each worker count against epochs; what was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no loss plot"
    runs = {n: r for n, r in (state.get("train") or {}).items() if isinstance(r, dict) and r.get("losses")}
    if not runs:
        return "no loss curve recorded: no plot"
    fig, ax = plt.subplots(figsize=(7, 4))
    for n, r in runs.items():
        per_step = r["epochs_done"] / max(1, r["steps"])  # a step of N workers takes N micro-batches
        ax.plot([(s + 1) * per_step for s, _ in r["losses"]], [v for _, v in r["losses"]], label=f"{n} worker(s)")
    ax.set(xlabel="epoch", ylabel="target-token loss (rank 0)", yscale="log", title="training loss")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return str(path)


def _save(work: Path, state: dict[str, Any]) -> None:
    from bench.generate_gpu import _write_json

    _write_json(work / "state.json", state)


# --- arguments -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=Path, help="targets request Parquet (request_id, query)")
    p.add_argument("--creative-requests", type=Path, default=None,
                   help="creatives request Parquet (request_id, ad_id + ad fields); none = targets only")
    p.add_argument("--index", type=Path, help="index folder (adbatch index), built with the model's tokenizer")
    p.add_argument("--model", default=None,
                   help="HF folder or GGUF: generates, and is the starting model of the training (default: the default model)")
    p.add_argument("--ads", type=Path, default=None, help="the index's ad corpus (titles; required for a codes index)")
    p.add_argument("--queries", type=Path, default=None, help="labelled train pairs (query, ad_id) for training")
    p.add_argument("--eval-queries", type=Path, default=None,
                   help="held-out pairs (query, ad_id[, grade]) for recall@10; none = ad titles -> their ad")
    p.add_argument("--eval-titles", type=int, default=256, help="ad titles evaluated without --eval-queries")
    p.add_argument("--no-eval", action="store_true", help="skip recall@10 of the trained models")
    p.add_argument("--gpus", type=int, default=None,
                   help="N: the runs are at 1 and N (default: every GPU nvidia-smi lists; --cpu: 2 workers)")
    p.add_argument("--epochs", type=float, default=None, help="training epochs at every N (default: TrainConfig's)")
    p.add_argument("--train", default="", help="TrainConfig overrides, e.g. batch_tokens=32768,pseudo_queries.per_ad=8")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    p.add_argument("--cpu", action="store_true", help="CPU actors and workers (no GPU needed): a plumbing check")
    p.add_argument("--smoke", action="store_true",
                   help="--cpu on a tiny random model, a 60-ad corpus, its index and 48 requests made in --work")
    p.add_argument("--work", type=Path, default=None, help="work folder (default /tmp/adbatch_scale_out[_smoke])")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Everything that can be checked before Ray, torch or a GPU: files, folders, numbers, the GPUs."""
    phases = [s.strip() for s in args.phases.split(",") if s.strip()]
    bad = sorted(set(phases) - set(PHASES))
    if bad or not phases:
        p.error(f"--phases: {bad or 'none given'}; choose from {', '.join(PHASES)}")
    args.phase_list = [ph for ph in PHASES if ph in phases]
    if args.smoke:
        args.cpu = True
        return  # the inputs are made in --work
    for name in ("requests", "index"):
        if getattr(args, name) is None:
            p.error(f"--{name} is required (or --smoke)")
    for name in ("requests", "creative_requests", "ads", "queries", "eval_queries"):
        path = getattr(args, name)
        if path is not None and not path.is_file() and not path.is_dir():
            p.error(f"--{name.replace('_', '-')}: {path} not found")
    if not (args.index / "manifest.json").is_file():
        p.error(f"--index: {args.index} is not an index folder (no manifest.json; adbatch index writes one)")
    if args.model and args.model != "default" and not Path(args.model).exists():  # "default": the default model
        p.error(f"--model: {args.model} not found")
    if args.epochs is not None and args.epochs <= 0:
        p.error(f"--epochs must be > 0, got {args.epochs}")
    if args.eval_titles < 1:
        p.error(f"--eval-titles must be >= 1, got {args.eval_titles}")
    if args.train:
        from bench.train_throughput import parse_variant

        try:
            parse_variant(args.train)
        except SystemExit as exc:
            p.error(f"--train: {exc}")


def resolve_counts(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``args.counts``: the actor / worker counts to run (1 and N), from ``--gpus`` and the GPUs visible."""
    args.gpus_visible = 0 if args.cpu else visible_gpus()
    if args.cpu:
        n = args.gpus if args.gpus is not None else 2
    else:
        if args.gpus_visible == 0:
            p.error("no GPU: nvidia-smi lists none (or is missing). This benchmark is for a multi-GPU host; "
                    "--cpu runs it on CPU actors and workers (a plumbing check), --smoke on made-up inputs")
        n = args.gpus if args.gpus is not None else args.gpus_visible
        if n > args.gpus_visible:
            p.error(f"--gpus {n}: only {args.gpus_visible} GPU(s) visible")
    if n < 1:
        p.error(f"--gpus must be >= 1, got {n}")
    if n == 1:
        log.warning("N = 1: one run per phase, nothing to compare it with")
    args.counts = sorted({1, n})


def make_smoke_inputs(args: argparse.Namespace, work: Path) -> None:
    """--smoke: a tiny random-init model over the default tokenizer, 60 ads, their text index, 48 targets
    requests and 8 creatives requests, made with ``bench.generate_gpu``'s helpers; small training batches."""
    import pyarrow.parquet as pq

    from adbatch.index.build import IndexConfig, build_index
    from adbatch.index.clustering import ClusterConfig
    from adbatch.index.corpus import CorpusConfig
    from adbatch.index.ids import IdScheme, RenderConfig

    from bench.generate_gpu import EXAMPLE_ADS, make_corpus, make_random_model, make_requests

    model = make_random_model(work / "random-model-tiny", None, tiny=True)
    corpus = work / "corpus.parquet"
    make_corpus(corpus, 60)
    index = work / "index"
    if not (index / "manifest.json").is_file():
        cfg = IndexConfig(columns=CorpusConfig(text="title", description="description", category="industry",
                                               embedding="embedding"),
                          cluster=ClusterConfig(branching=4, leaf_size=8), render=RenderConfig(scheme=IdScheme.TEXT),
                          tokenizer=str(model))
        build_index(corpus, index, cfg, progress=False)
    make_requests(work / "requests.parquet", 48, corpus)
    creatives = pq.read_table(REPO / "examples" / "requests_creatives.parquet").slice(0, 8)
    pq.write_table(creatives, work / "requests_creatives.parquet")
    args.model, args.ads, args.index = str(model), corpus, index
    args.requests, args.creative_requests = work / "requests.parquet", work / "requests_creatives.parquet"
    args.epochs = args.epochs or 2
    args.train = args.train or "batch_tokens=1024,pseudo_queries.per_ad=2,log_every=1"
    args.eval_titles = min(args.eval_titles, 16)
    log.info("smoke inputs in %s (ads from %s)", work, EXAMPLE_ADS)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = build_parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_args(p, args)
    resolve_counts(p, args)
    work = args.work or Path("/tmp/adbatch_scale_out_smoke" if args.smoke else "/tmp/adbatch_scale_out")
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    out_dir = Path(os.environ.get("OUT") or REPO / "bench" / "out")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.smoke:
        make_smoke_inputs(args, work)

    from pipelines.ray_runtime import prefer_loopback_ray

    prefer_loopback_ray()  # before anything imports Ray (environment() does): a local Ray on 127.0.0.1
    from bench.generate_gpu import _read_json, environment

    state: dict[str, Any] = _read_json(work / "state.json") or {}
    env = environment()
    state.update(env=env, device=env.get("cuda") or "cpu", gpus=args.counts[-1], cpu=args.cpu,
                 args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    phases = {"generate": phase_generate, "train": phase_train, "kill": phase_kill}
    try:
        for name in args.phase_list:
            t0 = time.perf_counter()
            phases[name](args, work, state)
            state.setdefault("phase_seconds", {})[name] = round(time.perf_counter() - t0, 1)
            _save(work, state)
    finally:
        if "train" in state:
            state["loss_plot"] = plot_losses(state, out_dir / "scale_out_loss.png")
        text = report(state)
        print(text, flush=True)
        if "train" in state and not state["loss_plot"].endswith(".png"):
            print(state["loss_plot"], flush=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "scale_out.json").write_text(json.dumps(state, indent=1, sort_keys=True, default=str) + "\n")
        (out_dir / "scale_out.md").write_text(text)
        _save(work, state)
    return state


if __name__ == "__main__":
    state = main()
    kill = state.get("kill") or {}
    sys.exit(0 if kill.get("every_request_once", True) else 1)
