"""bench/night_scale.py's arithmetic: the output checks on crafted tables (duplicates, lost and unexpected
requests, rejected rows), the per-stage projection and its caps, the expected distinct queries of a Zipf
stream, the peaks of a stage's window and the cost. Its --smoke (the refresh end to end, then resumed) runs
in tests/test_bench_smoke.py."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from adbatch.config import ConfigError  # noqa: E402
from bench import night_scale as ns  # noqa: E402

REQUESTS = ["r0", "r1", "r2", "r3"]


def _ranked(ids, k=2):
    return [(rid, rank) for rid in ids for rank in range(1, k + 1)]


def test_check_answers_passes_a_clean_output_and_counts_rejected_rows():
    clean = ns.check_answers("targets", REQUESTS, _ranked(REQUESTS), [])
    assert clean.ok and (clean.answered, clean.duplicate_rows, clean.lost, clean.unexpected) == (4, 0, 0, 0)
    # r3 rejected, the rest answered: answered = inputs - rejected
    rejected = ns.check_answers("targets", REQUESTS, _ranked(REQUESTS[:3]), ["r3"])
    assert rejected.ok and rejected.rejected == 1 and rejected.answered == 3


def test_check_answers_finds_a_duplicated_row():
    rows = _ranked(REQUESTS) + [("r1", 2)]  # a partition written twice would repeat (request_id, rank)
    check = ns.check_answers("targets", REQUESTS, rows, [])
    assert not check.ok and check.duplicate_rows == 1 and check.lost == 0


def test_check_answers_finds_a_lost_and_an_unexpected_request():
    lost = ns.check_answers("targets", REQUESTS, _ranked(REQUESTS[:3]), [])  # r3: neither answered nor rejected
    assert not lost.ok and lost.lost == 1 and lost.answered == 3
    unexpected = ns.check_answers("targets", REQUESTS, _ranked(REQUESTS + ["zz"]), [])
    assert not unexpected.ok and unexpected.unexpected == 1 and unexpected.lost == 0


def test_check_answers_with_a_duplicated_input_id():
    """Two identical copies of r0: the first is answered, the second rejected (the generate stage's rule), so
    the rows in = answered + rejected; a rejected row without a usable id still counts as rejected."""
    inputs = ["r0", "r0", "r1", None]
    check = ns.check_answers("targets", inputs, _ranked(["r0", "r1"]), ["r0", None])
    assert check.ok and (check.inputs, check.rejected, check.answered) == (4, 2, 2)
    # the same without the second copy rejected: one row unaccounted for
    assert not ns.check_answers("targets", inputs, _ranked(["r0", "r1"]), [None]).ok


def test_check_answers_on_single_column_keys_catches_an_ad_indexed_twice():
    ads = ["a", "b", "c"]
    assert ns.check_answers("index", ads, [("a",), ("b",), ("c",)], []).ok
    twice = ns.check_answers("index", ads, [("a",), ("b",), ("b",)], ["c"])
    assert not twice.ok and twice.duplicate_rows == 1 and twice.lost == 0


def test_expected_distinct_matches_the_scale_sets_draws():
    from bench.scale_set import zipf_cdf, zipf_ranks

    assert ns.expected_distinct(1, 1.0, 1000) == pytest.approx(1.0)
    assert ns.expected_distinct(500, 1.0, 1) == pytest.approx(1.0)
    assert ns.expected_distinct(50, 1.0, 10**9) == pytest.approx(50.0)
    pool, n = 2000, 5000
    cdf = zipf_cdf(pool, 1.0)
    drawn = [len(np.unique(zipf_ranks(cdf, n, np.random.default_rng(seed)))) for seed in range(20)]
    assert ns.expected_distinct(pool, 1.0, n) == pytest.approx(np.mean(drawn), rel=0.01)


def test_project_stage_by_scaling():
    assert ns.project_stage(ns.Scaling.FIXED, 48.0, 50.0) == 48.0
    assert ns.project_stage(ns.Scaling.ADS, 100.0, 50.0) == pytest.approx(5000.0)
    # generate: 20 s of start-up stay, 80 s of decoding grow 10x
    assert ns.project_stage(ns.Scaling.DISTINCT_QUERIES, 100.0, 10.0, fixed_s=20.0) == pytest.approx(820.0)
    # a fixed part larger than the stage (a rounding of the manifest's estimate) is the whole stage
    assert ns.project_stage(ns.Scaling.CREATIVE_REQUESTS, 10.0, 3.0, fixed_s=12.0) == pytest.approx(10.0)


@pytest.mark.parametrize("budget,max_steps,loop_s", [
    (None, None, 2 * 30.0 * 50),  # epochs decide: 2 epochs of 30 s, 50x the ads
    (600.0, None, 600.0),  # the stated budget stops it first
    (None, 20, 20 * 60.0 / 10),  # max_steps at the measured seconds per step
])
def test_project_training_caps_the_loop_and_scales_the_rest(budget, max_steps, loop_s):
    loop = ns.TrainLoop(seconds=60.0, steps=10, seconds_per_epoch=30.0, epochs=2.0, max_steps=max_steps,
                        budget_s=budget)
    # 100 s stage = 60 s loop + 40 s else (data preparation, load, save): the else grows with the ads
    assert ns.project_stage(ns.Scaling.TRAINING, 100.0, 50.0, loop=loop) == pytest.approx(40.0 * 50 + loop_s)


def test_peaks_take_the_samples_inside_the_window():
    gib = ns.GIB
    samples = [ns.Sample(0.0, 1 * gib, 2 * gib, [], []),
               ns.Sample(1.0, 3 * gib, 5 * gib, [50.0, 100.0], [1024.0, 2048.0]),
               ns.Sample(2.0, 2 * gib, 9 * gib, [0.0, 50.0], [4096.0, 1024.0]),
               ns.Sample(9.0, 8 * gib, 8 * gib, [], [])]
    got = ns.peaks(samples, 0.5, 2.5)
    assert got == {"samples": 2, "driver_rss_gib": 3.0, "tree_rss_gib": 9.0, "gpu_mem_gib": 5.0, "gpu_busy": 0.5}
    assert ns.peaks(samples, 3.0, 4.0)["driver_rss_gib"] is None  # a stage shorter than the interval
    assert ns.peaks(samples[:1], 0.0, 1.0)["gpu_busy"] is None  # CPU: no GPU samples


def test_gpu_cost():
    assert ns.gpu_cost(3600.0, 8, 2.5) == pytest.approx(20.0)
    assert ns.gpu_cost(1800.0, 0, 2.5) == pytest.approx(1.25)  # a CPU run priced as one GPU held


def test_config_refuses_what_the_bench_wires_and_bad_sizes():
    with pytest.raises(ConfigError, match="--work"):
        ns.NightScaleConfig(refresh_args=["--config", "x.toml", "--work", "/elsewhere"])
    with pytest.raises(ConfigError, match="creatives"):
        ns.NightSize(ads=10, requests=10, creatives=11)
    with pytest.raises(ConfigError, match="budget"):
        ns.NightScaleConfig(train_budget_s=0.0)
    assert ns.NightSize(ads=10, requests=1_000_000, creatives=1).pool == 200_000  # the scale set's ratio


def test_parse_args_passes_the_refresh_flags_and_reads_the_projection(tmp_path):
    config, smoke = ns.parse_args(["--ads", "300", "--requests", "50", "--creatives", "5", "--project",
                                   "--project-to", "1e7,1e8,1e5", "--work", str(tmp_path), "--",
                                   "--generate.config.concurrency", "8"])
    assert not smoke and (config.size.ads, config.size.requests, config.size.creatives) == (300, 50, 5)
    assert config.project_to.ads == 10**7 and config.project_to.requests == 10**8
    assert config.refresh_args == ["--config", str(ns.EXAMPLE_REFRESH), "--generate.config.concurrency", "8"]
    with pytest.raises(SystemExit):
        ns.parse_args(["--", "--index.config.ads", "other.parquet"])
