#!/usr/bin/env python3
"""The creative fine-tune on one GPU: base (few-shot) vs fine-tuned, dense vs compressed, separate vs shared.

A benchmark script, not a test (issue 18 items 1-3). No Ray, no network. Phases, in priority order (each
runs only while ``--budget-s`` leaves time for it; every finished phase is written to ``--out-json`` at
once, so a cut run keeps its rows):

1. ``base``: the model as given (``--model``: GGUF / HF folder; default: the default model) writes a
   headline for every row of ``--test-csv`` (slogan ``test-curated.csv``, 994 rows) from the few-shot
   prompt, through :class:`adbatch.serving.generators.CreativeGenerator` -- the decode engine, greedy, 16 new
   tokens, as ``adbatch generate`` / ``adbatch eval`` serve it.
2. ``tuned``: the ``separate`` shape -- :func:`adbatch.training.creatives.tune_creatives` with the
   library's :class:`CreativeTuneConfig` defaults (``--epochs`` / ``--lr`` override) on the (fields ->
   headline) pairs of ``--train-csv`` (slogan ``valid.csv``; rows whose description or headline equals a
   test row's are skipped and counted); then the same evaluation, from the tuned prompt the model declares.
3. ``tuned-compressed`` / 4. ``base-compressed``: the compress stage's defaults (``CompressJobConfig()``:
   calibration on the bundled corpus sample, adaptive INT4) through the stage itself (``run_compress``, no
   Ray; calibration and per-layer math on the GPU), loaded back as a compressed checkpoint (``ModelSpec(compressed=...)``, the Triton kernels on CUDA).
5. ``tuned-keep-copies``: the separate shape trained on every pair (``max_copy_fraction`` 1.0: the 39 % of
   valid.csv headlines that copy half their words from the description kept).
6. ``shared``: the ``shared`` shape -- :func:`adbatch.training.train_on_index` on ``--shared-index`` (an
   index folder of examples/slogan_ads.parquet = the valid.csv companies, e.g. the example refresh's
   ``runs/example_refresh/index``; its titles from that corpus) with the pairs mixed in as creative
   examples, ``--shared-epochs`` (1) of the targeting training's defaults; skipped without the index.
7. ``tuned-e4``: the separate shape with twice the default epochs.
8. ``tuned-qat`` / ``tuned-qat-compressed``: the separate shape with the targeting training's QAT final
   phase (``QuantAwareConfig()``), then compressed as 3. (the stage's rule: on the grid the record names);
   ``tuned-qat-s<start>[-e<epochs>]`` (+ ``-compressed``): QAT from that share of the steps on (0 = all of
   them), over that many epochs (default: the fine-tune's).
9. ``tuned-block<N>`` (any N: 0 or >= 2): the ``tuned`` model again with ``CreativeConfig.prompt_ngram_block
   = N`` (0 = off; the default is 6): how the prompt-copy share trades against ROUGE when the decoder may
   not repeat shorter runs of the prompt.
10. ``tuned-delex`` / ``tuned-delex-company``: the separate shape trained on masked pairs (``CreativeTuneConfig.delex =
   entities`` / ``company``; the default ``tuned`` trains on the text as written, issue 57).
11. ``tuned-checked`` / ``base-checked``: the tuned / base model with 4 beams as candidates
   (``CreativeConfig(strategy=beam, num_beams=4, candidates=4)``): the generator writes the best that passes its
   checks (``adbatch.serving.checks``); the invented-entity and flagged shares and headlines/s against
   ``tuned`` / ``base`` show what the candidates buy and cost.

Metrics per row (``adbatch.eval.report``, as ``adbatch eval``): ROUGE-1/2/L F1 x 100 (rouge-score), BLEU
(sacrebleu), METEOR exact+stem (nltk), distinct-1/2, copy >= 50 % of the prompt (against the text of the
prompt the model read), empty share, truthfulness (``adbatch.eval.truthfulness``: invented-entity share, the
ad's name right among the headlines that use it; against each row's advertiser, description, industry and
url), the share of written headlines the generation checks flagged (``adbatch.serving.checks``), and headlines/s (generation only; model load and one warm-up batch
excluded). A metric whose package is not importable is skipped and named in the output
(``skipped_metrics``). Then a 10-row sample table.

    # the device (one H200): slogans carried in .carry/slogan/
    python3 bench/creatives_tune.py --model /tmp/adbatch_files/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --train-csv .carry/slogan/valid.csv --test-csv .carry/slogan/test-curated.csv \\
        --budget-s 400 --out-json $OUT/creatives_tune.json
    # here, end to end on the CPU (tiny random model, a few synthetic rows; tests/test_creative_tune_bench.py)
    .venv/bin/python bench/creatives_tune.py --smoke --out-json /tmp/ct.json
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import logging
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

# run as a script, sys.path[0] is bench/, whose kernels.py would shadow the kernels package (imported by a
# test, sys.path is left as it is but for the repository)
REPO = Path(__file__).resolve().parent.parent
if sys.path and sys.path[0] and Path(sys.path[0]).resolve() == REPO / "bench":
    sys.path[0] = str(REPO)
elif str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

log = logging.getLogger("creatives_tune")

#: metric -> the module it needs (adbatch.eval.report imports these when computing it)
METRIC_MODULES = {"rouge": "rouge_score.rouge_scorer", "bleu": "sacrebleu", "meteor": "nltk.translate.meteor_score"}
SAMPLE_ROWS = 10
#: the slogan rows' fields a creative prompt shows (the generator's request columns)
AD_FIELDS = ("advertiser", "description", "industry")


def metric_support() -> dict[str, str | None]:
    """metric -> None when its package imports, else why not (the skipped-metric note)."""
    out: dict[str, str | None] = {}
    for name, module in METRIC_MODULES.items():
        try:
            importlib.import_module(module)
            out[name] = None
        except Exception as exc:  # ImportError, or a dependency failing at import (e.g. a compiled regex)
            out[name] = f"{module} not importable ({type(exc).__name__}: {exc})"[:200]
    return out


def quality(hyps: list[str], refs: list[str], prompt_texts: list[str], support: dict[str, str | None],
            ads: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Every creative metric of ``adbatch.eval.report`` whose package is importable; with ``ads`` (each
    headline's ad record) the truthfulness shares of :func:`adbatch.eval.truthfulness.truthfulness` too."""
    from adbatch.eval.report import (corpus_bleu, distinct_n, empty_share, meteor_exact_stem, prompt_copy_share,
                                prompt_echo_share, rouge_f1)

    out: dict[str, Any] = {}
    if support["rouge"] is None:
        out.update(rouge_f1(hyps, refs))
    if support["bleu"] is None:
        out["bleu"] = corpus_bleu(hyps, refs)
    if support["meteor"] is None:
        out["meteor"] = meteor_exact_stem(hyps, refs)
    out.update({"distinct1": distinct_n(hyps, 1), "distinct2": distinct_n(hyps, 2),
                "copy_share": prompt_copy_share(hyps, prompt_texts),
                "echo_share": prompt_echo_share(hyps, prompt_texts), "empty_share": empty_share(hyps)})
    if ads is not None:
        from adbatch.eval.truthfulness import truthfulness

        out.update(truthfulness(hyps, ads))
    return out


