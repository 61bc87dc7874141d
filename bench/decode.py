"""Benchmark: trie-constrained targeting search — HF constrained beam search vs today's engine vs ours.

Not a test. Methods (``--methods``): ``hf`` (HF generate with a trie ``prefix_allowed_tokens_fn``),
``old`` (the decoding package frozen at commit 93c19ce, ``off`` mode; extracted by
``scripts/make_baseline_engine.sh`` into ``.carry/baseline_decoding``, skipped with a warning when
absent), ``off`` / ``auto`` (the current ``adbatch.decoding``). All get the same trie. HF ends a
hypothesis at EOS (text) or, through a StoppingCriteria, at a trie leaf (codes).

Targets:
  --target cpu : the default model (SmolLM2-135M), a trie of Home Depot titles (text scheme:
                 title tokens + EOS), real Home Depot queries, small sweep. Writes decode_cpu.*.
  --target gpu : random-init bf16 LlamaForCausalLM models built on the GPU, synthetic tries shaped
                 like our index (codes: k=10 clusters per level, leaves <= 100; text: Zipf 15-30
                 token titles + EOS). One invocation, sections (each decode_gpu_<section>.md/.jsonl):
    default     (a) SmolLM2-135M shape, 5k-ad tries, 10 beams / top 10, batches 64/256/1024
    8b          (b) Llama-3-8B shape, 100k-ad tries, 8 beams, batches 1/16/64/256
    creatives   (c) --creatives: greedy headlines/s, HF generate vs generate_creatives
    compressed  (d) --compressed: off/auto on a 2:4 INT4 copy next to the dense model
    first_batch (e) --compressed --first-batch: the first batch of a fresh engine of the copy with no saved
                linear plan, with the saved plan, and with the saved plan after the engine's warm-up
  --smoke runs every gpu section with tiny models on the CPU (checks the script, times nothing).

Every point: one untimed warm-up batch per method at the point's shape (graph capture, kernel
compiles, allocator), then ``--repeats`` timed passes, method order rotated per repeat; the median
is reported. ``--budget-s`` stops starting new points and sections.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import inspect
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import adbatch.decoding as ours  # noqa: E402
from adbatch.index.trie import Trie  # noqa: E402

log = logging.getLogger("bench.decode")

BASELINE_DIR = ROOT / ".carry" / "baseline_decoding"
SUM_STATS = ("steps", "beams_verified", "verify_passes", "decode_rows", "verify_tokens")


def load_baseline() -> Any | None:
    """The frozen engine package ``adbatch_baseline_decoding`` (method ``old``), or None."""
    if not (BASELINE_DIR / "adbatch_baseline_decoding" / "__init__.py").is_file():
        log.warning("%s missing (run scripts/make_baseline_engine.sh): method 'old' skipped", BASELINE_DIR)
        return None
    if str(BASELINE_DIR) not in sys.path:
        sys.path.insert(0, str(BASELINE_DIR))
    import adbatch_baseline_decoding as old

    return old


def baseline_commit() -> str | None:
    f = BASELINE_DIR / "adbatch_baseline_decoding" / "COMMIT"
    return f.read_text().strip() if f.is_file() else None


class Budget:
    """Wall-clock budget of the whole run: new points and sections start only while time is left."""

    def __init__(self, seconds: float) -> None:
        self.t0, self.seconds = time.perf_counter(), seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()


# ---------------------------------------------------------------- HF reference
class HFTrieAllowed:
    """``prefix_allowed_tokens_fn`` for HF generate over our trie's CSR arrays (numpy), memoized by
    prefix: the usual way to constrain HF beam search (Python per beam per step)."""

    def __init__(self, trie: Trie, prompt_len: int, eos: int) -> None:
        self.ptr = trie.child_ptr.cpu().numpy().astype(np.int64)
        self.tok = trie.child_tokens.cpu().numpy().astype(np.int64)
        self.ids = trie.child_ids.cpu().numpy().astype(np.int64)
        self.prompt_len, self.eos = prompt_len, eos
        self.memo: dict[tuple[int, ...], int] = {(): 0}

    def node(self, gen: tuple[int, ...]) -> int:
        n = self.memo.get(gen)
        if n is None:
            parent = self.node(gen[:-1])
            if parent < 0:
                n = -1
            else:
                a, b = self.ptr[parent], self.ptr[parent + 1]
                i = a + int(np.searchsorted(self.tok[a:b], gen[-1]))
                n = int(self.ids[i]) if i < b and self.tok[i] == gen[-1] else -1
            self.memo[gen] = n
        return n

    def is_done(self, input_ids: torch.Tensor) -> torch.Tensor:
        """StoppingCriteria body: ``Bool[N]``, a hypothesis ends at a childless (leaf) node."""
        out = []
        for seq in input_ids[:, self.prompt_len:].tolist():
            n = self.node(tuple(seq))
            out.append(n < 0 or self.ptr[n + 1] == self.ptr[n])
        return torch.tensor(out, device=input_ids.device)

    def __call__(self, batch_id: int, input_ids: torch.Tensor) -> list[int]:
        n = self.node(tuple(input_ids[self.prompt_len:].tolist()))
        if n < 0:
            return [self.eos]
        return self.tok[self.ptr[n]:self.ptr[n + 1]].tolist() or [self.eos]


def hf_search(model, prompts: list[list[int]], trie: Trie, beams: int, k: int, eos: int, pad: int):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    dev = next(model.parameters()).device
    from transformers import StoppingCriteria, StoppingCriteriaList

    allowed = HFTrieAllowed(trie, width, eos)

    class AtLeaf(StoppingCriteria):  # codes scheme: no EOS, a hypothesis ends at a trie leaf
        def __call__(self, input_ids, scores, **kwargs):
            return allowed.is_done(input_ids)

    out = model.generate(
        ids.to(dev), attention_mask=mask.to(dev), num_beams=beams, num_return_sequences=k,
        prefix_allowed_tokens_fn=allowed, max_new_tokens=trie.max_depth,
        stopping_criteria=StoppingCriteriaList([AtLeaf()]),
        length_penalty=0.0, early_stopping=False, do_sample=False, eos_token_id=eos, pad_token_id=pad,
        output_scores=True, return_dict_in_generate=True)
    seqs = out.sequences[:, width:].reshape(len(prompts), k, -1)
    seqs = torch.where(seqs == pad, -1, seqs) if pad != eos else seqs
    return seqs, out.sequences_scores.view(len(prompts), k)


def rows_of(trie: Trie, seqs: torch.Tensor) -> list[list[int]]:
    """HF sequences [Q, k, T] (-1/EOS padded after EOS) -> first ad row at each terminal node."""
    Q, k, T = seqs.shape
    flat = seqs.reshape(Q * k, T).cpu().clone()
    nodes = torch.zeros(Q * k, dtype=torch.long)
    ptr = trie.terminal_ptr.cpu().long()
    rows = trie.terminal_rows.cpu().long()
    tr = trie.to("cpu")
    for j in range(T):  # positions, batched over sequences
        col = flat[:, j]
        stop = tr.is_terminal(nodes) & (nodes >= 0)
        nxt = tr.step(nodes, col.clamp(min=0))
        nodes = torch.where(stop | (col < 0), nodes, nxt)
    out = torch.where(nodes >= 0, rows[ptr[nodes.clamp(min=0)]], -1)
    return out.view(Q, k).tolist()


# ---------------------------------------------------------------- runners and timing
def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def device_of(model) -> torch.device:
    return next(model.parameters()).device


Runner = Callable[[list[list[int]]], tuple[list[list[int]], list[list[float]], dict]]


def release(dev: torch.device) -> None:
    """Collect what was dropped and return the freed blocks to the driver: what is built next starts from an empty
    cache (an 8B model's engines and copies fill most of an 80 GB card)."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def engine_runner(mod, model, trie: Trie, beams: int, k: int, verify: str, qbatch: int, cost, profile: bool,
                  formats: str | None = None) -> Runner:
    """One query batch through ``mod.search_targets`` (``mod``: adbatch.decoding or the baseline);
    ``formats``: the search's ``linear_formats`` (None: the config's default)."""
    # verify as a string: ConfigBase coerces it to the module's own VerifyMode; ``batch`` holds <= qbatch
    # queries, searched together (the baseline engine still takes that size as a config field)
    params = inspect.signature(mod.TargetSearchConfig).parameters
    sized = {"batch_size": qbatch} if "batch_size" in params else {}
    if formats is not None:
        sized["linear_formats"] = formats
    cfg = mod.TargetSearchConfig(num_beams=beams, top_k=k, verify=verify, profile=profile, **sized)

    def run(batch):
        r = mod.search_targets(model, batch, trie, cfg, cost)
        # the baseline engine (bench/results' copy of the loop before issue 16) returns a plain dict
        return r.rows.tolist(), r.scores.tolist(), r.stats.flat() if hasattr(r.stats, "flat") else r.stats
    run.config = cfg  # what a warm-up of this runner's engine plans for
    return run


