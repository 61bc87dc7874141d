"""Targets per second: the generative channel alone vs hybrid (both channels fused), one process, no Ray.

Runs :class:`adbatch.serving.hybrid.HybridRanker` -- what ``adbatch generate`` runs -- with the product's
``TargetSearchConfig`` defaults (``verify`` off, as the quality tables) over an index with a dense channel,
``--batch`` queries per call, median of ``--repeats`` calls after a warm-up, with the hybrid calls' counters of
dense candidates scored exactly (rows, tree tokens). A random-init model's fusion is the RRF fallback: every
candidate the beams did not find is scored (no bound), the most work hybrid can cost.

The model is random-init from a ``config.json`` (``--config``: the default model's shape) or loaded
(``--model``); queries come with precomputed MiniLM vectors (``bench/train_eval.py prepare`` writes
``query_emb_<catalogue>.npz``), so the GPU needs no embedder.
``--smoke``: a tiny random Llama over a tiny index built here (CPU, seconds).

    python3 bench/hybrid_speed.py --bundle .carry/b5k --catalogue 5000 --config .carry/assets/smollm2-tokenizer
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _smoke_assets(root: Path) -> tuple[Any, Any, Any, list[str], Any]:
    """A tiny model, an index of 40 ads embedded by a fixed random projection, and its query vectors."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from adbatch.index.build import IndexConfig, build_index, load_index
    from adbatch.index.clustering import ClusterConfig
    from adbatch.index.corpus import CorpusConfig
    from adbatch.index.embeddings import EmbeddingConfig
    from adbatch.models import resolve_model
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    rng = np.random.default_rng(0)
    emb = rng.normal(size=(40, 384)).astype(np.float32)  # MiniLM's width: the index probes its query embedder
    pq.write_table(pa.table({"ad_id": [f"a{i}" for i in range(40)], "title": [f"item {i} tool" for i in range(40)],
                             "vec": pa.array(list(map(list, emb)), pa.list_(pa.float32()))}), root / "ads.parquet")
    build_index(root / "ads.parquet", root / "index", IndexConfig(
        columns=CorpusConfig(embedding="vec"), embedding=EmbeddingConfig(query_embedder="default"),
        cluster=ClusterConfig(branching=4, leaf_size=8)), progress=False)
    tok = AutoTokenizer.from_pretrained(resolve_model(), local_files_only=True, trust_remote_code=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    queries = [f"tool {i}" for i in range(12)]
    return model.eval(), tok, load_index(root / "index"), queries, torch.from_numpy(rng.normal(size=(12, 384)).astype("float32"))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", help="bench/train_eval.py prepare bundle (index_<cat>_text, query_emb_<cat>.npz)")
    p.add_argument("--catalogue", default="5000")
    p.add_argument("--config", help="folder with the model's config.json + tokenizer (random-init weights)")
    p.add_argument("--model", help="a model folder or GGUF to load instead")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dense-k", default="10,20", help="hybrid rows' dense candidates per query")
    p.add_argument("--out", default=None, help="JSON file for the results")
    p.add_argument("--smoke", action="store_true", help="tiny model and index on the CPU")
    args = p.parse_args(argv)

    import numpy as np
    import torch

    from adbatch.decoding import DenseScoring, FusionMode, TargetSearchConfig, VerifyMode
    from adbatch.index.dense import DenseRetriever, PrecomputedQueryEmbedder
    from bench.train_eval import repeated, time_hybrid

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    tmp = tempfile.TemporaryDirectory()
    if args.smoke:
        model, tok, index, queries, qemb = _smoke_assets(Path(tmp.name))
        args.batch, args.repeats = 12, 1
    else:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from adbatch.index.build import load_index

        index = load_index(Path(args.bundle) / f"index_{args.catalogue}_text")
        z = np.load(Path(args.bundle) / f"query_emb_{args.catalogue}.npz")
        queries, qemb = [str(q) for q in z["queries"]], torch.from_numpy(z["emb"].astype(np.float32))
        if args.model:
            from adbatch.models import load_causal_lm

            model, tok = load_causal_lm(args.model, dtype=torch.float32, device="cpu")
        else:  # random init of the real shape: speed only (never zeros)
            torch.manual_seed(0)
            tok = AutoTokenizer.from_pretrained(args.config, local_files_only=True, trust_remote_code=False)
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.config, trust_remote_code=False),
                                                     trust_remote_code=False)
    model = model.to(device, torch.bfloat16 if device == "cuda" else torch.float32).eval()
    dense = DenseRetriever(index, device, embedder=PrecomputedQueryEmbedder(queries, qemb))
    batch = repeated(queries, args.batch)
    base = TargetSearchConfig(verify=VerifyMode.OFF)
    rows = {"generative": base.replace(fusion=FusionMode.GENERATIVE)}
    for dk in (int(x) for x in args.dense_k.split(",")):
        rows[f"hybrid dense_k {dk}"] = base.replace(dense_k=dk)
        rows[f"hybrid beam_floor dense_k {dk}"] = base.replace(dense_k=dk, dense_scoring=DenseScoring.BEAM_FLOOR)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                           "batch": len(batch), "rows": {}}
    for name, search in rows.items():
        r = out["rows"][name] = time_hybrid(model, tok, index, dense, search, None, batch, args.repeats)
        print(f"{name}: {r['queries_per_s']:.1f} queries/s (median of {len(r['times_s'])}: {r['median_s']:.3f} s)",
              flush=True)
    gen = out["rows"]["generative"]["queries_per_s"]
    for name, r in out["rows"].items():
        r["vs_generative"] = r["queries_per_s"] / gen
    print(json.dumps(out, indent=1, default=str))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
