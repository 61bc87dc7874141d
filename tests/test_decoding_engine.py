"""The decode engine's own forward over its static cache == HF's plain forward, per decoder family."""

from __future__ import annotations

import pytest
import torch

from adbatch.decoding.engine import DecodeEngine, check_supported, engine_for
from conftest import make_tiny_llama
from kernels import fused_ops

# fused=True runs the CUDA path's Triton kernels (kernels/fused_ops.py) on CPU under the interpreter
FUSED = [False, pytest.param(True, marks=pytest.mark.skipif(
    type(fused_ops._row_lse_kernel).__name__ != "InterpretedFunction", reason="needs TRITON_INTERPRET=1"))]


def _tiny(family: str):
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if family == "llama":
        return make_tiny_llama(vocab_size=64, heads=4, kv_heads=2)
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common)).eval()  # q/k/v biases
    if family == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16)).eval()  # q/k norms
    # Gemma 3: sandwich norms, q/k norms, scaled embeddings; a 4-token window on the first layer so
    # the prompts below reach past it
    cfg = Gemma3TextConfig(**common, head_dim=16, sliding_window=4,
                           layer_types=["sliding_attention", "full_attention"])
    return Gemma3ForCausalLM(cfg).eval()


def _ref_logprobs(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([seq])).logits[0, -1].float(), -1)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_prefill_steps_and_reorder_match_hf(family, fused):
    model = _tiny(family)
    engine = DecodeEngine(model, fused=fused)
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10], [11, 12, 13]]
    B = 2
    with torch.no_grad():
        logits, lse, Qb = engine.prefill(prompts, B, 8)
        for q, p in enumerate(prompts):
            got = logits[q].float() - lse[q]
            assert torch.allclose(got, _ref_logprobs(model, p), atol=2e-5)
        first = [20, 21]
        tokens = torch.tensor(first * Qb)
        engine.step(tokens, 0, Qb, torch.arange(Qb * B) // B * B)
        # second step: the two beams of each query swap their prefixes (reorder by parent rows)
        parent = torch.tensor([q * B + (1 - b) for q in range(Qb) for b in range(B)])
        logits, lse = engine.step(torch.tensor([30, 31] * Qb), 1, Qb, parent)
    for q, p in enumerate(prompts):
        for b in range(B):
            row = q * B + b
            got = logits[row].float() - lse[row]
            want = _ref_logprobs(model, p + [first[1 - b], 30 + b])
            assert torch.allclose(got, want, atol=2e-5), (family, q, b)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_short_prefill_after_a_long_one_runs_at_its_own_width(family, fused):
    """The reserved prompt region grows to the widest prompt seen (40 tokens -> 48 columns); a later batch of
    short prompts is prefilled over its own 16 columns, the stale columns left of them masked: its prefill, steps
    and tree pass still match HF (Gemma 3: through a sliding window)."""
    model = _tiny(family)
    engine = DecodeEngine(model, fused=fused)
    short = [[3, 4, 5, 6, 7], [9, 10]]
    with torch.no_grad():
        engine.prefill([list(range(3, 43))], 2, 8)  # the long prompt leaves finite K/V in every column
        widths = []
        real_body = engine._prefill_body
        engine._prefill_body = lambda Qb, Lw, pad_id: widths.append(Lw) or real_body(Qb, Lw, pad_id)
        logits, lse, Qb = engine.prefill(short, 2, 8)
        assert engine.Lp == 48 and widths == [16]
        for q, p in enumerate(short):
            assert torch.allclose(logits[q].float() - lse[q], _ref_logprobs(model, p), atol=2e-5)
        logits, lse = engine.step(torch.tensor([20, 21] * Qb), 0, Qb, torch.arange(Qb * 2) // 2 * 2)
        tree_l, tree_lse = engine.tree_forward(torch.tensor([0]), 1, torch.tensor([[30]]), torch.tensor([[6]]),
                                               torch.ones(1, 1, 1, dtype=torch.bool))
    for q, p in enumerate(short):
        for b, tok in enumerate((20, 21)):
            row = q * 2 + b
            assert torch.allclose(logits[row].float() - lse[row], _ref_logprobs(model, p + [tok]), atol=2e-5)
    assert torch.allclose(tree_l[0].float() - tree_lse[0], _ref_logprobs(model, short[0] + [20, 30]), atol=2e-5)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_tree_forward_sees_prompt_suffix_and_ancestors_only(family, fused):
    model = _tiny(family)  # Gemma 3: the sliding window applies inside the tree pass too
    engine = DecodeEngine(model, fused=fused)
    prompt = [3, 4, 5, 6, 7]
    with torch.no_grad():
        engine.prefill([prompt], 1, 8)
        engine.step(torch.tensor([20]), 0, 1, torch.tensor([0]))
        # tree below the beam: tokens 30 -> {31, 32} fed as [30, 31, 32] (31 and 32 siblings)
        tokens = torch.tensor([[30, 31, 32]])
        pos = torch.tensor([[6, 7, 7]])
        vis = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
        logits, lse = engine.tree_forward(torch.tensor([0]), 1, tokens, pos, vis)
    lp = logits.float() - lse[:, None]
    assert torch.allclose(lp[0], _ref_logprobs(model, prompt + [20, 30]), atol=2e-5)
    assert torch.allclose(lp[1], _ref_logprobs(model, prompt + [20, 30, 31]), atol=2e-5)
    assert torch.allclose(lp[2], _ref_logprobs(model, prompt + [20, 30, 32]), atol=2e-5)
    # the graph-safe form (CUDA): t on the device, every reserved suffix position gathered and
    # those at or past t masked, must score the same
    with torch.no_grad():
        g_logits, g_lse = engine._tree_body(torch.tensor([0]), torch.tensor([1]), tokens, pos, vis)
    assert torch.allclose(g_logits.float() - g_lse[:, None], lp, atol=2e-5)


def test_engine_is_rebuilt_when_weights_change():
    model = make_tiny_llama(vocab_size=64)
    first = engine_for(model)
    assert engine_for(model) is first          # kept across calls: buffers, graphs, fused weights
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(0.5)   # an in-place update (training)
    second = engine_for(model)
    assert second is not first
    prompt = [3, 4, 5]
    with torch.no_grad():
        logits, lse, _ = second.prefill([prompt], 1, 4)
    assert torch.allclose(logits[0].float() - lse[0], _ref_logprobs(model, prompt), atol=2e-5)


def test_engine_is_rebuilt_when_a_module_or_parameter_is_replaced():
    """The signature is read from every module's own dicts (not ``parameters()``): a swapped submodule, a
    reassigned parameter and a layer removed from its ModuleList (whose ``__delitem__`` rebuilds ``_modules``
    without a registration hook) each give a new engine."""
    model = make_tiny_llama(vocab_size=64, layers=3)
    eng = engine_for(model)
    mlp = model.model.layers[0].mlp
    mlp.down_proj = torch.nn.Linear(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False)
    assert engine_for(model) is not eng
    eng = engine_for(model)
    attn = model.model.layers[1].self_attn
    attn.o_proj.weight = torch.nn.Parameter(attn.o_proj.weight.detach().clone())
    assert engine_for(model) is not eng
    eng = engine_for(model)
    del model.model.layers[2]
    assert engine_for(model) is not eng


def test_eval_mode_restores_exactly_the_modules_that_were_training():
    from adbatch.models import eval_mode, submodules

    model = make_tiny_llama()
    assert [id(m) for m in submodules(model)] == [id(m) for m in model.modules()]
    model.train()
    frozen = model.model.layers[0]
    frozen.eval()  # its owner froze it: eval_mode must not turn it back to training after
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert model.training and model.model.layers[1].training
    assert not any(m.training for m in frozen.modules())
    with pytest.raises(KeyError):
        with eval_mode(model):
            raise KeyError("restored on an error too")
    assert model.training and not frozen.training


def test_serving_engine_is_engine_for_with_the_model_in_eval_inside():
    """One walk of the module tree serves the signature and eval mode: the block's engine is engine_for's (kept
    across calls, new after a weight change) and the model is in eval inside it, training again after."""
    from adbatch.decoding.engine import serving_engine

    model = make_tiny_llama(vocab_size=64)
    model.train()
    with serving_engine(model) as eng:
        assert not any(m.training for m in model.modules())
        assert engine_for(model) is eng
    assert all(m.training for m in model.modules())
    with serving_engine(model) as again:
        assert again is eng
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    with serving_engine(model) as changed:
        assert changed is not eng


def test_a_deleted_model_takes_its_engine_with_it():
    """Engines are kept per model weakly: once the caller drops the model, its engine (cache, graphs, copies)
    is freed too. An engine that held its model kept both alive (two trained models' engines filled an H100)."""
    import gc
    import weakref

    model = make_tiny_llama()
    eng = weakref.ref(engine_for(model))
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None and eng() is None


def test_unsupported_family_is_refused_by_name():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)).eval()
    with pytest.raises(ValueError, match="gpt2.*not supported"):
        check_supported(model)


