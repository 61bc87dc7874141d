"""Targeting speed of a served model: queries/s of ``search_targets`` (the call ``adbatch generate
--task targets`` makes per batch) by query batch and verify mode, against HF ``generate`` with a trie
``prefix_allowed_tokens_fn`` on the same model and queries.

Not a test. The model is loaded as ``adbatch generate`` loads it (``--model`` a dense folder or GGUF,
``--compressed`` a compressed checkpoint); the prompts are the product's chat-framed targeting prompts
(``encode_targeting_prompts``) of real query strings (``--queries``: a parquet with a ``query`` column,
distinct strings sorted, or a qrels JSON's keys); 10 beams, top 10, ``TargetSearchConfig()``'s other
defaults. Each point is the median of ``--repeats`` passes (one ``search_targets`` call per batch, timed with
bench/decode.py's runner) over the same queries after one warm-up batch
(that bucket's graph captures), over ``max(4 x batch, 1024)`` queries (fewer when fewer are given) so
compaction to smaller buckets is part of the figure. ``--profile`` adds one pass with the search's phase
clock (it syncs the device at each phase, so it is reported apart).

    python bench/targeting_speed.py --model /tmp/ckw/trained --index /tmp/bf/index_full_text \\
        --queries /tmp/bf/train_full.parquet --hf-queries 64 --out-json r.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# the repository first: this script's own folder (bench/, on the path as the script's) holds a
# kernels.py that would shadow the kernels package
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import adbatch.decoding as ours  # noqa: E402
from bench.decode import device_of, engine_runner, hf_runner, time_pass  # noqa: E402


def load_queries(path: Path, limit: int) -> list[str]:
    """Distinct query strings, sorted: a parquet's ``query`` column or a qrels JSON's keys."""
    if path.suffix == ".json":
        qs = set(json.loads(path.read_text()))
    else:
        import pyarrow.parquet as pq

        qs = set(pq.read_table(path, columns=["query"]).column("query").to_pylist())
    return sorted(q for q in qs if q and q.strip())[:limit]


def time_search(model: Any, prompts: list[list[int]], trie: Any, batch: int, verify: str, repeats: int,
                profile: bool = False) -> tuple[dict[str, Any], list[list[int]]]:
    """Median queries/s of ``search_targets`` over ``prompts`` in batches of ``batch`` (bench/decode.py's
    runner and timed pass: one call per batch, as a generate actor makes), and the last pass's rows."""
    run = engine_runner(ours, model, trie, 10, 10, verify, batch, None, profile)
    dev = device_of(model)
    run(prompts[:batch])  # warm-up: this bucket's graphs (and the cost model)
    passes = [time_pass(run, prompts, batch, dev) for _ in range(1 if profile else repeats)]
    med = statistics.median(p["time"] for p in passes)
    stats = passes[-1]["stats"]
    return {"batch": batch, "verify": verify, "profile": profile, "queries": len(prompts),
            "queries_per_s": round(len(prompts) / med, 1), "runs_s": [round(p["time"], 3) for p in passes],
            "ms_per_step": round(1e3 * med / max(stats.get("steps", 0), 1), 2),
            **{k: v for k, v in stats.items() if k in ("steps", "verify_passes", "beams_verified") or k.startswith("ms_")}
            }, passes[-1]["rows"]


def hf_side_by_side(model: Any, tok: Any, prompts: list[list[int]], index: Any) -> dict[str, Any]:
    """HF constrained beam search vs ours (``off``, one batch) on the same prompts: q/s and how many of
    HF's top-10 ad rows ours returns too (bf16 near-ties may differ)."""
    eos = index.eos_token_id if index.eos_token_id is not None else tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    run = hf_runner(model, index.trie, 10, 10, eos, pad)
    run(prompts[:2])  # warm-up
    hf = time_pass(run, prompts, len(prompts), device_of(model))
    ours, rows = time_search(model, prompts, index.trie, len(prompts), "off", 3)
    shared = sum(len(set(h) & {r for r in o if r >= 0}) for h, o in zip(hf["rows"], rows))
    return {"queries": len(prompts), "hf_queries_per_s": round(len(prompts) / hf["time"], 2),
            "ours_off_queries_per_s": ours["queries_per_s"],
            "speedup": round(ours["queries_per_s"] * hf["time"] / len(prompts), 1),
            "hf_top10_rows_also_ours": round(shared / max(1, sum(len(h) for h in hf["rows"])), 3)}


def render(result: dict[str, Any]) -> str:
    lines = ["| batch | verify | queries | q/s (median) | ms/step | steps | phases (ms, profiled pass) |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        phases = ", ".join(f"{k[3:]} {v:g}" for k, v in r.items() if k.startswith("ms_") and k != "ms_per_step")
        lines.append(f"| {r['batch']} | {r['verify']}{' (profiled)' if r['profile'] else ''} | {r['queries']} | "
                     f"{r['queries_per_s']:,.1f} | {r['ms_per_step']} | {r.get('steps', '')} | {phases} |")
    if result.get("hf"):
        h = result["hf"]
        lines.append(f"\nHF generate + prefix_allowed_tokens_fn, {h['queries']} queries: {h['hf_queries_per_s']} q/s; "
                     f"ours off {h['ours_off_queries_per_s']} q/s ({h['speedup']}x); HF's top-10 rows also in ours: "
                     f"{h['hf_top10_rows_also_ours']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="dense model folder / GGUF (default: the bundled default model)")
    ap.add_argument("--compressed", default=None, help="a compressed checkpoint (instead of --model)")
    ap.add_argument("--smoke", action="store_true", help="tiny random model over the default tokenizer (CPU plumbing)")
    ap.add_argument("--index", required=True, help="an index folder (its trie is searched)")
    ap.add_argument("--queries", required=True, help="parquet with a 'query' column, or a qrels JSON")
    ap.add_argument("--max-queries", type=int, default=4096)
    ap.add_argument("--batches", default="64,256,1024,2048")
    ap.add_argument("--verify", default="off,auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="one extra profiled pass per batch (off)")
    ap.add_argument("--hf-queries", type=int, default=0, help="HF generate side by side on this many queries")
    ap.add_argument("--out-json", default=None)
    args = ap.parse_args(argv)

    import torch

    from adbatch.serving.generators import ModelSpec, load_model
    from adbatch.index.build import load_index
    from adbatch.serving.prompts import encode_targeting_prompts

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        from bench.train_eval import load_base

        model, tok = load_base(None, True, device)
        model = model.to(device).eval()
    else:
        model, tok = load_model(ModelSpec(model=args.model, compressed=args.compressed), device)
    index = load_index(args.index)
    queries = load_queries(Path(args.queries), args.max_queries)
    if not queries:
        raise SystemExit(f"--queries {args.queries}: no query strings")
    prompts = encode_targeting_prompts(tok, queries)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                              "args": vars(args), "dtype": str(next(model.parameters()).dtype), "rows": []}
    for batch in (int(b) for b in args.batches.split(",")):
        n = min(len(prompts), max(4 * batch, 1024))
        for verify in args.verify.split(","):
            result["rows"].append(time_search(model, prompts[:n], index.trie, batch, verify, args.repeats)[0])
            print(json.dumps(result["rows"][-1]), flush=True)
        if args.profile:
            result["rows"].append(time_search(model, prompts[:n], index.trie, batch, "off", 1, profile=True)[0])
    if args.hf_queries:
        result["hf"] = hf_side_by_side(model, tok, prompts[:args.hf_queries], index)
    table = render(result)
    print(table)
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
