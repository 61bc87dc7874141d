"""Accuracy of the SparseGemv kernels against an fp64 product of the same dequantized weights.

    TRITON_INTERPRET=1 .venv/bin/python bench/kernel_accuracy.py          # CPU: the PTX's bit-exact emulation (~2 min)
    python3 bench/kernel_accuracy.py --device cuda                         # GPU: the PTX itself
    TRITON_INTERPRET=1 .venv/bin/python bench/kernel_accuracy.py --smoke  # CPU, seconds: K = 64 only

For each pattern and K, one 64 x K random packed weight and 8 fp16 activation rows, through
``nm_int4_linear_triton`` with forced configs: the GEMV (fp16x2 sums of 16 products, then fp32), the
tensor-core kernel (fp32 MMA accumulation). Prints the relative
Frobenius error, the worst |error| / sum |x * w| of an output, and, for scale, the error of rounding the
exact result to fp16 alone.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--ks", default="1024,4096", help="comma list of K (in_features)")
    ap.add_argument("--smoke", action="store_true", help="K = 64 only on the CPU: the plumbing, in seconds")
    args = ap.parse_args(argv)
    if args.smoke:
        args.device, args.ks = "cpu", "64"
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")

    import torch

    from kernels import int4_launch as launcher
    from kernels.int4_tuner import KernelConfig, tc_block_kk
    from kernels.nm_int4 import dequantize_nm_int4, random_packed

    rows = []
    print("| pattern | K | kernel | rel. error | max err / sum abs(x*w) | fp16 output rounding alone |")
    print("|---|---|---|---|---|---|")
    for pattern in ("2:4", "1:4", "4:4"):
        for k in (int(v) for v in args.ks.split(",")):
            p = random_packed(64, k, pattern, generator=torch.Generator().manual_seed(k))
            x = (torch.randn(8, k, generator=torch.Generator().manual_seed(1)) + 0.05).half()
            w = dequantize_nm_int4(p, torch.float64)
            ref = x.double() @ w.t()
            scale = x.double().abs() @ w.abs().t()
            rounding = float((ref.half().double() - ref).norm() / ref.norm())
            kk = tc_block_kk(p.pattern)
            for name, cfg in (("gemv", KernelConfig(8, 64, 64, 1, False)), ("tc", KernelConfig(16, 64, kk, 1, True))):
                y = launcher.nm_int4_linear_triton(x.to(args.device), p.to(args.device), config=cfg).double().cpu()
                row = dict(pattern=pattern, K=k, kernel=name, rel=float((y - ref).norm() / ref.norm()),
                           worst=float(((y - ref).abs() / scale).max()), output_rounding=rounding)
                rows.append(row)
                print(f"| {pattern} | {k} | {name} | {row['rel']:.2e} | {row['worst']:.1e} | {rounding:.2e} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