def _two_steps(engine):
    """Log-probs after a prefill of two prompts (2 beams) and two steps, the second with reordered parents."""
    with torch.no_grad():
        _, _, Qb = engine.prefill([[3, 4, 5, 6], [7, 8]], 2, 4)
        engine.step(torch.tensor([20, 21] * Qb), 0, Qb)
        logits, lse = engine.step(torch.tensor([30, 31] * Qb), 1, Qb, torch.tensor([1, 0, 3, 2]))
    return logits.float() - lse[:, None]


def test_compressed_layers_routed_dense_run_fused_copies_with_the_same_results():
    """A plan that routes every compressed unit to its dense copy: q/k/v and gate/up are one unit each
    (one GEMM of one concatenated copy), and the step's log-probs equal the packed path's."""
    from adbatch.compress import CompressConfig, compress_
    from adbatch.decoding.linear_plan import LinearChoice

    model = make_tiny_llama(vocab_size=64, heads=4, kv_heads=2)
    compress_(model, CompressConfig(score="magnitude", pattern_policy="uniform", group_policy="uniform",
                                    dense_dtype="float32"))

    packed = DecodeEngine(model)
    assert packed.linears.packed_modules and not packed.linears.fused  # nothing dense to fuse up front
    n_layers = model.config.num_hidden_layers
    assert len(packed.linears.units) == 4 * n_layers  # q/k/v, o, gate/up, down per layer
    want = _two_steps(packed)
    routed = DecodeEngine(model)
    for key in routed.plan_keys(4):
        routed.plan.choice[key] = "dense"
    routed.linears.route_bucket(4)
    attn = model.model.layers[0].self_attn
    choice, qkv = routed.linears.route[id(attn.q_proj)]
    assert choice is LinearChoice.DENSE and qkv.shape[0] == sum(m.out_features for m in (attn.q_proj, attn.k_proj,
                                                                                        attn.v_proj))
    assert id(attn.k_proj) not in routed.linears.route  # a member of the q/k/v unit, not a unit of its own
    torch.testing.assert_close(_two_steps(routed), want, atol=1e-4, rtol=1e-4)


