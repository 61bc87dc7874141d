"""Compressed checkpoints: save/load round trip, CompressedLinear forward, integrity failures."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from adbatch.compress import (
    CalibrationConfig, CheckpointError, CompressConfig, CompressedLinear, calibrate, compress_,
    load_compressed, save_compressed,
)
from adbatch.compress.linear import densify_
from adbatch.artifacts import sha256_file
from conftest import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_compressed():
    model = make_tiny_llama(seed=1)
    blocks = torch.randint(0, 512, (8, 32), generator=torch.Generator().manual_seed(1))
    stats = calibrate(model, blocks, CalibrationConfig(batch_size=4))
    dense = copy.deepcopy(model)
    recipe = compress_(model, CompressConfig(pattern_policy="layer_adaptive", target_density=0.4, dense_dtype="float32"), stats)
    return dense, model, recipe, blocks[:2]


@pytest.fixture(scope="module")
def saved(tiny_compressed, default_tokenizer, tmp_path_factory):
    _, model, recipe, _ = tiny_compressed
    out = tmp_path_factory.mktemp("ckpt") / "model"
    save_compressed(model, default_tokenizer, recipe, out)
    return out


def test_compress_swaps_linears_and_keeps_lm_head(tiny_compressed):
    dense, model, recipe, x = tiny_compressed
    swapped = [n for n, m in model.named_modules() if isinstance(m, CompressedLinear)]
    assert len(swapped) == 14 and len(recipe.layers) == 14
    assert isinstance(model.lm_head, torch.nn.Linear)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert abs(recipe.summary()["density"] - 0.4) < 0.05
    with torch.no_grad():
        ref, out = dense(x).logits, model(x).logits
    assert torch.isfinite(out).all()
    assert not torch.equal(ref, out)
    # the compressed model stays a usable LM: logits correlate strongly with the dense model's
    corr = torch.corrcoef(torch.stack([ref.flatten(), out.flatten()]))[0, 1]
    assert corr > 0.5


def test_compressed_forward_equals_densified(tiny_compressed):
    _, model, _, x = tiny_compressed
    dens = copy.deepcopy(model)
    assert densify_(dens) == 14
    with torch.no_grad():
        a, b = model(x).logits, dens(x).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_packed_view_is_stable_until_buffers_change(tiny_compressed):
    """The kernel binds its launcher to the packed object: one object per set of buffers."""
    _, model, _, _ = tiny_compressed
    layer = next(m for m in model.modules() if isinstance(m, CompressedLinear))
    first = layer.packed
    assert layer.packed is first and first.qweight is layer.qweight
    clone = copy.deepcopy(layer)  # new buffers -> a new packed view over them
    assert clone.packed is not first and clone.packed.qweight is clone.qweight
    layer._apply(lambda t: t.clone())  # what .to()/.cuda() do: replace every buffer
    assert layer.packed is not first and layer.packed.qweight is layer.qweight
    assert torch.equal(layer.packed.qweight, first.qweight)


def test_save_load_round_trip(tiny_compressed, saved):
    _, model, recipe, x = tiny_compressed
    loaded, tok = load_compressed(saved)
    assert tok.eos_token_id is not None
    for name, m in model.named_modules():
        if isinstance(m, CompressedLinear):
            lm = loaded.get_submodule(name)
            assert isinstance(lm, CompressedLinear) and lm.pattern is m.pattern
            for k in CompressedLinear.PACKED_KEYS:
                assert torch.equal(getattr(lm, k), getattr(m, k)), (name, k)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert torch.allclose(loaded(x).logits, model(x).logits, atol=1e-5, rtol=1e-5)
    stored = json.loads((saved / "recipe.json").read_text())
    assert [layer["pattern"] for layer in stored["layers"]] == [layer.pattern.value for layer in recipe.layers]
    assert all(layer["shard"].startswith("packed-") for layer in stored["layers"])


def test_generation_loads_compressed_densified_on_cpu(tiny_compressed, saved):
    """Off the GPU the generators serve the compressed model dequantized once into nn.Linear: the
    same fp32 values as the per-call reference, so the same logits (tied lm_head kept)."""
    from adbatch.serving.generators import ModelSpec, load_model

    _, model, _, x = tiny_compressed
    served, _ = load_model(ModelSpec(compressed=str(saved)), "cpu")
    assert not any(isinstance(m, CompressedLinear) for m in served.modules())
    assert served.lm_head.weight.data_ptr() == served.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert torch.allclose(served(x).logits, model(x).logits, atol=1e-5, rtol=1e-5)


def _copy(saved, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(saved, d)
    return d


def test_truncated_shard_fails(saved, tmp_path):
    d = _copy(saved, tmp_path)
    shard = d / "packed-00000.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_compressed(d)


def test_edited_byte_fails(saved, tmp_path):
    d = _copy(saved, tmp_path)
    shard = d / "packed-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        load_compressed(d)


def test_edited_recipe_or_config_fails(saved, tmp_path):
    d = _copy(saved, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 256
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json.*modified"):
        load_compressed(d)


def _rewrite_dense(d, mutate):
    """Replace a dense tensor and re-sign the manifest, so only the shape check can catch it."""
    from safetensors.torch import load_file, save_file

    path = d / "dense.safetensors"
    tensors = load_file(str(path))
    mutate(tensors)
    save_file(tensors, str(path))
    man = json.loads((d / "manifest.json").read_text())
    info = man["shards"]["dense.safetensors"]
    info["sha256"] = sha256_file(path)
    info["bytes"] = path.stat().st_size
    info["tensors"] = {k: [str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in tensors.items()}
    man["outputs"]["dense.safetensors"] = info["sha256"]
    (d / "manifest.json").write_text(json.dumps(man))


def test_wrong_shape_fails(saved, tmp_path):
    d = _copy(saved, tmp_path)
    _rewrite_dense(d, lambda t: t.__setitem__("model.norm.weight", torch.ones(63)))
    with pytest.raises(CheckpointError, match="model.norm.weight has shape \\[63\\]"):
        load_compressed(d)


def test_manifest_shape_disagreement_fails(saved, tmp_path):
    d = _copy(saved, tmp_path)
    man = json.loads((d / "manifest.json").read_text())
    tensors = man["shards"]["packed-00000.safetensors"]["tensors"]
    key = next(k for k in tensors if k.endswith("group_ptr"))
    tensors[key][1] = [tensors[key][1][0] + 1]
    (d / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(CheckpointError, match=f"tensor {key} is int32"):
        load_compressed(d)


def test_missing_manifest_fails(saved, tmp_path):
    d = _copy(saved, tmp_path)
    (d / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json"):
        load_compressed(d)


def test_magnitude_without_calibration(tmp_path):
    from adbatch.compress.recipe import GroupPolicy, PatternPolicy, ScoreMethod

    model = make_tiny_llama(seed=2)
    cfg = CompressConfig(score=ScoreMethod.MAGNITUDE, pattern_policy=PatternPolicy.UNIFORM,
                         group_policy=GroupPolicy.UNIFORM)
    recipe = compress_(model, cfg)
    assert {layer.pattern.value for layer in recipe.layers} == {"2:4"}
    with pytest.raises(ValueError, match="calibration statistics"):
        compress_(make_tiny_llama(seed=2), CompressConfig())


def test_generation_config_survives_round_trip(default_tokenizer, tmp_path):
    """Instruct models stop on extra EOS ids kept only in generation_config.json (Llama-3's
    <|eot_id|>, Qwen2.5's <|endoftext|>): the compressed checkpoint must keep them."""
    model = make_tiny_llama(seed=5)
    recipe = compress_(model, CompressConfig(score="magnitude", pattern_policy="uniform", group_policy="uniform"))
    model.generation_config.eos_token_id = [2, 7]
    model.generation_config.pad_token_id = 2
    save_compressed(model, default_tokenizer, recipe, tmp_path / "ckpt")
    loaded, _ = load_compressed(tmp_path / "ckpt")
    assert loaded.generation_config.eos_token_id == [2, 7]
    assert loaded.generation_config.pad_token_id == 2


@pytest.mark.parametrize("cast", ["float", "bfloat16", "bf16_then_half"])
def test_compressed_model_survives_dtype_casts(cast):
    """model.float() / model.to(bf16) cast floating buffers; the packed fp16 scale_zero must stay as is."""
    model = make_tiny_llama(seed=6)
    compress_(model, CompressConfig(score="magnitude", pattern_policy="uniform", group_policy="uniform"))
    layer = model.model.layers[0].self_attn.q_proj
    scale_zero = layer.scale_zero.clone()
    x = torch.randint(0, 512, (1, 8))
    with torch.no_grad():
        ref = model(x).logits
    if cast == "float":
        model.float()
    elif cast == "bfloat16":
        model.to(torch.bfloat16)
    else:
        model.to(torch.bfloat16).half()
    assert layer.scale_zero.dtype == torch.float16 and torch.equal(layer.scale_zero, scale_zero)
    with torch.no_grad():
        out = model(x).logits
    assert torch.isfinite(out).all()
    if cast == "float":
        assert torch.equal(out, ref)


def test_save_needs_the_tokenizer(tiny_compressed, tmp_path):
    _, model, recipe, _ = tiny_compressed
    with pytest.raises(ValueError, match="tokenizer"):
        save_compressed(model, None, recipe, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
