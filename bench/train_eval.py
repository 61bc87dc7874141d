"""Train the ad index into the default model and evaluate generative targeting (one script, one call).

Subcommands (``baseline``: MiniLM+FAISS on a catalogue's test queries, here on the CPU):

``prepare`` (here, CPU, needs ../shared/data and the MiniLM embeddings cached by ``--emb``): builds
a small *bundle* folder: Home Depot indexes (``text`` and ``codes`` schemes; the 5,000-title subset
and the full 54,667 catalogue) through the index stage's ``build_index`` over precomputed MiniLM
embeddings, the ads' titles, the train-split labelled pairs, the test qrels, and the MiniLM+FAISS
baseline numbers measured here.

``run`` (the device, no Ray; also runs on CPU with ``--smoke``): loads the default model (a GGUF or
HF folder), then, inside a time budget, in priority order:
1. zero-shot: the untrained model over the ``text`` index of 5,000 titles;
2. trained dense, ``text`` scheme, then ``codes`` scheme (5,000 titles);
3. progressive sparsity (2:4 with a share of layers at 1:4) on the better scheme, evaluated with
   the masks, then + adaptive INT4 (the compression stage's ``compress_``, masks kept: uniform 2:4
   magnitude selection over weights whose pruned entries are exactly zero reproduces the masks; a
   1:4 layer is stored as 2:4 with one zero kept per group, so its bytes are 2:4's, its values
   exact); quality is evaluated on the dequantized INT4 values (``densify_``);
4. the full 54,667-title catalogue: training throughput (seconds per epoch) and quality as reached.
Each evaluation runs ``search_targets`` (10 beams, top 10) over held-out test queries and reports
recall@1/10, success@10, MRR@10, nDCG@10 and queries/s. Writes ``results.json``, ``table.md`` and
``curves.png`` under ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

log = logging.getLogger("train_eval")

SCHEMES = ("text", "codes")


# ---------------------------------------------------------------------------------------------
# prepare (CPU, here)
# ---------------------------------------------------------------------------------------------
def channels(args: argparse.Namespace) -> None:
    """Issue 41's table, one device call, no Ray: each targeting channel alone and fused, on a trained model.

    1. ``train_on_index`` with ``TrainConfig()`` (the ``adbatch train`` defaults; ``--train-budget-s`` caps
       it) on the catalogue's index, validation qrels given: it fits the fusion of the two channels at the
       end (the record's ``fusion``), with the dense channel reading the bundle's precomputed query vectors
       (``PrecomputedQueryEmbedder``; the device has no MiniLM): the tuned query embedder's when ``tune-queries``
       wrote them (the product's default), MiniLM's as shipped otherwise (and in the ``dense untuned`` row);
    2. the dense prior's weight chosen on the validation queries (hybrid, default beams) from
       ``--prior-weights``;
    3. test queries, bf16, through :class:`adbatch.serving.hybrid.HybridRanker` (what ``adbatch generate``
       runs): dense alone, generative at beams 10 / 32 / 64, hybrid (fitted fusion; RRF beside it) with and
       without the prior at the same widths; then speed at ``--speed-batch`` queries per batch (the test
       queries repeated), median of 3: generative vs hybrid;
    4. the compress stage's defaults (``run_compress``, ``use_ray=False``), its checkpoint loaded as generate
       loads it (its manifest carries the fusion), and the same rows at the default width.
    Writes ``results.json`` and ``table.md`` under ``--out``. ``--ablation``: :func:`channels_ablation` instead.
    """
    import torch

    from adbatch.decoding import DenseScoring, FusionMode, TargetSearchConfig, VerifyMode
    from adbatch.eval.targeting import evaluate_targeting
    from adbatch.serving.generators import ModelSpec, load_model
    from adbatch.serving.hybrid import FusionMethod, FusionParams, fusion_of_record
    from adbatch.training import train_on_index
    from adbatch.training.checkpoint import read_training_record

    if args.ablation:
        return channels_ablation(args)
    out, device, results, save, bundle, cat, data, index, dense, untuned, cfg = _channels_setup(args)
    results["train_config"] = cfg.to_dict()
    model_dir = Path(args.work) / f"trained_{cat}_{args.scheme}{ids_suffix(args)}"
    t0 = time.perf_counter()
    if args.reuse_trained and read_training_record(model_dir) is not None:
        model, tok = load_base(str(model_dir), False, device)
    else:
        model, tok = load_base(args.model, args.smoke, device)
        model, tok, summary = train_on_index(index, model_dir, cfg, ad_texts=data["ad_texts"], labelled=data["labelled"],
                                             model=model, tokenizer=tok, device=device, progress=False,
                                             valid_qrels=data["valid"], dense=dense,
                                             exclude_queries=[*data["qrels"], *data["valid"]])
        results["train"] = {f"{cat}-{args.scheme}": summary.train | {"wall_s": round(time.perf_counter() - t0, 1)}}
    fusion = fusion_of_record(read_training_record(model_dir))
    results["fusion"] = fusion.to_dict()
    save()
    served = model.to(device)
    if device == "cuda":
        served = served.to(torch.bfloat16)
    served.eval()
    base = TargetSearchConfig(verify=VerifyMode.OFF)

    def eval_row(name: str, m: Any, search: Any, fus: FusionParams, qrels: dict | None = None,
                 channel: Any = None) -> dict:
        rank = hybrid_rank(m, tok, index, search, channel or dense, fus)
        qr = qrels if qrels is not None else data["qrels"]
        rank(sorted(qr)[:args.batch])  # warm-up: graphs, kernels
        r = evaluate_targeting(rank, qr, batch_size=args.batch, max_queries=args.max_queries)
        if qrels is None:
            results["rows"][name] = r
            log.info("%s: %s", name, {k: round(v, 4) for k, v in r.items()})
            save()
        return r

    rrf = FusionParams(method=FusionMethod.RRF)
    # the prior's weight, chosen on validation queries (never the test split)
    hyb = base.replace(fusion=FusionMode.HYBRID)
    floor = hyb.replace(dense_scoring=DenseScoring.BEAM_FLOOR)  # no exact pass (the fusion fitted for it)
    weights = [float(w) for w in args.prior_weights.split(",") if w]
    valid_rec = {w: eval_row(f"valid prior {w}", served, hyb.replace(prior_weight=w), fusion, data["valid"])["recall@10"]
                 for w in [0.0, *weights]}
    best_w = max(valid_rec, key=lambda w: (valid_rec[w], -w))
    results["prior_validation_recall@10"] = valid_rec
    results["prior_weight"] = best_w
    eval_row("dense", served, base.replace(fusion=FusionMode.DENSE, dense_k=base.top_k), fusion)
    if dense is not untuned:  # the shipped MiniLM's answers: the retrieval a user already has
        eval_row("dense untuned", served, base.replace(fusion=FusionMode.DENSE, dense_k=base.top_k), fusion,
                 channel=untuned)
    for beams in [int(b) for b in args.beams_list.split(",")]:
        eval_row(f"generative b{beams}", served, base.replace(fusion=FusionMode.GENERATIVE, num_beams=beams), fusion)
        eval_row(f"hybrid b{beams}", served, hyb.replace(num_beams=beams), fusion)
        eval_row(f"hybrid beam_floor b{beams}", served, floor.replace(num_beams=beams), fusion)
        if best_w > 0:
            eval_row(f"hybrid+prior b{beams}", served, hyb.replace(num_beams=beams, prior_weight=best_w), fusion)
    eval_row("hybrid rrf b10", served, hyb.replace(num_beams=10), rrf)
    for dk in (10, 40):  # dense candidates per query (the default is TargetSearchConfig.dense_k)
        eval_row(f"hybrid b10 dense_k {dk}", served, hyb.replace(num_beams=10, dense_k=dk), fusion)
    # every candidate's features, for fusion studies without the GPU (validation + test, dense_k 40, beams 10)
    results["candidates"] = dump_candidates(served, tok, index, dense, hyb.replace(num_beams=10, dense_k=40),
                                            {"valid": data["valid"], "test": data["qrels"]}, out / "candidates.npz")
    save()
    # speed at a large batch: the test queries repeated (each call one batch), median of 3 after a warm-up
    big = repeated(sorted(data["qrels"]), args.speed_batch)
    menu = [("generative b10", base.replace(fusion=FusionMode.GENERATIVE, num_beams=10)),
            ("dense", base.replace(fusion=FusionMode.DENSE, dense_k=base.top_k)),
            ("hybrid b10", hyb.replace(num_beams=10)), ("hybrid beam_floor b10", floor.replace(num_beams=10))]
    menu += [(f"hybrid b10 dense_k {dk}", hyb.replace(num_beams=10, dense_k=dk)) for dk in (10, 40)]
    if best_w > 0:
        menu.append(("hybrid+prior b10", hyb.replace(num_beams=10, prior_weight=best_w)))
    speed = {name: time_hybrid(served, tok, index, dense, search, fusion, big) for name, search in menu}
    results["speed"] = speed
    log.info("speed: %s", speed)
    save()
    del served, model
    if device == "cuda":
        import gc

        gc.collect()  # the bf16 model's engine (its graphs) goes with it
        torch.cuda.empty_cache()
    if not args.skip_compress:
        comp_dir = Path(args.work) / f"compressed_{cat}_{args.scheme}{ids_suffix(args)}"
        results["compress"] = {"defaults": compress_defaults(args, bundle, cat, model_dir, comp_dir, device)}
        spec = ModelSpec(compressed=str(comp_dir))
        cfus = fusion_of_record(spec.training_record())
        results["compressed_fusion"] = cfus.to_dict()
        cm, _ = load_model(spec, device)
        eval_row("compressed generative b10", cm, base.replace(fusion=FusionMode.GENERATIVE, num_beams=10), cfus)
        eval_row("compressed hybrid b10", cm, hyb.replace(num_beams=10), cfus)
        eval_row("compressed hybrid beam_floor b10", cm, floor.replace(num_beams=10), cfus)
        if best_w > 0:
            eval_row("compressed hybrid+prior b10", cm, hyb.replace(num_beams=10, prior_weight=best_w), cfus)
        results["candidates_compressed"] = dump_candidates(cm, tok, index, dense, hyb.replace(num_beams=10, dense_k=40),
                                                           {"valid": data["valid"], "test": data["qrels"]},
                                                           out / "candidates_compressed.npz")
        for name, search in (("generative b10", base.replace(fusion=FusionMode.GENERATIVE, num_beams=10)),
                             ("hybrid b10", hyb.replace(num_beams=10)),
                             ("hybrid beam_floor b10", floor.replace(num_beams=10))):
            results["speed"][f"compressed {name}"] = time_hybrid(cm, tok, index, dense, search, cfus, big)
        save()
    table = render_table(results)
    (out / "table.md").write_text(table)
    print(table)
    print(json.dumps({k: results.get(k) for k in ("train", "fusion", "prior_weight", "speed", "compress")},
                     default=str)[:3000])


def hybrid_rank(model: Any, tok: Any, index: Any, search: Any, dense: Any, fusion: Any) -> Any:
    """``queries -> ad ids, best first`` through :class:`adbatch.serving.hybrid.HybridRanker` (the generate
    stage's ranking), for :func:`adbatch.eval.targeting.evaluate_targeting`."""
    from adbatch.serving.hybrid import HybridRanker

    hr = HybridRanker(model, tok, index, search, dense=dense, fusion=fusion)
    return lambda qs: [[index.ad_ids[r] for r in row] for row in hr.rank(qs).lists()]


def repeated(queries: list[str], n: int) -> list[str]:
    """``n`` queries for one speed call: ``queries`` repeated in order (a test split is smaller than the batch)."""
    return (queries * (n // len(queries) + 1))[:n]


def time_hybrid(model: Any, tok: Any, index: Any, dense: Any, search: Any, fusion: Any, queries: list[str],
                repeats: int = 3) -> dict[str, Any]:
    """One speed row: ``queries`` ranked in one call through :class:`adbatch.serving.hybrid.HybridRanker`,
    median of ``repeats`` timed passes (bench/decode.py's) after a warm-up, with the last call's counters of
    dense candidates scored exactly."""
    import dataclasses
    import statistics

    import adbatch.serving.hybrid as hybrid
    from bench.decode import device_of, time_pass

    hr = hybrid.HybridRanker(model, tok, index, search, dense=dense, fusion=fusion)
    run = lambda qs: (hr.rank(qs).lists(), [], {})  # noqa: E731 - bench/decode.py's runner shape
    run(queries)  # warm-up: graph captures
    times = [time_pass(run, queries, len(queries), device_of(model))["time"] for _ in range(repeats)]
    med = statistics.median(times)
    row = {"queries": len(queries), "median_s": med, "queries_per_s": len(queries) / med, "times_s": times,
           "exact": dataclasses.asdict(hr.last_exact)}
    log.info("speed: %.1f q/s exact %s", row["queries_per_s"], row["exact"])
    return row


def dump_candidates(model: Any, tok: Any, index: Any, dense: Any, search: Any, splits: dict[str, dict],
                    path: Path, batch: int = 256) -> dict[str, Any]:
    """Every union candidate of each split's queries, unfused (``HybridRanker.candidates``: every dense candidate
    scored), into ``path`` (npz: ``<split>_queries``, ``<split>_rows`` / ``_generative`` / ``_dense`` /
    ``_channel`` / ``_length`` ``[Q, M]``): what fusion studies need without the GPU (``fusion-study``)."""
    import numpy as np
    import torch

    from adbatch.serving.hybrid import HybridRanker

    hr = HybridRanker(model, tok, index, search, dense=dense)
    arrays: dict[str, Any] = {}
    for split, qrels in splits.items():
        qs = sorted(qrels)
        parts = [hr._with_lengths(hr.candidates(qs[s0:s0 + batch])) for s0 in range(0, len(qs), batch)]
        arrays[f"{split}_queries"] = np.array(qs)
        for f in ("rows", "generative", "dense", "channel", "length"):
            arrays[f"{split}_{f}"] = torch.cat([getattr(c, f) for c in parts]).numpy()
    np.savez_compressed(path, **arrays)
    return {"file": path.name, "splits": {s: len(q) for s, q in splits.items()}}


def fusion_study(args: argparse.Namespace) -> None:
    """``fusion-study``: from a ``channels`` run's ``candidates.npz`` (dense_k 40) and its bundle, on the CPU:
    per dense_k, the fusion :func:`adbatch.serving.hybrid.fit_fusion` fits on the validation queries and its test
    recall@10 / MRR@10, with the union's recall (what a perfect reranker of those candidates would reach); the same
    with ``dense_scoring = beam_floor`` (:func:`adbatch.serving.hybrid.beam_floor_view`); then logistic regressions
    over richer candidate features (fitted on validation), beside it."""
    import numpy as np
    import torch

    from adbatch.serving.hybrid import (CHANNEL_DENSE, CHANNEL_GENERATIVE, Candidates, _ranks, beam_floor_view,
                                        fit_fusion, fused_scores, rank_candidates, recall_mrr)

    z = np.load(args.candidates)
    data = load_bundle(Path(args.bundle), args.catalogue)
    index = data["indexes"]["text"]
    row_of = {str(a): i for i, a in enumerate(index.ad_ids)}
    rel = {split: [{row_of[str(a)] for a, g in qr[q].items() if g >= 2.67 and str(a) in row_of}
                   for q in z[f"{split}_queries"]] for split, qr in (("valid", data["valid"]), ("test", data["qrels"]))}

    def cands(split: str, dk: int) -> Candidates:  # the union at dense_k dk: the dense channel's top dk by cosine
        rows, ch = torch.from_numpy(z[f"{split}_rows"]), torch.from_numpy(z[f"{split}_channel"]).long()
        g, d = torch.from_numpy(z[f"{split}_generative"]), torch.from_numpy(z[f"{split}_dense"])
        is_d, is_g = (ch & CHANNEL_DENSE) > 0, (ch & CHANNEL_GENERATIVE) > 0
        keep_d = is_d & (_ranks(d, is_d) <= dk)
        keep = (rows >= 0) & (is_g | keep_d)
        chan = (torch.where(is_g, CHANNEL_GENERATIVE, 0) | torch.where(keep_d, CHANNEL_DENSE, 0)).to(torch.int8)
        return Candidates(torch.where(keep, rows, -1), torch.where(keep, g, float("nan")),
                          torch.where(keep, d, float("nan")), chan, torch.from_numpy(z[f"{split}_length"]))

    def union_recall(c: Candidates, rels: list) -> float:
        return float(np.mean([len(set(r) & s) / len(s) for r, s in zip(c.rows.tolist(), rels) if s]))

    lines = ["| dense_k | fitted fusion | valid recall@10 | test recall@10 | test MRR@10 | union recall valid / test |",
             "|---|---|---|---|---|---|"]
    for dk in (5, 10, 15, 20, 30, 40):
        cv, ct = cands("valid", dk), cands("test", dk)
        f = fit_fusion(cv, rel["valid"], "validation")
        r, m = recall_mrr(rank_candidates(ct, fused_scores(ct, f), 10).rows, rel["test"])
        lines.append(f"| {dk} | {f.method.value} {f.weight_generative:g} {f.generative_norm} | "
                     f"{f.fit_metrics['hybrid_recall@10']:.4f} | {r:.4f} | {m:.4f} | "
                     f"{union_recall(cv, rel['valid']):.3f} / {union_recall(ct, rel['test']):.3f} |")

    # dense_scoring = beam_floor on the same candidates: the dense-only scores replaced by each query's lowest beam
    # score, its own fit (what the product stores as FusionParams.beam_floor)
    lines += ["", "| dense_k | beam_floor: fitted fusion | valid recall@10 | test recall@10 | test MRR@10 |",
              "|---|---|---|---|---|"]
    for dk in (10, 20, 40):
        cv, ct = beam_floor_view(cands("valid", dk)), beam_floor_view(cands("test", dk))
        f = fit_fusion(cv, rel["valid"], "validation")
        r, m = recall_mrr(rank_candidates(ct, fused_scores(ct, f), 10).rows, rel["test"])
        lines.append(f"| {dk} | {f.method.value} {f.weight_generative:g} {f.generative_norm} | "
                     f"{f.fit_metrics['hybrid_recall@10']:.4f} | {r:.4f} | {m:.4f} |")

    def features(c: Candidates, names: tuple[str, ...]) -> Any:
        ok = c.rows >= 0
        g = torch.nan_to_num(c.generative, nan=-80.0).clamp(min=-80)
        d = torch.nan_to_num(c.dense, nan=0.0)
        rank = lambda x: (_ranks(x, ok) - 1).float()  # noqa: E731 - 0-based, invalid last
        f = {"cos": d, "logp": g, "logp_mean": g / c.length.float().clamp(min=1),
             "beam": ((c.channel.long() & CHANNEL_GENERATIVE) > 0).float(),
             "dense": ((c.channel.long() & CHANNEL_DENSE) > 0).float(),
             "rr_gen": 1 / (5 + rank(g)), "rr_dense": 1 / (5 + rank(d))}
        return torch.stack([f[n] for n in names], -1)

    lines += ["", "| dense_k | logistic regression features (fitted on validation) | valid recall@10 | test recall@10 |",
              "|---|---|---|---|"]
    for dk in (10, 20):
        cv, ct = cands("valid", dk), cands("test", dk)
        for names in (("cos", "logp"), ("cos", "logp", "logp_mean"), ("cos", "logp", "logp_mean", "beam", "dense"),
                      ("cos", "logp", "logp_mean", "beam", "dense", "rr_gen", "rr_dense")):
            xv, xt = features(cv, names), features(ct, names)
            y = torch.tensor([[float(r in s) for r in row] for row, s in zip(cv.rows.tolist(), rel["valid"])])
            ok = cv.rows >= 0
            mu, sd = xv[ok].mean(0), xv[ok].std(0) + 1e-6
            w = torch.zeros(len(names), requires_grad=True)
            b = torch.zeros(1, requires_grad=True)
            opt = torch.optim.LBFGS([w, b], max_iter=200)

            def closure() -> Any:
                opt.zero_grad()
                loss = torch.nn.functional.binary_cross_entropy_with_logits(((xv[ok] - mu) / sd) @ w + b, y[ok])
                loss = loss + 1e-3 * (w * w).sum()
                loss.backward()
                return loss

            opt.step(closure)
            score = lambda c, x: torch.where(c.rows >= 0, ((x - mu) / sd) @ w.detach(), float("-inf"))  # noqa: E731
            rv = recall_mrr(rank_candidates(cv, score(cv, xv), 10).rows, rel["valid"])[0]
            rt = recall_mrr(rank_candidates(ct, score(ct, xt), 10).rows, rel["test"])[0]
            lines.append(f"| {dk} | {', '.join(names)} | {rv:.4f} | {rt:.4f} |")
    table = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(table)
    print(table)


def compress_defaults(args: argparse.Namespace, bundle: Path, cat: str, model_dir: Path, comp_dir: Path,
                      device: str) -> dict[str, Any]:
    """The compress stage with its defaults on ``model_dir`` (``run_compress``, no Ray), calibrated on the
    bundle's index, training queries and titles; its summary plus ``wall_s``."""
    from pipelines.compress import CompressJobConfig, run_compress

    t0 = time.perf_counter()
    csum = run_compress(CompressJobConfig(model=str(model_dir), index=bundle / f"index_{cat}_{args.scheme}{ids_suffix(args)}",
                                          queries=bundle / f"train_{cat}.parquet", ads=bundle / f"titles_{cat}.parquet",
                                          out=comp_dir, use_ray=False, layer_device=device if device == "cuda" else None))
    return {"wall_s": round(time.perf_counter() - t0, 1),
            **{k: v for k, v in csum.items() if isinstance(v, (int, float, str))}}


def _channels_setup(args: argparse.Namespace) -> tuple:
    """What ``channels`` and its ablation share: the results file, the bundle, the index of ``--scheme``, the
    dense channel over the bundle's precomputed MiniLM query vectors, and the TrainConfig (the ``adbatch train``
    defaults, ``--train-json`` merged, ``--train-budget-s``)."""
    from adbatch.index.dense import DenseRetriever, PrecomputedQueryEmbedder
    from adbatch.training import TrainConfig

    out, device, results, save = _results_file(args)
    bundle, cat = Path(args.bundle), args.catalogue
    if (bundle / "prepare.json").is_file():
        results["prepare"] = json.loads((bundle / "prepare.json").read_text())
    sfx = ids_suffix(args)
    data = load_bundle(bundle, cat, sfx)
    index = data["indexes"][args.scheme]
    # the index's own query embedder's vectors (MiniLM's, or the index stage's tuned encoder's for --ids tuned)
    untuned = DenseRetriever(index, device, embedder=PrecomputedQueryEmbedder.from_npz(bundle / f"query_emb_{cat}{sfx}.npz"))
    cfg = TrainConfig() if not args.smoke else TrainConfig(max_steps=2, batch_tokens=2048, compile=False)
    cfg = TrainConfig.from_dict(_merged(cfg.to_dict(), json.loads(args.train_json)))
    if args.train_budget_s:
        cfg = cfg.replace(time_budget_s=args.train_budget_s)
    # the product's dense channel: the query embedder the train stage tunes (tune-queries ran it on the CPU)
    dense, tuned = untuned, bundle / f"query_tuned_{cat}{sfx}.npz"
    if cfg.query_tuning.enabled and tuned.is_file():
        dense = DenseRetriever(index, device, embedder=PrecomputedQueryEmbedder.from_npz(tuned))
        results["query_tuning"] = json.loads((bundle / f"query_tuning_{cat}{sfx}.json").read_text())
    if sfx:
        results["embedder_tuning"] = index.manifest.get("embedder_tuning")
    return out, device, results, save, bundle, cat, data, index, dense, untuned, cfg


#: the arms of ``channels --ablation`` (issue 41 item 4): TrainConfig overrides merged over the run's config;
#: ``rank`` / ``rank_gen`` also take ``--rank-json``. The device has no query encoder: ``tune-queries`` stored the
#: tuned embedder's vectors of the labelled and span training queries, so ``rank`` ranks against the real teacher
#: (``teacher_query = embed``, the product's default); the generated queries have no stored vector, so ``rank_gen``
#: places a query at its source ad's vector (``source_ad``) unless ``--rank-json`` says otherwise
ABLATION_ARMS = {
    "ce": {"rank": {"enabled": False}},
    "rank": {"rank": {"enabled": True, "sources": ["labelled", "spans"]}},
    # the teacher-labelled generated queries: the generator's queries join training (mix: spans + generated)
    # and rank against the teacher's top-k
    "rank_gen": {"pseudo_queries": {"source": "mix"},
                 "rank": {"enabled": True, "teacher_query": "source_ad", "sources": ["labelled", "spans", "generated"]}},
}


#: issue 42 item 2: the compressed model's layers served in one format at every bucket (forced: the worst case of
#: what a per-bucket plan may choose; "int4" = the packed kernels everywhere, the served INT4 model's numerics),
#: next to the measured plan of the default formats (TargetSearchConfig.linear_formats)
FORMAT_ROWS = {"int4 every layer": "packed", "default plan": None, "fp8 every layer": "fp8",
               "2:4 fp8 + fp8 every layer": "sparse_fp8"}


def compressed_formats(args: argparse.Namespace, bundle: Path, cat: str, model_dir: Path, index: Any, dense: Any,
                       data: dict, channels_menu: dict, tok: Any) -> dict[str, dict]:
    """The compress stage's defaults on ``model_dir`` (``run_compress``, the product's recipe), then the generative
    and hybrid channels' recall with the compressed layers served per :data:`FORMAT_ROWS`."""
    import torch

    from adbatch.decoding.engine import engine_for
    from adbatch.eval.targeting import evaluate_targeting
    from adbatch.serving.generators import ModelSpec, load_model
    from adbatch.serving.hybrid import fusion_of_record

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    comp_dir = Path(args.work) / f"compressed_{model_dir.name}"
    log.info("compressed in %.1fs", compress_defaults(args, bundle, cat, model_dir, comp_dir, device)["wall_s"])
    spec = ModelSpec(compressed=str(comp_dir))
    cfus = fusion_of_record(spec.training_record())
    cm, _ = load_model(spec, device)
    out: dict[str, dict] = {}
    for label, forced in FORMAT_ROWS.items():
        engine_for(cm).force_format(forced)
        for name in ("generative", "hybrid"):
            rank = hybrid_rank(cm, tok, index, channels_menu[name], dense, cfus)
            try:
                r = evaluate_targeting(rank, data["qrels"], batch_size=args.batch, max_queries=args.max_queries)
            except RuntimeError as exc:  # a format this device cannot build
                log.warning("compressed %s %s: %s", label, name, str(exc).splitlines()[0])
                continue
            out[f"compressed {label} {name}"] = {k: r[k] for k in ("recall@10", "mrr@10", "queries", "queries_per_s")
                                                 if k in r}
            log.info("compressed %s %s: recall@10 %.4f", label, name, r["recall@10"])
    engine_for(cm).force_format(None)
    del cm
    return out


def channels_ablation(args: argparse.Namespace) -> None:
    """``channels --ablation``: the rank-aware distillation's ablation, one trained model per arm of ``--arms``
    (:data:`ABLATION_ARMS`: CE only, CE + rank loss, CE + rank loss + teacher-labelled generated queries), each
    evaluated on the test queries through :class:`adbatch.serving.hybrid.HybridRanker` (bf16, 10 beams, the
    fusion its training fitted): dense, generative and hybrid recall@10 / MRR@10 (rows ``<arm> <channel>``),
    with the training summary's rank record. Each arm trains within ``--train-budget-s``; for a 10-minute
    device call, one arm per call (the arms write ``results.json`` under ``--out`` as they finish)."""
    import torch

    from adbatch.decoding import DenseScoring, FusionMode, TargetSearchConfig, VerifyMode
    from adbatch.eval.targeting import evaluate_targeting
    from adbatch.serving.hybrid import fusion_of_record
    from adbatch.training import TrainConfig, train_on_index
    from adbatch.training.checkpoint import read_training_record

    out, device, results, save, bundle, cat, data, index, dense, untuned, base_cfg = _channels_setup(args)
    rank_over = json.loads(args.rank_json)
    results["ablation"] = {}
    base = TargetSearchConfig(verify=VerifyMode.OFF, num_beams=10)
    channels_menu = {"dense": base.replace(fusion=FusionMode.DENSE, dense_k=base.top_k),
                     "generative": base.replace(fusion=FusionMode.GENERATIVE),
                     "hybrid": base.replace(fusion=FusionMode.HYBRID),
                     "hybrid beam_floor": base.replace(fusion=FusionMode.HYBRID, dense_scoring=DenseScoring.BEAM_FLOOR)}
    for arm in [a for a in args.arms.split(",") if a]:
        if arm not in ABLATION_ARMS:
            raise SystemExit(f"unknown ablation arm {arm!r} (arms: {', '.join(ABLATION_ARMS)})")
        over = ABLATION_ARMS[arm]
        if over["rank"]["enabled"]:
            over = _merged(over, {"rank": rank_over})
        cfg = TrainConfig.from_dict(_merged(base_cfg.to_dict(), over))
        model_dir = Path(args.work) / f"trained_{cat}_{args.scheme}{ids_suffix(args)}_{arm}"
        t0 = time.perf_counter()
        model, tok = load_base(args.model, args.smoke, device)
        query_gen = bench_query_gen(args.smoke, json.loads(args.query_gen_json)) if arm == "rank_gen" else None
        model, tok, summary = train_on_index(index, model_dir, cfg, ad_texts=data["ad_texts"], labelled=data["labelled"],
                                             model=model, tokenizer=tok, device=device, progress=False,
                                             valid_qrels=data["valid"], dense=dense, query_gen=query_gen,
                                             exclude_queries=[*data["qrels"], *data["valid"]])
        fusion = fusion_of_record(read_training_record(model_dir))
        row: dict[str, Any] = {"train_config": cfg.to_dict(), "wall_s": round(time.perf_counter() - t0, 1),
                               "train": {k: v for k, v in summary.train.items() if k not in ("evals",)},
                               "examples": {k: v for k, v in summary.data.items() if isinstance(v, int)},
                               "fusion": fusion.to_dict()}
        if device == "cuda":  # the generative channel in fp32 first: is a ranking-trained model sensitive to bf16?
            model = model.to(device).eval()
            r = evaluate_targeting(hybrid_rank(model, tok, index, channels_menu["generative"], dense, fusion),
                                   data["qrels"], batch_size=args.batch, max_queries=args.max_queries)
            row["generative fp32"] = {k: r[k] for k in ("recall@10", "mrr@10", "recall@1", "queries") if k in r}
            results["rows"][f"{arm} generative fp32"] = r
            log.info("%s generative fp32: recall@10 %.4f mrr@10 %.4f", arm, r["recall@10"], r["mrr@10"])
        served = model.to(device, torch.bfloat16) if device == "cuda" else model
        served.eval()
        for name, search in channels_menu.items():
            rank = hybrid_rank(served, tok, index, search, dense, fusion)
            r = evaluate_targeting(rank, data["qrels"], batch_size=args.batch, max_queries=args.max_queries)
            row[name] = {k: r[k] for k in ("recall@10", "mrr@10", "recall@1", "queries", "queries_per_s") if k in r}
            results["rows"][f"{arm} {name}"] = r
            log.info("%s %s: recall@10 %.4f mrr@10 %.4f", arm, name, r["recall@10"], r["mrr@10"])
        results["ablation"][arm] = row
        save()
        if args.speed_batch:  # queries/s of each model-backed channel at one large call (the test queries repeated)
            big = repeated(sorted(data["qrels"]), args.speed_batch)
            row["speed"] = {name: time_hybrid(served, tok, index, dense, channels_menu[name], fusion, big)
                            for name in ("generative", "hybrid", "hybrid beam_floor")}
            save()
        del served, model
        if device == "cuda":
            torch.cuda.empty_cache()
        if args.formats:
            row["formats"] = compressed_formats(args, bundle, cat, model_dir, index, dense, data, channels_menu, tok)
            for name, r in row["formats"].items():
                results["rows"][f"{arm} {name}"] = r
            save()
    lines = ["| arm | channel | recall@10 | MRR@10 | rank steps | rank mean loss |", "|---|---|---|---|---|---|"]
    for arm, row in results["ablation"].items():
        rk = row["train"].get("rank") or {}
        for name in [*channels_menu, "generative fp32"]:
            if name not in row:
                continue
            lines.append(f"| {arm} | {name} | {row[name]['recall@10']:.4f} | {row[name]['mrr@10']:.4f} | "
                         f"{rk.get('steps', '-')} | {rk.get('mean_loss', '-')} |")
    for arm, row in results["ablation"].items():
        for name, r in (row.get("formats") or {}).items():
            lines.append(f"| {arm} | {name} | {r['recall@10']:.4f} | {r['mrr@10']:.4f} | | |")
    for arm, row in results["ablation"].items():
        for name, sp in (row.get("speed") or {}).items():
            lines.append(f"- {arm} {name}: {sp['queries_per_s']:.1f} queries/s at {sp['queries']} queries per call "
                         f"(median of {len(sp['times_s'])}), exact pass {sp['exact'].get('rows', 0)} rows")
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    print(table)


def smoke(out: Path) -> None:
    """``--smoke``: ``channels --smoke`` (tiny random Llama, 2 training steps) on a tiny bundle built here from
    synthetic ads (random vectors stand in for MiniLM's), on the CPU in seconds: the plumbing, not figures."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from adbatch.index.build import IndexConfig, build_index
    from adbatch.index.clustering import ClusterConfig
    from adbatch.index.corpus import CorpusConfig
    from adbatch.index.embeddings import EmbeddingConfig

    rng = np.random.default_rng(0)
    bundle = out / "bundle"
    bundle.mkdir(parents=True, exist_ok=True)
    words = ["drill", "saw", "paint", "lamp", "pipe", "tile", "glue", "hose"]
    n, d = 24, 384  # MiniLM's width: the index probes the query embedder it names against the vectors
    titles = [f"{words[i % 8]} {words[(3 * i) % 8]} model {i}" for i in range(n)]
    emb = rng.normal(size=(n, d)).astype(np.float32)
    pq.write_table(pa.table({"ad_id": pa.array(range(n), pa.int64()), "title": titles,
                             "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), d)}),
                   out / "corpus.parquet")
    pq.write_table(pa.table({"ad_id": pa.array(range(n), pa.int64()), "title": titles}), bundle / "titles_smoke.parquet")
    pq.write_table(pa.table({"query": [f"{words[i % 8]}" for i in range(8)], "ad_id": pa.array(range(8), pa.int64())}),
                   bundle / "train_smoke.parquet")
    queries = {"valid": [f"{words[i]} tool" for i in range(4)], "test": [f"{words[i]} kit" for i in range(4, 8)]}
    for split, qs in queries.items():
        (bundle / f"qrels_{split}_smoke.json").write_text(json.dumps({q: {str(i): 3.0} for i, q in enumerate(qs)}))
    all_q = queries["valid"] + queries["test"]
    np.savez(bundle / "query_emb_smoke.npz", queries=np.asarray(all_q),
             emb=rng.normal(size=(len(all_q), d)).astype(np.float16))
    # what tune-queries writes (the tuned embedder's query vectors): the channels run serves them, "dense untuned" not
    np.savez(bundle / "query_tuned_smoke.npz", queries=np.asarray(all_q),
             emb=rng.normal(size=(len(all_q), d)).astype(np.float16))
    (bundle / "query_tuning_smoke.json").write_text(json.dumps({"record": None, "smoke": True}))
    build_index(out / "corpus.parquet", bundle / "index_smoke_text",
                IndexConfig(columns=CorpusConfig(text="title", embedding="embedding"),
                            embedding=EmbeddingConfig(query_embedder="default"),
                            cluster=ClusterConfig(branching=4, leaf_size=6)), progress=False)
    # the train stage's query tuning as a catalogue without labels gets it (span pseudo-queries); replaces the
    # stand-in vectors above with the tuned embedder's
    main(["tune-queries", "--bundle", str(bundle), "--catalogue", "smoke", "--work", str(out / "work"),
          "--withhold-labels"])
    main(["channels", "--bundle", str(bundle), "--catalogue", "smoke", "--out", str(out / "channels"),
          "--work", str(out / "work"), "--smoke", "--batch", "4", "--speed-batch", "8", "--prior-weights", "1",
          "--beams-list", "10", "--skip-compress", "--train-json", '{"fusion_queries": 4}'])
    main(["fusion-study", "--candidates", str(out / "channels" / "candidates.npz"), "--bundle", str(bundle),
          "--catalogue", "smoke", "--out", str(out / "channels" / "fusion_study.md")])
    # the rank arm: its teacher embeds the training queries from the vectors tune-queries stored
    main(["channels", "--ablation", "--arms", "rank", "--bundle", str(bundle), "--catalogue", "smoke",
          "--out", str(out / "ablation"), "--work", str(out / "work"), "--smoke", "--batch", "4",
          "--speed-batch", "0", "--train-json", '{"fusion_queries": 4}'])


def _results_file(args: argparse.Namespace) -> tuple[Path, str, dict[str, Any], Any]:
    """``(out, device, results, save)`` of a check / channels run: ``results`` is saved to ``out/results.json``
    by ``save()`` after each row, so a call cut short still returns what it measured."""
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                               "args": vars(args), "rows": {}}

    def save() -> None:
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))

    return out, device, results, save


def _merged(base: dict, over: dict) -> dict:
    return {k: _merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
            for k, v in {**base, **over}.items()}


def prepare(args: argparse.Namespace) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from adbatch.index.corpus import CorpusConfig
    from adbatch.eval.datasets import HomeDepotConfig, QuerySplit, load_home_depot
    from adbatch.eval.metrics import HOME_DEPOT_RELEVANT
    from adbatch.index.build import IndexConfig, build_index
    from adbatch.index.embeddings import EmbeddingConfig
    from adbatch.index.ids import IdScheme, RenderConfig

    out = Path(args.bundle)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    sub_emb = Path(args.emb) / f"minilm_{args.size}.npz"  # MiniLM of the subset; computed here when absent
    plans = [] if args.no_subset else [(str(args.size), args.size, sub_emb, SCHEMES, 0.0)]
    if args.churn:  # the next night's subset, partly changed: warm start vs from scratch
        plans.append((f"{args.size}c{round(100 * args.churn)}", args.size, sub_emb, ("text",), args.churn))
    if not args.no_full:
        plans.append(("full", None, Path(args.full_emb), tuple(args.full_schemes.split(",")), 0.0))
    for name, size, emb_file, schemes, churn in plans:
        if size is None and not emb_file.is_file():
            log.warning("no embeddings %s: skipping catalogue %s", emb_file, name)
            continue
        summary[f"embeddings_{name}"] = emb_file.name if emb_file.is_file() else "MiniLM, computed here"
        data = load_home_depot(HomeDepotConfig(csv_path=args.csv, catalogue_size=size, churn=churn))
        npz = np.load(emb_file, allow_pickle=False) if emb_file.is_file() else {"ad_id": [], "emb": np.zeros((0, 384))}
        pos = {int(a): i for i, a in enumerate(npz["ad_id"])}
        ids = data.catalogue.column("ad_id").to_pylist()
        emb = _embeddings_for(ids, data.titles_by_id(), npz["emb"], pos)
        corpus = work / f"corpus_{name}.parquet"
        pq.write_table(pa.table({
            "ad_id": pa.array(ids, pa.int64()), "title": data.catalogue.column("title"),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), emb.shape[1]),
        }), corpus)
        pq.write_table(data.catalogue, out / f"titles_{name}.parquet")
        pq.write_table(data.labelled_table(QuerySplit.TRAIN), out / f"train_{name}.parquet")
        for split in (QuerySplit.TEST, QuerySplit.VALID):
            qrels = {q: {str(a): g for a, g in grades.items()} for q, grades in data.qrels[split].items()}
            (out / f"qrels_{split.value}_{name}.json").write_text(json.dumps(qrels))
        _write_query_embeddings(out / f"query_emb_{name}.npz", data)
        for scheme in schemes:
            # the vectors are MiniLM's (the packaged one embeds the queries): the index keeps a dense channel
            cfg = IndexConfig(columns=CorpusConfig(text="title", embedding="embedding"),
                              embedding=EmbeddingConfig(query_embedder="default"),
                              render=RenderConfig(scheme=IdScheme(scheme)))
            t0 = time.perf_counter()
            manifest = build_index(corpus, out / f"index_{name}_{scheme}", cfg, progress=False)
            summary[f"index_{name}_{scheme}_s"] = round(time.perf_counter() - t0, 2)
            summary[f"index_{name}_{scheme}_hash"] = manifest["index_hash"]
        if args.tuned_ids and churn == 0.0 and size is not None:
            # the index stage as `adbatch index --queries train --valid-queries valid` runs it: the corpus without
            # vectors, so the stage embeds it with its encoder tuned on the train split's labelled queries
            text_only = work / f"corpus_{name}_text.parquet"
            pq.write_table(pq.read_table(corpus, columns=["ad_id", "title"]), text_only)
            valid = [(q, a) for q, grades in data.qrels[QuerySplit.VALID].items() for a, g in grades.items()
                     if g >= HOME_DEPOT_RELEVANT]
            train = data.labelled_table(QuerySplit.TRAIN)
            t0 = time.perf_counter()
            manifest = build_index(text_only, out / f"index_{name}_text_tuned",
                                   IndexConfig(columns=CorpusConfig(text="title")), progress=False,
                                   queries=list(zip(train.column("query").to_pylist(), train.column("ad_id").to_pylist())),
                                   valid_queries=valid)
            summary[f"index_{name}_text_tuned_s"] = round(time.perf_counter() - t0, 2)
            summary[f"index_{name}_text_tuned_hash"] = manifest["index_hash"]
            summary[f"index_{name}_text_tuned_embedder"] = manifest.get("embedder_tuning")
        summary[f"data_{name}"] = data.stats
    for f in Path(args.emb).glob("minilm_*baseline*.json"):
        summary[f.stem] = json.loads(f.read_text())
    (out / "prepare.json").write_text(json.dumps(summary, indent=1))
    log.info("bundle written to %s: %s", out, summary)


def tune_queries(args: argparse.Namespace) -> None:
    """Issue 41: the train stage's query-embedder tuning (:func:`adbatch.training.query_tuning.tune_query_embedder`
    with the ``adbatch train`` defaults, ``TrainConfig().query_tuning``) on a bundle's catalogue: its training
    queries, the validation gate on its validation queries. Runs where MiniLM is (the CPU; the device has none) and
    writes what ``channels`` reads there: ``query_tuned_<cat>.npz`` (the tuned embedder's vectors of the validation
    and test queries) and ``query_tuning_<cat>.json`` (the record, with both embedders' test recall@10 / MRR@10)."""
    import numpy as np

    from adbatch.eval.metrics import HOME_DEPOT_RELEVANT, mrr_at_k, recall_at_k, relevant_set
    from adbatch.index.dense import DenseRetriever, embedder_identity
    from adbatch.training import TrainConfig
    from adbatch.training.query_tuning import tune_query_embedder, tuning_pairs

    bundle, cat, sfx = Path(args.bundle), args.catalogue, ids_suffix(args)
    data = load_bundle(bundle, cat, sfx)
    index = data["indexes"][args.scheme]
    base = DenseRetriever(index, "cpu")
    valid = [(q, a) for q, grades in data["valid"].items() for a, g in grades.items() if g >= HOME_DEPOT_RELEVANT]
    folder = Path(args.work) / f"query_embedder_{cat}{sfx}"
    t0 = time.perf_counter()
    # what the train stage tunes on (its _tune_query_embedder): the labelled pairs, or with too few of them
    # (--withhold-labels: a catalogue without labels) span pseudo-queries of the ads' titles
    cfg = TrainConfig().query_tuning
    texts = [str(data["ad_texts"].get(a) or "") for a in index.ad_ids]
    pairs, valid, source = tuning_pairs(index.ad_ids, texts, [] if args.withhold_labels else data["labelled"], valid, cfg)
    record = tune_query_embedder(base, pairs, cfg, folder, valid=valid, progress=True) if pairs else None
    wall = round(time.perf_counter() - t0, 1)
    tuned = base.with_query_embedder(embedder_identity(str(folder))) if record else base

    def test_metrics(dense: Any) -> dict[str, float]:
        queries = sorted(data["qrels"])
        rows = dense.search(dense.embed(queries), 10).rows.tolist()
        ranked = [[index.ad_ids[r] for r in row] for row in rows]
        rel = [relevant_set(data["qrels"][q]) for q in queries]
        return {"recall@10": round(float(np.mean([recall_at_k(r, s, 10) for r, s in zip(ranked, rel)])), 4),
                "mrr@10": round(float(np.mean([mrr_at_k(r, s, 10) for r, s in zip(ranked, rel)])), 4)}

    summary = {"record": record, "source": source, "wall_s": wall,
               "test": {"base": test_metrics(base), "tuned": test_metrics(tuned)}}
    queries = sorted(set(data["qrels"]) | set(data["valid"]))
    # the rank phase's teacher embeds its ranking queries (the ablation's rank arm: labelled + span pseudo-queries,
    # the train defaults' pick) with this embedder: the device has none, so their vectors travel too
    from adbatch.training.rank_loss import pick_rank_queries, spans_of

    arm = TrainConfig.from_dict(_merged(TrainConfig().to_dict(), ABLATION_ARMS["rank"]))  # the arm's own config
    picked = pick_rank_queries(arm.rank, {a: r for r, a in enumerate(index.ad_ids)}, labelled=data["labelled"],
                               spans=spans_of(texts, arm.pseudo_queries))
    teach = sorted(set(picked) - set(queries))
    np.savez(bundle / f"query_tuned_{cat}{sfx}.npz", queries=np.asarray(queries + teach),
             emb=tuned.embed(queries + teach).numpy().astype(np.float16))
    summary["teacher_queries"] = len(teach)
    if sfx:  # the index's own (tuned) encoder's vectors: the device has no encoder (channels' "dense untuned")
        np.savez(bundle / f"query_emb_{cat}{sfx}.npz", queries=np.asarray(queries),
                 emb=base.embed(queries).numpy().astype(np.float16))
    (bundle / f"query_tuning_{cat}{sfx}.json").write_text(json.dumps(summary, indent=1))
    log.info("query tuning on %s: %s", cat, json.dumps({k: v for k, v in summary.items() if k != "record"}))


def _write_query_embeddings(path: Path, data: Any) -> None:
    """MiniLM vectors of the validation and test queries (``queries`` str, ``emb`` float16 ``[Q, 384]``): the
    device has no MiniLM, so the dense channel there reads these (:class:`adbatch.index.dense.PrecomputedQueryEmbedder`)."""
    import numpy as np

    from adbatch.eval.datasets import QuerySplit
    from adbatch.eval.targeting import embed_texts, load_minilm

    queries = sorted(set(data.qrels[QuerySplit.TEST]) | set(data.qrels[QuerySplit.VALID]))
    emb = embed_texts(load_minilm(), queries)
    np.savez(path, queries=np.asarray(queries), emb=emb.astype(np.float16))


def _embeddings_for(ids: list[int], titles: dict[int, str], emb: Any, pos: dict[int, int]) -> Any:
    """float32 ``[len(ids), D]``: the precomputed row of each id, MiniLM for ids without one (the
    products a churned catalogue adds; the precomputed file must hold MiniLM vectors then)."""
    import numpy as np

    out = np.zeros((len(ids), emb.shape[1]), np.float32)
    missing = [i for i, a in enumerate(ids) if a not in pos]
    for i, a in enumerate(ids):
        if a in pos:
            out[i] = emb[pos[a]]
    if missing:
        from adbatch.eval.targeting import embed_texts, load_minilm

        log.info("embedding %d titles without a precomputed vector (MiniLM)", len(missing))
        out[missing] = embed_texts(load_minilm(), [titles[ids[i]] for i in missing])
    return out


def baseline(args: argparse.Namespace) -> None:
    """MiniLM + FAISS exact search on a Home Depot catalogue's test queries (here, CPU): the retrieval a
    user would pick instead; writes ``minilm_<catalogue>_baseline.json`` under ``--emb`` for ``prepare``."""
    from adbatch.eval.datasets import HomeDepotConfig, QuerySplit, load_home_depot
    from adbatch.eval.targeting import minilm_faiss_baseline

    import numpy as np

    from adbatch.eval.targeting import embed_texts, load_minilm

    size = None if args.catalogue == "full" else int(args.catalogue)
    data = load_home_depot(HomeDepotConfig(csv_path=args.csv, catalogue_size=size))
    ids, titles = data.catalogue.column("ad_id").to_pylist(), data.catalogue.column("title").to_pylist()
    t0 = time.perf_counter()
    emb = embed_texts(load_minilm(), titles)
    embed_s = time.perf_counter() - t0
    Path(args.emb).mkdir(parents=True, exist_ok=True)
    # the same vectors cluster the catalogue's index in ``prepare`` (``--full-emb`` / ``--emb``)
    np.savez(Path(args.emb) / f"minilm_{args.catalogue}.npz", ad_id=np.asarray(ids, np.int64), emb=emb)
    out = minilm_faiss_baseline(ids, titles, data.qrels[QuerySplit.TEST], ad_embeddings=emb)
    out["index_seconds"] += embed_s
    out["catalogue"] = data.catalogue.num_rows
    (Path(args.emb) / f"minilm_{args.catalogue}_baseline.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


# ---------------------------------------------------------------------------------------------
# run (device)
# ---------------------------------------------------------------------------------------------
class Budget:
    def __init__(self, seconds: float) -> None:
        self.t0, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)


def ids_suffix(args: argparse.Namespace) -> str:
    """The bundle's index folder suffix of ``--ids``: "" (ids from MiniLM's vectors) or "_tuned" (ids from the
    index stage's encoder tuned on the labelled queries, ``prepare --tuned-ids``)."""
    return "_tuned" if getattr(args, "ids", "minilm") == "tuned" else ""


def load_bundle(bundle: Path, name: str, suffix: str = "") -> dict[str, Any]:
    import pyarrow.parquet as pq

    from adbatch.index.build import load_index

    titles = pq.read_table(bundle / f"titles_{name}.parquet")
    train = pq.read_table(bundle / f"train_{name}.parquet")
    qrels = json.loads((bundle / f"qrels_test_{name}.json").read_text())
    vfile = bundle / f"qrels_valid_{name}.json"
    valid = json.loads(vfile.read_text()) if vfile.is_file() else {}
    return {
        "valid": {q: {int(a): g for a, g in grades.items()} for q, grades in valid.items()},
        "indexes": {s: load_index(bundle / f"index_{name}_{s}{suffix}") for s in SCHEMES
                    if (bundle / f"index_{name}_{s}{suffix}").is_dir()},
        "ad_texts": dict(zip(titles.column("ad_id").to_pylist(), titles.column("title").to_pylist())),
        "labelled": list(zip(train.column("query").to_pylist(), train.column("ad_id").to_pylist())),
        "qrels": {q: {int(a): g for a, g in grades.items()} for q, grades in qrels.items()},
    }


def title_qrels(ad_ids: list, ad_texts: dict, n: int) -> dict[str, dict[Any, float]]:
    """Qrels "ad title -> that ad" (and any other ad with the same title) for ``n`` ads evenly spaced
    over the index order: scores how much of the index a model has learned (the *indexing* task;
    validation for warm-start runs, where held-out queries of a small catalogue are too few). Integer ids
    stay ints (numpy ones become Python's), string ids stay strings."""
    step = max(1, len(ad_ids) // n)
    by_title: dict[str, dict[Any, float]] = {}
    for a in ad_ids:
        by_title.setdefault(ad_texts[a], {})[a if isinstance(a, str) else int(a)] = 3.0
    return {ad_texts[a]: by_title[ad_texts[a]] for a in ad_ids[::step][:n]}


def evaluate(model: Any, tok: Any, index: Any, qrels: dict, max_queries: int | None, beams: int) -> dict[str, float]:
    from adbatch.eval.targeting import evaluate_targeting, generative_ranker

    rank = generative_ranker(model, tok, index, num_beams=beams, top_k=10, batch_size=64)
    return evaluate_targeting(rank, qrels, batch_size=64, max_queries=max_queries)


def creatives_quality(model: Any, tok: Any, slogans: Any, max_new_tokens: int = 16) -> dict[str, Any]:
    """Held-out creative quality of ``model``: greedy headlines for the slogan test ads (pyarrow table of
    ``load_slogan_test``) scored against the human references (corpus BLEU, METEOR exact+stem, as
    ``adbatch eval``), with throughput and the first five outputs. DSI training must not collapse this."""
    from adbatch.decoding.config import CreativeConfig
    from adbatch.decoding.creative import generate_creatives
    from adbatch.serving.prompts import encode_creative_prompt
    from adbatch.eval.report import corpus_bleu, meteor_exact_stem

    ads = slogans.to_pylist()
    prompts = [encode_creative_prompt(tok, ad) for ad in ads]
    t0 = time.perf_counter()
    outs = generate_creatives(model, tok, prompts, CreativeConfig(max_new_tokens=max_new_tokens), batch_size=32)
    secs = time.perf_counter() - t0
    hyps = [o[0][0] if o else "" for o in outs]
    refs = [ad["reference"] for ad in ads]
    try:
        meteor = meteor_exact_stem(hyps, refs)
    except ModuleNotFoundError:  # nltk is not on the device image: BLEU only there
        meteor = None
    return {"bleu": corpus_bleu(hyps, refs), "meteor": meteor, "examples": len(hyps),
            "requests_per_s": len(hyps) / secs, "empty": sum(not h.strip() for h in hyps),
            "samples": [{"reference": r, "output": h} for r, h in zip(refs[:5], hyps[:5])]}


def load_base(model_src: str | None, smoke: bool, device: str) -> tuple[Any, Any]:
    import torch

    if smoke:  # a tiny random-init Llama over the real tokenizer: checks the plumbing on CPU
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        from adbatch.models import resolve_model

        tok = AutoTokenizer.from_pretrained(resolve_model(model_src), local_files_only=True, trust_remote_code=False)
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                          pad_token_id=tok.pad_token_id)
        return LlamaForCausalLM(cfg).float(), tok
    from adbatch.models import load_causal_lm

    return load_causal_lm(model_src, dtype=torch.float32, device="cpu")


def fresh_copy(base: tuple[Any, Any]) -> tuple[Any, Any]:
    import copy

    model, tok = base
    return copy.deepcopy(model), copy.deepcopy(tok)


def int4_compress(model: Any, examples_tokens: Any, device: str, summary: dict | None = None) -> dict[str, Any]:
    """INT4 with the trained masks kept, the group policy following the training ``summary``.

    ``summary`` (``train_on_index``'s): with ``sparsity.patterns`` every pruned layer keeps its
    trained n:4 mask (rebuilt from the nonzeros: the top-n magnitudes of each group of 4), the
    others stay dense (no sparsity: INT4 only); with ``qat`` the groups are uniform at QAT's size
    (the grid training saw), else adaptive at g128's bits -- the compression stage's rule
    (:func:`adbatch.compress.recipe.follow_training_qat`).
    """
    from adbatch.compress import (CalibrationConfig, CompressConfig, PatternPolicy, ScoreMethod, calibrate,
                                  compress_)
    from adbatch.compress.recipe import follow_training_qat
    from adbatch.compress.sparsity import nm_mask

    summary = summary or {}
    t0 = time.perf_counter()
    seq = 128
    n_blocks = min(64, examples_tokens.numel() // seq)
    blocks = examples_tokens[: n_blocks * seq].long().reshape(n_blocks, seq).to(device)
    cal = CalibrationConfig(num_texts=n_blocks, seq_len=seq, batch_size=16, use_gradients=False)
    model.float()
    stats = calibrate(model, blocks, cal)
    cfg, note = follow_training_qat(CompressConfig(score=ScoreMethod.MAGNITUDE, pattern_policy=PatternPolicy.NONE),
                                    summary)
    if note:
        log.info("%s", note)
    model.cpu()
    masks = {}
    for name, pattern in ((summary.get("sparsity") or {}).get("patterns") or {}).items():
        n = int(pattern.split(":")[0])
        if n < 4:
            masks[name] = nm_mask(model.get_submodule(name).weight.detach().abs(), n)
    recipe = compress_(model, cfg, stats, masks=masks or None)
    packed = sum(layer.packed_bytes for layer in recipe.layers)
    # Quality is measured on the exact INT4 values dequantized into nn.Linear (densify_): the
    # packed kernel's speed is the kernels/decoding benches' business, and the GEMV kernel is not
    # meant for the prefill shapes of a 64-query batch.
    from adbatch.compress.linear import densify_

    densify_(model)
    model.to(device)
    return {"seconds": round(time.perf_counter() - t0, 2), "packed_bytes": packed,
            "group_policy": f"{cfg.group_policy.value}-g{cfg.reference_group_size}"}


def run(args: argparse.Namespace) -> None:
    import torch

    from adbatch.training import SparsityScheduleConfig, TrainConfig, train_on_index

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_s)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                               "args": vars(args), "rows": {}, "curves": {}}
    bundle = Path(args.bundle)
    prep = json.loads((bundle / "prepare.json").read_text()) if (bundle / "prepare.json").is_file() else {}
    results["prepare"] = prep

    def save() -> None:
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))

    t0 = time.perf_counter()
    base = load_base(args.model, args.smoke, device)
    results["load_seconds"] = round(time.perf_counter() - t0, 2)
    small = load_bundle(bundle, "5000")
    mq = args.max_queries

    def eval_row(name: str, model: Any, tok: Any, index: Any, qrels: dict, extra: dict | None = None) -> dict:
        model.to(device)
        if device == "cuda":
            model.to(torch.bfloat16)
        model.eval()
        r = evaluate(model, tok, index, qrels, mq, args.beams)
        r.update(extra or {})
        results["rows"][name] = r
        log.info("%s: %s", name, {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()})
        save()
        return r

    def train(scheme: str, data: dict, cfg: TrainConfig, tag: str) -> tuple[Any, Any, dict]:
        model, tok = fresh_copy(base)
        model, tok, trained = train_on_index(data["indexes"][scheme], None, cfg, ad_texts=data["ad_texts"],
                                             labelled=data["labelled"], model=model, tokenizer=tok,
                                             device=device, progress=False)
        summary = trained.to_dict()  # the result files' JSON; int4_compress reads its qat and sparsity
        results["curves"][tag] = {"losses": summary["losses"], "density": summary["density"]}
        results.setdefault("train", {})[tag] = summary["train"] | {"data": summary["data"],
                                                                   "prepare_seconds": summary["prepare_seconds"]}
        log.info("trained %s: %s", tag, summary["train"])
        return model, tok, summary

    base_cfg = TrainConfig(epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens, warmup_fraction=0.05,
                           log_every=10, indexing_repeat=args.indexing_repeat)
    # 1. zero-shot over the text scheme (labels + titles are plain text the instruct model can read)
    m, t = fresh_copy(base)
    eval_row("zero-shot (text ids)", m, t, small["indexes"]["text"], small["qrels"])
    del m
    # 2. trained dense, both schemes
    dense_scores = {}
    for scheme in SCHEMES:
        if budget.left() < args.reserve_s:
            log.warning("budget: skipping dense %s", scheme)
            continue
        m, t, s = train(scheme, small, base_cfg, f"dense-{scheme}")
        r = eval_row(f"trained dense ({scheme} ids)", m, t, small["indexes"][scheme], small["qrels"],
                     {"train_s": s["train"]["seconds"]})
        dense_scores[scheme] = r["success@10"]
        del m
        if device == "cuda":
            torch.cuda.empty_cache()
    # 3. progressive sparsity + INT4 on the better scheme
    if dense_scores and budget.left() > args.reserve_s:
        best = max(dense_scores, key=dense_scores.get)
        sp = SparsityScheduleConfig(enabled=True, final_n=2, one_four_fraction=args.one_four, start_fraction=0.3,
                                    end_fraction=0.7, rescore_every=args.rescore_every)
        m, t, s = train(best, small, base_cfg.replace(sparsity=sp), f"sparse-{best}")
        dens = s["sparsity"]["density"]
        eval_row(f"trained + progressive 2:4/1:4 ({best} ids)", m, t, small["indexes"][best], small["qrels"],
                 {"density": dens, "train_s": s["train"]["seconds"]})
        if budget.left() > args.reserve_s / 2:
            try:
                from adbatch.training.data import build_examples

                idx = small["indexes"][best]
                ex, _ = build_examples(t, idx.ad_ids, idx.sequences(), small["ad_texts"], small["labelled"][:2000])
                info = int4_compress(m, ex.tokens, device, s)
                eval_row(f"trained + progressive 2:4/1:4 + INT4 ({best} ids)", m, t, idx, small["qrels"],
                         {"density": dens, **{f"int4_{k}": v for k, v in info.items()}})
            except Exception as exc:  # report, keep the other numbers
                log.exception("INT4 step failed")
                results["int4_error"] = repr(exc)
        del m
    # 4. full catalogue: throughput of one epoch + quality reached in the remaining budget
    if (bundle / "titles_full.parquet").is_file() and budget.left() > args.reserve_s:
        full = load_bundle(bundle, "full")
        ranked = sorted(dense_scores, key=dense_scores.get, reverse=True) + list(SCHEMES)
        scheme = next((s for s in ranked if s in full["indexes"]), None)
        if scheme is not None:
            spare = budget.left() - args.reserve_s / 2
            cfg = base_cfg.replace(epochs=args.full_epochs, time_budget_s=max(10.0, spare * 0.6))
            m, t, s = train(scheme, full, cfg, f"full-{scheme}")
            tr = s["train"]
            results["full_epoch"] = {"train_seconds": tr["seconds"], "epochs_done": tr["epochs_done"],
                                     "seconds_per_epoch": tr["seconds_per_epoch"], "tokens_per_s": tr["tokens_per_s"],
                                     "examples_per_epoch": s["data"].get("indexing", 0) + s["data"].get("retrieval", 0),
                                     "stopped_early": tr["stopped_early"]}
            eval_row(f"trained dense, full catalogue ({scheme} ids)", m, t, full["indexes"][scheme], full["qrels"],
                     {"train_s": tr["seconds"], "stopped_early": tr["stopped_early"]})
            del m
    results["total_seconds"] = round(time.perf_counter() - budget.t0, 1)
    save()
    finish(results, out)


def bench_query_gen(smoke: bool, overrides: dict[str, Any] | None = None) -> Any:
    """The query generator's config: ``adbatch train``'s default (``TrainJobConfig.query_gen``), or a tiny
    one for ``--smoke`` (two fine-tune steps, one 3-token query per ad, no nucleus sort: the CPU plumbing
    check still samples all 5,000 ads, ~5 min on two busy cores); ``overrides``: fields replaced on it
    (``check --query-gen-json``, recorded in the results)."""
    from adbatch.training.query_generation import QueryGenConfig, QueryGenTrainConfig

    cfg = QueryGenConfig() if not smoke else QueryGenConfig(
        queries_per_ad=1, max_new_tokens=3, top_p=1.0, batch_size=256, min_pairs=1,
        train=QueryGenTrainConfig(max_steps=2, batch_tokens=2048))
    return cfg.replace(**overrides) if overrides else cfg


def generated_samples(model_dir: Path, n: int = 12) -> list[list[Any]] | None:
    """The first ``n`` (query, ad_id, source) rows of the generated queries cached in ``model_dir`` (None
    without generated queries): what the generator wrote, for the report."""
    from adbatch.training.query_generation import GENERATED_QUERIES_FILE, load_generated_queries

    got = load_generated_queries(model_dir / GENERATED_QUERIES_FILE)
    return None if got is None else [list(r) for r in got.rows()[:n]]


def check(args: argparse.Namespace) -> None:
    """The product's own recipe on a trained model, end to end (one device call, no Ray):

    1. ``train_on_index`` with ``TrainConfig()`` (the ``adbatch train`` defaults) on the ``--catalogue``'s
       ``text`` index (5,000 titles, or the full 54,667) and the train-split labelled queries; tokens/s and MFU from its summary;
    2. test-query quality and speed, bf16, 10 beams, top 10: the new engine ``off`` and ``auto``
       and the engine before issue 16 (``.carry/baseline_decoding``, ``off``), each at query batch
       64, plus new ``off`` at the GPU default batch (1,024) for speed;
    3. the compress stage (``run_compress`` with its defaults, ``use_ray=False`` on the GPU:
       calibrated on what the served model reads, ``--index`` + the labelled queries), the
       checkpoint loaded as ``adbatch generate`` loads it, then test quality/speed off and auto.
    ``--query-source`` spans | generated | mix: the pseudo-queries the training reads
    (``TrainConfig.pseudo_queries.source``, the generator at ``QueryGenConfig()``'s defaults: what
    ``adbatch train --train.pseudo-queries.source`` runs); the generated queries are cached in the model
    folder under ``--work``, so generated then mix on one ``--work`` generates once. The validation and
    test query strings are refused from the generator's pairs (the bundle's train pairs are the train split).
    Writes ``results.json`` and ``table.md`` under ``--out``.
    """
    import torch

    from adbatch.serving.generators import ModelSpec, load_model
    from adbatch.serving.prompts import encode_targeting_prompts
    from adbatch.eval.targeting import evaluate_targeting
    from adbatch.training import TrainConfig, train_on_index
    from adbatch.training.checkpoint import read_training_record

    wanted = set(args.methods.split(","))  # checked before minutes of training, not after
    unknown = wanted - {"off64", "auto64", "old64", "off1024"}
    if unknown:
        raise SystemExit(f"--methods: unknown {sorted(unknown)}")
    out, device, results, save = _results_file(args)

    bundle = Path(args.bundle)
    if (bundle / "prepare.json").is_file():
        results["prepare"] = json.loads((bundle / "prepare.json").read_text())  # MiniLM + FAISS there
    cat = args.catalogue  # "5000" or "full": the bundle's titles_<cat>.parquet, index_<cat>_text, ...
    data = load_bundle(bundle, cat)
    index = data["indexes"]["text"]
    cfg = TrainConfig() if not args.smoke else TrainConfig(max_steps=2, batch_tokens=2048)
    cfg = cfg.replace(pseudo_queries=cfg.pseudo_queries.replace(source=args.query_source))

    cfg = TrainConfig.from_dict(_merged(cfg.to_dict(), json.loads(args.train_json)))
    results["train_config"] = cfg.to_dict()
    if args.train_budget_s:
        cfg = cfg.replace(time_budget_s=args.train_budget_s)
    query_gen = bench_query_gen(args.smoke, json.loads(args.query_gen_json))
    results["query_gen_config"] = query_gen.to_dict()
    t0 = time.perf_counter()
    model_dir = Path(args.work) / "trained"  # saved by the library, as ``adbatch train`` saves it
    if args.reuse_trained and read_training_record(model_dir) is not None:  # a warm machine's earlier call
        model, tok = load_base(str(model_dir), False, device)  # (the base model is not loaded at all)
        summary = {"train": {"reused": str(model_dir)}, "data": {}}
    else:
        model, tok = load_base(args.model, args.smoke, device)
        # a model folder an earlier call trained on this index: training continues from it (a warm start)
        init = args.model if args.model and Path(args.model).is_dir() else None
        model, tok, trained = train_on_index(index, model_dir, cfg, ad_texts=data["ad_texts"], labelled=data["labelled"],
                                             init_model=init, model=model, tokenizer=tok, device=device, progress=False,
                                             query_gen=query_gen,
                                             exclude_queries=[*data["qrels"], *data["valid"]])
        summary = trained.to_dict()  # the result files' JSON; int4_compress reads its qat and sparsity
    results["train"] = {"dense-text": summary["train"] | {"data": summary["data"],
                                                          "wall_s": round(time.perf_counter() - t0, 1)}}
    results["query_source"] = args.query_source
    results["generated_samples"] = generated_samples(model_dir)
    log.info("trained: %s", results["train"])
    save()
    old = None
    base_dir = Path(__file__).resolve().parent.parent / ".carry" / "baseline_decoding"
    if (base_dir / "adbatch_baseline_decoding" / "__init__.py").is_file():
        sys.path.insert(0, str(base_dir))
        import adbatch_baseline_decoding as old

    def ranker(mod: Any, m: Any, verify: str, batch: int) -> Any:
        # the baseline engine still takes its batch size as a config field; ours searches each rank() batch whole
        sized = {"batch_size": batch} if "batch_size" in inspect.signature(mod.TargetSearchConfig).parameters else {}
        tcfg = mod.TargetSearchConfig(num_beams=args.beams, top_k=10, verify=verify, **sized)

        def rank(qs: list[str]) -> list[list[Any]]:
            prompts = encode_targeting_prompts(tok, qs)  # one batched call, the same ids
            with torch.inference_mode():
                res = mod.search_targets(m, prompts, index.trie, tcfg)
            return [[index.ad_ids[r] for r in row if r >= 0] for row in res.rows.tolist()]
        return rank

    def eval_rows(tag: str, m: Any, methods: list[tuple[str, Any, str, int]]) -> None:
        m.eval()
        for name, mod, verify, batch in methods:
            if mod is None:
                continue
            rank = ranker(mod, m, verify, batch)
            rank(sorted(data["qrels"])[:min(batch, args.max_queries or batch)])  # warm-up: graphs, kernels, cost model
            r = evaluate_targeting(rank, data["qrels"], batch_size=batch, max_queries=args.max_queries)
            results["rows"][f"{tag} {name}"] = r
            log.info("%s %s: %s", tag, name, {k: round(v, 4) for k, v in r.items()})
            save()

    import adbatch.decoding as new
    dense = model.to(device)
    if device == "cuda":
        dense = dense.to(torch.bfloat16)
    # (key, row name, engine, verify, batch); off1024 is the GPU default batch, timed on the GPU only
    menu = [("off64", "new off @64", new, "off", 64), ("auto64", "new auto @64", new, "auto", 64),
            ("old64", "old off @64", old, "off", 64), ("off1024", "new off @1024", new, "off", 1024)]
    chosen = [(name, mod, v, b) for key, name, mod, v, b in menu
              if key in wanted and not (args.smoke and key == "off1024")]
    eval_rows("dense", dense, chosen)
    del dense, model
    if device == "cuda":
        torch.cuda.empty_cache()
    # 3. the compress stage with its defaults, calibrated on the served index and queries
    from pipelines.compress import CompressJobConfig, run_compress

    queries = bundle / f"train_{cat}.parquet"  # the train-split (query, ad_id) pairs
    from adbatch.compress import CompressConfig

    # "compressed" = the compress stage's own defaults; the others override CompressConfig fields
    variants = {} if args.skip_compress else {"compressed": {}, **json.loads(args.compress_variants)}
    results["compress"] = {}
    for vname, overrides in variants.items():
        t0 = time.perf_counter()
        comp_dir = Path(args.work) / f"compressed-{vname}"
        csum = run_compress(CompressJobConfig(model=str(model_dir), index=bundle / f"index_{cat}_text", queries=queries,
                                              ads=bundle / f"titles_{cat}.parquet", out=comp_dir, use_ray=False,
                                              layer_device=device if device == "cuda" else None,
                                              compress=CompressConfig.from_dict(overrides)))
        results["compress"][vname] = {"overrides": overrides, "wall_s": round(time.perf_counter() - t0, 1),
                                      **{k: v for k, v in csum.items() if isinstance(v, (int, float, str, dict))}}
        save()
        cm, _ = load_model(ModelSpec(compressed=str(comp_dir)), device)
        methods = [m for m in chosen if m[1] is new]
        eval_rows(vname, cm, methods if vname == "compressed" else methods[:1])
        del cm
        if device == "cuda":
            torch.cuda.empty_cache()
    save()
    table = render_table(results)
    (out / "table.md").write_text(table)
    print(table)
    print(json.dumps({"train": results["train"], "compress": results.get("compress")}, default=str)[:3000])


def sweep(args: argparse.Namespace) -> None:
    """Train a list of configurations with validation-based model selection; test each selected model.

    ``--configs``: a JSON list (inline or a file) of dicts with keys ``name``, ``catalogue``
    ("5000"/"full"), ``scheme``, ``lr``, ``epochs``, ``pseudo`` (span pseudo-queries per ad),
    ``max_words``, ``subset_share`` / ``typo_rate`` (pseudo-query augmentations), ``retrieval_repeat`` /
    ``indexing_repeat`` (copies per epoch), ``eval_every``, ``patience``, ``batch_tokens``, ``sparse`` (progressive 2:4/1:4),
    ``one_four``, ``int4`` (then INT4 with the masks kept: uniform groups at QAT's size after QAT, else
    adaptive), ``qat`` / ``qat_start`` / ``qat_group`` (quantization-aware final phase), ``init`` (a model folder saved
    by an earlier config, e.g. the dense model to sparsify), ``save`` (save the selected model under
    ``--save-dir``), ``wide_beams`` (also test with this many beams, still top 10: a second row),
    ``creatives`` (with ``--slogans``: held-out creative quality of the selected model vs the base model),
    ``distill`` / ``distill_alpha`` / ``distill_t`` (distil from a frozen copy of the ``init`` model),
    ``rehearsal`` (ads whose own headlines are mixed in: creative rehearsal) / ``rehearsal_repeat``,
    ``max_steps``, ``query_source`` (spans | generated | mix: ``TrainConfig.pseudo_queries.source``, the
    generator at ``QueryGenConfig()``'s defaults, its queries cached in ``--out`` per catalogue),
    ``valid`` = "titles" (+ ``valid_ads``, ``valid_metric`` e.g. "success@1": validate on title -> own
    ad). Model selection uses the *validation* queries only; test queries are scored once per selected
    model.
    """
    import torch

    from adbatch.training import DistillConfig, SparsityScheduleConfig, TrainConfig, train_on_index
    from adbatch.training.pseudo_queries import PseudoQueryConfig
    from adbatch.training.quant_aware import QuantAwareConfig
    from adbatch.training.rehearsal import CreativeRehearsalConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_s)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    raw = args.configs
    configs = json.loads(Path(raw).read_text() if Path(raw).is_file() else raw)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                               "args": vars(args), "rows": {}, "curves": {}, "configs": configs}

    def save() -> None:
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))

    t0 = time.perf_counter()
    base = load_base(args.model, args.smoke, device)
    results["load_seconds"] = round(time.perf_counter() - t0, 2)
    data_cache: dict[str, dict] = {}
    slogans = None
    if args.slogans and any(c.get("creatives") for c in configs):
        from adbatch.eval.datasets import load_slogan_test

        slogans = load_slogan_test(args.slogans).slice(0, args.creatives_n)
        m0, tok0 = fresh_copy(base)
        m0.to(device)
        if device == "cuda":
            m0.to(torch.bfloat16)
        results["creatives"] = {"base model": creatives_quality(m0.eval(), tok0, slogans)}
        log.info("creatives, base model: %s", {k: v for k, v in results["creatives"]["base model"].items() if k != "samples"})
        del m0
    for c in configs:
        name = c["name"]
        left = budget.left() - args.reserve_s
        if left < 30:
            log.warning("budget: skipping %s", name)
            results["rows"][name] = {"skipped": "budget"}
            continue
        cat = str(c.get("catalogue", "5000"))
        data = data_cache.setdefault(cat, load_bundle(Path(args.bundle), cat))
        scheme = c.get("scheme", "text")
        index = data["indexes"][scheme]
        sp = SparsityScheduleConfig(enabled=bool(c.get("sparse")), final_n=2, one_four_fraction=c.get("one_four", 0.25),
                                    start_fraction=c.get("sp_start", 0.1), end_fraction=c.get("sp_end", 0.5),
                                    rescore_every=c.get("rescore_every", 1))
        cfg = TrainConfig(epochs=c.get("epochs", 10), lr=c.get("lr", 1e-3), batch_tokens=c.get("batch_tokens", 32768),
                          warmup_fraction=0.05, log_every=10, eval_every=c.get("eval_every", 2.0),
                          retrieval_repeat=c.get("retrieval_repeat", 1), indexing_repeat=c.get("indexing_repeat", 1),
                          early_stop_patience=c.get("patience", 0), valid_max_queries=c.get("valid_queries"),
                          valid_metric=c.get("valid_metric", "recall@10"),
                          time_budget_s=max(20.0, left - c.get("eval_reserve_s", 40)), sparsity=sp,
                          pseudo_queries=PseudoQueryConfig(per_ad=c.get("pseudo", 0), max_words=c.get("max_words", 4),
                                                            subset_share=c.get("subset_share", 0.0),
                                                            typo_rate=c.get("typo_rate", 0.0),
                                                            source=c.get("query_source", "spans")),
                          qat=QuantAwareConfig(enabled=bool(c.get("qat")), start_fraction=c.get("qat_start", 0.8),
                                               group_size=c.get("qat_group", 128)),
                          distill=DistillConfig(enabled=bool(c.get("distill")), alpha=c.get("distill_alpha", 0.5),
                                                temperature=c.get("distill_t", 2.0)),
                          creative_rehearsal=CreativeRehearsalConfig(enabled=bool(c.get("rehearsal")),
                                                                     ads=int(c.get("rehearsal") or 256),
                                                                     repeat=c.get("rehearsal_repeat", 1)),
                          max_steps=c.get("max_steps"))
        if c.get("init"):
            from adbatch.models import load_causal_lm

            m, t = load_causal_lm(c["init"], dtype=torch.float32, device="cpu")
        else:
            m, t = fresh_copy(base)
        valid = data["valid"]
        if c.get("valid") == "titles":  # how much of the index the model knows: title -> its own ad
            valid = title_qrels(index.ad_ids, data["ad_texts"], c.get("valid_ads", 100))
        m, t, trained = train_on_index(index, None, cfg, ad_texts=data["ad_texts"], labelled=data["labelled"],
                                       valid_qrels=valid or None, model=m, tokenizer=t, device=device,
                                       init_model=c.get("init"),
                                       progress=False, query_gen=bench_query_gen(args.smoke),
                                       # one file per catalogue: keyed by its inputs, so configs share it
                                       query_cache=out / f"generated_queries_{cat}.parquet",
                                       exclude_queries=[*data["qrels"], *data["valid"]])
        summary = trained.to_dict()  # the result files' JSON; int4_compress reads its qat and sparsity
        tr = summary["train"]
        results["curves"][name] = {"losses": summary["losses"], "density": summary["density"],
                                   "evals": tr.get("evals", [])}
        results.setdefault("train", {})[name] = tr | {"data": summary["data"]}
        log.info("trained %s: %s", name, {k: v for k, v in tr.items() if k != "evals"})
        if c.get("save") and args.save_dir:
            folder = Path(args.save_dir) / name
            m.save_pretrained(folder)
            t.save_pretrained(folder)
        m.to(device)
        if device == "cuda":
            m.to(torch.bfloat16)
        m.eval()
        extra = {"train_s": tr["seconds"], "best_valid": (tr.get("best") or {}).get("metric"),
                 "best_epoch": next((e for st, e, _ in tr.get("evals", []) if st == (tr.get("best") or {}).get("step")), None),
                 "epochs_done": tr["epochs_done"], "scheme": scheme, "catalogue": cat}
        if summary.get("sparsity"):
            extra["density"] = summary["sparsity"]["density"]
        r = evaluate(m, t, index, data["qrels"], args.max_queries, args.beams) | extra
        results["rows"][name] = r
        log.info("%s test: %s", name, {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()})
        if slogans is not None and c.get("creatives") and budget.left() > 30:
            results["creatives"][name] = creatives_quality(m, t, slogans)
            log.info("creatives, %s: %s", name, {k: v for k, v in results["creatives"][name].items() if k != "samples"})
        if c.get("wide_beams") and budget.left() > 30:
            results["rows"][f"{name} ({c['wide_beams']} beams)"] = evaluate(
                m, t, index, data["qrels"], args.max_queries, int(c["wide_beams"])) | extra
        save()
        if c.get("int4") and budget.left() > 20:
            try:
                from adbatch.training.data import build_examples

                ex, _ = build_examples(t, index.ad_ids, index.sequences(), data["ad_texts"], data["labelled"][:2000])
                info = int4_compress(m, ex.tokens, device, summary)
                if device == "cuda":
                    m.to(torch.bfloat16)
                r2 = evaluate(m, t, index, data["qrels"], args.max_queries, args.beams) | extra | {
                    f"int4_{k}": v for k, v in info.items()}
                results["rows"][name + " + INT4"] = r2
                log.info("%s + INT4 test: %s", name, {k: round(v, 4) if isinstance(v, float) else v for k, v in r2.items()})
            except Exception as exc:  # keep the dense/sparse numbers
                log.exception("INT4 step failed")
                results["rows"][name + " + INT4"] = {"error": repr(exc)}
        del m
        if device == "cuda":
            torch.cuda.empty_cache()
        save()
    results["total_seconds"] = round(time.perf_counter() - budget.t0, 1)
    save()
    finish(results, out)