def hf_runner(model, trie: Trie, beams: int, k: int, eos: int, pad: int) -> Runner:
    def run(batch):
        seqs, sc = hf_search(model, batch, trie, beams, k, eos, pad)
        return rows_of(trie, seqs), sc.float().cpu().tolist(), {}
    return run


def runner_for(name: str, ctx: dict, beams: int, k: int, qbatch: int) -> Runner | None:
    """``name``: hf | old | off | auto | always, optionally ``@variant`` (a model in ctx['variants']), and
    ``+FORMATS`` (the search's ``linear_formats``, e.g. ``+int4``: the compressed model's per-bucket plan without
    the FP8 copies; none: the config's default). None when the method does not run at this point (HF above its
    batch cap, no baseline)."""
    name, _, formats = name.partition("+")
    base, _, variant = name.partition("@")
    model, cost = ctx["variants"][variant] if variant else (ctx["model"], ctx["cost"])
    if base == "hf":
        if qbatch > ctx["hf_max_batch"]:
            return None
        return hf_runner(model, ctx["trie"], beams, k, ctx["eos"], ctx["pad"])
    if base == "old":
        if ctx["old"] is None or qbatch > ctx.get("old_max_batch", qbatch):
            return None
        return engine_runner(ctx["old"], model, ctx["trie"], beams, k, "off", qbatch, None, ctx["profile"])
    return engine_runner(ours, model, ctx["trie"], beams, k, base, qbatch, cost, ctx["profile"], formats or None)


def time_pass(run: Runner, qs: list[list[int]], qbatch: int, dev) -> dict:
    """One timed pass over ``qs`` in batches of ``qbatch``: rows, scores, seconds, summed stats."""
    total = 0.0
    rows: list[list[int]] = []
    scores: list[list[float]] = []
    stats: dict = {}
    for s in range(0, len(qs), qbatch):
        sync(dev)
        t0 = time.perf_counter()
        r, sc, st = run(qs[s:s + qbatch])
        sync(dev)
        total += time.perf_counter() - t0
        rows += r
        scores += sc
        for key, val in st.items():
            if key in SUM_STATS or key.startswith("ms_"):
                stats[key] = round(stats.get(key, 0) + val, 2)
        if "tree_tokens_max" in st:
            stats["tree_tokens_max"] = max(stats.get("tree_tokens_max", 0), st["tree_tokens_max"])
    return {"rows": rows, "scores": scores, "time": total, "stats": stats}


#: a gap between kernels longer than this is counted as host time (launch latency inside a graph is ~1-5 us)
GAP_LONG_US = 20


def _gpu_idle(events) -> tuple[float, float, float, int]:
    """From a profile's events: us from the first kernel's start to the last one's end, us the GPU sat idle in
    gaps of at most GAP_LONG_US, us in longer gaps, and how many of those."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return 0.0, 0.0, 0.0, 0
    short = long_ = 0.0
    n_long, end = 0, spans[0][1]
    for a, b in spans[1:]:
        if a - end > GAP_LONG_US:
            long_, n_long = long_ + a - end, n_long + 1
        elif a > end:
            short += a - end
        end = max(end, b)
    return end - spans[0][0], short, long_, n_long


def _host_table(title: str, stats: dict, by: int, top: int) -> list[str]:
    """cProfile ``stats`` as markdown rows, the ``top`` largest by field ``by`` (2: own time, 3: cumulative)."""
    lines = [f"| {title} | calls | own ms | cumulative ms |", "|---|---:|---:|---:|"]
    for (file, line, name), (_, nc, tt, ct, _) in sorted(stats.items(), key=lambda kv: -kv[1][by])[:top]:
        where = f"{Path(file).name}:{line}" if line else file
        lines.append(f"| {name} ({where}) | {nc} | {1e3 * tt:.2f} | {1e3 * ct:.2f} |")
    return lines


def trace_batch(run: Runner, batch: list[list[int]], dev, top: int = 14) -> str:
    """One more (untimed) batch under ``torch.profiler``: its wall time next to the summed device time
    of the kernels it ran (graph replays included), where the GPU sat idle (gaps between kernels: short
    ones are launch latency inside a graph, long ones host time the GPU waited through), the kernels
    with the most device time, and -- one more batch under ``cProfile`` -- the host functions with the
    most time of their own (a blocking sync shows as its caller's wait), as markdown."""
    import cProfile
    import pstats

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        run(batch)
        sync(dev)
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.device_time_total > 0]
    busy = sum(e.device_time_total for e in kernels)
    span, short, long_, n_long = _gpu_idle(prof.events())
    lines = [f"wall {1e3 * wall:.2f} ms (profiled), kernels {busy / 1e3:.2f} ms of device time "
             f"({len(kernels)} distinct, {sum(e.count for e in kernels)} launches); first to last kernel "
             f"{span / 1e3:.2f} ms, GPU idle {short / 1e3:.2f} ms in gaps <= {GAP_LONG_US} us, "
             f"{long_ / 1e3:.2f} ms in {n_long} longer gaps", "",
             "| kernel | calls | device ms | share |", "|---|---:|---:|---:|"]
    for e in sorted(kernels, key=lambda e: -e.device_time_total)[:top]:
        lines.append(f"| {e.key[:90]} | {e.count} | {e.device_time_total / 1e3:.3f} | "
                     f"{e.device_time_total / max(busy, 1e-9):.1%} |")
    prof_py = cProfile.Profile()
    sync(dev)
    t0 = time.perf_counter()
    prof_py.enable()
    run(batch)
    sync(dev)
    prof_py.disable()
    wall_py = time.perf_counter() - t0
    stats = pstats.Stats(prof_py).stats  # (file, line, name) -> (cc, nc, own s, cumulative s, callers)
    ours = {k: v for k, v in stats.items() if any(f"/{d}/" in k[0] for d in ("adbatch", "kernels"))}
    lines += ["", f"host, one more batch under cProfile: wall {1e3 * wall_py:.2f} ms", ""]
    lines += _host_table("function", stats, by=2, top=top) + [""]
    lines += _host_table("ours, by cumulative time", ours, by=3, top=top)
    return "\n".join(lines)


