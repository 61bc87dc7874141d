"""Run (a subset of) the compression ablation table on one model, one JSON line per variant.

    python bench/compress.py --out rows.jsonl [--only 2:4-wanda 2:4-paper ...]
    python bench/compress.py --smoke --out rows.jsonl   # CPU, seconds: tiny random model, 2 variants, 8 short texts

Same calibration and evaluation sets as ``adbatch compress --ablations true`` (same seeds and sizes),
in-process (no Ray), appending each row as soon as it is measured so a killed run keeps its rows.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

# run as a script, sys.path[0] is bench/, whose kernels.py would shadow the kernels package
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402

from adbatch.compress.calibration import calibrate, example_corpus_split, load_calibration_texts, token_blocks  # noqa: E402
from adbatch.compress.report import EvalSets, ablation_variants, run_ablations  # noqa: E402
from adbatch.models import load_causal_lm  # noqa: E402
from pipelines.compress import CompressJobConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--only", nargs="*", default=None, help="variant names (default: all)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU plumbing check: a 2-layer random model over the default tokenizer, variants dense and "
                         "int4-g128, 8 calibration / 8 evaluation texts of 32 tokens")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    job = CompressJobConfig(model=args.model)
    if args.smoke:
        from bench.creatives_tune import smoke_model

        folder = Path(tempfile.mkdtemp(prefix="compress-smoke-"))
        job = CompressJobConfig.from_dict({"model": str(smoke_model(folder / "model")), "eval_texts": 8, "eval_seq_len": 32,
                                           "calibration": {"num_texts": 8, "seq_len": 32}})
        args.only = args.only or ["dense", "int4-g128"]
    t0 = time.perf_counter()
    model, tok = load_causal_lm(job.model, dtype=torch.float32)
    cal = job.calibration
    stats = calibrate(model, token_blocks(tok, load_calibration_texts(cal), cal.seq_len), cal, job.compress.skip_modules)
    _, held = example_corpus_split(cal.num_texts, job.eval_texts, cal.seed)
    sets = EvalSets.build(tok, held, job.eval_seq_len)
    variants = [v for v in ablation_variants(job.compress) if not args.only or v[0] in args.only]
    for v in variants:
        row = run_ablations(model, stats, sets, job.compress, variants=[v])[0]
        row["eval_tokens"] = sets.info()
        with open(args.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    logging.info("done in %.1f s (calibration %s)", time.perf_counter() - t0, stats.info)


if __name__ == "__main__":
    main()
