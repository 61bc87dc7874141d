"""``adbatch eval`` pieces: creative metrics, the report writer, and run_eval end to end on small
made-up Home Depot / slogan files (the real ../shared/data is not needed)."""

from __future__ import annotations

import csv
import json

import pytest

from adbatch.eval.report import corpus_bleu, meteor_exact_stem, write_report
from test_generate_support import tiny_model_dir


def test_meteor_exact_stem_values():
    assert meteor_exact_stem(["the cat sat"], ["the cat sat"]) == pytest.approx(0.9815, abs=1e-3)
    # "cats" matches "cat" through the Porter stem, no synonym stage
    assert meteor_exact_stem(["the cats sat"], ["the cat sat"]) == pytest.approx(0.9815, abs=1e-3)
    assert meteor_exact_stem(["quick"], ["fast"]) == 0.0  # a synonym earns nothing here
    assert meteor_exact_stem([], []) == 0.0
    with pytest.raises(ValueError):
        meteor_exact_stem(["a"], [])


def test_bleu_values():
    assert corpus_bleu(["build better homes today"], ["build better homes today"]) == pytest.approx(100.0)
    assert corpus_bleu(["completely different words"], ["build better homes today"]) < 1.0


def test_report_has_tables_and_plots(tmp_path):
    results = {
        "meta": {"created": "now", "machine": "test", "code_version": "x"},
        "targeting": {"catalogue": "3 products", "query_split": "test", "index": "idx", "rows": [
            {"variant": "dense", "channel": "hybrid", "scheme": "text", "verify": "off", "recall@1": 0.1, "recall@10": 0.5,
             "mrr@10": 0.2, "ndcg@10": 0.3, "queries": 4, "queries_per_s": 2.0, "ms_per_query": 500.0},
            {"variant": "compressed", "scheme": "text", "verify": "auto", "note": "not evaluated: x"}]},
        "creatives": {"skipped": "no data"},
    }
    files = write_report(tmp_path, results)
    text = files["report"].read_text()
    assert "| dense | hybrid | text | off | 0.100 | 0.500 | 0.200 | 0.300 | 4 | 2.000 | 500.000 |" in text
    assert "not evaluated: x" in text and "Skipped: no data" in text
    assert files["targeting_quality"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _fake_home_depot(path):
    rows = []
    titles = {100001: "cordless drill driver kit", 100002: "led light bulb 60w", 100003: "garden hose 50 ft",
              100004: "wood glue 8 oz", 100005: "claw hammer 16 oz", 100006: "interior paint white gallon"}
    queries = {"drill": {100001: 3.0, 100005: 1.0}, "light bulb": {100002: 3.0}, "hose": {100003: 2.67},
               "glue": {100004: 3.0}, "hammer": {100005: 3.0}, "paint": {100006: 2.67, 100004: 1.33},
               "cordless drill": {100001: 3.0}, "led bulb": {100002: 2.67}}
    i = 0
    for q, grades in queries.items():
        for uid, g in grades.items():
            i += 1
            rows.append({"id": i, "product_uid": uid, "product_title": titles[uid], "search_term": q, "relevance": g})
    with open(path, "w", newline="", encoding="latin-1") as fh:
        w = csv.DictWriter(fh, fieldnames=["id", "product_uid", "product_title", "search_term", "relevance"])
        w.writeheader()
        w.writerows(rows)
    return path


def _fake_slogans(path, n=4):
    cols = ["desc", "output", "type", "company", "industry", "url", "alias", "desc_masked", "output_masked",
            "ent_dict", "unsupported", "first_pos"]
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        for i in range(n):
            w.writerow({"desc": f"We build great tools number {i} for your home.", "output": f"Great Tools {i}",
                        "type": "headline", "company": f"tools{i}", "industry": "retail", "url": f"t{i}.com",
                        "alias": f"Tools {i}", "desc_masked": "", "output_masked": "", "ent_dict": "{}",
                        "unsupported": "", "first_pos": ""})
    return path


@pytest.mark.slow
def test_run_eval_end_to_end_on_small_files(tmp_path):
    from pipelines.evaluate import EvalJobConfig, run_eval

    model = tiny_model_dir(tmp_path)
    hd = _fake_home_depot(tmp_path / "hd.csv")
    slog = _fake_slogans(tmp_path / "slogans.csv")
    cfg = EvalJobConfig.from_dict({
        "out": str(tmp_path / "eval"), "model": str(model),
        "targeting": {"home_depot": {"csv_path": str(hd), "catalogue_size": None,
                                     "split_fractions": [0.0, 0.0, 1.0]},
                      "max_queries": 5, "batch_size": 5, "search": {"num_beams": 3, "top_k": 10},
                      "verify_modes": ["off", "always"]},
        "creatives": {"csv": str(slog), "max_examples": 3, "batch_size": 3,
                      "creative": {"max_new_tokens": 4}},
    })
    res = run_eval(cfg)
    rows = {(r["variant"], r.get("channel"), r["verify"]): r for r in res["targeting"]}
    assert set(rows) == {("dense", "hybrid", "off"), ("dense", "hybrid", "always"), ("dense", "generative", "off"),
                         ("dense", "generative", "always"), ("index embeddings", "dense", None),
                         ("MiniLM+faiss", None, None)}
    for r in rows.values():
        assert r["queries"] == 5 and 0.0 <= r["recall@10"] <= 1.0 and r["queries_per_s"] > 0
    # 10 beams (raised to top_k) over 6 ads: off and always search the same trie exactly -> the same metrics
    for channel in ("hybrid", "generative"):
        assert rows[("dense", channel, "off")]["recall@10"] == pytest.approx(rows[("dense", channel, "always")]["recall@10"])
    # MiniLM finds the relevant product of these easy queries; the index keeps the same vectors: the same ranks
    assert rows[("MiniLM+faiss", None, None)]["recall@1"] >= 0.8
    for metric in ("recall@1", "recall@10", "mrr@10"):
        assert rows[("index embeddings", "dense", None)][metric] == pytest.approx(rows[("MiniLM+faiss", None, None)][metric])
    (creative,) = res["creatives"]
    assert creative["variant"] == "dense" and creative["examples"] == 3 and 0 <= creative["meteor"] <= 1
    report = (tmp_path / "eval" / "report.md").read_text()
    assert "Home Depot" in report and "METEOR (exact+stem)" in report
    assert json.loads((tmp_path / "eval" / "manifest.json").read_text())["stage"] == "eval"


def test_run_eval_reports_a_variant_it_cannot_load(tmp_path):
    """A wrong compressed-checkpoint path costs that variant's rows (with the reason), not the report."""
    from pipelines.evaluate import EvalJobConfig, run_eval

    model = tiny_model_dir(tmp_path)
    cfg = EvalJobConfig.from_dict({
        "out": str(tmp_path / "eval"), "model": str(model), "compressed": str(tmp_path / "no_such_checkpoint"),
        "targeting": {"home_depot": {"csv_path": str(_fake_home_depot(tmp_path / "hd.csv")), "catalogue_size": None,
                                     "split_fractions": [0.0, 0.0, 1.0]},
                      "max_queries": 3, "batch_size": 3, "search": {"num_beams": 3, "top_k": 10},
                      "verify_modes": ["off"], "minilm": False},
        "creatives": {"csv": str(_fake_slogans(tmp_path / "slogans.csv")), "max_examples": 2, "batch_size": 2,
                      "creative": {"max_new_tokens": 3}},
    })
    res = run_eval(cfg)
    rows = {r["variant"]: r for r in res["targeting"]}
    assert rows["dense"]["queries"] == 3 and rows["compressed"]["note"].startswith("not evaluated")
    creative = {r["variant"]: r for r in res["creatives"]}
    assert creative["dense"]["examples"] == 2 and creative["compressed"]["note"].startswith("not evaluated")
    assert "not evaluated" in (tmp_path / "eval" / "report.md").read_text()

