"""Ray-parallel compression equals the sequential path bit for bit; the job runs end to end."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from adbatch.compress import CalibrationConfig, CompressConfig, CompressedLinear, calibrate, compress_, load_compressed
from conftest import assert_same_packed, make_tiny_llama


@pytest.mark.parametrize("config", [
    CompressConfig(pattern_policy="layer_adaptive"),  # the paper's recipe: paper score, layer-adaptive, adaptive groups
    CompressConfig(pattern_policy="uniform", group_policy="uniform", score="wanda"),
])
def test_ray_matches_sequential_bit_for_bit(ray_local, config):
    from pipelines.compress import RayLayerExecutor

    model = make_tiny_llama(seed=3, hidden=128, intermediate=256)
    blocks = torch.randint(0, 512, (8, 32), generator=torch.Generator().manual_seed(3))
    stats = calibrate(model, blocks, CalibrationConfig(batch_size=4))
    seq_model, ray_model = copy.deepcopy(model), copy.deepcopy(model)
    r_seq = compress_(seq_model, config, stats)
    r_ray = compress_(ray_model, config, stats, executor=RayLayerExecutor())
    assert [x.to_dict() for x in r_seq.layers] == [x.to_dict() for x in r_ray.layers]
    assert assert_same_packed(seq_model, ray_model) == 14


def test_run_compress_end_to_end(ray_local, tmp_path, default_tokenizer):
    from pipelines.compress import CompressJobConfig, run_compress

    src = tmp_path / "tiny"
    model = make_tiny_llama(vocab_size=len(default_tokenizer), seed=4)
    model.save_pretrained(src)
    default_tokenizer.save_pretrained(src)
    out = tmp_path / "out"
    cfg = CompressJobConfig(model=str(src), out=out, eval_texts=8, eval_seq_len=32,
                            calibration=CalibrationConfig(num_texts=8, seq_len=32, batch_size=4))
    result = run_compress(cfg)
    assert result["summary"]["layers"] == 14
    assert result["sizes"]["ours_bytes"] > 0
    for key in ("ppl_ads", "ppl_generic", "dense_ppl_ads", "dense_ppl_generic"):
        assert result["quality"][key] > 1.0
    report = (out / "report.md").read_text()
    assert "| compressed |" in report and "model.layers.1.mlp.down_proj" in report
    assert (out / "importance.png").stat().st_size > 1000
    loaded, _ = load_compressed(out)
    assert sum(isinstance(m, CompressedLinear) for m in loaded.modules()) == 14
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["job_config"]["eval_texts"] == 8