def same_sets(a: list[list[int]], b: list[list[int]]) -> float:
    return float(np.mean([set(x) == set(y) for x, y in zip(a, b)]))


def bench_point(section: str, scheme: str, names: list[str], ctx: dict, beams: int, qbatch: int,
                queries: list[list[int]], repeats: int, q1_queries: int) -> list[dict]:
    """All methods at one (beams, query batch): warm-up, ``repeats`` rotated timed passes, medians."""
    k = min(beams, 10)
    n_q = max(qbatch, q1_queries) if qbatch == 1 else qbatch
    qs = queries[:n_q]
    dev = ctx.get("dev") or device_of(ctx["model"])
    runners = {n: r for n in names if (r := runner_for(n, ctx, beams, k, qbatch)) is not None}
    for run in runners.values():  # untimed: graph capture, kernel compiles, allocator growth
        gc.collect()
        run(qs[:qbatch])
        sync(dev)
    res: dict[str, dict] = {}
    times: dict[str, list[float]] = {n: [] for n in runners}
    order0 = list(runners)
    # Method order rotated each repeat: on the H200 the method run right after HF generate
    # measured up to 1.8x slower on identical work (allocator/clock effects).
    for rep in range(repeats):
        order = order0[rep % len(order0):] + order0[: rep % len(order0)]
        for name in order:
            gc.collect()
            r = time_pass(runners[name], qs, qbatch, dev)
            res.setdefault(name, r)  # searches are deterministic: the first pass's answers stand
            times[name].append(r["time"])
    med = {n: float(np.median(t)) for n, t in times.items()}
    qps = {n: n_q / med[n] for n in runners}
    if ctx.get("trace"):
        for name, run in runners.items():
            ctx["trace"](f"{section} {scheme} {name} {beams}x{qbatch}", trace_batch(run, qs[:qbatch], dev))
    out = []
    for name, r in res.items():
        base, _, variant = name.partition("+")[0].partition("@")
        suffix = "@" + variant if variant else ""
        t = times[name]
        row = {"section": section, "scheme": scheme, "method": name, "beams": beams, "top_k": k,
               "query_batch": qbatch, "queries": n_q, "qps": qps[name],
               "latency_ms": 1e3 * med[name] / -(-n_q // qbatch), "times_s": [round(x, 4) for x in t],
               "spread": (max(t) - min(t)) / med[name]}
        for ref in ("hf", "old", "off"):
            if ref in res and ref != name:
                row[f"x_{ref}"] = qps[name] / qps[ref]
                row[f"same_topk_vs_{ref}"] = same_sets(r["rows"], res[ref]["rows"])
        if variant and base in res:  # compressed next to the same method on the dense model
            row["x_dense"] = qps[name] / qps[base]
            row["same_topk_vs_dense"] = same_sets(r["rows"], res[base]["rows"])
        off = res.get("off" + suffix)
        if base not in ("off", "hf", "old") and off is not None:
            row["best_ge_off"] = float(np.mean([a[0] >= b[0] - 1e-3 for a, b in zip(r["scores"], off["scores"])]))
            # same ad scored by both: how far apart (numerics of tree pass vs steps, bf16)
            diffs = [abs(sa - dict(zip(rb, sb))[ra]) for ra_, sa_, rb, sb in
                     zip(r["rows"], r["scores"], off["rows"], off["scores"])
                     for ra, sa in zip(ra_, sa_) if ra >= 0 and ra in rb]
            row["max_score_diff_vs_off"] = float(max(diffs)) if diffs else None
        row.update(r["stats"])
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def search_section(report: "Report", section: str, tries: dict[str, Trie], points: list[tuple[int, int]],
                   names: list[str], ctx: dict, queries: list[list[int]], args, budget: Budget,
                   scheme_prefix: str = "") -> None:
    """Points outer, schemes inner: a budget cut drops the largest points of both schemes."""
    for beams, qbatch in points:
        for scheme, trie in tries.items():
            if budget.left() <= 0:
                report.note(section, f"budget reached: skipped {scheme_prefix}{scheme} {beams}x{qbatch} "
                                     "and later points")
                return
            t0 = time.perf_counter()
            rows = bench_point(section, scheme_prefix + scheme, names, dict(ctx, trie=trie), beams, qbatch,
                               queries, args.repeats, args.q1_queries)
            log.info("%s %s%s %dx%d: %.1fs (elapsed %.0fs)", section, scheme_prefix, scheme, beams, qbatch,
                     time.perf_counter() - t0, budget.elapsed())
            report.add(section, rows)


# ---------------------------------------------------------------- report
def fmt(x, nd: int = 2) -> str:
    return "" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


SEARCH_COLS = [  # (header, key, digits); optional columns show only when some row has the key
    ("scheme", "scheme", 0), ("method", "method", 0), ("beams", "beams", 0), ("query batch", "query_batch", 0),
    ("queries", "queries", 0), ("queries/s", "qps", 2), ("ms/batch", "latency_ms", 1), ("spread", "spread", 2),
    ("x HF", "x_hf", 2), ("x old", "x_old", 2), ("x off", "x_off", 2), ("x dense", "x_dense", 2),
    ("top-k = HF", "same_topk_vs_hf", 2), ("top-k = old", "same_topk_vs_old", 2),
    ("top-k = dense", "same_topk_vs_dense", 2), ("best >= off", "best_ge_off", 2), ("steps", "steps", 0),
    ("beams verified", "beams_verified", 0), ("max tree", "tree_tokens_max", 0),
]
FIRST_BATCH_COLS = [
    ("scheme", "scheme", 0), ("method", "method", 0), ("beams", "beams", 0), ("query batch", "query_batch", 0),
    ("first batch ms, no saved plan", "first_cold_ms", 1), ("first batch ms, saved plan", "first_saved_plan_ms", 1),
    ("warm-up s (planning the rest)", "warm_up_plan_s", 2), ("warm-up s, saved plan", "warm_up_s", 2),
    ("buckets warmed", "buckets_warmed", 0),
    ("first batch ms, saved plan + warm-up", "first_warmed_ms", 1), ("next batch ms", "next_ms", 1),
    ("steady ms/batch (rotation median)", "steady_ms", 1),
]
CREATIVE_COLS = [
    ("method", "method", 0), ("prompts", "prompts", 0), ("new tokens", "new_tokens", 0),
    ("headlines/s", "headlines_per_s", 1), ("ms/batch", "latency_ms", 1), ("spread", "spread", 2),
    ("x HF", "x_hf", 2), ("identical to HF", "identical_to_hf", 3), ("tokens = HF", "token_agreement_hf", 3),
]


def table(rows: list[dict], cols) -> str:
    cols = [c for c in cols if any(r.get(c[1]) is not None for r in rows)]
    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(key), nd) for _, key, nd in cols) + " |")
    return "\n".join(lines)


