"""CUDA check of the engine's semi-structured path (issue 20 item 4): the sparse copy's GEMM against the dense
copy's on the same 2:4 INT4 weights, and one engine step of a compressed model served from sparse copies against
the same model served from dense copies (log-probs, bf16). Not a test: the CPU suite checks the routing with a
stand-in copy; this runs the real cuSPARSELt / CUTLASS path.

    python bench/sparse_copy_check.py
    python bench/sparse_copy_check.py --smoke   # CPU, seconds: a tiny model's packed GEMM against its dense copy

``--smoke`` runs what a CPU can: a tiny model's 2:4 INT4 copy and one layer's packed GEMM against the dense copy
of the same weights. The semi-structured copies (cuSPARSELt / CUTLASS) and the engine's per-layer routing (it
times each path in CUDA graphs) need a GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adbatch.decoding.engine import DecodeEngine, semi_structured_copy  # noqa: E402
from bench.decode import build_model, compress_copy, random_prompts  # noqa: E402
from kernels.nm_int4 import dequantize_nm_int4  # noqa: E402


def gemm_check(m, route: str, rows: int, dev: torch.device) -> float:
    """Max |difference| between one compressed layer's GEMM served ``route`` (``sparse``: the semi-structured copy;
    ``packed``: the module's own packed kernel) and the dense copy of the same INT4 weights."""
    w = dequantize_nm_int4(m.packed, torch.bfloat16)
    x = torch.randn(rows, m.in_features, device=dev, dtype=torch.bfloat16)
    ref = F.linear(x, w).float()
    with torch.no_grad():
        got = (F.linear(x, semi_structured_copy(w)) if route == "sparse" else m(x)).float()
    diff = float((got - ref).abs().max())
    print(f"GEMM {tuple(w.shape)} x {rows} rows: max |{route} - dense| {diff:.4g}, max |dense| {float(ref.abs().max()):.4g}",
          flush=True)
    return diff


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny model, the packed kernel's GEMM against its dense copy")
    args = ap.parse_args(argv)
    if args.smoke:  # the engine routes layers only where it can time them (CUDA graphs): the GEMM is what a CPU checks
        dev = torch.device("cpu")
        comp, _ = compress_copy(build_model("8b", dev, smoke=True), dev)
        return {"gemm_max_abs_diff": gemm_check(DecodeEngine(comp)._packed_modules[0], "packed", 32, dev)}
    dev = torch.device("cuda")
    comp, _ = compress_copy(build_model("8b", dev, smoke=False, layers=2), dev)
    engines = {}
    for route in ("dense", "sparse"):
        eng = DecodeEngine(comp)
        for rows in (1024, 4096):  # the step's rows and the prefill's (128 queries x 32 prompt tokens)
            for key in eng.plan_keys(rows):
                eng.plan.choice[key] = route
        engines[route] = eng
    result = {"gemm_max_abs_diff": gemm_check(engines["dense"]._packed_modules[0], "sparse", 1024, dev)}
    queries = random_prompts(128, 32, 100, 40000, seed=0)
    out = {}
    for route, eng in engines.items():
        with torch.no_grad():
            eng.prefill(queries, 8, 8)
            Qb = eng.bucket(128)
            tok = torch.randint(100, 40000, (Qb * 8,), device=dev, generator=torch.Generator(dev).manual_seed(0))
            logits, lse = eng.step(tok, 0, Qb)
            out[route] = logits.float() - lse[:, None]
        served = [c.value for c, _ in eng._route.values()]
        print(route, "units served sparse:", served.count("sparse"), "dense:", served.count("dense"), flush=True)
    d = (out["sparse"] - out["dense"]).abs()
    result.update(max_abs_diff=float(d.max()), mean_abs_diff=float(d.mean()),
                  top1_agreement=float((out["sparse"].argmax(1) == out["dense"].argmax(1)).float().mean()))
    print(f"step log-probs, sparse vs dense copies of the same INT4 weights: max |diff| {result['max_abs_diff']:.4g}, "
          f"mean {result['mean_abs_diff']:.4g}; top-1 agreement {result['top1_agreement']:.4f}")
    return result

if __name__ == "__main__":
    main()
