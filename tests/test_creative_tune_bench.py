"""bench/creatives_tune.py end to end on the CPU (--smoke: tiny random model, synthetic slogan rows)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("creatives_tune", REPO / "bench" / "creatives_tune.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_smoke_runs_every_phase_and_reports_each_metric(tmp_path):
    bench = _bench()
    out = tmp_path / "ct.json"
    state = bench.main(["--smoke", "--out-json", str(out), "--work", str(tmp_path / "work"),
                        "--phases", "base,tuned,tuned-compressed,shared,tuned-block2,tuned-qat,tuned-qat-compressed,"
                                   "tuned-qat-s0-e1,tuned-qat-s0-e1-compressed"])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(state["rows"], default=str))
    assert not state["not_run"], state["not_run"]
    rows = {r["phase"]: r for r in state["rows"]}
    assert list(rows) == ["base", "tuned", "tuned-compressed", "shared", "tuned-block2", "tuned-qat",
                          "tuned-qat-compressed", "tuned-qat-s0-e1", "tuned-qat-s0-e1-compressed"]
    assert rows["tuned-block2"]["prompt_ngram_block"] == 2 and "prompt_ngram_block" not in rows["tuned"]
    # base reads the few-shot prompt; the tuned models (the compressed checkpoint too) declare the tuned one
    assert rows["base"]["prompt"] == "few_shot"
    assert {rows[k]["prompt"] for k in ("tuned", "tuned-compressed", "shared", "tuned-block2", "tuned-qat",
                                        "tuned-qat-compressed")} == {"tuned"}
    # the QAT model is compressed on the grid its record names (the compress stage's rule); the others not
    assert state["extra"]["tuned-qat"]["train"]["steps"] >= 1
    assert "QAT" in state["extra"]["tuned-qat-compressed"]["qat_note"]
    assert state["extra"]["tuned-compressed"]["qat_note"] is None
    # tuned-qat-s<start>-e<epochs>: QAT from that share of the steps, over that many epochs
    assert state["extra"]["tuned-qat"]["config"]["qat"]["start_fraction"] == 0.8
    assert state["extra"]["tuned-qat-s0-e1"]["config"]["qat"]["start_fraction"] == 0.0
    assert state["extra"]["tuned-qat-s0-e1"]["config"]["epochs"] == 1.0
    assert "QAT" in state["extra"]["tuned-qat-s0-e1-compressed"]["qat_note"]
    expected = {"distinct1", "distinct2", "copy_share", "empty_share", "headlines_per_s"}
    expected |= {"rouge1", "rouge2", "rougeL"} if "rouge" not in state["skipped_metrics"] else set()
    expected |= {"bleu"} if "bleu" not in state["skipped_metrics"] else set()
    assert all(expected <= set(r) and r["examples"] == 2 for r in rows.values())
    assert rows["tuned"]["train_steps"] >= 1 and state["pairs"]["pairs"] == 4
    assert len(state["samples"]) == 2 and set(state["samples"][0]) >= {"advertiser", "reference", "base", "tuned"}


def test_a_missing_metric_package_is_skipped_and_named(monkeypatch):
    bench = _bench()
    real = bench.importlib.import_module

    def fake(name, *a, **k):
        if name.startswith("sacrebleu"):
            raise ImportError("No module named 'sacrebleu'")
        return real(name, *a, **k)

    monkeypatch.setattr(bench.importlib, "import_module", fake)
    support = bench.metric_support()
    assert support["bleu"].startswith("sacrebleu not importable") and support["rouge"] is None
    q = bench.quality(["Fresh Coffee Daily"], ["Fresh Coffee Every Day"], ["Coffee shop"], support)
    assert "bleu" not in q and q["rouge1"] > 0 and q["copy_share"] == 0.0
