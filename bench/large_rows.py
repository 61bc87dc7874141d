"""Decode steps at large row counts (issues 20, 42): a 2:4-compressed 8B-shaped model vs its dense form.

Not a test. Builds a random-init bf16 Llama of Llama-3-8B's width (``bench/decode.py``'s ``SHAPES["8b"]``)
with ``--layers`` decoder layers, its uniform 2:4 + INT4 copy (``bench/decode.py``'s ``compress_copy``: the
library's ``compress_``), and times the decode engine's graph-replayed step (``DecodeEngine.step``, what
``search_targets`` calls) on both at ``--queries`` x ``--beams`` rows. The compressed engine plans every
layer shape per bucket among the packed kernel, a dense copy and (from ``SPARSE_MIN_ROWS`` rows) a
semi-structured sparse copy -- and, with ``linear_formats`` fp8 (a second engine over the same model), FP8
and 2:4 FP8 copies; the tables show the step ratios, then each shape's timings,
FP8 errors and choice.

    python bench/large_rows.py --layers 4 --queries 16,128,512,1024 --out $OUT/large_rows.md
    python bench/large_rows.py --smoke    # CPU, seconds: tiny model, compress, eager steps (no graphs, no sparse copies)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.decode import build_model, compress_copy, plan_table, random_prompts, release  # noqa: E402
from bench.step_profile import eager_step_ms, graphed_step_ms, write_report  # noqa: E402
from adbatch.decoding import LinearFormats  # noqa: E402
from adbatch.decoding.engine import _MODEL_COPIES, DecodeEngine  # noqa: E402


def copy_bytes(c) -> int:
    """Bytes of an engine's kept copy: a packed or FP8 weight (``nbytes()``), a semi-structured tensor (its inner
    tensors, values + metadata, by its own flattening), a bf16 tensor."""
    if hasattr(c, "nbytes") and callable(c.nbytes):
        return c.nbytes()
    if hasattr(c, "__tensor_flatten__"):
        names, _ = c.__tensor_flatten__()
        return sum(t.numel() * t.element_size() for t in (getattr(c, n) for n in names) if isinstance(t, torch.Tensor))
    return c.numel() * c.element_size()


def smoke(args) -> None:
    """The CPU-able part: build, compress and step both models; the engine plans packed vs dense on the CPU."""
    dev = torch.device("cpu")
    dense = build_model("8b", dev, smoke=True)
    comp, summary = compress_copy(dense, dev)
    queries = random_prompts(4, 8, 100, 1000, seed=0)
    lines = [f"# Large-row steps, smoke (tiny 8B-architecture model, CPU, eager; times mean nothing): {summary}", "",
             "| queries | rows | dense step ms | compressed step ms |", "|---:|---:|---:|---:|"]
    for qn in (1, 4):
        d = eager_step_ms(DecodeEngine(dense), queries, qn, args.beams, 1, 6, 2)
        c = eager_step_ms(DecodeEngine(comp), queries, qn, args.beams, 1, 6, 2)
        lines.append(f"| {qn} | {qn * args.beams} | {d:.2f} | {c:.2f} |")
    write_report(lines, args.out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--beams", type=int, default=8)
    ap.add_argument("--queries", type=lambda s: [int(x) for x in s.split(",")], default=[16, 128, 512, 1024])
    ap.add_argument("--t", type=int, default=8, help="suffix position of the timed step")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="CPU: a tiny 8B-architecture model and its 2:4 copy, eager steps only (graph replay and the "
                         "semi-structured sparse copies need CUDA)")
    args = ap.parse_args()
    if args.smoke:
        return smoke(args)
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    dense = build_model("8b", dev, smoke=False, layers=args.layers)
    comp, summary = compress_copy(dense, dev)
    print(f"built + compressed in {time.perf_counter() - t0:.1f} s: {summary}", flush=True)
    queries = random_prompts(max(args.queries), 32, 100, 40000, seed=0)
    # One engine at a time, each freed before the next: the dense engine's cache and step buffers, then each
    # compressed engine's, with only that engine's copies beside the packed model (32 layers of 8B width did not fit
    # an 80 GB card with all three engines, their copies and the bf16 model resident together)
    steps: dict[str, list[float]] = {}
    e_dense = DecodeEngine(dense)
    steps["dense"] = [graphed_step_ms(e_dense, queries, qn, args.beams, args.t, args.t + 4, args.repeats, dev)[0]
                      for qn in args.queries]
    del e_dense
    dense.to("cpu")
    release(dev)
    plans: list[str] = []
    kept: dict[str, str] = {}
    for fmt in (LinearFormats.INT4, LinearFormats.FP8):
        eng = DecodeEngine(comp, formats=fmt)
        steps[fmt.value] = [graphed_step_ms(eng, queries, qn, args.beams, args.t, args.t + 4, args.repeats, dev)[0]
                            for qn in args.queries]
        plans += plan_table({fmt: eng}, f"{fmt.value} formats: per unit shape and bucket (graph-replayed us of every "
                                         "format timed; FP8 copies' relative error vs the bf16 copy) -> choice") + [""]
        sizes: dict[str, int] = {}
        for (_, choice), c in eng.linears.copies.items():
            sizes[choice.value] = sizes.get(choice.value, 0) + copy_bytes(c)
        kept[fmt.value] = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items()) or "none"
        del eng
        _MODEL_COPIES.pop(comp, None)  # the next engine times (and keeps) its own copies
        release(dev)
    lines = [f"# Decode steps at large row counts ({args.layers}-layer Llama-3-8B width, uniform 2:4 + INT4, bf16, "
             f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             "compressed = the engine's per-bucket plan with linear_formats int4 (packed INT4 / bf16 copy / 2:4 bf16 "
             "copy) or fp8 (also FP8 and 2:4 FP8 copies); speed = dense step ms / compressed step ms; each engine "
             "timed alone on the card", "",
             "| queries | rows | dense step ms | compressed int4 ms | compressed fp8 ms | int4 speed | fp8 speed |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for i, qn in enumerate(args.queries):
        d, ci, cf = steps["dense"][i], steps["int4"][i], steps["fp8"][i]
        lines.append(f"| {qn} | {qn * args.beams} | {d:.2f} | {ci:.2f} | {cf:.2f} | {d / ci:.2f}x | {d / cf:.2f}x |")
    lines += [""] + plans + [f"copies kept by the {k} engine: {v}" for k, v in kept.items()]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