def test_packed_plan_runs_each_qkv_and_gate_up_unit_as_one_stacked_launch(monkeypatch):
    """A plan that serves every unit packed: q/k/v and gate/up each run one launch over their members' packed
    weights stacked (not one per member), o/down their own; the step's log-probs equal the members' path."""
    from adbatch.compress import CompressConfig, compress_
    from adbatch.decoding.linear_plan import LinearChoice
    from kernels.nm_int4 import PackedNMInt4

    model = make_tiny_llama(vocab_size=64, heads=4, kv_heads=2)
    compress_(model, CompressConfig(score="magnitude", pattern_policy="uniform", uniform_pattern="2:4",
                                    group_policy="uniform", dense_dtype="float32"))
    want = _two_steps(DecodeEngine(model))  # CPU, no plan: every member's own forward
    routed = DecodeEngine(model)
    for key in routed.plan_keys(4):
        routed.plan.choice[key] = "packed"
    routed.linears.route_bucket(4)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    choice, qkv = routed.linears.route[id(attn.q_proj)]
    assert choice is LinearChoice.PACKED and isinstance(qkv, PackedNMInt4)
    assert qkv.out_features == attn.q_proj.out_features + attn.k_proj.out_features + attn.v_proj.out_features
    assert routed.linears.route[id(mlp.gate_proj)][1].out_features == 2 * mlp.gate_proj.out_features
    assert routed.linears.route[id(attn.o_proj)] == (LinearChoice.PACKED, None)  # a unit of one: its own weight
    member_calls = []
    for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
        monkeypatch.setattr(m, "forward", lambda *a, **k: member_calls.append(1))
    torch.testing.assert_close(_two_steps(routed), want, atol=1e-5, rtol=1e-5)
    assert not member_calls


