"""SparseGemv benchmark for the device: ours (2:4 / 1:4 / dense INT4) vs cuBLAS fp16, torch int4, torch 2:4.

Shapes are N x K = out_features x in_features (y[B, N] = x[B, K] @ W[N, K].T).

    python bench/kernels.py --out $OUT            # full sweep + decode-step benchmark (H200: ~6 min)
    python bench/kernels.py --smoke               # tiny shapes, for a syntax run (CPU: interpreter)

For every shape: copy bandwidth first, then per format a correctness check on fresh random inputs
(rel. Frobenius error vs an fp32 reference of the same dequantized weight), then medians per batch size:
``triton.testing.do_bench`` (L2 flushed before every call, so small shapes are not flattered; times
one launch sequence on the GPU) and, for all shapes, a CUDA-graph replay time (``do_bench_cudagraph``:
launch gaps removed, L2 warm). Writes ``kernels.json`` (everything) and ``kernels.md`` (table) to --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import logging
import math
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

log = logging.getLogger("bench.kernels")

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672), (28672, 8192), (576, 1536), (1536, 576)]
LARGE = {(4096, 14336), (14336, 4096), (8192, 28672), (28672, 8192)}
BATCHES = [1, 2, 4, 8, 16, 32, 64]
GROUP_SIZES = (64, 128, 256)  # adaptive per-row groups for ours; torch int4 uses 128 throughout


def _env() -> dict:
    import triton

    info = {
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "host": os.uname().nodename,
    }
    if torch.cuda.is_available():
        prop = torch.cuda.get_device_properties(0)
        info.update(device=prop.name, sms=prop.multi_processor_count, l2_mb=getattr(prop, "L2_cache_size", 0) / 2**20)
    else:
        info.update(device="cpu (interpreter)")
    return info


class Timer:
    """Medians in microseconds: do_bench (L2 flushed) and CUDA-graph replay; wall clock on CPU."""

    def __init__(self, smoke: bool):
        self.cuda = torch.cuda.is_available()
        self.smoke = smoke

    def plain(self, fn) -> float:
        if not self.cuda:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6
        import triton

        return triton.testing.do_bench(fn, warmup=5, rep=20 if self.smoke else 30, return_mode="median") * 1e3

    def graph(self, fn) -> float | None:
        if not self.cuda:
            return None
        import triton

        with torch.cuda.stream(torch.cuda.Stream()):
            return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


def copy_bandwidth(timer: Timer) -> float:
    """GB/s of a device-to-device copy, counting bytes read + written."""
    n = (1 << 30) if timer.cuda else (1 << 20)
    dev = "cuda" if timer.cuda else "cpu"
    a = torch.empty(n, dtype=torch.uint8, device=dev).random_()
    b = torch.empty_like(a)
    us = timer.plain(lambda: b.copy_(a))
    return 2 * n / us / 1e3


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(y).all():
        return float("nan")
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def _mask_24(w: torch.Tensor) -> torch.Tensor:
    """Keep the 2 largest |w| of every 4 consecutive input columns."""
    n, k = w.shape
    g = w.reshape(n, k // 4, 4)
    idx = g.abs().topk(2, dim=-1).indices
    mask = torch.zeros_like(g, dtype=torch.bool).scatter_(-1, idx, True)
    return (g * mask).reshape(n, k)


def _torch_int4(n: int, k: int, dev: str):
    """(packed weight, scales_and_zeros, dense bf16 reference weight) for torch._weight_int4pack_mm."""
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, device=dev)
    gs = 128
    scale = (torch.rand(k // gs, n, device=dev) + 0.5) / math.sqrt(k)
    zero = (torch.rand(k // gs, n, device=dev) - 0.5) / math.sqrt(k)
    sz = torch.stack([scale, zero], dim=-1).to(torch.bfloat16).contiguous()  # [K/gs, N, 2]
    # tinygemm convention: w = (q - 8) * scale + zero
    s_full = sz[..., 0].float().repeat_interleave(gs, 0).t()
    z_full = sz[..., 1].float().repeat_interleave(gs, 0).t()
    w_ref = (q.float() - 8) * s_full + z_full
    packed_u8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
    wq = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
    return wq, sz, w_ref


def bench_shape(n: int, k: int, batches: list[int], timer: Timer, copy_gbs: float, graph: bool) -> list[dict]:
    from kernels import int4_launch as launcher
    from kernels.nm_int4 import SparsityPattern, dequantize_nm_int4, random_packed

    dev = "cuda" if timer.cuda else "cpu"
    torch.manual_seed(n * 7 + k)
    rows: list[dict] = []
    bmax = max(batches)
    w16 = (torch.randn(n, k, device=dev) / math.sqrt(k)).half()

    methods: dict[str, dict] = {}
    methods["cublas_fp16"] = dict(fn=lambda x: F.linear(x, w16), bytes=n * k * 2, ref_w=w16.float(), dtype=torch.float16)
    if timer.cuda:
        try:
            wq, sz, wref = _torch_int4(n, k, dev)
            methods["torch_int4_g128"] = dict(
                fn=lambda x: torch._weight_int4pack_mm(x, wq, 128, sz),
                bytes=n * k // 2 + sz.numel() * 2,
                ref_w=wref,
                dtype=torch.bfloat16,
            )
        except Exception as e:  # noqa: BLE001 - a baseline that fails is reported, not fatal
            log.warning("torch int4 unavailable for %dx%d: %s", n, k, e)
            methods["torch_int4_g128"] = dict(error=repr(e))
        try:
            from torch.sparse import to_sparse_semi_structured

            w24 = _mask_24(w16)
            w24s = to_sparse_semi_structured(w24)
            methods["torch_2:4_fp16"] = dict(
                fn=lambda x: F.linear(x, w24s), bytes=n * k + n * k // 8, ref_w=w24.float(), dtype=torch.float16
            )
        except Exception as e:  # noqa: BLE001
            log.warning("torch 2:4 unavailable for %dx%d: %s", n, k, e)
            methods["torch_2:4_fp16"] = dict(error=repr(e))
    for pat in (SparsityPattern.TWO_FOUR, SparsityPattern.ONE_FOUR, SparsityPattern.DENSE):
        p = random_packed(n, k, pat, group_sizes=GROUP_SIZES, device=dev)
        methods[f"ours_{pat.value}"] = dict(
            fn=(lambda x, p=p: launcher.nm_int4_linear_triton(x, p)),
            bytes=p.nbytes(),
            ref_w=dequantize_nm_int4(p),
            dtype=torch.float16,
            packed=p,
        )

    for name, m in methods.items():
        if "error" in m:
            rows.append(dict(shape=f"{n}x{k}", method=name, error=m["error"]))
            continue
        # fresh random, never-zero activations for the check; an fp32 reference of the same weight
        x_chk = (torch.randn(bmax, k, device=dev) + 0.05).to(m["dtype"])
        ref = x_chk.float() @ m.pop("ref_w").t()
        for b in batches:
            row = dict(shape=f"{n}x{k}", N=n, K=k, B=b, method=name, bytes=m["bytes"])
            try:
                y = m["fn"](x_chk[:b])  # first call per bucket also tunes ours
                if timer.cuda:
                    torch.cuda.synchronize()
                row["rel_err"] = _rel(y, ref[:b])
                if "packed" in m and timer.cuda:
                    cfg = launcher.TUNER.select(x_chk[:b], m["packed"], None)
                    row["config"] = cfg.__dict__ if hasattr(cfg, "__dict__") else str(cfg)
                xs = [(torch.randn(b, k, device=dev) + 0.05).to(m["dtype"]) for _ in range(8)]
                it = itertools.cycle(xs)
                row["us"] = timer.plain(lambda: m["fn"](next(it)))
                if graph:
                    row["graph_us"] = timer.graph(lambda: m["fn"](xs[0]))
                moved = m["bytes"] + b * k * 2 + b * n * 2
                row["gbs"] = moved / row["us"] / 1e3
                row["frac_copy_bw"] = row["gbs"] / copy_gbs
            except Exception as e:  # noqa: BLE001
                log.warning("%s %dx%d B=%d failed: %s", name, n, k, b, e)
                row["error"] = repr(e)[:300]
            rows.append(row)
        m.pop("packed", None)
    fp16 = {r["B"]: r for r in rows if r["method"] == "cublas_fp16" and "us" in r}
    for r in rows:
        if "us" in r and r.get("B") in fp16:
            r["speedup_vs_fp16"] = fp16[r["B"]]["us"] / r["us"]
            if r.get("graph_us") and fp16[r["B"]].get("graph_us"):
                r["graph_speedup_vs_fp16"] = fp16[r["B"]]["graph_us"] / r["graph_us"]
    del methods, w16
    if timer.cuda:
        torch.cuda.empty_cache()
    return rows


# ---- parallel precompile ----------------------------------------------------------------------
def _compile_worker(jobs: list[tuple]) -> int:
    """Compile kernel variants by launching them on a small weight; fills Triton's on-disk cache, so
    the tuner in the parent process loads instead of compiling (compiles are serial per process)."""
    from kernels import int4_launch as launcher
    from kernels.int4_tuner import KernelConfig
    from kernels.nm_int4 import SparsityPattern, random_packed

    done = 0
    packed: dict = {}
    for pattern, dtype_name, cfg_dict in jobs:
        pat = SparsityPattern(pattern)
        if pat not in packed:
            packed[pat] = random_packed(64, 4096, pat, device="cuda")
        p = packed[pat]
        cfg = KernelConfig(**cfg_dict)
        x = torch.randn(max(cfg.block_b, 2), 4096, device="cuda").to(getattr(torch, dtype_name))
        try:
            launcher.launch(x, p, None, cfg)
            done += 1
        except Exception as e:  # noqa: BLE001 - the tuner skips what does not compile
            print(f"precompile {pattern} {cfg}: {e!r}"[:300], flush=True)
    torch.cuda.synchronize()
    return done


def precompile(patterns, dtypes, batches, workers: int) -> None:
    """Compile every candidate variant the tuner will time, in ``workers`` processes."""
    import concurrent.futures as cf
    import multiprocessing as mp

    from kernels.int4_tuner import candidate_configs
    from kernels.nm_int4 import random_packed

    jobs = set()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for pat in patterns:
        p = random_packed(64, 256, pat)  # only the pattern matters for the candidate tiles
        for b in batches:
            for cfg in candidate_configs(p, b, sms):
                for split in (1, 2):  # ATOMIC is a constexpr: compile both variants
                    d = dict(cfg.__dict__, split_k=split)
                    for dt_name in dtypes:
                        jobs.add((pat.value, dt_name, tuple(sorted(d.items()))))
    jobs_l = [(pat, dt_name, dict(items)) for pat, dt_name, items in sorted(jobs)]
    t0 = time.time()
    chunks = [jobs_l[i::workers] for i in range(workers)]
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        n = sum(ex.map(_compile_worker, chunks))
    log.info("precompiled %d/%d kernel variants in %.0f s with %d processes", n, len(jobs_l), time.time() - t0, workers)


# ---- decode step ------------------------------------------------------------------------------
class PackedLinearForBench(torch.nn.Module):
    """Minimal stand-in for adbatch.compress's CompressedLinear: y = nm_int4_linear(x, packed)."""

    def __init__(self, packed, bias=None):
        super().__init__()
        self.packed = packed
        self.bias = bias

    def forward(self, x):
        from kernels.packed_linear import nm_int4_linear

        return nm_int4_linear(x, self.packed, self.bias)


