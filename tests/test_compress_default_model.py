"""The real default model (SmolLM2-135M) through the whole compression job, small calibration."""

from __future__ import annotations

import pytest

from adbatch.compress import CalibrationConfig, CompressedLinear, load_compressed


@pytest.mark.slow
@pytest.mark.realmodel
def test_default_model_compresses_end_to_end(tmp_path, default_tokenizer):
    from pipelines.compress import CompressJobConfig, run_compress

    out = tmp_path / "smollm2"
    cfg = CompressJobConfig(out=out, use_ray=False, eval_texts=16, eval_seq_len=128,
                            calibration=CalibrationConfig(num_texts=16, seq_len=128, batch_size=4))
    result = run_compress(cfg)
    summary, sizes, q = result["summary"], result["sizes"], result["quality"]
    assert summary["layers"] == 30 * 7  # every q/k/v/o/gate/up/down; lm_head (tied) stays dense
    assert summary["density"] == 1.0 and summary["pattern_counts"] == {"4:4": 210}  # the default: INT4 only
    assert sizes["ours_over_csr"] <= 0.30
    assert summary["bits_per_weight"] < 4.5
    assert 1.0 < q["dense_ppl_ads"] < q["ppl_ads"] < 100 * q["dense_ppl_ads"]
    model, tok = load_compressed(out)
    assert sum(isinstance(m, CompressedLinear) for m in model.modules()) == 210
    ids = tok("Fast shipping on all orders", return_tensors="pt")["input_ids"]
    assert model(input_ids=ids).logits.isfinite().all()