def reference_shares(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The copy and echo shares of the human reference headlines against the tuned prompt of their own
    ad: what a model that writes like the references would score on those two metrics."""
    from adbatch.serving.prompts import CreativePrompt, creative_prompt_text
    from adbatch.eval.report import prompt_copy_share, prompt_echo_share

    refs = [r["reference"] for r in rows]
    prompts = [creative_prompt_text({k: r[k] for k in AD_FIELDS}, style=CreativePrompt.TUNED) for r in rows]
    return {"copy_share": prompt_copy_share(refs, prompts), "echo_share": prompt_echo_share(refs, prompts)}


def read_slogans(path: Path) -> list[dict[str, Any]]:
    """Rows of a slogan CSV as ad records + ``reference`` (:func:`adbatch.eval.datasets.load_slogan_test`)."""
    from adbatch.eval.datasets import load_slogan_test

    return load_slogan_test(path).to_pylist()


def train_pairs(train_csv: Path, test_rows: list[dict[str, Any]], keep_copies: bool = False) -> Any:
    """(fields -> headline) pairs of ``train_csv``; never a test row (by description or headline)."""
    from adbatch.training.creatives import HeadlinePairsConfig, headline_pairs

    held = [r["description"] for r in test_rows] + [r["reference"] for r in test_rows]
    cfg = HeadlinePairsConfig(ad_id="ad_id", headline="reference")
    if keep_copies:
        cfg = cfg.replace(max_copy_fraction=1.0)
    rows = [{**r, "ad_id": f"train-{i}"} for i, r in enumerate(read_slogans(train_csv))]
    return headline_pairs(rows, cfg, exclude_texts=held)


def evaluate(spec: Any, rows: list[dict[str, Any]], batch: int, max_new_tokens: int,
             support: dict[str, str | None], creative: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """Headlines for ``rows`` through the generate stage's generator; metrics + throughput.
    ``creative``: CreativeConfig overrides (default: the library's defaults)."""
    import pyarrow as pa
    import torch

    from adbatch.decoding import CreativeConfig
    from adbatch.serving.generators import CreativeGenerator, GenerateConfig
    from adbatch.serving.prompts import creative_prompt_text

    t0 = time.perf_counter()
    gen = CreativeGenerator(spec, CreativeConfig(max_new_tokens=max_new_tokens, **(creative or {})),
                            GenerateConfig(batch_size=batch))
    load_s = time.perf_counter() - t0
    table = pa.Table.from_pylist([{"request_id": r["ad_id"], "ad_id": r["ad_id"], **{k: r[k] for k in AD_FIELDS}}
                                  for r in rows])
    gen(table.slice(0, min(batch, table.num_rows)))  # warm-up: CUDA graph capture, kernel autotune
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    answers = [gen(table.slice(s, batch)) for s in range(0, table.num_rows, batch)]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    secs = time.perf_counter() - t1
    hyps = [(h[0] if h else "") for a in answers for h in a.column("headlines").to_pylist()]
    flagged = [bool(f and f[0]) for a in answers for f in a.column("flags").to_pylist()]
    prompts = [creative_prompt_text({k: r[k] for k in AD_FIELDS}, style=gen.prompt_style) for r in rows]
    ads = [{k: r.get(k) for k in (*AD_FIELDS, "url")} for r in rows]
    row = {"prompt": gen.prompt_style.value, "delex": gen.delex.value, "examples": len(hyps),
           **quality(hyps, [r["reference"] for r in rows], prompts, support, ads),
           "flagged_share": sum(flagged) / max(len(flagged), 1),
           "headlines_per_s": len(hyps) / secs, "ms_per_headline": 1000.0 * secs / max(len(hyps), 1),
           "generate_s": round(secs, 3), "load_s": round(load_s, 3), "batch": batch, "device": gen.device}
    del gen
    _free()
    return row, hyps


def _free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compress(src: Path, out: Path, device: str) -> dict[str, Any]:
    """The compress stage itself: ``run_compress`` with ``CompressJobConfig()``'s defaults (calibration on
    the bundled corpus sample; a QAT model on the grid its record names), no Ray, calibration and
    per-layer math on the GPU when there is one. Returns its timings, summary and QAT note."""
    from pipelines.compress import CompressJobConfig, run_compress

    job = CompressJobConfig()
    on_gpu = device.startswith("cuda")
    res = run_compress(job.replace(model=str(src), out=out, use_ray=False, layer_device=device if on_gpu else None,
                                   calibration=job.calibration.replace(device=device) if on_gpu else job.calibration))
    _free()
    t = res["timings_s"]
    return {"calibrate_s": t.get("calibrate", 0.0), "compress_s": t.get("compress", 0.0),
            "summary": res["summary"], "qat_note": res["group_policy"]["note"], "quality": res["quality"]}


def tune(src: str, pairs: Any, out: Path, device: str, epochs: float | None, lr: float | None,
         smoke: bool, qat_start: float | None = None, delex: str | None = None) -> dict[str, Any]:
    """The separate shape: :func:`tune_creatives` with the library defaults (+ overrides); ``qat_start``:
    the creative fine-tune's own QAT config turned on, from this share of the steps on; ``delex``: the
    masking (None = the default)."""
    from adbatch.training.creatives import CreativeTuneConfig, tune_creatives

    cfg = CreativeTuneConfig(enabled=True)
    if delex is not None:
        cfg = cfg.replace(delex=delex)
    train = cfg.train.replace(**{k: v for k, v in (("epochs", epochs), ("lr", lr)) if v is not None})
    if qat_start is not None:
        train = train.replace(qat=train.qat.replace(enabled=True, start_fraction=qat_start))
    if smoke:
        train = train.replace(batch_tokens=1024)
    _, _, summary = tune_creatives(pairs, out, cfg.replace(train=train), init_model=src, device=device, progress=False)
    _free()
    return {"train": summary["train"], "data": summary["data"], "config": train.to_dict(), "delex": cfg.delex.value}


def tune_shared(src: str, pairs: Any, index_dir: Path, out: Path, device: str, epochs: float, smoke: bool) -> dict[str, Any]:
    """The shared shape: the targeting training's defaults (``epochs`` of them) with the pairs mixed in."""
    import pyarrow.parquet as pq

    from adbatch.index.build import load_index
    from adbatch.training import TrainConfig, train_on_index
    from adbatch.training.creatives import CreativeTuneConfig, CreativeTuneShape

    index = load_index(index_dir)
    corpus = pq.read_table(REPO / "examples" / "slogan_ads.parquet", columns=["ad_id", "title"])
    titles = dict(zip(corpus.column("ad_id").to_pylist(), corpus.column("title").to_pylist()))
    cfg = TrainConfig(epochs=epochs)
    if smoke:
        cfg = cfg.replace(batch_tokens=1024, pseudo_queries=cfg.pseudo_queries.replace(per_ad=1))
    _, _, summary = train_on_index(index, out, cfg, ad_texts={a: titles.get(a, "") for a in index.ad_ids},
                                   init_model=src, device=device, progress=False, creative_pairs=pairs,
                                   creative_config=CreativeTuneConfig(enabled=True, shape=CreativeTuneShape.SHARED))
    _free()
    return {"train": summary.train, "data": summary.data, "config": cfg.to_dict()}


# --- smoke inputs --------------------------------------------------------------------------------------
SMOKE_ROWS = [
    ("Hand-built city bikes with free servicing for a year.", "Ride Further", "northwind bikes", "sporting goods"),
    ("Family dental clinic open six days a week.", "Brighter Smiles", "lumen dental", "medical practice"),
    ("Cloud bookkeeping that files VAT returns.", "Books That Balance", "ledgerly", "computer software"),
    ("Same-day bouquets delivered across the city.", "Fresh Flowers Today", "blue fern", "retail"),
    ("Payroll and HR software for small teams.", "Payday Made Simple", "gridline", "computer software"),
    ("Organic coffee roasted every morning.", "Wake Up to Better Coffee", "morning roast", "food & beverages"),
]


def write_smoke_csvs(folder: Path) -> tuple[Path, Path]:
    """Two tiny slogan-format CSVs (never the real data): train = rows 0-3, test = rows 4-5."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in (("valid.csv", SMOKE_ROWS[:4]), ("test-curated.csv", SMOKE_ROWS[4:])):
        path = folder / name
        with path.open("w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh)
            w.writerow(["desc", "output", "company", "industry", "url", "alias"])
            for desc, out, company, industry in rows:
                w.writerow([desc, out, company, industry, company.replace(" ", "") + ".com", company.title()])
        paths.append(path)
    return paths[0], paths[1]


def smoke_model(folder: Path) -> Path:
    """A 2-layer random Llama over the default tokenizer (real architecture), saved as an HF folder."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from adbatch.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(), local_files_only=True, trust_remote_code=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512, tie_word_embeddings=True))
    model.config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def smoke_index(model_dir: Path, folder: Path) -> Path:
    """A text-scheme index of the first 40 example ads (their own embedding stand-in: no MiniLM)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from adbatch.index.corpus import CorpusConfig
    from adbatch.index.build import IndexConfig, build_index
    from adbatch.index.ids import IdScheme, RenderConfig

    t = pq.read_table(REPO / "examples" / "slogan_ads.parquet", columns=["ad_id", "title"]).slice(0, 40)
    emb = np.random.default_rng(0).standard_normal((t.num_rows, 8)).astype(np.float32)
    t = t.append_column("embedding", pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), 8))
    pq.write_table(t, folder.with_suffix(".parquet"))
    cfg = IndexConfig(columns=CorpusConfig(text="title", embedding="embedding"), render=RenderConfig(scheme=IdScheme.TEXT),
                      tokenizer=str(model_dir))
    build_index(folder.with_suffix(".parquet"), folder, cfg, progress=False)
    return folder


# --- the run -------------------------------------------------------------------------------------------
def markdown(state: dict[str, Any]) -> str:
    cols = [("phase", "variant"), ("prompt", "prompt"), ("rouge1", "ROUGE-1"), ("rouge2", "ROUGE-2"),
            ("rougeL", "ROUGE-L"), ("bleu", "BLEU"), ("meteor", "METEOR"), ("distinct1", "dist-1"),
            ("distinct2", "dist-2"), ("copy_share", "copy>=50%"), ("echo_share", "echo"),
            ("empty_share", "empty"), ("invented_share", "invented"), ("name_right_share", "name right"),
            ("flagged_share", "flagged"),
            ("headlines_per_s", "headlines/s"), ("examples", "rows")]

    def fmt(v: Any) -> str:
        return "–" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = [f"test rows: {state.get('test_rows')}; train pairs: {state.get('pairs', {}).get('pairs')}; "
             f"skipped metrics: {state.get('skipped_metrics') or 'none'}; the human references against their own "
             f"prompts: {state.get('references')}", "",
             "| " + " | ".join(t for _, t in cols) + " |", "|" + "---|" * len(cols)]
    for r in state["rows"]:
        lines.append("| " + " | ".join(fmt(r.get(k)) for k, _ in cols) + " |")
    for name, why in state.get("not_run", {}).items():
        lines.append(f"- {name}: not run ({why})")
    samples = state.get("samples") or []
    if samples:
        names = [k for k in samples[0] if k not in ("advertiser", "reference")]
        lines += ["", "| advertiser | reference | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for s in samples:
            lines.append("| " + " | ".join(str(s.get(k, "")).replace("|", "/") for k in ("advertiser", "reference", *names))
                         + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: the default model)")
    ap.add_argument("--train-csv", type=Path, default=None, help="slogan valid.csv (training pairs)")
    ap.add_argument("--test-csv", type=Path, default=None, help="slogan test-curated.csv (evaluation only)")
    ap.add_argument("--shared-index", type=Path, default=None, help="index folder of examples/slogan_ads.parquet")
    ap.add_argument("--max-test", type=int, default=None, help="first N test rows (default: all)")
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop starting phases after this (from start)")
    ap.add_argument("--batch", type=int, default=None, help="headlines per model call (default: the generator's by device)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--epochs", type=float, default=None, help="separate shape: override the default epochs")
    ap.add_argument("--lr", type=float, default=None, help="separate shape: override the default lr")
    ap.add_argument("--shared-epochs", type=float, default=1.0)
    ap.add_argument("--phases", default="base,tuned,tuned-compressed,base-compressed,tuned-keep-copies,shared,tuned-e4")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp folder, removed)")
    ap.add_argument("--out-json", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny random model, synthetic rows, every phase")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t_start = time.perf_counter()
    import torch

    from adbatch.serving.generators import ModelSpec, default_batch_size

    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = args.work or Path(tempfile.mkdtemp(prefix="creatives-tune-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        model_src = str(smoke_model(work / "smoke_model"))
        train_csv, test_csv = write_smoke_csvs(work / "smoke_data")
        train_csv, test_csv = args.train_csv or train_csv, args.test_csv or test_csv
        shared_index = args.shared_index or smoke_index(Path(model_src), work / "smoke_index")
    else:
        if args.train_csv is None or args.test_csv is None:
            ap.error("--train-csv and --test-csv are required (or --smoke)")
        model_src, train_csv, test_csv, shared_index = args.model, args.train_csv, args.test_csv, args.shared_index
    base_folder = ModelSpec(model=model_src).folder()  # GGUF -> safetensors folder once
    support = metric_support()
    test_rows = read_slogans(test_csv)[:args.max_test]
    pairs = train_pairs(train_csv, test_rows)
    batch = args.batch or default_batch_size(device)
    state: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None, "host": platform.node(),
        "torch": torch.__version__, "transformers": importlib.import_module("transformers").__version__,
        "model": str(model_src or "default"), "train_csv": str(train_csv), "test_csv": str(test_csv),
        "test_rows": len(test_rows), "pairs": pairs.stats, "batch": batch, "max_new_tokens": args.max_new_tokens,
        "skipped_metrics": {k: v for k, v in support.items() if v}, "rows": [], "extra": {}, "not_run": {},
        "budget_s": args.budget_s, "references": reference_shares(test_rows)}
    outputs: dict[str, list[str]] = {}
    folders = {"base": base_folder, "tuned": work / "tuned", "tuned-keep-copies": work / "tuned_keep",
               "tuned-e4": work / "tuned_e4", "shared": work / "shared", "tuned-qat": work / "tuned_qat"}
    spent: dict[str, float] = {}

    def save() -> None:
        if args.out_json:
            args.out_json.parent.mkdir(parents=True, exist_ok=True)
            args.out_json.write_text(json.dumps(state, indent=1, default=str))
            # every headline of every phase, row-aligned with the test file (metrics can be re-computed offline)
            args.out_json.with_suffix(".headlines.json").write_text(json.dumps(outputs))

    def evaluate_into(name: str, spec: Any, extra: dict[str, Any] | None = None,
                      creative: dict[str, Any] | None = None) -> None:
        row, hyps = evaluate(spec, test_rows, batch, args.max_new_tokens, support, creative)
        state["rows"].append({"phase": name, **row, **(extra or {})})
        outputs[name] = hyps
        log.info("%s: %s", name, state["rows"][-1])

    def p_base() -> None:
        evaluate_into("base", ModelSpec(model=str(base_folder)))

    def p_tuned(name: str, keep_copies: bool = False, epochs: float | None = args.epochs,
                qat_start: float | None = None, delex: str | None = None) -> Callable[[], None]:
        def run() -> None:
            p = train_pairs(train_csv, test_rows, keep_copies=True) if keep_copies else pairs
            t = tune(str(base_folder), p, folders[name], device, epochs, args.lr, args.smoke, qat_start=qat_start,
                     delex=delex)
            state["extra"][name] = {**t, "pairs": p.stats}
            evaluate_into(name, ModelSpec(model=str(folders[name])),
                          {"train_s": t["train"]["seconds"], "train_steps": t["train"]["steps"]})
        return run

    def p_compressed(name: str, src: str) -> Callable[[], None]:
        def run() -> None:
            if not Path(folders[src]).is_dir():
                raise RuntimeError(f"{src} model not available (phase not run)")
            out = work / f"{name}_ckpt"
            c = compress(Path(folders[src]), out, device)
            state["extra"][name] = c
            evaluate_into(name, ModelSpec(compressed=str(out)), {"compress_s": c["calibrate_s"] + c["compress_s"]})
        return run

    def p_shared() -> None:
        if shared_index is None:
            raise RuntimeError("no --shared-index (index stage needs faiss, absent on the device): give an index "
                               "folder of examples/slogan_ads.parquet, e.g. runs/example_refresh/index")
        t = tune_shared(str(base_folder), pairs, shared_index, folders["shared"], device, args.shared_epochs, args.smoke)
        state["extra"]["shared"] = t
        evaluate_into("shared", ModelSpec(model=str(folders["shared"])),
                      {"train_s": t["train"]["seconds"], "train_steps": t["train"]["steps"]})

    def p_block(name: str, block: int | None, creative: dict[str, Any] | None = None) -> Callable[[], None]:
        """The tuned model again with ``prompt_ngram_block = block`` or other CreativeConfig overrides."""
        over = creative if creative is not None else {"prompt_ngram_block": block}

        def run() -> None:
            if not Path(folders["tuned"]).is_dir():
                raise RuntimeError("tuned model not available (phase not run)")
            evaluate_into(name, ModelSpec(model=str(folders["tuned"])), dict(over), creative=over)
        return run

    def p_checked_base() -> None:
        evaluate_into("base-checked", ModelSpec(model=str(base_folder)), None,
                      creative={"strategy": "beam", "num_beams": 4, "candidates": 4})

    from adbatch.training.quant_aware import QuantAwareConfig

    default_epochs = __import__("adbatch.training.creatives", fromlist=["x"])._default_creative_train().epochs
    phases: dict[str, Callable[[], None]] = {
        "base": p_base, "tuned": p_tuned("tuned"), "tuned-compressed": p_compressed("tuned-compressed", "tuned"),
        "base-compressed": p_compressed("base-compressed", "base"),
        "tuned-keep-copies": p_tuned("tuned-keep-copies", keep_copies=True), "shared": p_shared,
        "tuned-e4": p_tuned("tuned-e4", epochs=2 * (args.epochs or default_epochs)),
        "tuned-qat": p_tuned("tuned-qat", qat_start=QuantAwareConfig().start_fraction),
        "tuned-qat-compressed": p_compressed("tuned-qat-compressed", "tuned-qat"),
        "tuned-delex": p_tuned("tuned-delex", delex="entities"),
        "tuned-delex-company": p_tuned("tuned-delex-company", delex="company"),
        "tuned-checked": p_block("tuned-checked", None, {"strategy": "beam", "num_beams": 4, "candidates": 4}),
        "base-checked": p_checked_base}
    wanted = [p.strip() for p in args.phases.split(",") if p.strip()]
    for name in wanted:
        block = name.removeprefix("tuned-block")
        if name.startswith("tuned-block") and block.isdigit():
            phases[name] = p_block(name, int(block))
        # tuned-qat-s<start>[-e<epochs>][-compressed]: QAT from that share of the steps, over that many epochs
        m = re.fullmatch(r"(tuned-qat-s([0-9.]+)(?:-e([0-9.]+))?)(-compressed)?", name)
        if m:
            tuned_name = m.group(1)
            folders.setdefault(tuned_name, work / tuned_name.replace("-", "_").replace(".", "p"))
            phases[name] = (p_compressed(name, tuned_name) if m.group(4) else
                            p_tuned(name, epochs=float(m.group(3)) if m.group(3) else args.epochs,
                                    qat_start=float(m.group(2))))
    unknown = [p for p in wanted if p not in phases]
    if unknown:
        ap.error(f"unknown phase(s) {unknown}; known: {list(phases)}")
    for name in wanted:
        elapsed = time.perf_counter() - t_start
        # a phase costs about what the dearest finished one did; none is started that would overrun
        guess = max(spent.values(), default=0.0)
        if not args.smoke and elapsed + guess > args.budget_s:
            state["not_run"][name] = f"budget: {elapsed:.0f} s spent, a phase takes ~{guess:.0f} s, budget {args.budget_s:.0f} s"
            log.warning("%s skipped: %s", name, state["not_run"][name])
            continue
        t0 = time.perf_counter()
        try:
            phases[name]()
        except Exception as exc:  # one failed phase must not lose the others' rows
            log.exception("phase %s failed", name)
            state["not_run"][name] = f"failed: {type(exc).__name__}: {exc}"[:300]
        spent[name] = time.perf_counter() - t0
        state.setdefault("phase_seconds", {})[name] = round(spent[name], 2)
        save()
    state["samples"] = [{"advertiser": r["advertiser"], "reference": r["reference"],
                         **{k: v[i] for k, v in outputs.items()}} for i, r in enumerate(test_rows[:SAMPLE_ROWS])]
    state["wall_s"] = round(time.perf_counter() - t_start, 2)
    save()
    print(markdown(state))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return state


if __name__ == "__main__":
    main()
