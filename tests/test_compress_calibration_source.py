"""Where calibration texts come from (issue 17 item 4): with an index, the ads it was built from and
queries rendered as the targeting prompt + the ad's target -- what the served model reads -- not the
bundled example corpus."""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from adbatch.compress.calibration import EXAMPLE_CORPUS, example_corpus_split, served_calibration_texts
from adbatch.compress.recipe import CalibrationConfig
from adbatch.config import ConfigError
from adbatch.serving.prompts import TARGETING_INSTRUCTION, encode_targeting_prompt, special_tokens_around
from test_generate_support import tiny_index_dir, tiny_model_dir


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("calib_source")
    index = tiny_index_dir(root)  # 40 synthetic ads, text scheme; corpus at root / tiny_ads.parquet
    corpus = pq.read_table(root / "tiny_ads.parquet")
    ids, titles = corpus.column("ad_id").to_pylist(), corpus.column("title").to_pylist()
    queries = root / "queries.parquet"
    pq.write_table(pa.table({"query": [f"labelled query {i}" for i in range(6)], "ad_id": ids[:6]}), queries)
    return {"root": root, "index": index, "titles": dict(zip(ids, titles)), "queries": queries}


def _example_texts() -> set[str]:
    t = pq.read_table(EXAMPLE_CORPUS, columns=["title", "description"])
    return set(t.column("title").to_pylist()) | set(t.column("description").to_pylist())


def _query_part(tok, text: str, index) -> tuple[list[int], int]:
    """(ids of ``text``, row of the index whose target ends it); asserts the prompt + target layout."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    targets = [list(t) for t in index.sequences()]
    eos = tok.eos_token_id
    rows = [r for r, t in enumerate(targets) if ids[-(len(t) - 1):] == t[:-1] and t[-1] == eos]
    assert rows, text
    return ids, rows[0]


def test_texts_come_from_the_index_corpus_and_its_queries(assets, default_tokenizer):
    from adbatch.index.build import load_index

    tok, index = default_tokenizer, load_index(assets["index"])
    pairs = pq.read_table(assets["queries"]).to_pylist()
    cfg = CalibrationConfig(num_texts=20, seed=0)
    texts = served_calibration_texts(assets["index"], tok, cfg, queries=[(p["query"], p["ad_id"]) for p in pairs])
    assert len(texts) == 20
    assert texts == served_calibration_texts(assets["index"], tok, cfg,
                                             queries=[(p["query"], p["ad_id"]) for p in pairs])
    assert not set(texts) & _example_texts()
    ads, prompts = texts[:10], texts[10:]
    assert set(ads) <= set(assets["titles"].values())  # the corpus' own texts (title-only corpus)
    by_query = {p["query"]: p["ad_id"] for p in pairs}
    prefix = list(special_tokens_around(tok)[0])
    seen_labelled = 0
    for text in prompts:
        assert TARGETING_INSTRUCTION in text
        ids, row = _query_part(tok, text, index)
        query = re.search(r"Query: (.*?)<\|im_end\|>", text).group(1)
        want = encode_targeting_prompt(tok, query)
        want = want[len(prefix):] if want[:len(prefix)] == prefix else want
        assert ids[:len(want)] == want  # exactly the served prompt's tokens, then the ad's target
        if query in by_query:
            seen_labelled += 1
            assert index.ad_ids[row] == by_query[query]
        else:  # topped up with pseudo-queries: words of the target ad's title
            title_words = set(assets["titles"][index.ad_ids[row]].lower().split())
            assert query.split() and set(query.split()) <= title_words | {w[:-1] for w in title_words}
    assert seen_labelled == 6  # every labelled pair used, 4 pseudo-queries top up to 10


def test_without_labelled_queries_every_prompt_is_a_pseudo_query(assets, default_tokenizer):
    from adbatch.index.build import load_index

    index = load_index(assets["index"])
    texts = served_calibration_texts(assets["index"], default_tokenizer, CalibrationConfig(num_texts=8, seed=1),
                                     query_share=0.5)
    assert len(texts) == 8 and all(TARGETING_INSTRUCTION in t for t in texts[4:])
    assert not any(TARGETING_INSTRUCTION in t for t in texts[:4])
    for text in texts[4:]:
        _query_part(default_tokenizer, text, index)


def test_compress_with_index_calibrates_on_it_not_on_the_example(assets, tmp_path, monkeypatch, default_tokenizer):
    import adbatch.compress.calibration as calibration
    import adbatch.compress.report  # noqa: F401 - imported before the patch, so it binds the real token_blocks
    from pipelines.compress import CompressJobConfig, run_compress

    seen = {}

    class Stop(Exception):
        pass

    def capture(tok, texts, seq_len):
        seen["texts"] = texts
        raise Stop

    monkeypatch.setattr(calibration, "token_blocks", capture)
    calib = CalibrationConfig(num_texts=8, seq_len=32, batch_size=2)
    model = tiny_model_dir(assets["root"])
    job = CompressJobConfig(model=str(model), index=assets["index"], queries=assets["queries"],
                            out=tmp_path / "out", use_ray=False, calibration=calib, eval_texts=4, eval_seq_len=16)
    with pytest.raises(Stop):
        run_compress(job)
    pairs = [(r["query"], r["ad_id"]) for r in pq.read_table(assets["queries"]).to_pylist()]
    assert seen["texts"] == served_calibration_texts(assets["index"], default_tokenizer, calib, queries=pairs)
    assert not set(seen["texts"]) & _example_texts()
    # without an index the same job samples the bundled example (unchanged)
    with pytest.raises(Stop):
        run_compress(job.replace(index=None, queries=None, out=tmp_path / "out2"))
    assert seen["texts"] == example_corpus_split(8, 0, 0)[0]


@pytest.mark.parametrize("bad", [{"calib": "x.txt", "index": "idx"}, {"queries": "q.parquet"}, {"ads": "a.parquet"}])
def test_calibration_sources_are_exclusive(bad):
    from pipelines.compress import CompressJobConfig

    with pytest.raises(ConfigError, match="calib|index"):
        CompressJobConfig.from_dict(bad)
