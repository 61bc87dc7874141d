"""The per-bucket linear plan saved per device (no timing inside the work), the warm-up that routes a run's buckets
before it, and a compressed model served by its bf16 copies making the dense model's calls."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
import torch.nn.functional as F

import adbatch.decoding.linear_plan as plan_mod
import kernels.int4_tuner as tuner
from adbatch.decoding.config import LinearFormats
from adbatch.decoding.engine import DecodeEngine, warm_up_search
from adbatch.decoding.linear_plan import LinearChoice, LinearPlanner, plan_identity, plan_path
from conftest import make_tiny_llama
from kernels.nm_int4 import dequantize_nm_int4

GPU_NAME = "NVIDIA H200"


def _compressed_tiny(pattern: str = "2:4"):
    from adbatch.compress import CompressConfig, compress_

    model = make_tiny_llama(vocab_size=64, heads=4, kv_heads=2)
    compress_(model, CompressConfig(score="magnitude", pattern_policy="uniform", uniform_pattern=pattern,
                                    group_policy="uniform", dense_dtype="float32"))
    return model


def _groups(model) -> list[tuple]:
    return [g for layer in model.model.layers
            for g in ((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                      (layer.mlp.gate_proj, layer.mlp.up_proj))]


@pytest.fixture
def gpu_planner(tmp_path, monkeypatch):
    """``make(model, formats, name)``: a planner that takes itself for one on a GPU named ``name`` (CUDA device,
    the model's tensors on the CPU: a plan it has routes without touching the device), its plan saved under
    ``tmp_path``; ``time_unit`` fakes a measurement (bf16 fastest) and counts its calls in ``make.timed``."""
    monkeypatch.setenv("ADBATCH_CACHE", str(tmp_path))
    name = {"device": GPU_NAME}
    monkeypatch.setattr(tuner, "cuda_device_name", lambda device: name["device"])

    def fake_time_unit(self, unit, key, rows):
        make.timed.append(key)
        self.plan.timings[key] = {LinearChoice.PACKED: 2.0 + rows, LinearChoice.DENSE: 1.0 + rows}
        self.plan.errors[key] = {}
        self.plan.choice[key] = LinearChoice.DENSE

    monkeypatch.setattr(LinearPlanner, "time_unit", fake_time_unit)

    def make(model, formats=LinearFormats.INT4, device_name=GPU_NAME):
        name["device"] = device_name
        return LinearPlanner(model, _groups(model), formats, torch.device("cuda"), torch.float32)

    make.timed = []
    return make


def _no_timing(monkeypatch):
    def refuse(self, unit, key, rows):
        raise AssertionError(f"timed {key}: the saved plan should have served it")

    monkeypatch.setattr(LinearPlanner, "time_unit", refuse)


def _identity(formats=LinearFormats.INT4, device_name=GPU_NAME):
    return {**plan_identity(torch.device("cuda"), formats, torch.float32), "device": device_name}


def test_a_saved_plan_round_trips_and_routes_without_timing(gpu_planner, monkeypatch):
    model = _compressed_tiny()
    first = gpu_planner(model)
    assert not first.plan.choice and not first.plan_file.exists()
    first.route_bucket(8)
    shapes = {u.key for u in first.units}
    assert sorted(gpu_planner.timed) == sorted(k + (8,) for k in shapes)  # once per unit shape, not per layer
    saved = json.loads(first.plan_file.read_text())
    assert saved["identity"] == plan_identity(torch.device("cuda"), LinearFormats.INT4, torch.float32)
    assert saved["identity"]["device"] == GPU_NAME and saved["identity"]["dtype"] == "float32"

    _no_timing(monkeypatch)
    second = gpu_planner(model)  # another process (an actor) on the same device: reads the plan when built
    assert second.plan_file == first.plan_file
    assert second.plan.choice == first.plan.choice and second.plan.timings == first.plan.timings
    assert second.plan.errors == first.plan.errors
    second.route_bucket(8)
    assert len(second.route) == len(second.units)
    assert {choice for choice, _ in second.route.values()} == {LinearChoice.DENSE}
    with pytest.raises(AssertionError, match="timed"):  # a bucket nobody planned is timed
        second.route_bucket(16)


def test_saving_keeps_other_models_shapes_and_reads_only_this_models(gpu_planner):
    model = _compressed_tiny()
    identity = _identity()
    other = {"n": 4096, "k": 4096, "pattern": "2:4", "rows": 8, "choice": "sparse", "timings_us": {"sparse": 1.0},
             "errors": {}}
    path = plan_path(identity)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"identity": identity, "entries": [other]}))
    planner = gpu_planner(model)
    assert not planner.plan.choice  # another model's unit shape: not this model's plan
    planner.route_bucket(8)
    entries = json.loads(path.read_text())["entries"]
    assert other in entries and len(entries) == 1 + len({u.key for u in planner.units})


@pytest.mark.parametrize("other", [dict(device_name="NVIDIA H100 80GB HBM3"), dict(formats=LinearFormats.FP8)])
def test_a_plan_saved_for_another_device_or_formats_is_not_read(gpu_planner, other):
    model = _compressed_tiny()
    gpu_planner(model).route_bucket(8)
    assert gpu_planner.timed
    gpu_planner.timed.clear()
    planner = gpu_planner(model, **other)
    assert not planner.plan.choice
    planner.route_bucket(8)
    assert gpu_planner.timed  # planned again, into its own file
    assert planner.plan_file != plan_path(_identity())


def test_a_file_whose_identity_differs_from_its_name_is_ignored_with_a_log_line(gpu_planner, caplog):
    model = _compressed_tiny()
    planner = gpu_planner(model)
    planner.route_bucket(8)
    raw = json.loads(planner.plan_file.read_text())
    raw["identity"]["torch"] = "0.0"
    planner.plan_file.write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING, logger=plan_mod.__name__):
        assert not gpu_planner(model).plan.choice
    assert "ignoring the linear plan" in caplog.text


@pytest.mark.parametrize("text", ["{not json", '{"entries": []}', "[]",
                                  '{"identity": IDENTITY, "entries": [{"n": 8, "choice": "dense"}]}',
                                  '{"identity": IDENTITY, "entries": [{"n": 8, "k": 8, "pattern": "2:4", "rows": 8, '
                                  '"choice": "warp-drive", "timings_us": {}, "errors": {}}]}'])
def test_a_corrupt_saved_plan_is_ignored_with_a_log_line_and_replaced(gpu_planner, caplog, text):
    model = _compressed_tiny()
    identity = _identity()
    path = plan_path(identity)
    path.parent.mkdir(parents=True)
    path.write_text(text.replace("IDENTITY", json.dumps(identity)))
    with caplog.at_level(logging.WARNING, logger=plan_mod.__name__):
        planner = gpu_planner(model)
    assert not planner.plan.choice
    assert "ignoring unreadable linear plan" in caplog.text and str(path) in caplog.text
    planner.route_bucket(8)  # planned again; the save replaces the unreadable file
    assert json.loads(path.read_text())["identity"] == identity


def test_a_cpu_planner_reads_and_writes_no_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("ADBATCH_CACHE", str(tmp_path))
    engine = DecodeEngine(_compressed_tiny())
    assert engine.linears.plan_file is None
    engine.linears.route_bucket(8)  # nothing to time on a CPU: the units keep their own forward
    assert not engine.linears.route and not any(tmp_path.rglob("*.json"))


# ------------------------------------------------------------------------------------------ warm-up
def test_pass_buckets_are_the_buckets_the_passes_route_at():
    engine = DecodeEngine(_compressed_tiny())
    # 5 queries -> query buckets 1, 2, 4, 8; 10 beams; prompts of up to 40 tokens -> widths 16, 32, 48
    steps = [10, 20, 40, 80]
    prefills = [16, 32, 64, 128, 256, 512]  # bucket_queries(Qb * Lw)
    trees = [4, 8, 16, 32, 64, 128]         # up to bucket_queries(2 * 64)
    assert engine.pass_buckets(5, 10, 40) == sorted(set(steps + prefills))
    assert engine.pass_buckets(5, 10, 40, tree_tokens=64) == sorted(set(steps + prefills + trees))


def test_warm_up_routes_each_pass_bucket_before_the_work(monkeypatch):
    from adbatch.decoding.config import TargetSearchConfig

    engine = DecodeEngine(_compressed_tiny())
    assert engine.warm_up(4, 8, 32) == []  # CPU: eager passes route nothing
    routed = []
    monkeypatch.setattr(engine.linears, "route_bucket", routed.append)
    engine.graphs_enabled = True  # as on a GPU
    buckets = engine.warm_up(4, 8, 32, tree_tokens=32)
    assert buckets == routed == engine.pass_buckets(4, 8, 32, 32)
    assert DecodeEngine(make_tiny_llama(vocab_size=64, heads=4, kv_heads=2)).warm_up(4, 8, 32) == []  # dense

    model = _compressed_tiny()
    calls = []
    monkeypatch.setattr(DecodeEngine, "warm_up", lambda self, *a: calls.append(a) or [])
    warm_up_search(model, TargetSearchConfig(num_beams=8, top_k=10, verify="off"), 64, 40)
    warm_up_search(model, TargetSearchConfig(num_beams=4, top_k=10, max_tokens_per_pass=1024), 64, 40)
    assert calls == [(64, 10, 40, 0), (64, 10, 40, 1024)]  # beams: the pool, max(num_beams, top_k)


# ------------------------------------------------------------------------------------------ served dense
def _dense_twin(model):
    """``model`` with every compressed linear replaced by an ``nn.Linear`` holding its dequantized weight."""
    twin = copy.deepcopy(model)
    for name, mod in list(twin.named_modules()):
        if hasattr(mod, "packed"):
            dense = torch.nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
            dense.weight.data = dequantize_nm_int4(mod.packed, torch.float32)
            if mod.bias is not None:
                dense.bias.data = mod.bias.clone()
            parent, _, attr = name.rpartition(".")
            setattr(twin.get_submodule(parent), attr, dense)
    return twin.eval()


def _traced_two_steps(engine, monkeypatch):
    """Log-probs after a prefill and two steps, and every ``F.linear`` call's ``(input shape, weight shape, has
    bias)`` in order."""
    from tests.test_decoding_engine import _two_steps

    calls, real = [], F.linear

    def traced(x, w, b=None):
        calls.append((tuple(x.shape), tuple(w.shape), b is not None))
        return real(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", traced)
    out = _two_steps(engine)
    monkeypatch.setattr(torch.nn.functional, "linear", real)
    return out, calls


def test_a_compressed_model_served_dense_makes_the_dense_models_calls(monkeypatch):
    """Every unit routed to its bf16 copy: the compressed model's passes make the same GEMM calls as the dense model
    holding the same (dequantized) weights -- q/k/v and gate/up one concatenated GEMM each, no packed kernel, no FP8
    quantizing norm -- and give bit-identical log-probs."""
    model = _compressed_tiny()
    twin = _dense_twin(model)
    dense = DecodeEngine(twin)
    want, dense_calls = _traced_two_steps(dense, monkeypatch)

    served = DecodeEngine(model)
    for key in served.plan_keys(4):
        served.plan.choice[key] = LinearChoice.DENSE
    served.linears.route_bucket(4)  # (a GPU routes each pass's bucket; the CPU serves the route it is given)
    n_layers = model.config.num_hidden_layers
    for engine in (dense, served):  # q/k/v and gate/up of every layer: one GEMM of a bf16 matrix each
        assert len(engine.linears.group_calls) == 2 * n_layers
        assert {call.route[0] for call in engine.linears.group_calls.values()} == {LinearChoice.DENSE}
    for m in served.linears.packed_modules:
        monkeypatch.setattr(m, "forward", lambda *a, **k: pytest.fail("a packed kernel ran"))
    monkeypatch.setattr(served.ops, "add_rms_norm_fp8", lambda *a, **k: pytest.fail("an FP8 norm ran"))
    got, served_calls = _traced_two_steps(served, monkeypatch)
    assert len(dense_calls) == 3 * (4 * n_layers + 1)  # prefill + 2 steps: q/k/v, o, gate/up, down; the head
    assert served_calls == dense_calls
    assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="timing a plan and capturing passes need a GPU")
def test_on_a_gpu_a_new_engine_reads_the_warmed_plan_and_times_nothing(tmp_path, monkeypatch):
    """A first engine's warm-up times and saves the plan of every bucket a prefill + steps of 2 prompts x 2 beams
    route at; a second engine (a new actor's) reads it when built and runs those passes without timing; a replayed
    prefill routes nothing."""
    from adbatch.compress import CompressConfig, compress_
    from tests.test_decoding_engine import _two_steps

    monkeypatch.setenv("ADBATCH_CACHE", str(tmp_path))
    model = make_tiny_llama(vocab_size=64, heads=4, kv_heads=2)
    compress_(model, CompressConfig(score="magnitude", pattern_policy="uniform", uniform_pattern="2:4",
                                    group_policy="uniform", dense_dtype="bfloat16"))
    model = model.to(torch.bfloat16).cuda()
    first = DecodeEngine(model, formats=LinearFormats.INT4)
    assert first.warm_up(2, 2, 16) == [2, 4, 16, 32]  # steps 1 x 2, 2 x 2; prefills of 16 and 32 rows
    assert first.linears.plan_file.is_file() and len(first.plan.choice) == 4 * len({u.key for u in first.linears.units})
    _no_timing(monkeypatch)
    second = DecodeEngine(model, formats=LinearFormats.INT4)
    assert second.plan.choice == first.plan.choice
    _two_steps(second)
    routed = []
    real_route = second.linears.route_bucket
    monkeypatch.setattr(second.linears, "route_bucket", lambda rows: routed.append(rows) or real_route(rows))
    with torch.no_grad():
        second.prefill([[3, 4, 5, 6], [7, 8]], 2, 4)  # captured by _two_steps's prefill: replayed
    assert routed == []