class Report:
    """Per section: rows and notes, rewritten to <out>/<stem>.md/.jsonl after every point, so a run
    cut short (time limit) still leaves what it measured."""

    def __init__(self, out: Path, target: str, meta: dict) -> None:
        self.out, self.target, self.meta = out, target, meta
        self.rows: dict[str, list[dict]] = {}
        self.notes: dict[str, list[str]] = {}

    def stem(self, section: str) -> str:
        return "decode_cpu" if self.target == "cpu" else f"decode_gpu_{section}"

    def add(self, section: str, rows: list[dict]) -> None:
        self.rows.setdefault(section, []).extend(rows)
        self.write(section)

    def note(self, section: str, text: str) -> None:
        log.info("[%s] %s", section, text)
        self.notes.setdefault(section, []).append(text)
        self.write(section)

    def markdown(self, section: str) -> str:
        rows = self.rows.get(section, [])
        cols = {"creatives": CREATIVE_COLS, "first_batch": FIRST_BATCH_COLS}.get(section, SEARCH_COLS)
        body = table(rows, cols) if rows else "(no points measured)"
        notes = "\n".join(f"- {n}" for n in self.notes.get(section, []))
        return f"## decode {self.target} / {section}\n\n{json.dumps(self.meta)}\n\n{notes}\n\n{body}\n"

    def write(self, section: str) -> None:
        stem = self.stem(section)
        (self.out / f"{stem}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in self.rows.get(section, [])))
        (self.out / f"{stem}.md").write_text(self.markdown(section))

    def print_all(self) -> None:
        for section in dict.fromkeys([*self.notes, *self.rows]):
            print("\n" + self.markdown(section))


# ---------------------------------------------------------------- synthetic tries (GPU bench)
def codes_sequences(n_ads: int, base: int, rng: np.random.Generator) -> list[list[int]]:
    """Hierarchical codes: split by 10 until a cluster holds <= 100 ads, then the position in it
    (cluster tokens base+0..9, position tokens base+10..109); no EOS (HF ends them at leaves)."""
    out: list[list[int]] = []

    def rec(ids: np.ndarray, path: list[int]) -> None:
        if ids.size <= 100:
            for i in range(ids.size):
                out.append([base + d for d in path] + [base + 10 + i])
            return
        # k-means-like balance: 10 clusters of roughly equal size (multinomial), none empty
        sizes = rng.multinomial(ids.size - 10, np.full(10, 0.1)) + 1
        for c, part in enumerate(np.split(ids, np.cumsum(sizes)[:-1])):
            rec(part, path + [c])

    rec(np.arange(n_ads), [])
    return out


def text_sequences(n_ads: int, vocab: int, eos: int, rng: np.random.Generator,
                   lengths: tuple[int, int] = (15, 30)) -> list[list[int]]:
    """Title-like token sequences: Zipf per position (shared prefixes, then diverging), 15-30 + EOS."""
    lens = rng.integers(lengths[0], lengths[1] + 1, size=n_ads)
    out = []
    for i in range(n_ads):
        z = rng.zipf(1.3, size=lens[i]) % (vocab - 1000)
        out.append([int(t) + 500 for t in z] + [eos])
    uniq = {tuple(s) for s in out}
    return [list(s) for s in sorted(uniq)]


# ---------------------------------------------------------------- GPU sections
# (a) SmolLM2-135M and (b) Llama-3-8B shapes; the per-shape settings of the synthetic workload
SHAPES = {
    "default": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0,
                    max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, rope_theta=500000.0,
               max_position_embeddings=8192, bos_token_id=128000, eos_token_id=128001, pad_token_id=128002),
}
# smoke: small vocab too (the full-vocabulary head dominates a tiny model on a 2-core CPU)
SMOKE_SHAPE = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
WORKLOAD = {  # prompt tokens drawn from [lo, hi); calibration rows = beams x the points' query batches
    "default": dict(prompt_len=40, lo=1000, hi=48000, codes_base=48000, beams=10,
                    calib_rows=(10, 40, 160, 640, 2560, 10240)),
    "8b": dict(prompt_len=32, lo=1000, hi=120000, codes_base=128100, beams=8,
               calib_rows=(8, 32, 128, 512, 2048)),
}


def workload(shape: str, smoke: bool) -> dict:
    """WORKLOAD[shape], in smoke mode fitted to the small vocabulary, with short text titles."""
    w = dict(WORKLOAD[shape], text_lengths=(15, 30))
    if smoke:
        v = SMOKE_SHAPE["vocab_size"]
        w.update(lo=100, hi=v - 300, codes_base=v - 200, text_lengths=(3, 6))
    return w


