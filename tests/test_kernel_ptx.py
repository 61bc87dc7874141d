"""The kernels' inline PTX assembles for sm_90 (no GPU needed).

The interpreter tests (test_sparse_gemv.py) run the bit-faithful *emulation* of the inline PTX; only a
GPU runs the PTX itself. Compiling every pattern x dtype x kernel through Triton's bundled ptxas
catches malformed PTX (operand counts, register types, constraint strings) in CI. Runs in a
subprocess: the kernels must be imported with TRITON_INTERPRET unset to compile for a GPU target.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_COMPILE_ALL = """
import itertools, json
from kernels import int4_launch as launcher
from kernels.int4_tuner import KernelConfig, tc_block_kk
from kernels.nm_int4 import SparsityPattern
out = []
for pat, bf16 in itertools.product(SparsityPattern, (False, True)):
    for cfg in (KernelConfig(4, 64, 64, 2, False), KernelConfig(16, 64, tc_block_kk(pat), 2, True)):
        k = launcher.compile_offline(cfg, pat, bf16, split=True)
        ptx = k.asm["ptx"]
        out.append(dict(pattern=pat.value, bf16=bf16, dot=cfg.use_dot, cubin=len(k.asm["cubin"]),
                        lop3=ptx.count("lop3.b32"), prmt=ptx.count("prmt.b32"), mma="mma" in ptx))
# the launcher's slots against the compiled (not interpreted) kernels: Triton's own constexpr list
sigs = [dict(names=list(sig.names), runtime=sig.runtime, constexprs=list(fn.constexprs), arg_names=list(fn.arg_names))
        for sig, fn in ((launcher._GEMV_SIG, launcher._nm_int4_gemv_kernel), (launcher._TC_SIG, launcher._nm_int4_tc_kernel))]
print(json.dumps(dict(rows=out, sigs=sigs)))
"""


def test_inline_ptx_assembles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_ALL], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(run.stdout.strip().splitlines()[-1])
    rows = res["rows"]
    for sig in res["sigs"]:  # constexprs trail the runtime arguments, as the bound fast path assumes
        assert sig["names"] == sig["arg_names"] and sig["constexprs"] == list(range(sig["runtime"], len(sig["names"]))), sig
    assert len(rows) == 12  # 3 patterns x fp16/bf16 x GEMV / tensor-core
    for r in rows:
        assert r["cubin"] > 0 and r["lop3"] > 0, r  # the nibble dequantization is in the assembled code
        if r["pattern"] != "4:4":
            assert r["prmt"] > 0, r  # positions -> byte selectors
        if r["dot"]:
            assert r["mma"], r  # the tensor-core kernel reached the tensor cores
