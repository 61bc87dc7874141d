"""CUDA check of the engine's semi-structured path (issue 20 item 4): the sparse copy's GEMM against the dense
copy's on the same 2:4 INT4 weights, and one engine step of a compressed model served from sparse copies against
the same model served from dense copies (log-probs, bf16). Not a test: the CPU suite checks the routing with a
stand-in copy; this runs the real cuSPARSELt / CUTLASS path.

    python bench/sparse_copy_check.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adbatch.decoding.engine import DecodeEngine, _shape_key, semi_structured_copy  # noqa: E402
from bench.decode import build_model, compress_copy, random_prompts  # noqa: E402
from kernels.nm_int4 import dequantize_nm_int4  # noqa: E402


def main() -> None:
    dev = torch.device("cuda")
    comp, _ = compress_copy(build_model("8b", dev, smoke=False, layers=2), dev)
    engines = {}
    for route in ("dense", "sparse"):
        eng = DecodeEngine(comp)
        for m in eng._packed_modules:
            for rows in (1024, 4096):  # the step's rows and the prefill's (128 queries x 32 prompt tokens)
                eng.plan.choice[_shape_key(m) + (rows,)] = route
        engines[route] = eng
    m = engines["dense"]._packed_modules[0]
    w = dequantize_nm_int4(m.packed, torch.bfloat16)
    x = torch.randn(1024, m.in_features, device=dev, dtype=torch.bfloat16)
    ref = F.linear(x, w).float()
    got = F.linear(x, semi_structured_copy(w)).float()
    print(f"GEMM {tuple(w.shape)} x 1024 rows: max |sparse - dense| {float((got - ref).abs().max()):.4g}, "
          f"max |dense| {float(ref.abs().max()):.4g}", flush=True)
    queries = random_prompts(128, 32, 100, 40000, seed=0)
    out = {}
    for route, eng in engines.items():
        with torch.no_grad():
            eng.prefill(queries, 8, 8)
            Qb = eng.bucket(128)
            tok = torch.randint(100, 40000, (Qb * 8,), device=dev, generator=torch.Generator(dev).manual_seed(0))
            logits, lse = eng.step(tok, 0, Qb)
            out[route] = logits.float() - lse[:, None]
        print(route, "layers served sparse:", len(eng._use_sparse), "dense:", len(eng._use_dense), flush=True)
    d = (out["sparse"] - out["dense"]).abs()
    print(f"step log-probs, sparse vs dense copies of the same INT4 weights: max |diff| {float(d.max()):.4g}, "
          f"mean {float(d.mean()):.4g}; top-1 agreement {float((out['sparse'].argmax(1) == out['dense'].argmax(1)).float().mean()):.4f}")


if __name__ == "__main__":
    main()
