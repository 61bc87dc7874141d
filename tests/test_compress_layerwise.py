"""Layer-by-layer calibration gives the full path's statistics and therefore the same compression."""

from __future__ import annotations

import copy

import pytest
import torch

from adbatch.compress import CalibrationConfig, CompressConfig, calibrate, compress_
from adbatch.compress import calibration as calib_mod
from adbatch.compress.linear import SequentialExecutor
from conftest import assert_same_packed, make_tiny_llama


def _tiny_qwen2(seed: int = 0):
    """Qwen2 with q/k/v biases and mixed full / sliding-window layers (per-block attention masks)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      use_sliding_window=True, sliding_window=8, max_window_layers=1,
                      tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).eval()


def _tiny_gemma(seed: int = 0):
    """Gemma: embeddings scaled by sqrt(hidden) before the first block, tied lm_head."""
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(seed)
    cfg = GemmaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=512)
    return GemmaForCausalLM(cfg).eval()


MODELS = {
    "llama_tied": (lambda: make_tiny_llama(seed=1, layers=3), ("lm_head",)),
    # untied lm_head compressed too: its statistics come from the head pass
    "llama_untied_lm_head": (lambda: _untied_llama(), ()),
    "qwen2_sliding": (_tiny_qwen2, ("lm_head",)),
    "gemma": (_tiny_gemma, ("lm_head",)),
}


def _untied_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def _blocks(seed: int = 0, rows: int = 7, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, 512, (rows, seq), generator=torch.Generator().manual_seed(seed))


def _assert_same_stats(a, b) -> None:
    assert sorted(a.layers) == sorted(b.layers)
    for name, x in a.layers.items():
        y = b.layers[name]
        assert x.num_tokens == y.num_tokens, name
        for field in ("act_sq", "grad_sq", "out_grad_sq"):
            tx, ty = getattr(x, field), getattr(y, field)
            if tx is None:
                assert ty is None, (name, field)
                continue
            assert ty.device.type == "cpu" and ty.dtype == torch.float32
            torch.testing.assert_close(ty, tx, rtol=1e-5, atol=1e-6 * float(tx.abs().max()), msg=f"{name}.{field}")


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_layerwise_statistics_equal_full(arch):
    build, skip = MODELS[arch]
    model = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    blocks = _blocks()
    # batch_size 3 over 7 rows: the last batch is shorter (its own captured mask / rotary tensors)
    full = calibrate(model, blocks, CalibrationConfig(batch_size=3, mode="full"), skip)
    layer = calibrate(model, blocks, CalibrationConfig(batch_size=3, mode="layerwise"), skip)
    assert full.info["mode"] == "full" and layer.info["mode"] == "layerwise"
    assert layer.info["path"] == "layerwise_forward_backward" and layer.info["peak_rss_mb"] > 0
    if not skip:
        assert "lm_head" in layer.layers
    _assert_same_stats(full, layer)
    # the model is handed back untouched: same values, device, flags, no grads, ties intact
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]) and v.device.type == "cpu", k
    for n, p in model.named_parameters():
        assert p.requires_grad == flags[n] and p.grad is None, n
    if model.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_layerwise_forward_only_statistics_equal_full():
    model = make_tiny_llama(seed=5, layers=2)
    blocks = _blocks(seed=5)
    cfg = dict(batch_size=4, use_gradients=False)
    full = calibrate(model, blocks, CalibrationConfig(mode="full", **cfg))
    layer = calibrate(model, blocks, CalibrationConfig(mode="layerwise", **cfg))
    assert layer.info["path"] == "layerwise_forward"
    _assert_same_stats(full, layer)
    assert all(st.grad_sq is None for st in layer.layers.values())


@pytest.mark.parametrize("config", [
    CompressConfig(pattern_policy="layer_adaptive"),  # paper score, layer-adaptive patterns, adaptive groups
    CompressConfig(pattern_policy="uniform", group_policy="uniform", score="wanda"),
])
def test_layerwise_and_full_compress_identically(config):
    model = make_tiny_llama(seed=3, hidden=128, intermediate=256, layers=2)
    blocks = _blocks(seed=3, rows=8, seq=32)
    full = calibrate(model, blocks, CalibrationConfig(batch_size=4, mode="full"))
    layer = calibrate(model, blocks, CalibrationConfig(batch_size=4, mode="layerwise"))
    m_full, m_layer = copy.deepcopy(model), copy.deepcopy(model)
    r_full = compress_(m_full, config, full)
    r_layer = compress_(m_layer, config, layer)
    assert [x.pattern for x in r_full.layers] == [x.pattern for x in r_layer.layers]
    assert [x.group_size_counts for x in r_full.layers] == [x.group_size_counts for x in r_layer.layers]
    assert assert_same_packed(m_full, m_layer) == 14


def test_executor_with_device_matches_plain_loop():
    """``SequentialExecutor(device=...)`` moves layers there and results back; on CPU it must give
    the plain loop's bytes (the same math, only the .to() round trips added)."""
    model = make_tiny_llama(seed=6, hidden=128, intermediate=256)
    stats = calibrate(model, _blocks(seed=6, rows=4, seq=32), CalibrationConfig(batch_size=2))
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    cfg = CompressConfig(pattern_policy="layer_adaptive")
    ra = compress_(a, cfg, stats)
    rb = compress_(b, cfg, stats, executor=SequentialExecutor(device="cpu"))
    assert [x.to_dict() for x in ra.layers] == [x.to_dict() for x in rb.layers]
    assert_same_packed(a, b)