def build_model(shape: str, dev: torch.device, smoke: bool, layers: int | None = None):
    """A random-init bf16 Llama of ``SHAPES[shape]`` (``layers``: another decoder layer count)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**SHAPES[shape], **(SMOKE_SHAPE if smoke else {}),
                         **({} if layers is None else {"num_hidden_layers": layers})})
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    return model.eval()


def calibrate_cost(model, cache_dir: Path, smoke: bool, **kw):
    """``ours.load_or_calibrate`` with the kwargs its ``calibrate`` takes (the engine under rewrite
    may rename or drop some; dropped ones are logged)."""
    if smoke:
        kw.update(rows=tuple(kw.get("rows", (8,)))[:1], tokens=(16, 64), context_len=16, repeats=1)
    fn = getattr(ours, "calibrate", None)
    if fn is not None:
        params = inspect.signature(fn).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            dropped = sorted(set(kw) - set(params))
            if dropped:
                log.warning("calibrate() takes no %s; not passed", dropped)
            kw = {k: v for k, v in kw.items() if k in params}
    t0 = time.perf_counter()
    cost = ours.load_or_calibrate(model, cache_dir=cache_dir, **kw)
    log.info("calibration %.1fs: %s", time.perf_counter() - t0, cost.to_dict() if hasattr(cost, "to_dict") else cost)
    return cost


def build_tries(schemes: list[str], n_ads: int, vocab: int, eos: int, w: dict, dev) -> dict[str, Trie]:
    rng = np.random.default_rng(0)
    tries = {}
    for scheme in schemes:
        seqs = (codes_sequences(n_ads, w["codes_base"], rng) if scheme == "codes"
                else text_sequences(n_ads, vocab, eos, rng, w["text_lengths"]))
        tries[scheme] = Trie.from_sequences(seqs).to(dev)
        log.info("%s trie: %s", scheme, tries[scheme])
    return tries


def random_prompts(n: int, length: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(lo, hi, size=length))) for _ in range(n)]


class IdTokenizer:
    """Stand-in tokenizer for ``generate_creatives`` on a random model: text = space-joined ids,
    so texts map back to token ids exactly."""

    def __init__(self, eos_token_id: int, pad_token_id: int = 0) -> None:
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id

    def batch_decode(self, seqs, skip_special_tokens: bool = False, **kw) -> list[str]:
        skip = {self.eos_token_id, self.pad_token_id} if skip_special_tokens else set()
        return [" ".join(str(int(t)) for t in s if int(t) not in skip) for s in seqs]

    def decode(self, ids, skip_special_tokens: bool = False, **kw) -> str:
        return self.batch_decode([ids], skip_special_tokens)[0]


@contextlib.contextmanager
def no_eos(model):
    """The model's own EOS off (config and generation config): neither side may stop early, so both
    generate exactly the requested tokens and their outputs compare position by position."""
    saved = [(o, o.eos_token_id) for o in (model.config, getattr(model, "generation_config", None)) if o is not None]
    for o, _ in saved:
        o.eos_token_id = None
    try:
        yield
    finally:
        for o, e in saved:
            o.eos_token_id = e


def creatives_section(report: Report, model, args, budget: Budget) -> None:
    """(c) greedy headlines/s: HF generate vs ours, same prompts, exactly ``T`` new tokens each."""
    section, dev = "creatives", device_of(model)
    if budget.left() <= 0:
        report.note(section, "budget reached: skipped")
        return
    n, T = (8, 8) if args.smoke else (args.creative_prompts, args.creative_tokens)
    w = workload("default", args.smoke)
    prompts = random_prompts(n, w["prompt_len"], w["lo"], w["hi"], seed=2)
    # an id argmax can never return: generate_creatives never sees its EOS (with the model's EOS off)
    never = model.config.vocab_size
    tok = IdTokenizer(never, pad_token_id=model.config.pad_token_id)
    # the n-gram guards off: HF's greedy has no equivalent for a decoder-only prompt, and the texts are compared
    cfg = ours.CreativeConfig(max_new_tokens=T, stop_strings=[], no_repeat_ngram_size=0, prompt_ngram_block=0)
    ids = torch.tensor(prompts, device=dev)
    mask = torch.ones_like(ids)

    def hf():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=T, min_new_tokens=T,
                             pad_token_id=model.config.pad_token_id)
        return out[:, ids.shape[1]:].tolist()

    def mine():
        return [list(map(int, c[0][0].split())) for c in ours.generate_creatives(model, tok, prompts, cfg)]

    runs = {"hf": hf, "ours": mine}
    outs: dict[str, list] = {}
    times: dict[str, list[float]] = {m: [] for m in runs}
    with no_eos(model), torch.no_grad():
        for fn in runs.values():  # untimed warm-up (graph capture, allocator)
            fn()
            sync(dev)
        for rep in range(args.repeats):
            for name in (list(runs) if rep % 2 == 0 else list(runs)[::-1]):
                gc.collect()
                sync(dev)
                t0 = time.perf_counter()
                o = runs[name]()
                sync(dev)
                times[name].append(time.perf_counter() - t0)
                outs.setdefault(name, o)
    med = {m: float(np.median(t)) for m, t in times.items()}
    a, b = outs["ours"], outs["hf"]
    lens_ok = all(len(x) == T for x in a + b)
    agree = [np.mean([i == j for i, j in zip(x, y)] + [False] * abs(len(x) - len(y))) for x, y in zip(a, b)]
    rows = []
    for m in runs:
        row = {"section": section, "method": m, "prompts": n, "new_tokens": T, "headlines_per_s": n / med[m],
               "latency_ms": 1e3 * med[m], "times_s": [round(x, 4) for x in times[m]],
               "spread": (max(times[m]) - min(times[m])) / med[m]}
        if m == "ours":
            row.update(x_hf=med["hf"] / med[m], identical_to_hf=float(np.mean([x == y for x, y in zip(a, b)])),
                       token_agreement_hf=float(np.mean(agree)), all_lengths_equal_T=lens_ok)
        rows.append(row)
        print(json.dumps(row), flush=True)
    report.note(section, f"{n} prompts of {w['prompt_len']} random tokens, greedy, {T} new tokens, no stop strings, "
                         f"model EOS off (ours sees eos id {never}, outside the vocabulary); HF: generate("
                         f"do_sample=False, max_new_tokens={T}, min_new_tokens={T}), one batch of {n}; ours: "
                         f"generate_creatives(batch_size={n}) with a space-joined-ids stand-in tokenizer. "
                         "'identical to HF' = share of prompts whose token sequences match exactly "
                         "(bf16: different kernels may flip near-tied argmaxes)")
    report.add(section, rows)


def compress_copy(model, dev: torch.device):
    """A 2:4 INT4 copy of ``model`` via adbatch's own compress_: magnitude scores (no calibration
    data), uniform 2:4 on every linear but lm_head, uniform group size 128. The per-layer math runs
    on the model's GPU (SequentialExecutor(device)): the CPU path is far slower on 8B."""
    from adbatch.compress import CompressConfig, compress_
    from adbatch.compress.linear import SequentialExecutor

    cfg = CompressConfig(score="magnitude", pattern_policy="uniform", uniform_pattern="2:4",
                         group_policy="uniform", follow_training_qat=False)
    mc = copy.deepcopy(model)
    recipe = compress_(mc, cfg, stats=None, executor=SequentialExecutor(dev if dev.type == "cuda" else None))
    return mc.eval(), recipe.summary()


