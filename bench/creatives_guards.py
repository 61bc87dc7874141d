"""Creative quality of one creative model under the decoding guards, dense and compressed (CPU or GPU).

What it measures, for each variant ``model:no_repeat:prompt_block`` (``model`` = dense | compressed):
ROUGE-1/2/L, BLEU, METEOR, distinct-1/2, prompt-copy share and empty share
(:func:`adbatch.eval.report.creative_quality`) of greedy headlines (16 tokens) on

- the example's creative requests (``examples/requests_creatives.parquet``; references = the ads' own
  ``title`` in ``examples/slogan_ads.parquet``), and
- the first ``--test`` rows of the slogan ``test-curated.csv`` (references = the human headlines).

``compressed`` variants compress the model once with the compress stage's own entry point
(:func:`pipelines.compress.run_compress`, in-process), calibrated on the model's served text: its creative
prompt + headline for the first ``--calib-texts`` pairs of ``--pairs`` (the refresh writes that file as
``creative_pairs.parquet``). ``--compress-json`` overrides :class:`adbatch.compress.recipe.CompressConfig`
fields (``{}`` = the shipped recipe; ``{"pattern_policy": "uniform", "uniform_pattern": "4:4"}`` = INT4 only).

Example (the figures in bench/RESULTS.md, "Creatives: guards and compression"):

    .venv/bin/python bench/creatives_guards.py --model runs/example_refresh/creative_model \\
        --pairs runs/example_refresh/creative_pairs.parquet --test 24 \\
        --variants dense:0:0,dense:3:0,dense:3:6,dense:3:4,compressed:3:6 --out-json /tmp/guards.jsonl
    .venv/bin/python bench/creatives_guards.py --smoke   # CPU, seconds: tiny random model, synthetic pairs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def smoke_inputs(args: argparse.Namespace) -> None:
    """Point ``args`` at a tiny random creative model, its (synthetic) headline pairs and test CSV under --work."""
    from bench.creatives_tune import SMOKE_ROWS, smoke_model, write_smoke_csvs
    from adbatch.training.creatives import HeadlinePairs, write_headline_pairs

    work = Path(args.work) / "smoke"
    args.model = str(smoke_model(work / "model"))
    _, args.test_csv = write_smoke_csvs(work / "data")
    pairs = HeadlinePairs([f"smoke-{i}" for i in range(len(SMOKE_ROWS))],
                          [{"advertiser": c, "description": d, "industry": i} for d, _, c, i in SMOKE_ROWS],
                          [h for _, h, _, _ in SMOKE_ROWS], {})
    args.pairs = str(write_headline_pairs(pairs, work / "creative_pairs.parquet"))
    args.test, args.calib_texts, args.variants = 2, 4, "dense:3:6,compressed:3:6"
    args.work = str(work)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a creative model folder (train_creatives output)")
    ap.add_argument("--pairs", help="its headline pairs (creative_pairs.parquet), for calibration")
    ap.add_argument("--test-csv", default=str(REPO.parent / "shared" / "data" / "slogan_gen" / "test-curated.csv"))
    ap.add_argument("--test", type=int, default=24, help="first N test rows")
    ap.add_argument("--variants", default="dense:0:0,dense:3:0,dense:3:6,compressed:3:6")
    ap.add_argument("--compress-json", default="{}", help="CompressConfig overrides for the compressed variants")
    ap.add_argument("--calib-texts", type=int, default=64)
    ap.add_argument("--work", default="/tmp/creatives_guards")
    ap.add_argument("--out-json", default=None, help="append one JSON line per variant")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU plumbing check: a 2-layer random model, synthetic pairs and test rows, variants "
                         "dense:3:6 and compressed:3:6")
    args = ap.parse_args()
    if args.smoke:
        smoke_inputs(args)
    elif not (args.model and args.pairs):
        ap.error("--model and --pairs are required (or --smoke)")

    import pyarrow.parquet as pq
    import torch

    from adbatch.eval.datasets import load_slogan_test
    from adbatch.decoding.config import CreativeConfig
    from adbatch.decoding.creative import generate_creatives
    from adbatch.serving.generators import ModelSpec, load_model
    from adbatch.serving.prompts import creative_prompt_of, creative_prompt_text, encode_creative_prompt, encode_creative_target
    from adbatch.eval.report import creative_quality
    from adbatch.training.creatives import load_headline_pairs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    dense, tok = load_model(ModelSpec(model=args.model), device)
    style = creative_prompt_of(dense)
    requests = pq.read_table(REPO / "examples" / "requests_creatives.parquet").to_pylist()
    titles = {r["ad_id"]: r["title"] for r in pq.read_table(REPO / "examples" / "slogan_ads.parquet").to_pylist()}
    test = load_slogan_test(args.test_csv).to_pylist()[: args.test]
    models = {"dense": dense}

    def compressed():
        if "compressed" not in models:
            from pipelines.compress import CompressJobConfig, run_compress

            out = work / "compressed"
            if not (out / "manifest.json").is_file():
                pairs = load_headline_pairs(args.pairs)
                calib = work / "calib.txt"
                calib.write_text("".join(
                    tok.decode(encode_creative_prompt(tok, f, style=style) + encode_creative_target(tok, h)).replace("\n", " ") + "\n"
                    for f, h in list(zip(pairs.fields, pairs.headlines))[: args.calib_texts]))
                t0 = time.perf_counter()
                run_compress(CompressJobConfig(
                    model=args.model, calib=calib, out=out, use_ray=False, eval_texts=4, eval_seq_len=64,
                    compress=json.loads(args.compress_json),
                    calibration={"num_texts": args.calib_texts, "seq_len": 128, "batch_size": 4}))
                print(f"compressed in {time.perf_counter() - t0:.0f} s -> {out}", flush=True)
            models["compressed"], _ = load_model(ModelSpec(compressed=str(out)), device)
        return models["compressed"]

    def headlines(model, rows, cfg):
        prompts = [encode_creative_prompt(tok, r, style=style) for r in rows]
        return [outs[0][0] for outs in generate_creatives(model, tok, prompts, cfg, batch_size=12)]

    for variant in args.variants.split(","):
        name, no_repeat, block = variant.split(":")
        model = dense if name == "dense" else compressed()
        cfg = CreativeConfig(strategy="greedy", max_new_tokens=16, no_repeat_ngram_size=int(no_repeat),
                             prompt_ngram_block=int(block))
        t0 = time.perf_counter()
        ex = headlines(model, requests, cfg)
        te = headlines(model, test, cfg)
        rec = {"variant": variant, "compress": json.loads(args.compress_json) if name == "compressed" else None,
               "example": creative_quality(ex, [titles[r["ad_id"]] for r in requests],
                                           [creative_prompt_text(r, style=style) for r in requests]),
               "test": creative_quality(te, [r["reference"] for r in test],
                                        [creative_prompt_text(r, style=style) for r in test]),
               "n_example": len(requests), "n_test": len(test), "seconds": round(time.perf_counter() - t0, 1),
               "example_samples": ex[:8], "test_samples": list(zip([r["reference"] for r in test[:6]], te[:6]))}
        e, t = rec["example"], rec["test"]
        print(f"{variant:>18}  example R1 {e['rouge1']:5.1f} RL {e['rougeL']:5.1f} copy {e['copy_share']:.3f} | "
              f"test R1 {t['rouge1']:5.1f} R2 {t['rouge2']:5.1f} RL {t['rougeL']:5.1f} copy {t['copy_share']:.3f} "
              f"empty {t['empty_share']:.3f}  ({rec['seconds']} s)", flush=True)
        if args.out_json:
            with open(args.out_json, "a") as fh:
                fh.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