def finish(results: dict, out: Path) -> None:
    """Write ``table.md`` and ``curves.png`` under ``out`` and print the table."""
    table = render_table(results)
    (out / "table.md").write_text(table)
    plot_curves(results, out / "curves.png")
    print(table)


def render_table(results: dict) -> str:
    cols = ("recall@1", "recall@10", "success@10", "mrr@10", "ndcg@10", "queries_per_s", "queries")
    lines = ["| model | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, r in results["rows"].items():
        if "recall@10" not in r:
            lines.append(f"| {name} | " + " | ".join([str(r.get("skipped") or r.get("error"))[:40]] * len(cols)) + " |")
            continue
        lines.append(f"| {name} | " + " | ".join(f"{r.get(c, float('nan')):.3f}" if c != "queries"
                                                   else str(int(r.get(c, 0))) for c in cols) + " |")
    for key, base in (results.get("prepare") or {}).items():
        if key.startswith("minilm") and isinstance(base, dict):
            for cat, r in (base.items() if "recall@10" not in base else [(key, base)]):
                if isinstance(r, dict) and "recall@10" in r:
                    lines.append(f"| MiniLM+FAISS CPU ({cat}) | " + " | ".join(
                        f"{r.get(c, float('nan')):.3f}" if c != "queries" else str(int(r.get(c, 0))) for c in cols) + " |")
    lines.append("")
    for tag, tr in (results.get("train") or {}).items():
        if "steps" not in tr:  # --reuse-trained
            lines.append(f"- train {tag}: {json.dumps(tr)}")
            continue
        lines.append(f"- train {tag}: {tr['steps']} steps, {tr['tokens']} tokens in {tr['seconds']:.1f} s = "
                     f"{tr['tokens_per_s']:.0f} tok/s, MFU {tr.get('mfu', 'n/a')}, loss {tr['first_loss']:.3f} -> "
                     f"{tr['final_loss']:.3f}" + (f", density {tr['sparsity_density']:.3f}" if tr.get("sparsity_density") else ""))
    for name, c in (results.get("compress") or {}).items():  # check's variants
        if "overrides" in c:
            lines.append(f"- compress {name} {json.dumps(c['overrides'])}: {c['wall_s']} s, "
                         + json.dumps({k: c[k] for k in ("quality", "summary") if k in c}, default=str)[:600])
    if "full_epoch" in results:
        lines.append(f"- full catalogue: {json.dumps(results['full_epoch'])}")
    if results.get("fusion"):  # channels
        lines.append(f"- fusion (fitted at train time): {json.dumps(results['fusion'])}")
        lines.append(f"- dense prior, validation recall@10 by weight: {results.get('prior_validation_recall@10')}")
    for name, sp in (results.get("speed") or {}).items():
        if "queries" not in sp:
            lines.append(f"- {name}: {json.dumps(sp)}")
            continue
        ex = sp.get("exact") or {}
        work = (f"; exact {ex['rows']} rows / {ex['tree_tokens']} tree tokens ({ex['tree_tokens_padded']} padded) over "
                f"{ex['queries_scored']} queries in {ex['passes']} passes" if ex.get("queries") else "")
        lines.append(f"- speed {name}: {sp['queries']} queries per call, median {sp['median_s']:.3f} s = "
                     f"{sp['queries_per_s']:.1f} queries/s{work}")
    if results.get("creatives"):
        lines += ["", "| creatives (slogan test, greedy, 16 tokens) | BLEU | METEOR | empty | ads | requests/s |",
                  "|---|---|---|---|---|---|"]
        fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731 - METEOR needs nltk, absent on the device
        lines += [f"| {name} | {fmt(r['bleu'])} | {fmt(r['meteor'])} | {r['empty']} | {r['examples']} | "
                  f"{r['requests_per_s']:.1f} |" for name, r in results["creatives"].items()]
    return "\n".join(lines) + "\n"


def plot_curves(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(1, 3, figsize=(16, 4))
    for tag, c in results["curves"].items():
        if c["losses"]:
            ax[0].plot([s for s, _ in c["losses"]], [v for _, v in c["losses"]], label=tag)
        if c["density"]:
            ax[1].plot([s for s, _ in c["density"]], [v for _, v in c["density"]], label=tag)
        if c.get("evals"):
            ax[2].plot([e for _, e, _ in c["evals"]], [v for _, _, v in c["evals"]], marker="o", label=tag)
    ax[0].set(xlabel="optimizer step", ylabel="target-token loss", yscale="log", title="training loss")
    ax[1].set(xlabel="optimizer step", ylabel="kept share of prunable weights", title="progressive sparsity")
    ax[2].set(xlabel="epoch", ylabel="validation recall@10", title="model selection (validation queries)")
    for a in ax:
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true",
                   help="without a subcommand: `channels --smoke` on a tiny synthetic bundle (CPU, seconds)")
    p.add_argument("--smoke-out", default=None, help="folder of the --smoke run (default: a temporary one)")
    sub = p.add_subparsers(dest="cmd")
    bp = sub.add_parser("baseline", help="MiniLM+FAISS on a catalogue's test queries (CPU)")
    bp.add_argument("--catalogue", default="5000", help="'full' or a catalogue size")
    bp.add_argument("--csv", default="../shared/data/home_depot_relevance/train.csv")
    bp.add_argument("--emb", default="/tmp/tr", help="folder for minilm_<catalogue>_baseline.json")
    pp = sub.add_parser("prepare")
    pp.add_argument("--csv", default="../shared/data/home_depot_relevance/train.csv")
    pp.add_argument("--emb", default="/tmp/tr", help="folder with minilm_5000.npz (+ baseline JSON)")
    pp.add_argument("--full-emb", default="/tmp/tr/tfidf_full.npz", help="embeddings (npz ad_id, emb) clustering the full catalogue")
    pp.add_argument("--full-schemes", default="codes", help="schemes of the full-catalogue index")
    pp.add_argument("--work", default="/tmp/tr/work")
    pp.add_argument("--size", type=int, default=5000, help="titles of the subset catalogue")
    pp.add_argument("--churn", type=float, default=0.0,
                    help="also the subset with this share replaced ('<size>c<pct>', text ids: warm-start runs)")
    pp.add_argument("--no-full", action="store_true", help="skip the full 54,667-title catalogue")
    pp.add_argument("--no-subset", action="store_true", help="only the full catalogue (a bundle of its own)")
    pp.add_argument("--bundle", required=True)
    pp.add_argument("--tuned-ids", action="store_true",
                    help="also the subset's text index from the index stage's encoder tuned on the train queries "
                         "(index_<size>_text_tuned; MiniLM and its tuning run here)")
    sw = sub.add_parser("sweep")
    sw.add_argument("--bundle", required=True)
    sw.add_argument("--out", required=True)
    sw.add_argument("--model", default=None)
    sw.add_argument("--smoke", action="store_true")
    sw.add_argument("--configs", required=True, help="JSON list (inline or file), see sweep()")
    sw.add_argument("--budget-s", type=float, default=540.0)
    sw.add_argument("--reserve-s", type=float, default=30.0)
    sw.add_argument("--save-dir", default=None)
    sw.add_argument("--beams", type=int, default=10)
    sw.add_argument("--max-queries", type=int, default=None)
    sw.add_argument("--slogans", default=None, help="slogan test-curated.csv, for configs with 'creatives'")
    sw.add_argument("--creatives-n", type=int, default=200, help="slogan test ads scored per model")
    ck = sub.add_parser("check", help="product defaults on a trained model: train, old/new engines, compress")
    ck.add_argument("--bundle", required=True)
    ck.add_argument("--out", required=True)
    ck.add_argument("--work", default="/tmp/adbatch_check")
    ck.add_argument("--catalogue", default="5000", help="the bundle's catalogue: 5000 or full (its text index)")
    ck.add_argument("--skip-compress", action="store_true", help="dense rows only (a first call of a chained run)")
    ck.add_argument("--model", default=None)
    ck.add_argument("--smoke", action="store_true")
    ck.add_argument("--beams", type=int, default=10)
    ck.add_argument("--max-queries", type=int, default=None)
    ck.add_argument("--train-budget-s", type=float, default=None,
                    help="stop training after this long (recorded; the recipe's schedule is not shortened)")
    ck.add_argument("--compress-variants", default="{}",
                    help='JSON {name: CompressConfig overrides} compressed and tested beside the defaults ("compressed")')
    ck.add_argument("--train-json", default="{}", help="JSON TrainConfig overrides (nested dicts merge), e.g. "
                    '\'{"qat": {"enabled": true}}\'')
    ck.add_argument("--reuse-trained", action="store_true",
                    help="use the model an earlier call trained under --work (a warm device keeps /tmp)")
    ck.add_argument("--methods", default="off64,auto64,old64,off1024",
                    help="dense rows to test (the compressed default gets off64/auto64/off1024 of them, other "
                         "variants off64): off64, auto64, old64 (pre-issue-16 engine), off1024")
    ck.add_argument("--query-gen-json", default="{}",
                    help='JSON QueryGenConfig overrides for generated / mix, e.g. \'{"queries_per_ad": 5}\'')
    ck.add_argument("--query-source", choices=("spans", "generated", "mix"), default="spans",
                    help="pseudo-queries of the training: spans (the default recipe) | generated (a query "
                         "generator tuned on the train pairs) | mix (both)")
    ch = sub.add_parser("channels", help="issue 41: dense, generative and hybrid targeting on a trained model")
    ch.add_argument("--bundle", required=True)
    ch.add_argument("--out", required=True)
    ch.add_argument("--work", default="/tmp/adbatch_channels")
    ch.add_argument("--catalogue", default="5000", help="the bundle's catalogue: 5000 or full")
    ch.add_argument("--scheme", default="text", choices=SCHEMES)
    ch.add_argument("--ids", default="minilm", choices=("minilm", "tuned"),
                    help="the index: ids from MiniLM's vectors, or from the encoder the index stage tuned (prepare --tuned-ids)")
    ch.add_argument("--model", default=None)
    ch.add_argument("--smoke", action="store_true", help="tiny random model on the CPU (plumbing)")
    ch.add_argument("--batch", type=int, default=64, help="queries per ranking call in the quality rows")
    ch.add_argument("--speed-batch", type=int, default=1024, help="queries per call in the speed rows")
    ch.add_argument("--max-queries", type=int, default=None)
    ch.add_argument("--prior-weights", default="1,3,10", help="dense prior weights tried on the validation queries")
    ch.add_argument("--train-budget-s", type=float, default=None)
    ch.add_argument("--beams-list", default="10,32,64", help="beam widths of the generative and hybrid rows")
    ch.add_argument("--train-json", default="{}", help="JSON TrainConfig overrides (nested dicts merge)")
    ch.add_argument("--skip-compress", action="store_true")
    ch.add_argument("--reuse-trained", action="store_true")
    ch.add_argument("--ablation", action="store_true",
                    help="issue 41 item 4: train one model per --arms (CE only / CE + rank loss / CE + rank loss + "
                         "teacher-labelled generated queries) and report each channel's recall@10 / MRR@10")
    ch.add_argument("--arms", default="ce,rank,rank_gen", help="ablation arms, in order (see ABLATION_ARMS)")
    ch.add_argument("--rank-json", default="{}", help="JSON RankLossConfig overrides of the rank arms")
    ch.add_argument("--formats", action="store_true",
                    help="ablation: also compress each arm (the compress stage's defaults) and evaluate its layers served "
                         "with every layer INT4, the default plan, every layer FP8 and 2:4 FP8 (issue 42)")
    ch.add_argument("--query-gen-json", default="{}", help="JSON QueryGenConfig overrides (the rank_gen arm)")
    tq = sub.add_parser("tune-queries", help="issue 41: the train stage's query-embedder tuning on a bundle (CPU)")
    tq.add_argument("--bundle", required=True)
    tq.add_argument("--catalogue", default="5000")
    tq.add_argument("--scheme", default="text", choices=SCHEMES)
    tq.add_argument("--ids", default="minilm", choices=("minilm", "tuned"), help="which index (see channels --ids)")
    tq.add_argument("--withhold-labels", action="store_true",
                    help="a catalogue without labelled queries: the train stage's fallback (span pseudo-queries)")
    tq.add_argument("--work", default="/tmp/adbatch_channels", help="where the tuned folder is written")
    fs = sub.add_parser("fusion-study", help="issue 41: fusions over a channels run's candidates.npz (CPU)")
    fs.add_argument("--candidates", required=True, help="candidates.npz of a channels run")
    fs.add_argument("--bundle", required=True)
    fs.add_argument("--catalogue", default="5000")
    fs.add_argument("--out", default=None, help="markdown file for the tables")
    pr = sub.add_parser("run")
    pr.add_argument("--bundle", required=True)
    pr.add_argument("--out", required=True)
    pr.add_argument("--model", default=None, help="GGUF file / HF folder; default: the bundled default model")
    pr.add_argument("--smoke", action="store_true", help="tiny random model (CPU plumbing check)")
    pr.add_argument("--budget-s", type=float, default=330.0)
    pr.add_argument("--reserve-s", type=float, default=60.0, help="don't start a phase with less left")
    pr.add_argument("--epochs", type=float, default=20.0)
    pr.add_argument("--full-epochs", type=float, default=3.0)
    pr.add_argument("--lr", type=float, default=1e-3)
    pr.add_argument("--batch-tokens", type=int, default=32768)
    pr.add_argument("--indexing-repeat", type=int, default=1)
    pr.add_argument("--one-four", type=float, default=0.25)
    pr.add_argument("--rescore-every", type=int, default=1)
    pr.add_argument("--beams", type=int, default=10)
    pr.add_argument("--max-queries", type=int, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.cmd is None:
        if not args.smoke:
            p.error("a subcommand is required (or --smoke)")
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            smoke(Path(args.smoke_out or tmp))
        return
    {"prepare": prepare, "baseline": baseline, "run": run, "sweep": sweep, "check": check,
     "channels": channels, "fusion-study": fusion_study, "tune-queries": tune_queries}[args.cmd](args)


if __name__ == "__main__":
    main()
