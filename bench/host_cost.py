"""Fixed host cost of a search call on the CPU (issue 42): the engine lookup's weights signature and eval mode, apart
and through ``serving_engine`` (one module walk), on a dense model and its uniform 2:4 INT4 copy.

Not a test. Builds ``bench/decode.py``'s random-init model of ``--model-shape`` and its ``compress_copy``, then
times (min of ``--repeats`` x ``--number`` calls) ``engine_for`` + ``eval_mode`` (two walks), ``serving_engine``
(one), the walk alone and the signature alone. Every search / creatives call pays this before its first kernel.

    python bench/host_cost.py                    # the default 135M shape
    python bench/host_cost.py --smoke            # tiny model, seconds
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from adbatch.decoding.engine import engine_for, serving_engine, weights_signature  # noqa: E402
from adbatch.models import eval_mode, submodules  # noqa: E402
from bench.decode import build_model, compress_copy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-shape", default="default", help="bench/decode.py's SHAPES key")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--number", type=int, default=300)
    ap.add_argument("--smoke", action="store_true", help="a tiny model of the shape's architecture, few calls")
    args = ap.parse_args()
    if args.smoke:
        args.repeats, args.number = 2, 5
    dev = torch.device("cpu")
    dense = build_model(args.model_shape, dev, smoke=args.smoke)
    comp, _ = compress_copy(dense, dev)

    def ms(fn) -> float:
        return 1e3 * min(timeit.repeat(fn, number=args.number, repeat=args.repeats)) / args.number

    lines = [f"# Fixed host cost per search call, {args.model_shape} shape, CPU ({torch.get_num_threads()} threads; "
             f"min of {args.repeats} x {args.number} calls)", "",
             "| model | tensors | modules | engine_for + eval_mode ms | serving_engine ms | walk ms | signature ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, model in (("dense bf16", dense), ("2:4 INT4 copy", comp)):
        engine_for(model)  # built once: the rows time the lookup a search call pays

        def two_walks(model=model) -> None:
            engine_for(model)
            with eval_mode(model):
                pass

        def one_walk(model=model) -> None:
            with serving_engine(model):
                pass

        lines.append(f"| {name} | {len(weights_signature(model))} | {len(submodules(model))} | {ms(two_walks):.3f} | "
                     f"{ms(one_walk):.3f} | {ms(lambda: submodules(model)):.3f} | "
                     f"{ms(lambda: weights_signature(model)):.3f} |")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
