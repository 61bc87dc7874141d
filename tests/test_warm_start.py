"""The nightly warm start: when last night's model is reused, and how the train stage applies it."""

from __future__ import annotations

import pytest

from adbatch.artifacts import write_json_atomic
from adbatch.config import ConfigError
from adbatch.serving.prompts import TARGETING_PROMPT_VERSION
from adbatch.training import TrainConfig
from adbatch.training.checkpoint import TRAINING_RECORD
from adbatch.training.warm_start import IndexSnapshot, WarmStartConfig, plan_warm_start
from tests.test_training import _tiny_corpus


@pytest.fixture(scope="module")
def nights(tmp_path_factory):
    """Night 1 (24 ads), night 2 (the same + 1 new ad) and an unrelated catalogue, as built indexes."""
    from adbatch.index.clustering import ClusterConfig
    from adbatch.index.corpus import CorpusConfig
    from adbatch.index.build import IndexConfig, build_index

    root = tmp_path_factory.mktemp("nights")
    cfg = IndexConfig(columns=CorpusConfig(text="title", embedding="embedding"),
                      cluster=ClusterConfig(branching=2, leaf_size=6))
    out = {}
    for name, n in (("night1", 24), ("night2", 25)):
        (root / name).mkdir()
        ads, _, _ = _tiny_corpus(root / name, n=n)
        build_index(ads, root / f"index_{name}", cfg, progress=False)
        out[name] = root / f"index_{name}"
    return out


def _model(tmp_path, index_hash, scheme="text", version=TARGETING_PROMPT_VERSION):
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    write_json_atomic(folder / TRAINING_RECORD, {"trained_on_index": index_hash, "scheme": scheme,
                                                 "targeting_prompt_version": version})
    return folder


def test_snapshot_of_missing_or_broken_index(tmp_path):
    assert IndexSnapshot.of(tmp_path / "absent") is None
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "manifest.json").write_text("{not json")
    assert IndexSnapshot.of(tmp_path / "half") is None


def test_warm_when_the_index_changed_partly(nights, tmp_path):
    prev = IndexSnapshot.of(nights["night1"])
    today = IndexSnapshot.of(nights["night2"])
    assert prev is not None and today is not None and prev.index_hash != today.index_hash
    model = _model(tmp_path, prev.index_hash)
    plan = plan_warm_start(model, prev, today, 6.0, WarmStartConfig())
    assert plan.init_model == str(model.resolve()) and plan.epochs == 3.0
    assert plan.overlap == pytest.approx(24 / 25)
    # a stricter threshold, or a different base model -> cold, full epochs
    strict = plan_warm_start(model, prev, today, 6.0, WarmStartConfig(min_overlap=0.99))
    assert strict.init_model is None and strict.epochs == 6.0 and "96.0%" in strict.reason
    other_base = plan_warm_start(model, prev, today, 6.0, WarmStartConfig(), same_base_model=False)
    assert other_base.init_model is None and "base model" in other_base.reason


def test_codes_needs_the_same_code_tokens(tmp_path):
    prev = IndexSnapshot("h1", frozenset(range(10)), "codes", ("<a_0>", "<a_1>"))
    model = _model(tmp_path, "h1", scheme="codes")

    def today(*tokens):
        return IndexSnapshot("h2", frozenset(range(10)), "codes", tokens)

    same = plan_warm_start(model, prev, today("<a_0>", "<a_1>"), 2.0, WarmStartConfig())
    assert same.init_model is not None and same.epochs == 1.0
    appended = plan_warm_start(model, prev, today("<a_0>", "<a_1>", "<b_0>"), 2.0, WarmStartConfig())
    assert appended.init_model is not None  # stable ids: new tokens after the learned ones
    other = plan_warm_start(model, prev, today("<a_1>", "<a_0>"), 2.0, WarmStartConfig())
    assert other.init_model is None and "code tokens" in other.reason


@pytest.mark.parametrize("case", ["disabled", "no_model", "no_record", "scheme", "prompt", "index_not_on_disk"])
def test_cold_cases(nights, tmp_path, case):
    prev = IndexSnapshot.of(nights["night1"])
    today = IndexSnapshot.of(nights["night2"])
    cfg = WarmStartConfig(enabled=case != "disabled")
    model = _model(tmp_path, prev.index_hash, scheme="codes" if case == "scheme" else "text",
                   version=TARGETING_PROMPT_VERSION - 1 if case == "prompt" else TARGETING_PROMPT_VERSION)
    if case == "no_model":
        model = tmp_path / "nothing"
    if case == "no_record":
        (model / TRAINING_RECORD).unlink()
    # a crash after the index stage leaves today's index on disk: it is not the one the model learned
    snapshot = today if case == "index_not_on_disk" else prev
    plan = plan_warm_start(model, snapshot, today, 4.0, cfg)
    assert plan.init_model is None and plan.epochs == 4.0 and plan.reason


def test_config_validation():
    for bad in (dict(min_overlap=0.0), dict(min_overlap=1.5), dict(epochs_fraction=0.0), dict(epochs_fraction=2.0)):
        with pytest.raises(ConfigError):
            WarmStartConfig(**bad).validate()


def test_nightly_train_stage_applies_the_plan(nights, tmp_path, monkeypatch):
    """The refresh's train stage warm-starts from its own output folder with the shortened schedule,
    and trains cold (configured model, full epochs) when the plan says so."""
    import pipelines.train
    from pipelines.train import TrainJobConfig, run_train_warm

    seen = []
    monkeypatch.setattr(pipelines.train, "run_train", lambda job: seen.append(job) or {"ok": True})
    prev = IndexSnapshot.of(nights["night1"])
    model = _model(tmp_path, prev.index_hash)
    job = TrainJobConfig(index=nights["night2"], out=model, init_model=None, train=TrainConfig(epochs=6.0))
    result = run_train_warm(job, WarmStartConfig(), prev, same_base_model=True)
    assert seen[-1].init_model == str(model.resolve()) and seen[-1].train.epochs == 3.0
    assert result["ok"] and result["warm_start"]["init_model"] == str(model.resolve())
    result = run_train_warm(job, WarmStartConfig(), None, same_base_model=True)
    assert seen[-1].init_model is None and seen[-1].train.epochs == 6.0
    assert result["warm_start"]["init_model"] is None


def test_index_left_half_written_is_not_last_nights(nights, tmp_path):
    """An index build killed after replacing ad_codes.parquet but before manifest.json: the old
    manifest hash beside new ad ids must not count as the index last night's model learned."""
    import shutil

    from adbatch.index.build import AD_CODES_FILE

    prev = IndexSnapshot.of(nights["night1"])
    mixed = tmp_path / "index"
    shutil.copytree(nights["night1"], mixed)
    shutil.copy(nights["night2"] / AD_CODES_FILE, mixed / AD_CODES_FILE)
    assert IndexSnapshot.of(mixed) is None
    model = _model(tmp_path, prev.index_hash)
    plan = plan_warm_start(model, IndexSnapshot.of(mixed), IndexSnapshot.of(nights["night2"]), 6.0, WarmStartConfig())
    assert plan.init_model is None and plan.epochs == 6.0