def test_auto_mode_follows_the_documented_rule(monkeypatch):
    model = make_tiny_llama(seed=7, layers=2)
    blocks = _blocks(seed=7, rows=4, seq=16)
    cfg = CalibrationConfig(batch_size=2, mode="auto", auto_memory_fraction=0.5)
    linears = calib_mod.compressible_linears(model)
    need = calib_mod.full_path_bytes(model, linears, 2 * 16, True, torch.device("cpu"))
    # model already on the device: parameters do not count, grads + statistics + activations do
    w_bytes = sum(m.weight.numel() * 4 for m in linears.values())
    assert need > 2 * w_bytes  # fp32 weight grads + fp32 grad_sq + activations
    # exactly at the limit -> full; one byte less free memory -> layerwise
    monkeypatch.setattr(calib_mod, "free_memory_bytes", lambda device: 2 * need)
    stats = calibrate(model, blocks, cfg)
    assert stats.info["mode"] == "full" and stats.info["mode_reason"].startswith("auto:")
    monkeypatch.setattr(calib_mod, "free_memory_bytes", lambda device: 2 * need - 2)
    assert calibrate(model, blocks, cfg).info["mode"] == "layerwise"
    # an explicit mode is never overridden
    assert calibrate(model, blocks, cfg.replace(mode="full")).info["mode_reason"] == "configured"


def test_full_path_bytes_counts_parameters_only_when_the_model_is_elsewhere():
    model = make_tiny_llama(seed=8, layers=2)
    linears = calib_mod.compressible_linears(model)
    here = calib_mod.full_path_bytes(model, linears, 64, True, torch.device("cpu"))
    away = calib_mod.full_path_bytes(model, linears, 64, True, torch.device("meta"))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert away - here == params
    no_grad = calib_mod.full_path_bytes(model, linears, 64, False, torch.device("cpu"))
    grad_and_stats = sum(m.weight.numel() * (4 + 4) + 4 * m.out_features for m in linears.values())
    assert here - no_grad == grad_and_stats


def test_config_rejects_bad_values():
    from adbatch.config import ConfigError

    with pytest.raises(ConfigError, match="auto_memory_fraction"):
        CalibrationConfig(auto_memory_fraction=0.0)
    with pytest.raises(ConfigError, match="device"):
        CalibrationConfig(device="not-a-device")
    with pytest.raises(ConfigError):
        CalibrationConfig(mode="sometimes")


class _ToyBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, h, scale):
        return h + scale * self.down(torch.tanh(self.up(h)))


class _ToyLM(torch.nn.Module):
    """Not a transformers model: blocks found as the largest ModuleList, a keyword argument per call."""

    def __init__(self, pre_linear: bool) -> None:
        super().__init__()
        torch.manual_seed(9)
        self.emb = torch.nn.Embedding(64, 16)
        self.pre = torch.nn.Linear(16, 16) if pre_linear else None
        self.layers = torch.nn.ModuleList(_ToyBlock() for _ in range(3))
        self.head = torch.nn.Linear(16, 64)

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids, labels=None, use_cache=None):
        from types import SimpleNamespace

        h = self.emb(input_ids)
        if self.pre is not None:
            h = self.pre(h)
        for block in self.layers:
            h = block(h, scale=0.5)
        logits = self.head(h)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits)


def test_layerwise_generic_module_and_head_linear():
    model = _ToyLM(pre_linear=False)
    blocks = torch.randint(0, 64, (5, 12), generator=torch.Generator().manual_seed(9))
    full = calibrate(model, blocks, CalibrationConfig(batch_size=2, mode="full"), skip=())
    layer = calibrate(model, blocks, CalibrationConfig(batch_size=2, mode="layerwise"), skip=())
    assert "head" in layer.layers and len(layer.layers) == 7
    _assert_same_stats(full, layer)


def test_layerwise_refuses_linears_before_the_blocks():
    model = _ToyLM(pre_linear=True)
    blocks = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(9))
    with pytest.raises(ValueError, match="before the decoder blocks"):
        calibrate(model, blocks, CalibrationConfig(batch_size=2, mode="layerwise"), skip=())
    assert all(p.grad is None and p.device.type == "cpu" for p in model.parameters())