def _layer_pattern(layer: int, n_layers: int, proj: str):
    from kernels.nm_int4 import SparsityPattern

    # "realistic mix": the first/last 4 layers (most important) stay 2:4 throughout; in the middle the
    # attention projections keep 2:4 and the MLP goes to 1:4.
    if layer < 4 or layer >= n_layers - 4 or proj.endswith(("q_proj", "k_proj", "v_proj", "o_proj")):
        return SparsityPattern.TWO_FOUR
    return SparsityPattern.ONE_FOUR


def decode_bench(batches: list[int], timer: Timer, smoke: bool, context: int = 128) -> list[dict]:
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    from kernels.nm_int4 import random_packed

    dev = "cuda" if timer.cuda else "cpu"
    if smoke:
        cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=512)
    else:  # Llama-3-8B shapes
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(prev)
    out: list[dict] = []

    def run(variant: str):
        for b in batches:
            row = dict(variant=variant, B=b, context=context)
            try:
                cache = StaticCache(config=cfg, max_cache_len=context + 8)
                tok = torch.randint(0, cfg.vocab_size, (b, 1), device=dev)
                pos = torch.tensor([context], device=dev)

                def step():
                    return model(tok, past_key_values=cache, cache_position=pos, use_cache=True).logits

                with torch.no_grad():
                    for _ in range(2):
                        step()  # warm-up; tunes our kernels for this batch bucket
                    if timer.cuda:
                        torch.cuda.synchronize()
                        try:
                            g = torch.cuda.CUDAGraph()
                            with torch.cuda.graph(g):
                                step()
                            row["us"] = timer.plain(g.replay)
                            row["mode"] = "cuda_graph"
                        except Exception as e:  # noqa: BLE001
                            log.warning("graph capture failed (%s); timing eager", e)
                            row["us"] = timer.plain(step)
                            row["mode"] = f"eager ({type(e).__name__})"
                    else:
                        row["us"] = timer.plain(step)
                        row["mode"] = "cpu"
                row["tokens_per_s"] = b / row["us"] * 1e6
            except Exception as e:  # noqa: BLE001
                log.warning("decode %s B=%d failed: %s", variant, b, traceback.format_exc())
                row["error"] = repr(e)[:300]
            out.append(row)
            log.info("decode %s", row)

    run("bf16")
    linear_bytes = 0
    packed_bytes = 0
    for li, layer in enumerate(model.model.layers):
        for parent_name in ("self_attn", "mlp"):
            parent = getattr(layer, parent_name)
            for name, mod in list(parent.named_children()):
                if not isinstance(mod, torch.nn.Linear):
                    continue
                pat = _layer_pattern(li, cfg.num_hidden_layers, name)
                p = random_packed(mod.out_features, mod.in_features, pat, group_sizes=GROUP_SIZES, device=dev)
                linear_bytes += mod.weight.numel() * 2
                packed_bytes += p.nbytes()
                setattr(parent, name, PackedLinearForBench(p, mod.bias))
                del mod
    if timer.cuda:
        torch.cuda.empty_cache()
    run("compressed 2:4/1:4 INT4 (lm_head, embeddings bf16)")
    for r in out:
        r["linear_bytes_bf16"] = linear_bytes
        r["linear_bytes_packed"] = packed_bytes
    del model
    return out