def test_sparse_plan_routes_2to4_layers_through_their_semi_structured_copies(monkeypatch):
    """A plan that serves the 2:4 units from semi-structured copies (the large-bucket path) runs
    ``F.linear`` on the copy, not the packed kernel or the dense copy, with the packed path's results.
    On a CPU torch has no semi-structured tensors: a dense stand-in for the copy checks the routing,
    and without the stand-in such a plan is refused by name."""
    import adbatch.decoding.linear_plan as plan_mod
    from adbatch.compress import CompressConfig, compress_
    from adbatch.decoding.linear_plan import SPARSE_MIN_ROWS, LinearChoice

    model = make_tiny_llama(vocab_size=64, heads=4, kv_heads=2)
    compress_(model, CompressConfig(score="magnitude", pattern_policy="uniform", uniform_pattern="2:4",
                                    group_policy="uniform", dense_dtype="float32"))

    want = _two_steps(DecodeEngine(model))
    copies = []
    monkeypatch.setattr(plan_mod, "semi_structured_copy", lambda w: copies.append(w) or w.clone())
    routed = DecodeEngine(model)
    assert all(u.sparse for u in routed.linears.units)
    for key in routed.plan_keys(4):
        routed.plan.choice[key] = "sparse"
    routed.linears.route_bucket(4)
    assert {c for c, _ in routed.linears.route.values()} == {LinearChoice.SPARSE}
    assert len(copies) == len(routed.linears.units) == len(routed.linears.route)
    packed_calls = []
    for m in routed.linears.packed_modules:
        monkeypatch.setattr(m, "forward", lambda *a, **k: packed_calls.append(1))
    torch.testing.assert_close(_two_steps(routed), want, atol=1e-4, rtol=1e-4)
    assert not packed_calls
    monkeypatch.undo()
    refused = DecodeEngine(model)
    refused.linears.copies.clear()  # the model's engines share copies: drop the stand-ins the first one built
    for key in refused.plan_keys(8):
        refused.plan.choice[key] = "sparse"
    with pytest.raises(RuntimeError, match="sparse copy"):
        refused.linears.route_bucket(8)
    assert SPARSE_MIN_ROWS >= 256  # cuSPARSELt lost to cuBLAS at 256 rows on the H200 (0.37x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_prefill_equals_eager_on_cuda():
    """The graph-replayed prefill (captured at a bucket's first use) writes the prompt region and
    returns the logits an eager prefill does, for other prompts of other lengths in the same bucket."""
    model = make_tiny_llama(vocab_size=64, heads=4, kv_heads=2).cuda().eval()
    first = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    second = [[12, 13], [14, 15, 16, 17, 18], [19]]
    graphed = DecodeEngine(model)
    eager = DecodeEngine(model)
    eager.graphs_enabled = False
    graphed.prefill(first, 2, 4)                     # eager run + capture
    logits, lse, qb = graphed.prefill(second, 2, 4)  # replay
    assert any(k[0] == "prefill" for k in graphed._graphs)
    ref_logits, ref_lse, ref_qb = eager.prefill(second, 2, 4)
    assert (qb, ref_qb) == (4, 3)  # graphs run at power-of-two buckets, eager at the exact count
    torch.testing.assert_close(logits[:3], ref_logits)
    torch.testing.assert_close(lse[:3], ref_lse)
    assert torch.equal(graphed.prompt_len[:3], eager.prompt_len[:3])
    assert torch.equal(graphed.prompt_bias[:3], eager.prompt_bias[:3])
    for li in range(len(graphed.kp)):
        torch.testing.assert_close(graphed.kp[li][:3], eager.kp[li][:3])


def test_an_engine_built_in_inference_mode_serves_a_later_no_grad_caller():
    """The ranker decodes under ``torch.inference_mode`` (its buffers are inference tensors); a later caller of the
    same, unchanged model under plain ``no_grad`` (e.g. the rank loss's mining) gets an engine it may write into,
    with the same answers, instead of "Inplace update to inference tensor outside InferenceMode"."""
    model = make_tiny_llama()
    with torch.inference_mode():
        want = _two_steps(engine_for(model)).clone()
    got = _two_steps(engine_for(model))
    torch.testing.assert_close(got, want)
    assert not engine_for(model).inference_tensors
    with torch.inference_mode():  # and back: an engine of normal tensors serves inference mode as it is
        same = engine_for(model)
        torch.testing.assert_close(_two_steps(same), want)
    assert engine_for(model) is same