def compressed_section(report: Report, shape: str, model, tries: dict[str, Trie], points, ctx: dict,
                       queries, args, budget: Budget, need_s: float) -> None:
    """(d) off / auto on a 2:4 INT4 copy next to the dense model, same points, in one rotation."""
    section = "compressed"
    if budget.left() < need_s:
        report.note(section, f"{shape}: skipped, {budget.left():.0f}s of budget left < {need_s:.0f}s needed")
        return
    t0 = time.perf_counter()
    dev = device_of(model)
    names = args.compressed_methods
    dense_free = all("@" in n for n in names) and dev.type == "cuda"
    if dense_free:
        # no dense method in this section (its rows are the shape's own section, same points, same run): the
        # dense model's engines go before the copy is made and the dense model leaves the GPU after, which then
        # holds the compressed model's engines alone (an 8B dense model, its engines' buffers and the compressed
        # engines' copies do not fit 80 GB together)
        from adbatch.decoding.engine import _ENGINES, _MODEL_COPIES

        _ENGINES.pop(model, None)
        _MODEL_COPIES.pop(model, None)
        release(dev)
    mc, summary = compress_copy(model, dev)
    report.note(section, f"{shape}: 2:4 INT4 copy (magnitude score, uniform 2:4, group 128, lm_head dense) "
                         f"built in {time.perf_counter() - t0:.1f}s: {json.dumps(summary)}")
    if dense_free:
        model.to("cpu")
        release(dev)
        report.note(section, f"{shape}: dense model moved off the GPU for this section; dense rows: section {shape}")
    w = workload(shape, args.smoke)
    cost_c = calibrate_cost(mc, args.out / "calibration", args.smoke, rows=w["calib_rows"],
                            tokens=(32, 256, 1024, 4096), repeats=2, beams=w["beams"])
    ctx = dict(ctx, variants={"2:4": (mc, cost_c)}, dev=dev)
    search_section(report, section, tries, points, names, ctx, queries, args, budget, scheme_prefix=f"{shape}:")
    if args.first_batch:
        first_batch_section(report, shape, mc, tries, points, ctx, queries, args, budget)
    from adbatch.decoding.engine import _ENGINES

    report.note(section, "\n".join(plan_table(_ENGINES.get(mc) or {}, f"{shape}: the compressed model's per-bucket "
                                                                          "linear plan")))
    del mc, cost_c
    release(dev)


