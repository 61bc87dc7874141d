"""Masks learned in training survive compression: same kept positions, same N:M pattern."""

from __future__ import annotations

import pytest
import torch

from adbatch.compress import CalibrationConfig, CompressConfig, calibrate, compress_
from adbatch.compress.linear import CompressedLinear, pattern_of_mask
from conftest import make_tiny_llama
from kernels.nm_int4 import SparsityPattern, dequantize_nm_int4


def _random_nm_mask(shape: tuple[int, int], n: int, gen: torch.Generator) -> torch.Tensor:
    """bool [N, K] keeping n random positions in every group of 4 columns."""
    rows, cols = shape
    ranks = torch.rand(rows, cols // 4, 4, generator=gen).argsort(-1).argsort(-1)
    return (ranks < n).reshape(rows, cols)


def test_training_masks_are_kept_exactly():
    model = make_tiny_llama(seed=3)
    gen = torch.Generator().manual_seed(3)
    names = ["model.layers.0.mlp.up_proj", "model.layers.1.self_attn.q_proj"]
    masks = {
        names[0]: _random_nm_mask(tuple(model.get_submodule(names[0]).weight.shape), 1, gen),
        names[1]: _random_nm_mask(tuple(model.get_submodule(names[1]).weight.shape), 2, gen),
    }
    blocks = torch.randint(0, 512, (4, 16), generator=gen)
    stats = calibrate(model, blocks, CalibrationConfig(batch_size=4))
    recipe = compress_(model, CompressConfig(pattern_policy="layer_adaptive", target_density=0.5, dense_dtype="float32"), stats, masks=masks)
    patterns = {layer.name: layer.pattern for layer in recipe.layers}
    assert patterns[names[0]] is SparsityPattern.ONE_FOUR
    assert patterns[names[1]] is SparsityPattern.TWO_FOUR
    for name, mask in masks.items():
        module = model.get_submodule(name)
        assert isinstance(module, CompressedLinear)
        dense = dequantize_nm_int4(module.packed)
        # nothing outside the mask survives; the kept positions are exactly the mask's
        assert torch.all(dense[~mask] == 0)
        assert torch.equal(dense != 0, mask & (dense != 0))
        assert (dense[mask] != 0).float().mean() > 0.9  # INT4 can round a few kept values to 0


def test_bad_masks_are_refused():
    model = make_tiny_llama(seed=4)
    name = "model.layers.0.mlp.up_proj"
    w = model.get_submodule(name).weight
    uneven = torch.zeros_like(w, dtype=torch.bool)
    uneven[:, 0] = True
    uneven[0, 1] = True  # one group keeps 2, the others 1
    with pytest.raises(ValueError, match="not N:4"):
        pattern_of_mask(name, uneven)
    with pytest.raises(ValueError, match="shape"):
        compress_(model, CompressConfig(score="magnitude", pattern_policy="uniform", group_policy="uniform"),
                  masks={name: torch.ones(3, 4, dtype=torch.bool)})
    with pytest.raises(ValueError, match="does not compress"):
        compress_(make_tiny_llama(seed=4), CompressConfig(score="magnitude", pattern_policy="uniform",
                                                           group_policy="uniform"),
                  masks={"lm_head": torch.ones_like(model.lm_head.weight, dtype=torch.bool)})


@pytest.mark.parametrize("policy", ["layer_adaptive", "interleaved"])
def test_training_masks_count_against_target_density(policy):
    """Layers whose N:M mask comes from training take part in the density budget at their mask's
    pattern: the other layers are allocated so that the whole model still meets target_density."""
    gen = torch.Generator().manual_seed(3)
    model = make_tiny_llama(seed=3, layers=4)
    masks = {n: _random_nm_mask(tuple(m.weight.shape), 2, gen) for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and ".mlp." in n}  # every MLP projection trained 2:4
    stats = calibrate(model, torch.randint(0, 512, (4, 16), generator=gen), CalibrationConfig(batch_size=4))
    recipe = compress_(model, CompressConfig(pattern_policy=policy, target_density=0.45), stats, masks=masks)
    assert all(recipe.layer(n).pattern is SparsityPattern.TWO_FOUR for n in masks)
    assert recipe.summary()["density"] <= 0.45 + 1e-9
