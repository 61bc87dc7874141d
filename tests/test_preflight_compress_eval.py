"""The compress and eval stages' pre-flights (issue 59 item 5): each named check refuses its hand-made bad input
with its own line (a user error, exit status 2) before Ray starts or a model loads, a good config passes, and
the refresh runs the same pre-flights before its first stage. CPU only, no model is loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from adbatch.artifacts import ArtifactKind, mark_output

HD_HEADER = "id,product_uid,product_title,search_term,relevance"
SLOGAN_HEADER = "desc,output,company,industry,url,alias"
INDEX_CFG = {"columns": {"embedding": "vec"}, "cluster": {"branching": 4, "leaf_size": 8}}


def _model_folder(root: Path) -> Path:
    """What the pre-flight checks of a model folder without loading it: a JSON config.json and readable
    safetensors headers (the weights are never loaded here)."""
    from safetensors.numpy import save_file

    d = root / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"w": np.zeros((2, 2), np.float32)}, str(d / "model.safetensors"))
    return d


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from test_generate_support import tiny_index_dir

    root = tmp_path_factory.mktemp("preflight")
    queries = root / "queries.parquet"
    pq.write_table(pa.table({"query": ["drill", "saw"], "ad_id": ["ad-000", "ad-001"]}), queries)
    calib = root / "calib.txt"
    calib.write_text("one calibration text\nanother one\n")
    hd, slogans = root / "hd.csv", root / "slogans.csv"
    hd.write_text(f"{HD_HEADER}\n1,2,claw hammer,hammer,3\n")
    slogans.write_text(f"{SLOGAN_HEADER}\nWe make tools.,Great Tools,tools,retail,t.com,Tools\n")
    return {"root": root, "model": _model_folder(root), "index": tiny_index_dir(root), "ads": root / "tiny_ads.parquet",
            "queries": queries, "calib": calib, "hd": hd, "slogans": slogans}


def _write(t: Path, name: str, text: str) -> Path:
    (t / name).write_text(text)
    return t / name


def _parquet(t: Path, name: str, **columns) -> Path:
    pq.write_table(pa.table(columns), t / name)
    return t / name


# --- compress -------------------------------------------------------------------------------------------
def _compress(a, t: Path, **kw):
    from adbatch.compress import CalibrationConfig
    from pipelines.compress import CompressJobConfig

    base = {"model": str(a["model"]), "out": t / "o", "calib": a["calib"],
            "calibration": CalibrationConfig(num_texts=4, seq_len=16)}
    if "index" in kw:
        base["calib"] = None
    return CompressJobConfig(**{**base, **kw})


def _damaged_index(a, t: Path) -> Path:
    d = t / "index"
    shutil.copytree(a["index"], d)
    (d / "ad_codes.parquet").write_bytes(b"not the indexed codes")
    return d


def _index_without_its_corpus(a, t: Path) -> Path:
    d = t / "index"
    shutil.copytree(a["index"], d)
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["input_files"] = [str(t / "moved_away.parquet")]
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d


def _record_not_json(a, t: Path) -> str:
    d = t / "trained"
    shutil.copytree(a["model"], d)
    (d / "adbatch_training.json").write_text('{"trained_on_index": ')
    return str(d)


def _other_stage_folder(t: Path, kind: ArtifactKind) -> Path:
    mark_output(t / "o", kind)
    return t / "o"


def _mutated(cfg, **changes):
    for k, v in changes.items():  # a config changed after it was built (and validated)
        setattr(cfg, k, v)
    return cfg


COMPRESS_BAD = {
    "config-changed-after-construction": (lambda a, t: _mutated(_compress(a, t), eval_texts=0),
                                          "CompressJobConfig.eval_texts must be >= 1"),
    "out-owned-by-index": (lambda a, t: _compress(a, t, out=_other_stage_folder(t, ArtifactKind.INDEX)),
                           "holds an adbatch index artifact"),
    "out-foreign-files": (lambda a, t: _compress(a, t, out=_write(t, "notes.txt", "x").parent),
                          "is not empty and holds no adbatch artifact"),
    "model-missing": (lambda a, t: _compress(a, t, model=str(t / "no_model")), "model not found"),
    "model-folder-without-config": (lambda a, t: _compress(a, t, model=str(t)), "is a folder without config.json"),
    "model-not-gguf": (lambda a, t: _compress(a, t, model=str(_write(t, "m.gguf", "text"))), "bad magic bytes"),
    "model-record-not-json": (lambda a, t: _compress(a, t, model=_record_not_json(a, t)),
                              r"adbatch_training.json: not valid JSON"),
    "calib-missing": (lambda a, t: _compress(a, t, calib=t / "none.txt"),
                      r"CalibrationConfig.path: .*none.txt not found"),
    "calib-without-text-column": (lambda a, t: _compress(a, t, calib=_parquet(t, "c.parquet", body=["a", "b"])),
                                  r"needs a 'text' column or 'title'\+'description'; has \['body'\]"),
    "calib-empty": (lambda a, t: _compress(a, t, calib=_write(t, "c.txt", "\n \n")), "holds no texts"),
    "index-missing": (lambda a, t: _compress(a, t, index=t / "none"), "CompressJobConfig.index: index folder not found"),
    "index-not-an-index": (lambda a, t: _compress(a, t, index=a["model"]), "is not an index folder"),
    "index-file-damaged": (lambda a, t: _compress(a, t, index=_damaged_index(a, t)),
                           r"ad_codes.parquet: sha256 \w+ does not match the manifest"),
    "index-corpus-gone": (lambda a, t: _compress(a, t, index=_index_without_its_corpus(a, t)),
                          "the ad corpus .*moved_away.parquet the index was built from is not there"),
    "ads-without-the-index-column": (lambda a, t: _compress(a, t, index=a["index"], ads=_parquet(
        t, "ads.parquet", ad_id=["ad-000"], label=["drill"])), r"column 'title' \(mapped to text\) is missing"),
    "queries-missing": (lambda a, t: _compress(a, t, index=a["index"], queries=t / "none.parquet"),
                        "CompressJobConfig.queries: .*none.parquet not found"),
    "queries-without-ad-id": (lambda a, t: _compress(a, t, index=a["index"], queries=_parquet(
        t, "q.parquet", query=["drill"])), r"labelled queries need column\(s\) \['ad_id'\]"),
    "heldout-beyond-the-example": (lambda a, t: _compress(a, t, eval_texts=10**6),
                                   r"asked for 4 calibration \+ 1000000"),
}


def _refused_with_its_line(preflight, make, expected, assets, tmp_path):
    """``preflight`` of the config ``make`` builds fails with one line matching ``expected``, as a user error."""
    from jobs.config_cli import is_user_error

    cfg = make(assets, tmp_path)
    with pytest.raises((ValueError, FileNotFoundError), match=expected) as info:
        preflight(cfg)
    assert is_user_error(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("case", sorted(COMPRESS_BAD))
def test_compress_preflight_refuses_each_bad_input_with_its_line(case, assets, tmp_path):
    from pipelines.compress import preflight

    _refused_with_its_line(preflight, *COMPRESS_BAD[case], assets, tmp_path)


def test_compress_preflight_passes_good_configs_and_returns_what_it_read(assets, tmp_path):
    from pipelines.compress import preflight

    found = preflight(_compress(assets, tmp_path))
    assert found.calibration.path == assets["calib"] and sorted(found.texts) == ["another one", "one calibration text"]
    assert found.model_dir == assets["model"] and found.record is None
    found = preflight(_compress(assets, tmp_path, index=assets["index"], ads=assets["ads"], queries=assets["queries"]))
    assert found.texts is None and found.queries == [("drill", "ad-000"), ("saw", "ad-001")]
    found = preflight(_compress(assets, tmp_path, calib=None, out=_other_stage_folder(tmp_path, ArtifactKind.COMPRESS)))
    assert len(found.texts) == 4  # the bundled example, into its own earlier output


def test_compress_preflight_leaves_what_an_earlier_stage_writes_to_that_stage(assets, tmp_path):
    """The refresh's view: tonight's index and trained model are not there yet; the rest is still checked."""
    from pipelines.compress import preflight

    cfg = _compress(assets, tmp_path, model=str(tmp_path / "model"), index=tmp_path / "index",
                    ads=tmp_path / "gone.parquet", queries=assets["queries"])
    assert preflight(cfg, upstream=("index", "model")).queries == [("drill", "ad-000"), ("saw", "ad-001")]
    with pytest.raises(FileNotFoundError, match="CompressJobConfig.queries"):
        preflight(cfg.replace(queries=tmp_path / "none.parquet"), upstream=("index", "model"))
    with pytest.raises(FileNotFoundError, match="model not found"):
        preflight(cfg, upstream=("index",))
    with pytest.raises(ValueError, match="upstream names"):
        preflight(cfg, upstream=("ads",))


def test_run_compress_runs_the_preflight_before_ray_and_the_claim(assets, tmp_path, monkeypatch):
    import pipelines.ray_runtime
    from pipelines.compress import run_compress

    monkeypatch.setattr(pipelines.ray_runtime, "init_ray", lambda *a, **k: pytest.fail("Ray started"))
    with pytest.raises(FileNotFoundError, match="CompressJobConfig.queries"):
        run_compress(_compress(assets, tmp_path, index=assets["index"], queries=tmp_path / "none.parquet", use_ray=True))
    assert not (tmp_path / "o").exists()


# --- eval -----------------------------------------------------------------------------------------------
def _eval(a, t: Path, targeting=None, creatives=None, **kw):
    from pipelines.evaluate import EvalJobConfig

    return EvalJobConfig.from_dict({
        "out": str(t / "o"), **kw,
        "targeting": {"home_depot": {"csv_path": str(a["hd"])}, "index": str(a["index"]), **(targeting or {})},
        "creatives": {"csv": str(a["slogans"]), **(creatives or {})}})


EVAL_BAD = {
    "out-owned-by-compress": (lambda a, t: _eval(a, t, out=str(_other_stage_folder(t, ArtifactKind.COMPRESS))),
                              "holds an adbatch compress artifact"),
    "home-depot-without-relevance": (lambda a, t: _eval(a, t, targeting={"home_depot": {"csv_path": str(_write(
        t, "hd.csv", "id,product_uid,product_title,search_term\n1,2,t,s\n"))}}), r"missing column\(s\) \['relevance'\]"),
    "index-missing": (lambda a, t: _eval(a, t, targeting={"index": str(t / "none")}),
                      "TargetingEvalConfig.index: index folder not found"),
    "extra-index-not-an-index": (lambda a, t: _eval(a, t, targeting={"extra_index": str(a["model"]),
                                                                     "extra_model": str(a["model"])}),
                                 "TargetingEvalConfig.extra_index: .* is not an index folder"),
    "index-file-damaged": (lambda a, t: _eval(a, t, targeting={"index": str(_damaged_index(a, t))}),
                           r"ad_codes.parquet: sha256 \w+ does not match the manifest"),
    "slogans-without-alias": (lambda a, t: _eval(a, t, creatives={"csv": str(_write(
        t, "s.csv", "desc,output,company,industry,url\nd,o,c,i,u\n"))}), r"missing column\(s\) \['alias'\]"),
}


@pytest.mark.parametrize("case", sorted(EVAL_BAD))
def test_eval_preflight_refuses_each_bad_input_with_its_line(case, assets, tmp_path):
    from pipelines.evaluate import preflight

    _refused_with_its_line(preflight, *EVAL_BAD[case], assets, tmp_path)


def test_eval_preflight_passes_what_the_run_reports_rather_than_refuses(assets, tmp_path):
    """A good config passes; so do a missing data file (its section is skipped), a checkpoint that is not there
    (its rows say why) and a bad file of a section that is off."""
    from pipelines.evaluate import preflight

    preflight(_eval(assets, tmp_path))
    preflight(_eval(assets, tmp_path, compressed=str(tmp_path / "no_such_checkpoint"),
                    targeting={"home_depot": {"csv_path": str(tmp_path / "none.csv")}},
                    creatives={"csv": str(tmp_path / "none.csv")}))
    bad = _write(tmp_path, "bad.csv", "a,b\n1,2\n")
    preflight(_eval(assets, tmp_path, targeting={"enabled": False, "home_depot": {"csv_path": str(bad)},
                                                 "index": str(tmp_path / "none")},
                    creatives={"enabled": False, "csv": str(bad)}))


def test_run_eval_runs_the_preflight_before_the_claim(assets, tmp_path):
    from pipelines.evaluate import run_eval

    with pytest.raises(ValueError, match="missing column"):
        run_eval(_eval(assets, tmp_path, creatives={"csv": str(_write(tmp_path, "s.csv", "desc\nd\n"))}))
    assert not (tmp_path / "o").exists()


# --- the refresh ----------------------------------------------------------------------------------------
def _refresh(a, t: Path, **sections):
    from jobs.nightly_refresh import RefreshConfig

    return RefreshConfig.from_dict({
        "work": str(t / "work"), "model": str(a["model"]), "num_cpus": 1,
        "index": {"config": {"ads": str(a["ads"]), "index": INDEX_CFG}, "stable_ids": False},
        "train": {"enabled": False}, "compress": {"enabled": False}, "eval": {"enabled": False},
        "generate": {"targets_requests": None, "creatives_requests": None}, **sections})


def _with_folder_of(folder: Path, kind: ArtifactKind, cfg):
    """``cfg``, with ``folder`` (a stage's output folder in its work folder) holding stage ``kind``'s marker."""
    mark_output(folder, kind)
    return cfg


REFRESH_BAD = {
    "compress-calib-without-text": (lambda a, t: _refresh(a, t, compress={"config": {"calib": str(_parquet(
        t, "c.parquet", body=["a"]))}}), "needs a 'text' column"),
    "compress-out-owned-by-index": (lambda a, t: _with_folder_of(
        t / "work" / "compressed", ArtifactKind.INDEX, _refresh(a, t, compress={"enabled": True})),
        "holds an adbatch index artifact"),
    "compress-queries-without-ad-id": (lambda a, t: _refresh(a, t, compress={"enabled": True}, train={
        "enabled": False, "config": {"queries": str(_parquet(t, "q.parquet", query=["drill"]))}}),
        r"labelled queries need column\(s\) \['ad_id'\]"),
    "eval-slogans-without-alias": (lambda a, t: _refresh(a, t, eval={"config": {
        "targeting": {"enabled": False}, "creatives": {"csv": str(_write(t, "s.csv", "desc,output\nd,o\n"))}}}),
        r"missing column\(s\) \['company', 'industry', 'url', 'alias'\]"),
}


@pytest.mark.parametrize("case", sorted(REFRESH_BAD))
def test_refresh_runs_the_compress_and_eval_preflights_before_its_first_stage(case, assets, tmp_path, monkeypatch):
    import pipelines.index
    import pipelines.ray_runtime
    from jobs.nightly_refresh import run_refresh

    monkeypatch.setattr(pipelines.ray_runtime, "init_ray", lambda *a, **k: pytest.fail("Ray started"))
    monkeypatch.setattr(pipelines.index, "run_index", lambda job: pytest.fail("the index stage ran"))
    make, expected = REFRESH_BAD[case]
    cfg = make(assets, tmp_path)
    with pytest.raises((ValueError, FileNotFoundError), match=expected):
        run_refresh(cfg)
    assert not (tmp_path / "work" / "_refresh").exists()


def test_refresh_preflight_passes_when_tonight_writes_the_index_and_the_model(assets, tmp_path):
    """Train and compress on, calibration on tonight's index: neither the index nor the model is there before the
    night, and the refresh's pre-flight does not ask for them; the eval stage's inputs are checked."""
    from jobs.nightly_refresh import _check_inputs

    evaluation = {"targeting": {"home_depot": {"csv_path": str(assets["hd"])}},
                  "creatives": {"csv": str(assets["slogans"])}}
    cfg = _refresh(assets, tmp_path, train={"enabled": True, "config": {"queries": str(assets["queries"])}},
                   compress={"enabled": True}, eval={"config": evaluation})
    assert _check_inputs(cfg) == {}
    assert not (tmp_path / "work").exists()