def first_batch_section(report: Report, shape: str, mc, tries: dict[str, Trie], points, ctx: dict, queries, args,
                        budget: Budget) -> None:
    """(e) The first batch a fresh process serves on the compressed copy ``mc`` (method ``args.first_batch_method``,
    each point of the compressed section, the first scheme): its engine built anew (``_ENGINES`` / ``_MODEL_COPIES``
    dropped, as in a new Ray actor) (1) with no saved linear plan (its buckets timed inside the batch), (2) with
    the plan (1) saved (copies built inside the batch), (3) after ``warm_up_search`` with the whole plan saved
    (timed apart, as is the warm-up before it that planned the buckets (1) did not use); then the batch after (3). Every state still captures its graphs inside its first batch; Triton's kernels are
    compiled already (an actor's first compiles read Triton's disk cache). The plans live in a cache folder of this
    run's (``<out>/first_batch_cache``, emptied first), never the user's."""
    from adbatch.decoding.engine import _ENGINES, _MODEL_COPIES, warm_up_search

    section, dev = "first_batch", ctx["dev"]
    scheme, trie = next(iter(tries.items()))
    cache = args.out / "first_batch_cache"
    shutil.rmtree(cache, ignore_errors=True)
    user_cache = os.environ.get("ADBATCH_CACHE")
    os.environ["ADBATCH_CACHE"] = str(cache)
    rows = []
    try:
        for beams, qbatch in points:
            if budget.left() <= 0:
                report.note(section, f"budget reached: skipped {beams}x{qbatch} and later points")
                break
            qs = queries[:qbatch]
            row = {"section": section, "scheme": f"{shape}:{scheme}", "method": args.first_batch_method,
                   "beams": beams, "query_batch": qbatch}
            def fresh_runner() -> Runner:
                _ENGINES.pop(mc, None)  # a new process: no engine, no plan in memory, no copies
                _MODEL_COPIES.pop(mc, None)
                release(dev)
                return runner_for(args.first_batch_method, dict(ctx, trie=trie), beams, min(beams, 10), qbatch)

            for state in ("cold", "saved_plan", "warmed"):
                run = fresh_runner()
                if state == "warmed":
                    # the warm-up routes buckets this batch does not use, whose plan is not saved yet: a first
                    # warm-up plans them (warm_up_plan_s), and the timed one is a new actor's, whose plan is saved
                    for name in ("warm_up_plan_s", "warm_up_s"):
                        run = fresh_runner()
                        t0 = time.perf_counter()
                        warmed = warm_up_search(mc, run.config, qbatch, max(len(q) for q in qs))
                        sync(dev)
                        row[name] = time.perf_counter() - t0
                    row["buckets_warmed"] = len(warmed)
                row[f"first_{state}_ms"] = 1e3 * time_pass(run, qs, qbatch, dev)["time"]
            row["next_ms"] = 1e3 * time_pass(run, qs, qbatch, dev)["time"]
            steady = [r for r in report.rows.get("compressed", []) if r["method"] == args.first_batch_method
                      and r["scheme"] == row["scheme"] and (r["beams"], r["query_batch"]) == (beams, qbatch)]
            if steady:
                row["steady_ms"] = steady[0]["latency_ms"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        if user_cache is None:
            os.environ.pop("ADBATCH_CACHE", None)
        else:
            os.environ["ADBATCH_CACHE"] = user_cache
    report.note(section, f"{shape}: a fresh engine of the compressed copy per state (as a new actor's); 'saved "
                         "plan' reads the plan the 'no saved plan' batch timed and saved; the warm-up routes "
                         "DecodeEngine.pass_buckets before the batch (its first run plans the buckets no batch used "
                         "yet, the timed one reads the saved plan); graphs are captured inside every first batch")
    report.add(section, rows)


def plan_table(engines: dict, title: str) -> list[str]:
    """Markdown lines: per engine (``{LinearFormats: DecodeEngine}``), per unit shape and row bucket, every timed
    format's microseconds, the FP8 copies' relative errors and the choice."""
    lines = [title, "", "| formats | N | K | pattern | rows | timed us (graph-replayed) | FP8 rel. error | choice |",
             "|---|---:|---:|---|---:|---|---|---|"]
    for formats, eng in engines.items():
        for key in sorted(eng.plan.choice, key=lambda k: (k[3], k[0], k[1])):
            t = eng.plan.timings.get(key, {})
            e = eng.plan.errors.get(key, {})
            lines.append(f"| {formats.value} | {key[0]} | {key[1]} | {key[2]} | {key[3]} | "
                         + ", ".join(f"{c.value} {v:.1f}" for c, v in t.items()) + " | "
                         + ", ".join(f"{c.value} {v:.3f}" for c, v in e.items()) + f" | {eng.plan.choice[key].value} |")
    return lines


def exactness_check(report: Report, dev: torch.device, tries: dict[str, Trie], eos: int, pad: int) -> None:
    """fp32 (no bf16 rounding noise) sanity on the same tries: a 4-layer model of the 8B width.
    Ours off vs HF: same top-k and scores; always vs off: scores elementwise >= (tolerance)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
                      eos_token_id=eos, pad_token_id=pad)
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).eval()
    qs = random_prompts(16, 24, 1000, 120000, seed=1)
    for scheme, trie in tries.items():
        hf = time_pass(hf_runner(model, trie, 8, 8, eos, pad), qs, 16, dev)
        off = time_pass(engine_runner(ours, model, trie, 8, 8, "off", 16, None, False), qs, 16, dev)
        alw = time_pass(engine_runner(ours, model, trie, 8, 8, "always", 16, None, False), qs, 16, dev)
        row = {"scheme": scheme,
               "same_topk_off_vs_hf": float(np.mean([a == b for a, b in zip(off["rows"], hf["rows"])])),
               "max_abs_score_diff_off_vs_hf": float(np.max(np.abs(np.array(off["scores"]) - np.array(hf["scores"])))),
               "always_ge_off_elementwise": bool((np.array(alw["scores"]) >= np.array(off["scores"]) - 1e-3).all()),
               # how far below: numerics (tree pass vs steps; compare max_abs_score_diff_off_vs_hf)
               # or a lost candidate (a gap of a whole token's log-prob)
               "max_always_below_off": float(np.max(np.nan_to_num(np.array(off["scores"]) - np.array(alw["scores"]),
                                                                  nan=0.0, posinf=1e9, neginf=0.0))),
               "always_beams_verified": alw["stats"].get("beams_verified")}
        report.note("8b", "fp32 exactness check (4-layer, 8B width): " + json.dumps(row))
    del model


def run_gpu(args, report: Report, budget: Budget) -> None:
    dev = torch.device("cpu" if args.smoke else "cuda")
    if args.compressed and not args.tune_kernels:
        # the packed kernels' tuner times up to 32 configs per (shape, batch bucket) on a fresh
        # machine: minutes; the heuristic config keeps the run inside its budget
        os.environ.setdefault("ADBATCH_NM_INT4_AUTOTUNE", "0")
    if args.check_only:  # the fp32 exactness check alone, on the 8B-shape tries (no 8B model built)
        cfg, w = {**SHAPES["8b"], **(SMOKE_SHAPE if args.smoke else {})}, workload("8b", args.smoke)
        tries = build_tries(args.schemes, 300 if args.smoke else args.n_ads_8b, cfg["vocab_size"],
                            cfg["eos_token_id"], w, dev)
        exactness_check(report, dev, tries, cfg["eos_token_id"], cfg["pad_token_id"])
        return
    old = load_baseline()
    names = [m for m in args.methods if m != "old" or old is not None]
    shapes = list(dict.fromkeys(args.model_shape + (["default"] if args.creatives else [])))
    for shape in shapes:
        w, cfg = workload(shape, args.smoke), {**SHAPES[shape], **(SMOKE_SHAPE if args.smoke else {})}
        searched = shape in args.model_shape
        if budget.left() < (60 if shape == "8b" and not args.smoke else 0):
            report.note("8b" if shape == "8b" else "default", f"budget reached: {shape} model not built")
            continue
        t0 = time.perf_counter()
        model = build_model(shape, dev, args.smoke)
        log.info("%s-shaped model built in %.1fs", shape, time.perf_counter() - t0)
        eos, pad = cfg["eos_token_id"], cfg["pad_token_id"]
        if searched:
            points = args.points if shape == "default" else args.points_8b
            n_ads = args.n_ads if shape == "default" else args.n_ads_8b
            if args.smoke:  # one point each: batch > 1 (default) and the one-at-a-time batch-1 path (8b)
                points = [(10, 4)] if shape == "default" else [(8, 1)]
                n_ads = 300
            hf_max = args.hf_max_batch if shape == "default" else args.hf_max_batch_8b
            cost = calibrate_cost(model, args.out / "calibration", args.smoke, rows=w["calib_rows"],
                                  tokens=(32, 256, 1024, 4096), repeats=2, beams=w["beams"])
            tries = build_tries(args.schemes, n_ads, cfg["vocab_size"], eos, w, dev)
            n_q = max(max(b, args.q1_queries) for _, b in points)
            comp_points = args.points_compressed if shape == "default" else args.points_compressed_8b
            if args.smoke:
                comp_points = points[:1]
            n_q = max(n_q, *(max(b, args.q1_queries) for _, b in comp_points))
            queries = random_prompts(n_q, w["prompt_len"], w["lo"], w["hi"], seed=0)
            ctx = {"model": model, "cost": cost, "eos": eos, "pad": pad, "old": old, "profile": args.profile,
                   "hf_max_batch": hf_max, "old_max_batch": args.old_max_batch, "variants": {},
                   "trace": (lambda title, text: report.note("trace", f"{title}: {text}")) if args.trace else None}
            report.note(shape, f"random-init LlamaForCausalLM {json.dumps(cfg)}"
                               f", bf16 on {dev}; {n_ads} synthetic ads; queries: {w['prompt_len']} random tokens; "
                               f"top_k = min(beams, 10); hf only at query batch <= {hf_max}; "
                               f"old = {baseline_commit() or 'absent'} (off mode); repeats {args.repeats} (median)")
            for scheme, trie in tries.items():
                report.note(shape, f"{scheme} trie: {trie}")
            if shape == "8b" and args.check:
                exactness_check(report, dev, tries, eos, pad)
            if names:  # none: the compressed section's rotation holds every method (--methods "")
                search_section(report, shape, tries, points, names, ctx, queries, args, budget)
        if shape == "default" and args.creatives:
            creatives_section(report, model, args, budget)
        # smoke: the two tiny models differ only in workload, so the compressed path runs once
        if searched and args.compressed and not (args.smoke and shape == "8b"):
            # 8B: deep copy (16 GB) + per-layer quantize on the GPU + the copy's calibration
            compressed_section(report, shape, model, tries, comp_points, ctx, queries, args, budget,
                               need_s=0 if args.smoke else (90 if shape == "8b" else 30))
        del model
        ctx = tries = cost = None
        release(dev)


# ---------------------------------------------------------------- CPU target
def load_home_depot(path: Path, n_titles: int, n_queries: int, seed: int = 0):
    import csv

    titles: dict[str, None] = {}
    queries: list[str] = []
    with path.open(encoding="latin-1", newline="") as fh:
        for rec in csv.DictReader(fh):
            titles.setdefault(rec["product_title"].strip(), None)
            queries.append(rec["search_term"].strip())
    rng = np.random.default_rng(seed)
    tl = list(titles)
    pick = rng.choice(len(tl), size=min(n_titles, len(tl)), replace=False)
    qs = list(dict.fromkeys(queries))
    qpick = rng.choice(len(qs), size=n_queries, replace=False)
    return [tl[i] for i in sorted(pick)], [qs[i] for i in qpick]


def run_cpu_bench(args, report: Report, budget: Budget) -> None:
    from adbatch.models import load_causal_lm
    from adbatch.serving.prompts import encode_targeting_prompts

    model, tok = load_causal_lm()
    titles, qtexts = load_home_depot(Path(args.home_depot), args.titles, 16)
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    seqs = [tok(t, add_special_tokens=False)["input_ids"][:40] + [eos] for t in titles]
    trie = Trie.from_sequences(seqs)
    report.note("cpu", f"SmolLM2-135M fp32, Home Depot trie: {trie}; repeats {args.repeats} (median)")
    queries = encode_targeting_prompts(tok, qtexts)
    # small calibration: the shared 2-core CPU is slow (context 32, up to 32 rows / 512 tokens)
    cost = calibrate_cost(model, args.out / "calibration", False, rows=(1, 8, 32), tokens=(16, 128, 512),
                          context_len=32, repeats=1)
    old = load_baseline()
    names = [m for m in args.methods if m != "old" or old is not None]
    ctx = {"model": model, "cost": cost, "eos": eos, "pad": pad, "old": old, "profile": args.profile,
           "hf_max_batch": args.hf_max_batch, "variants": {}}
    search_section(report, "cpu", {"text-hd": trie}, args.points, names, ctx, queries, args, budget)


def points_arg(s: str) -> list[tuple[int, int]]:
    return [tuple(map(int, p.split("x"))) for p in s.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=["cpu", "gpu"], default=None, help="required unless --smoke (= the gpu sections)")
    ap.add_argument("--out", type=Path, default=None, help="default bench/out (git-ignored); smoke: a temp folder")
    ap.add_argument("--methods", type=lambda s: [m for m in s.split(",") if m], default=["hf", "old", "off", "auto"],
                    help="search methods, comma-separated: hf, old, off, auto, always; \"\" (gpu): no search "
                         "section of its own, e.g. where --compressed-methods rotates dense and compressed together")
    ap.add_argument("--schemes", nargs="+", default=["codes", "text"])
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting new points/sections after this (default gpu 420, cpu 400)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed runs per point, median reported (default 3, smoke 1)")
    ap.add_argument("--profile", action="store_true", help="phase timings of ours (syncs per phase)")
    ap.add_argument("--trace", action="store_true",
                    help="after each point, one more batch per method under torch.profiler (wall vs kernel time, "
                         "GPU idle gaps, top kernels) and one under cProfile (host functions) (section 'trace')")
    ap.add_argument("--smoke", action="store_true", help="gpu sections with tiny models on the CPU")
    ap.add_argument("--q1-queries", type=int, default=None,
                    help="queries timed one at a time at batch 1 (default 4, smoke 2)")
    ap.add_argument("--points", type=points_arg, default=None,
                    help="beamsxbatch,... (gpu default shape: 10x64,10x256,10x1024; cpu: 4x1,8x1,4x16,8x16)")
    ap.add_argument("--old-max-batch", type=int, default=256,
                    help="today's (old) engine only at query batches <= this (it is slow; budget)")
    ap.add_argument("--hf-max-batch", type=int, default=64,
                    help="hf only at query batches <= this (default shape, cpu)")
    ap.add_argument("--home-depot", default=str(ROOT.parent / "shared/data/home_depot_relevance/train.csv"))
    ap.add_argument("--titles", type=int, default=5000, help="cpu: Home Depot titles in the trie")
    g = ap.add_argument_group("gpu")
    g.add_argument("--model-shape", nargs="+", choices=["default", "8b"], default=["default", "8b"],
                   help="search sections: (a) default = SmolLM2-135M shape, (b) 8b = Llama-3-8B shape")
    g.add_argument("--n-ads", type=int, default=5000, help="ads per synthetic trie, default shape")
    g.add_argument("--points-8b", type=points_arg, default=points_arg("8x1,8x16,8x64,8x256"))
    g.add_argument("--n-ads-8b", type=int, default=100_000)
    g.add_argument("--hf-max-batch-8b", type=int, default=16)
    g.add_argument("--check", action="store_true", help="8b: fp32 exactness check first")
    g.add_argument("--check-only", action="store_true", help="only the fp32 exactness check (8B-shape tries)")
    g.add_argument("--compressed-methods", type=lambda s: s.split(","),
                   default=["off", "auto", "off@2:4", "auto@2:4+int4", "auto@2:4+fp8"],
                   help="(d) methods of the compressed section; @2:4 = the compressed copy, +int4 / +fp8 = its "
                        "linear_formats (none: the default)")
    g.add_argument("--creatives", action="store_true", help="(c) greedy creatives, HF generate vs ours")
    g.add_argument("--creative-prompts", type=int, default=256)
    g.add_argument("--creative-tokens", type=int, default=16)
    g.add_argument("--compressed", action="store_true", help="(d) off/auto on a 2:4 INT4 copy vs dense")
    g.add_argument("--points-compressed", type=points_arg, default=points_arg("10x64,10x256"))
    g.add_argument("--points-compressed-8b", type=points_arg, default=points_arg("8x1,8x64"))
    g.add_argument("--first-batch", action="store_true",
                   help="(e) with --compressed: the copy's first batch in a fresh engine without / with a saved linear "
                        "plan / after the warm-up, at each --points-compressed point")
    g.add_argument("--first-batch-method", default="auto@2:4", help="(e) the method timed (a compressed one)")
    g.add_argument("--tune-kernels", action="store_true",
                   help="compressed: let the packed kernels autotune (minutes on a fresh machine)")
    args = ap.parse_args()
    if args.target is None:  # --smoke alone runs the gpu sections on the CPU: what the smoke is for
        if not args.smoke:
            ap.error("--target is required")
        args.target = "gpu"
    if args.points is None:
        args.points = points_arg("10x64,10x256,10x1024" if args.target == "gpu" else "4x1,8x1,4x16,8x16")
    if args.out is None:  # smoke output is no result: keep it out of the repo
        args.out = Path(tempfile.gettempdir()) / "adbatch_decode_smoke" if args.smoke else Path("bench/out")
    args.repeats = args.repeats or (1 if args.smoke else 3)
    args.q1_queries = args.q1_queries or (2 if args.smoke else 4)
    if args.budget_s is None:
        args.budget_s = 420.0 if args.target == "gpu" else 400.0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.repeats < 3 and not args.smoke:
        log.warning("--repeats %d: medians of fewer than 3 runs", args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    import transformers

    gpu = args.target == "gpu" and not args.smoke
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "target": args.target, "smoke": args.smoke,
            "machine": torch.cuda.get_device_name() if gpu else platform.processor() or platform.machine(),
            "load": os.getloadavg(), "torch": torch.__version__, "transformers": transformers.__version__,
            "baseline": baseline_commit(), "command": " ".join(sys.argv)}
    budget = Budget(args.budget_s)
    report = Report(args.out, args.target, meta)
    try:
        run_gpu(args, report, budget) if args.target == "gpu" else run_cpu_bench(args, report, budget)
    finally:
        report.print_all()
        log.info("total %.0fs; results in %s", budget.elapsed(), args.out)


if __name__ == "__main__":
    main()
