"""Speed of the query generator's sampling (``adbatch.training.query_generation.generate_queries``, the
decode engine's sampling path): queries/s by the generator's dtype and the ads decoded together
(``QueryGenConfig.batch_size``), and where one run's time goes (``torch.profiler``).

Not a test. The generator is the default model after the product's short fine-tune
(:func:`tune_query_generator`) on ``--pairs`` of the bundle's train pairs, so the samples have the
lengths the real run's have; each point is the median of ``--repeats`` runs after one warm-up (graph
capture) over the same ``--ads`` ads, ``queries_per_ad`` from ``QueryGenConfig()``.

    python bench/query_gen_speed.py --bundle .carry/bundle_full --catalogue full --out-json r.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository (its kernels, not bench/kernels.py)


def _profile(fn: Any, device: str, top: int = 12) -> dict[str, Any]:
    """One call of ``fn`` under torch.profiler: wall time, summed device-kernel time, the top ops by
    self CPU time and by device time (strings, for the report)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ev = prof.key_averages()
    dev_us = sum(e.self_device_time_total for e in ev) if device == "cuda" else 0.0
    return {"wall_s": round(wall, 3), "device_kernel_s": round(dev_us / 1e6, 3),
            "by_self_cpu": ev.table(sort_by="self_cpu_time_total", row_limit=top),
            "by_device": ev.table(sort_by="self_cuda_time_total", row_limit=top) if device == "cuda" else ""}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", required=True, help="bench/train_eval.py prepare's bundle")
    ap.add_argument("--catalogue", default="full", help="the bundle's catalogue: 5000 or full")
    ap.add_argument("--model", default=None, help="GGUF file / HF folder (default: the bundled default model)")
    ap.add_argument("--smoke", action="store_true", help="tiny random model (CPU plumbing check)")
    ap.add_argument("--ads", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=2000, help="train pairs of the generator's fine-tune")
    ap.add_argument("--batches", default="64,256", help="QueryGenConfig.batch_size values")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out-json", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch

    from adbatch.training.query_generation import (QueryGenConfig, QueryGenTrainConfig, generate_queries,
                                                   query_pairs, tune_query_generator)
    from bench.train_eval import load_base, load_bundle

    device = "cuda" if torch.cuda.is_available() else "cpu"
    data = load_bundle(Path(args.bundle), args.catalogue)
    index = data["indexes"]["text"]
    ads = list(index.ad_ids)[:: max(1, len(index.ad_ids) // args.ads)][: args.ads]
    base = QueryGenConfig(max_pairs=args.pairs)
    if args.smoke:
        base = base.replace(max_new_tokens=3, train=QueryGenTrainConfig(max_steps=2, batch_tokens=2048))
    model, tok = load_base(args.model, args.smoke, device)
    pairs = query_pairs(data["labelled"], data["ad_texts"], exclude_queries=[*data["qrels"], *data["valid"]],
                        max_pairs=base.max_pairs, seed=base.seed)
    tune = tune_query_generator(model, tok, pairs, base, device=device, progress=False)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                           "ads": len(ads), "queries_per_ad": base.queries_per_ad, "fine_tune": tune, "rows": []}
    best: tuple[float, Any] | None = None
    for dt in args.dtypes.split(","):
        model.to(getattr(torch, dt))
        for b in map(int, args.batches.split(",")):
            cfg = base.replace(batch_size=b)
            generate_queries(model, tok, ads, data["ad_texts"], cfg, progress=False)  # warm-up: graph capture
            secs, kept = [], 0
            for _ in range(args.repeats):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                got = generate_queries(model, tok, ads, data["ad_texts"], cfg, progress=False)
                secs.append(time.perf_counter() - t0)
                kept = len(got)
            med = statistics.median(secs)
            row = {"dtype": dt, "batch_size": b, "rows_per_batch": b * cfg.queries_per_ad,
                   "median_s": round(med, 3), "runs_s": [round(s, 3) for s in secs],
                   "samples_per_s": round(len(ads) * cfg.queries_per_ad / med, 1), "kept": kept,
                   "samples": [list(r) for r in got.rows()[:6]]}
            out["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "samples"}), flush=True)
            if best is None or med < best[0]:
                best = (med, (dt, b))
    assert best is not None
    dt, b = best[1]
    model.to(getattr(torch, dt))
    prof = _profile(lambda: generate_queries(model, tok, ads, data["ad_texts"], base.replace(batch_size=b),
                                             progress=False), device)
    out["profile"] = {"dtype": dt, "batch_size": b, **prof}
    print(f"profile at {dt} batch {b}: wall {prof['wall_s']} s, device kernels {prof['device_kernel_s']} s")
    print(prof["by_self_cpu"])
    print(prof["by_device"])
    out["best"] = {"dtype": dt, "batch_size": b}
    if args.out_json:
        args.out_json.parent.mkdir(parents=True, exist_ok=True)
        args.out_json.write_text(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
