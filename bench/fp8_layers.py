"""Per-layer formats at the 8B shapes and large row counts (issue 42): what the engine's plan chooses among.

Not a test. For Llama-3-8B's layer shapes (fused q/k/v 6144x4096, o 4096x4096, fused gate/up 28672x4096,
down 4096x14336; N x K) and row counts ``--rows``, times ``y = x @ W.T`` graph-replayed (the engine plan's
own timer, :func:`kernels.int4_tuner.time_graphed_ms`) for every format a compressed layer can run in:

  bf16        cuBLAS bf16 (F.linear): the dense baseline
  int4_2:4    the packed 2:4 INT4 kernel (kernels.packed_linear), the product's compressed format
  sp24_bf16   2:4 semi-structured bf16 copy (cuSPARSELt / CUTLASS through torch.sparse)
  fp8         FP8 copy, per-channel weight / per-row activation scales (kernels.fp8_linear: the Triton row
              quantization + torch._scaled_mm with fast accumulation), activation quantization included in the time
  fp8_full_acc  the same with the tensor cores' partial sums promoted to float32 (the default before 2026-12-06)
  sp24_fp8    2:4 FP8 copy on the sparse tensor cores (kernels.fp8_linear: torchao's 2:4 FP8 CUTLASS layout)
  ao_fp8      public reference for fp8: torchao Float8DynamicActivationFloat8WeightConfig(PerRow), when importable

on random normal weights (std 0.02, pruned 2:4 for the sparse formats) and activations, never zeros, and
each format's relative error vs the float32 product of the same (2:4 or dense) weights. Prints a table of
speed vs bf16 and writes it to ``--out``. The public kernels of the same formats (torchao's 2:4 FP8 CUTLASS,
mslk's FP8 x INT4, torch 2:4 fp16) come from the project's anchor script, run in the same device call.

    python bench/fp8_layers.py --rows 64,256,1024,4096,8192 --out $OUT/fp8_layers.md
    python bench/fp8_layers.py --smoke    # CPU, seconds: small shapes, the references' errors, no timing
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from adbatch.compress.sparsity import nm_mask  # noqa: E402
from adbatch.decoding.engine import semi_structured_copy  # noqa: E402
from kernels.fp8_linear import Fp8Layout, fp8_linear, fp8_supported, quantize_weight_fp8, relative_error  # noqa: E402

#: N x K of one Llama-3-8B layer's GEMMs as the engine runs them (q/k/v and gate/up fused)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
FORMATS = ["bf16", "int4_2:4", "sp24_bf16", "fp8", "fp8_full_acc", "sp24_fp8", "ao_fp8"]


def torchao_fp8(wb: torch.Tensor):
    """torchao's dense FP8 (row-wise scales) of ``wb``, or None without torchao."""
    try:
        from torchao import quantization as aoq
    except ImportError:
        return None
    lin = torch.nn.Linear(wb.shape[1], wb.shape[0], bias=False, device=wb.device, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(wb)
    aoq.quantize_(lin, aoq.Float8DynamicActivationFloat8WeightConfig(granularity=aoq.PerRow(),
                                                                     set_inductor_config=False))
    return lin


def timed_us(fn, dev: torch.device) -> float | None:
    """Graph-replayed median microseconds of ``fn`` on CUDA (the engine plan's timer); None on the CPU."""
    if dev.type != "cuda":
        return None
    from kernels.int4_tuner import time_graphed_ms

    return round(1e3 * time_graphed_ms(fn, "warm"), 2)


def packed_24(w24: torch.Tensor):
    """The product's 2:4 INT4 layer of ``w24`` (uniform group 128), via the compress stage's own verb."""
    from torch import nn

    from adbatch.compress import CompressConfig, compress_
    from adbatch.compress.linear import SequentialExecutor

    holder = nn.Sequential(nn.Linear(w24.shape[1], w24.shape[0], bias=False))
    with torch.no_grad():
        holder[0].weight.copy_(w24.float().cpu())
    dev = w24.device
    compress_(holder, CompressConfig(score="magnitude", pattern_policy="uniform", uniform_pattern="2:4",
                                     group_policy="uniform", follow_training_qat=False, skip_modules=[]),
              executor=SequentialExecutor(dev if dev.type == "cuda" else None))
    return holder[0].to(dev)


def bench_shape(name: str, n: int, k: int, rows: list[int], dev: torch.device) -> list[dict]:
    torch.manual_seed(0)
    w = torch.randn(n, k, device=dev) * 0.02
    w24 = w * nm_mask(w.abs(), 2)  # the 2 largest |w| of every 4 along K
    wb, w24b = w.to(torch.bfloat16), w24.to(torch.bfloat16)
    layer = packed_24(w24)
    sp = semi_structured_copy(w24b)
    w8 = quantize_weight_fp8(wb) if fp8_supported(w.device, Fp8Layout.DENSE) is None else None
    s8 = quantize_weight_fp8(w24b, Fp8Layout.SPARSE_24) if fp8_supported(w.device, Fp8Layout.SPARSE_24) is None else None
    ao = torchao_fp8(wb) if dev.type == "cuda" else None
    out = []
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref_dense, ref_24 = x.float() @ w.t(), x.float() @ w24.t()
        fns = {"bf16": (lambda: F.linear(x, wb), ref_dense), "int4_2:4": (lambda: layer(x), ref_24)}
        if sp is not None:
            fns["sp24_bf16"] = (lambda: F.linear(x, sp).contiguous(), ref_24)
        if w8 is not None:
            fns["fp8"] = (lambda: fp8_linear(x, w8), ref_dense)
            if dev.type == "cuda":
                fns["fp8_full_acc"] = (lambda: fp8_linear(x, w8, fast_accum=False), ref_dense)
        if s8 is not None:
            fns["sp24_fp8"] = (lambda: fp8_linear(x, s8), ref_24)
        if ao is not None:
            fns["ao_fp8"] = (lambda: ao(x), ref_dense)
        row = {"layer": name, "N": n, "K": k, "rows": m, "us": {}, "rel_err": {}}
        for fmt, (fn, ref) in fns.items():
            try:
                row["rel_err"][fmt] = round(relative_error(fn(), ref), 4)
                row["us"][fmt] = timed_us(fn, dev)
            except RuntimeError as exc:
                row.setdefault("failed", {})[fmt] = str(exc).splitlines()[0][:160]
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256, 1024, 4096, 8192])
    ap.add_argument("--shapes", type=lambda s: s.split(","), default=list(SHAPES))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="CPU: 128-wide stand-ins of the four units at 8 / 32 rows, the formats' errors only (no timing)")
    args = ap.parse_args()
    if args.smoke:
        dev, shapes, args.rows = torch.device("cpu"), {s: (n // 32, k // 32) for s, (n, k) in SHAPES.items()}, [8, 32]
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing to time (--smoke checks the script on the CPU)")
        return
    else:
        dev, shapes = torch.device("cuda"), SHAPES
    rows = [r for s in args.shapes for r in bench_shape(s, *shapes[s], args.rows, dev)]
    card = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU smoke: no timing"
    lines = [f"# Layer formats at the 8B shapes ({card}, torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             "speed vs cuBLAS bf16 (graph-replayed medians, L2 warm); FP8 times include the activation quantization",
             "", "| layer | N x K | rows | bf16 us | " + " | ".join(f"{f}" for f in FORMATS[1:]) + " | rel. err "
             + " / ".join(FORMATS[1:]) + " |", "|---|---|---:|---:|" + "---:|" * (len(FORMATS) - 1) + "---|"]
    for r in rows:
        base = r["us"].get("bf16")
        cells = [f"{base / r['us'][f]:.2f}x" if base and r["us"].get(f) else "-" for f in FORMATS[1:]]
        errs = " / ".join(f"{r['rel_err'][f]:.3f}" if f in r["rel_err"] else "-" for f in FORMATS[1:])
        lines.append(f"| {r['layer']} | {r['N']}x{r['K']} | {r['rows']} | {base or '-'} | " + " | ".join(cells)
                     + f" | {errs} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        args.out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
