"""Builders shared by the generate-stage tests (no tests here): a tiny random-init Llama saved as an
HF folder with the default tokenizer, a tiny text-scheme index built by the index stage, and
request files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

WORDS = ["drill", "saw", "paint", "brush", "lamp", "bulb", "pipe", "valve", "tile", "grout",
         "hammer", "glue", "hose", "mower", "fence", "door"]


def tiny_model_dir(root: Path, seed: int = 0) -> Path:
    """A 2-layer random Llama over the default tokenizer's vocabulary, saved as an HF folder."""
    from conftest import make_tiny_llama
    from transformers import AutoTokenizer

    from adbatch.models import resolve_model

    out = root / "tiny_model"
    if (out / "config.json").is_file():
        return out
    tok = AutoTokenizer.from_pretrained(resolve_model(), local_files_only=True)
    model = make_tiny_llama(vocab_size=len(tok), hidden=32, intermediate=64, heads=2, kv_heads=1,
                            seed=seed)
    model.config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def tiny_corpus(path: Path, n: int = 40, d: int = 8, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    topics = rng.integers(0, 8, n)
    mu = rng.normal(size=(8, d)).astype(np.float32) * 3
    emb = (mu[topics] + 0.3 * rng.normal(size=(n, d))).astype(np.float32)
    titles = [f"{WORDS[2 * t]} {WORDS[2 * t + 1]} item {i}" for i, t in enumerate(topics)]
    table = pa.table({"ad_id": [f"ad-{i:03d}" for i in range(n)], "title": titles,
                      "vec": pa.array([list(map(float, e)) for e in emb], pa.list_(pa.float32()))})
    pq.write_table(table, path)
    return path


def tiny_index_dir(root: Path, n: int = 40) -> Path:
    """A text-scheme index of ``n`` synthetic ads (precomputed embeddings), built sequentially."""
    from adbatch.index.clustering import ClusterConfig
    from adbatch.index.corpus import CorpusConfig
    from adbatch.index.build import IndexConfig, build_index

    out = root / "tiny_index"
    if (out / "manifest.json").is_file():
        return out
    ads = tiny_corpus(root / "tiny_ads.parquet", n=n)
    cfg = IndexConfig(columns=CorpusConfig(embedding="vec"),
                      cluster=ClusterConfig(branching=4, leaf_size=8))
    build_index(ads, out, cfg, progress=False)
    return out


def target_requests(path: Path, n: int = 30, start: int = 0) -> Path:
    ids = [f"q{i:04d}" for i in range(start, start + n)]
    queries = [f"{WORDS[i % len(WORDS)]} {WORDS[(3 * i) % len(WORDS)]}" for i in range(start, start + n)]
    pq.write_table(pa.table({"request_id": ids, "query": queries}), path)
    return path


def creative_requests(path: Path, n: int = 6) -> Path:
    pq.write_table(pa.table({
        "request_id": [f"c{i}" for i in range(n)],
        "ad_id": [f"ad-{i}" for i in range(n)],
        "advertiser": [f"Acme {WORDS[i]}" for i in range(n)],
        "description": [f"We sell the best {WORDS[i]} and {WORDS[i + 1]} in town." for i in range(n)],
    }), path)
    return path


def test_pickle_only_model_folder_is_refused(tmp_path):
    """A --model folder holding only pytorch_model.bin (pickle) is refused before anything loads it."""
    import pytest
    import torch

    from adbatch.models import UnsafeCheckpointError, load_causal_lm
    from conftest import make_tiny_llama

    model = make_tiny_llama(vocab_size=32)
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(UnsafeCheckpointError, match="pytorch_model.bin.*safetensors only"):
        load_causal_lm(tmp_path)
