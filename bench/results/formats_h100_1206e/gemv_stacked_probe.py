"""Probe (not committed): packed 2:4 INT4 GEMV fp16 vs bf16 activations at small rows, tuned, vs cuBLAS bf16."""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import torch, torch.nn.functional as F, triton
from kernels.nm_int4 import random_packed, nm_int4_linear_reference
from kernels.int4_launch import nm_int4_linear_triton
from kernels.int4_tuner import time_graphed_ms
from kernels.fp8_linear import relative_error

dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
rows_out = []
print("| N x K | B | dtype | packed us | cuBLAS bf16 us | x | rel err |")
print("|---|---|---|---|---|---|---|")
for n, k in [(4096, 4096), (1024, 4096), (6144, 4096), (14336, 4096), (28672, 4096), (4096, 14336)]:
    p = random_packed(n, k, "2:4", generator=g, device=dev)
    wb = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    for b in (1, 8, 16):
        xb = torch.randn(b, k, device=dev, dtype=torch.bfloat16, generator=g)
        dense_us = 1e3 * time_graphed_ms(lambda: F.linear(xb, wb), "warm")
        for dt in (torch.float16, torch.bfloat16):
            x = xb.to(dt)
            y = nm_int4_linear_triton(x, p)
            err = relative_error(y.float(), nm_int4_linear_reference(x.float(), p).float())
            us = 1e3 * time_graphed_ms(lambda: nm_int4_linear_triton(x, p), "warm")
            r = dict(n=n, k=k, b=b, dtype=str(dt)[6:], packed_us=us, dense_us=dense_us, err=err)
            rows_out.append(r)
            print(f"| {n}x{k} | {b} | {r['dtype']} | {us:.1f} | {dense_us:.1f} | {dense_us/us:.2f} | {err:.4f} |", flush=True)
out = os.environ.get("OUT", "/tmp")
open(f"{out}/gemv_dtype.json", "w").write(json.dumps(rows_out))