def profile_launches(shapes: list[tuple[int, int]], batches: list[int]) -> dict:
    """One launch of each of our formats per (shape, B) with the config the dispatcher picks, for ncu
    (``ncu -k regex:nm_int4 ...``). Run after a sweep of the same shapes in the same ADBATCH_CACHE so
    the tuned configs are read from the cache: tuning launches would otherwise be profiled too."""
    from kernels import int4_launch as launcher
    from kernels.nm_int4 import SparsityPattern, random_packed

    picked = {}
    for (n, k), pat in itertools.product(shapes, SparsityPattern):
        p = random_packed(n, k, pat, group_sizes=GROUP_SIZES, device="cuda")
        for b in batches:
            x = torch.randn(b, k, device="cuda").half()
            cached = launcher.TUNER.lookup(p, b, x.dtype, x.device) is not None
            cfg = launcher.TUNER.select(x, p, None)
            launcher.launch(x, p, None, cfg)
            torch.cuda.synchronize()
            picked[f"{n}x{k} {pat.value} B={b}"] = {"config": repr(cfg), "from_cache": cached}
            print(f"profiled {n}x{k} {pat.value} B={b} {cfg} (tuned config from cache: {cached})", flush=True)
    return picked


def host_probe(n: int = 576, k: int = 1536, calls: int = 2000) -> dict:
    """Host cost per call (eager, no L2 flush): enqueue-only and drained us/call for F.linear and ours at
    B = 1, whether the bound fast path is taken, and a cProfile of 500 calls (round 3 saw eager do_bench
    times of ours far above their CUDA-graph times on small shapes; this isolates the host side)."""
    import cProfile
    import io
    import pstats

    from kernels import int4_launch as launcher
    from kernels.nm_int4 import SparsityPattern, random_packed

    out: dict = {}
    w = torch.randn(n, k, device="cuda").half()
    x = torch.randn(1, k, device="cuda").half()
    for pat in (SparsityPattern.TWO_FOUR, SparsityPattern.DENSE):
        p = random_packed(n, k, pat, device="cuda")
        for name, f in (("cublas_fp16", lambda: F.linear(x, w)), (f"ours_{pat.value}", lambda p=p: launcher.nm_int4_linear_triton(x, p))):
            for _ in range(20):
                f()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            out[name] = dict(enqueue_us=1e6 * (t1 - t0) / calls, drained_us=1e6 * (t2 - t0) / calls)
            print(f"host {name}: enqueue {out[name]['enqueue_us']:.1f} us/call, drained {out[name]['drained_us']:.1f} us/call", flush=True)
        out[f"fast_path_{pat.value}"] = launcher.takes_fast_path(x, p)
        print(f"bound fast path taken for {pat.value}: {out[f'fast_path_{pat.value}']}", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            launcher.nm_int4_linear_triton(x, p)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(10)
        print(buf.getvalue()[:2500], flush=True)
    return out


# ---- report -----------------------------------------------------------------------------------
def table(rows: list[dict], env: dict, copy_gbs: float) -> str:
    lines = [
        f"# SparseGemv benchmark — {env.get('device')} — {env['date_utc']} UTC",
        f"torch {env['torch']}, triton {env['triton']}; copy bandwidth {copy_gbs:.0f} GB/s (read+write).",
        "Shapes N x K = out x in. us = do_bench median, L2 flushed before each call; graph = CUDA-graph replay",
        "median (L2 warm, no launch gaps). x = speedup vs cuBLAS fp16 at the same B. %bw = bytes the format",
        "must read (weights + x + y) / time, over the copy bandwidth. torch int4 runs with bf16 activations.",
        "",
    ]
    by_shape: dict[str, list[dict]] = {}
    for r in rows:
        by_shape.setdefault(r["shape"], []).append(r)
    for shape, rs in by_shape.items():
        methods = list(dict.fromkeys(r["method"] for r in rs))
        bs = sorted({r["B"] for r in rs if "B" in r})
        lines.append(f"## {shape}")
        lines.append("| method | " + " | ".join(f"B={b}" for b in bs) + " |")
        lines.append("|---" * (len(bs) + 1) + "|")
        for m in methods:
            cells = []
            for b in bs:
                r = next((r for r in rs if r["method"] == m and r.get("B") == b), None)
                if r is None or "us" not in r:
                    cells.append("err" if r is not None else "-")
                    continue
                c = f"{r['us']:.1f}us {r.get('speedup_vs_fp16', 0):.2f}x {100 * r['frac_copy_bw']:.0f}%"
                if r.get("graph_us"):
                    c += f" (g {r['graph_us']:.1f})"
                if r.get("rel_err", 0) > 2e-2 or r.get("rel_err") != r.get("rel_err"):
                    c += f" ERR {r['rel_err']:.1e}"
                cells.append(c)
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def compact(rows: list[dict]) -> str:
    """One line per (shape, B): fp16 us, then per format us and speedup, eager / CUDA graph."""
    methods = ["torch_int4_g128", "ours_2:4", "ours_1:4", "ours_4:4"]
    lines = ["| shape | B | fp16 us (graph) | " + " | ".join(f"{m} us x (graph us x)" for m in methods) + " |",
             "|---|---|---|" + "---|" * len(methods)]
    idx = {(r["shape"], r.get("B"), r["method"]): r for r in rows}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for b in sorted({r["B"] for r in rows if r["shape"] == shape and "B" in r}):
            f = idx.get((shape, b, "cublas_fp16"), {})
            cells = [f"{f.get('us', float('nan')):.1f} ({f.get('graph_us') or float('nan'):.1f})"]
            for m in methods:
                r = idx.get((shape, b, m))
                if r is None or "us" not in r:
                    cells.append("-")
                    continue
                c = f"{r['us']:.1f} {r.get('speedup_vs_fp16', 0):.2f}x"
                if r.get("graph_us"):
                    c += f" ({r['graph_us']:.1f} {r.get('graph_speedup_vs_fp16', 0):.2f}x)"
                if not (r.get("rel_err", 0) <= 2e-2):
                    c += f" ERR {r.get('rel_err')}"
                cells.append(c)
            lines.append(f"| {shape} | {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_speedups(rows: list[dict], path: Path) -> bool:
    """Speedup vs cuBLAS fp16 over B, one panel per shape: L2-flushed medians (solid) and CUDA-graph
    medians (dotted; L2 warm, so a packed weight that fits in L2 is flattered). False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "cublas_fp16"]
    cols = min(3, len(shapes))
    fig, axes = plt.subplots(-(-len(shapes) // cols), cols, figsize=(5 * cols, 3.6 * -(-len(shapes) // cols)),
                             squeeze=False)
    for ax, shape in zip(axes.flat, shapes):
        for i, m in enumerate(methods):
            pts = sorted((r["B"], r.get("speedup_vs_fp16"), r.get("graph_speedup_vs_fp16")) for r in rows
                         if r["shape"] == shape and r["method"] == m and r.get("speedup_vs_fp16"))
            if pts:
                ax.plot([b for b, _, _ in pts], [v for _, v, _ in pts], marker="o", label=m, color=f"C{i}")
                ax.plot([b for b, _, g in pts if g], [g for _, _, g in pts if g], ls=":", color=f"C{i}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set(xscale="log", yscale="log", title=f"{shape} (N x K)", xlabel="batch rows B", ylabel="speedup vs fp16")
        ax.set_xticks([1, 2, 4, 8, 16, 32, 64], labels=["1", "2", "4", "8", "16", "32", "64"])
    for ax in list(axes.flat)[len(shapes):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _cfg_label(c: dict) -> str:
    kind = "tc" if c["use_dot"] else "gemv"
    return (f"{kind} b{c['block_b']} n{c['block_n']} kk{c['block_kk']} s{c['split_k']} w{c['num_warps']}"
            + (f" st{c['num_stages']}" if c["use_dot"] else ""))


def tune_log_summary(entries: list[dict]) -> str:
    """Per tuning key: the fastest candidate with a warm and with a cold L2, and the fastest GEMV and
    tensor-core candidates (warm us / cold us)."""
    by_key: dict[str, list[dict]] = {}
    for e in entries:
        by_key.setdefault(e["key"], []).append(e)
    lines = ["| key | candidates | best warm (warm/cold us) | best cold (warm/cold us) | best GEMV | best tensor-core |",
             "|---|---|---|---|---|---|"]

    def fmt(e):
        return f"{_cfg_label(e['config'])} ({e['warm_us']:.1f}/{e['cold_us']:.1f})" if e else "-"

    for key, es in by_key.items():
        warm = min(es, key=lambda e: e["warm_us"])
        cold = min(es, key=lambda e: e["cold_us"])
        kind = {dot: min((e for e in es if e["config"]["use_dot"] == dot), key=lambda e: e["warm_us"], default=None)
                for dot in (False, True)}
        lines.append(f"| {key} | {len(es)} | {fmt(warm)} | {fmt(cold)} | {fmt(kind[False])} | {fmt(kind[True])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes only (CPU: Triton interpreter)")
    ap.add_argument("--shapes", default="", help="comma list NxK to restrict the sweep")
    ap.add_argument("--batches", default="", help="comma list of batch sizes")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--decode-only", action="store_true")
    ap.add_argument("--no-precompile", action="store_true")
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay timings")
    ap.add_argument("--profile", action="store_true", help="launch a few kernels once each (run under ncu)")
    ap.add_argument("--host", action="store_true", help="only the host launch-cost probe (B = 1, 576x1536)")
    ap.add_argument("--time-budget", type=float, default=540.0, help="skip remaining work after this many s")
    ap.add_argument("--tune-log", action="store_true",
                    help="record every candidate the tuner times (L2 warm and cold) and print the best per key")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("ADBATCH_CACHE", "/tmp/adbatch-bench-cache")  # tunings of this run, not the user's cache
    if args.profile:
        return profile_launches([tuple(int(v) for v in s.split("x")) for s in (args.shapes or "4096x14336").split(",")],
                                [int(b) for b in (args.batches or "1,16,64").split(",")])
    if args.host:
        res = host_probe()
        (args.out / "kernels_host.json").write_text(json.dumps(res, indent=1))
        return res
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    timer = Timer(args.smoke)
    env = _env()
    # smoke: one shape, the GEMV's batch and a tensor-core batch, one decode batch: every path once (the
    # interpreter runs each kernel call for seconds); odd shapes are the kernel tests' job
    shapes = [(64, 256)] if args.smoke else SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    batches = [1, 16] if args.smoke else BATCHES
    if args.batches:
        batches = [int(b) for b in args.batches.split(",")]
    if timer.cuda and not args.no_precompile:
        from kernels.nm_int4 import SparsityPattern

        workers = min(16, os.cpu_count() or 1)
        if not args.decode_only:
            precompile(list(SparsityPattern), ["float16"], batches, workers)
        if not args.no_decode:
            precompile([SparsityPattern.TWO_FOUR, SparsityPattern.ONE_FOUR], ["bfloat16"], [1, 8, 32], workers)
    if args.tune_log:
        from kernels.int4_launch import TUNER

        TUNER.start_tune_log()
    copy_gbs = copy_bandwidth(timer)
    log.info("env %s copy %.0f GB/s", env, copy_gbs)
    results: dict = dict(env=env, copy_gbs=copy_gbs, shape_convention="N x K = out_features x in_features", rows=[])
    if not args.decode_only:
        for n, k in shapes:
            if time.time() - t0 > args.time_budget:
                log.warning("time budget spent: skipping %dx%d", n, k)
                results.setdefault("skipped", []).append(f"{n}x{k}")
                continue
            results["rows"] += bench_shape(n, k, batches, timer, copy_gbs, graph=not args.no_graph)
            (args.out / "kernels.json").write_text(json.dumps(results, indent=1, default=str))
            log.info("shape %dx%d done at %.0f s", n, k, time.time() - t0)
        md = table(results["rows"], env, copy_gbs)
        (args.out / "kernels.md").write_text(md + "\n" + compact(results["rows"]))
        plot_speedups(results["rows"], args.out / "kernels.png")
    if not args.no_decode and time.time() - t0 < args.time_budget:
        results["decode"] = decode_bench([1] if args.smoke else [1, 8, 32], timer, args.smoke)
    (args.out / "kernels.json").write_text(json.dumps(results, indent=1, default=str))
    cache = Path(os.environ["ADBATCH_CACHE"]) / "kernels"
    if cache.is_dir():
        for f in cache.glob("*.json"):
            (args.out / f.name).write_text(f.read_text())
    if args.tune_log:
        from kernels.int4_launch import TUNER

        results["tune_log"] = TUNER.tune_log()
        (args.out / "kernels.json").write_text(json.dumps(results, indent=1, default=str))
        print(tune_log_summary(results["tune_log"]))
    if not args.decode_only:
        print(compact(results["rows"]))
    for r in results.get("decode", []):
        print(f"decode {r['variant']:<50} B={r['B']:>3} {r.get('us', float('nan')):9.1f} us "
              f"{r.get('tokens_per_s', float('nan')):9.1f} tok/s {r.get('mode', r.get('error', ''))}")
    print(f"total {time.time() - t0:.0f} s")
    return results


if __name__ == "__main__":
    main()
