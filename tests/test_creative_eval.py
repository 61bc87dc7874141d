"""Creative metrics of ``adbatch eval`` (issue 18 item 2): ROUGE-1/2/L F1, distinct-n, prompt-copy and
empty shares (hand-computed values), the report's columns and sample table, and eval_creatives on a
handful of rows of the real slogan ``test-curated.csv`` (skipped when ../shared/data is absent)."""

from __future__ import annotations

import pytest

from adbatch.serving.prompts import creative_prompt_text
from adbatch.serving.prompts import CreativePrompt
from adbatch.eval.report import (creative_quality, distinct_n, empty_share, prompt_copy_fraction, prompt_copy_share,
                            prompt_echo, prompt_echo_share, rouge_f1, write_report)
from test_generate_support import tiny_model_dir

AD = {"advertiser": "Clearfunds", "description": "Business loans for small firms, decided in a day.",
      "industry": "financial services"}


def test_rouge_hand_computed():
    assert rouge_f1(["the cat sat"], ["the cat sat"]) == pytest.approx({"rouge1": 100.0, "rouge2": 100.0,
                                                                         "rougeL": 100.0})
    # hyp "the cat" vs ref "the cat sat": R1 P=1 R=2/3 -> F=0.8; R2 P=1 R=1/2 -> F=2/3; LCS = 2 -> 0.8
    r = rouge_f1(["the cat", "completely unrelated"], ["the cat sat", "the cat sat"])
    assert r == pytest.approx({"rouge1": 40.0, "rouge2": 100 / 3, "rougeL": 40.0})
    assert rouge_f1(["Running shoes"], ["run shoe"])["rouge1"] == pytest.approx(100.0)  # stemmed
    with pytest.raises(ValueError, match="hypotheses"):
        rouge_f1(["a"], [])


def test_distinct_n():
    # unigrams a b a a b: 2 distinct of 5; bigrams (a b) (b a) (a b): 2 of 3
    assert distinct_n(["a b a", "A, b!"], 1) == pytest.approx(0.4)
    assert distinct_n(["a b a", "A, b!"], 2) == pytest.approx(2 / 3)
    assert distinct_n(["", "one"], 2) == 0.0
    with pytest.raises(ValueError):
        distinct_n(["a"], 0)


def test_prompt_copy_and_empty_shares():
    prompt = creative_prompt_text(AD)
    assert prompt_copy_fraction("Advertiser: Clearfunds", prompt) == 1.0  # the prompt echoed back
    assert prompt_copy_fraction("Clearfunds: loans made simple", prompt) == 0.25  # a brand name is not a copy
    assert prompt_copy_fraction("Business loans for small firms", prompt) == 1.0
    assert prompt_copy_fraction("firms small loans", prompt) == pytest.approx(1 / 3)  # runs must be contiguous
    assert prompt_copy_fraction("", prompt) == 0.0
    outs = ["Advertiser: Clearfunds", "Clearfunds: loans made simple", "  ", "Money for small firms fast"]
    # fractions 1.0, 0.25, 0 (empty), 3/5 -> two of four copy >= 50 %
    assert prompt_copy_share(outs, [prompt] * 4) == 0.5
    assert prompt_copy_share(outs, [prompt] * 4, threshold=0.7) == 0.25
    assert empty_share(outs) == 0.25
    q = creative_quality(outs, ["Loans made simple"] * 4, [prompt] * 4)
    assert set(q) == {"rouge1", "rouge2", "rougeL", "bleu", "meteor", "distinct1", "distinct2", "copy_share",
                      "echo_share", "empty_share"}
    assert q["copy_share"] == 0.5 and q["empty_share"] == 0.25 and q["rouge1"] == pytest.approx(
        100 * (0 + 6 / 7 + 0 + 0) / 4)


@pytest.mark.parametrize("style", list(CreativePrompt))
def test_prompt_echo_flags_the_prompts_frame_not_a_headline_that_reuses_its_words(style):
    prompt = creative_prompt_text(AD, style=style)
    assert prompt_echo("Advertiser: Clearfunds", prompt)  # the untuned model's failure: a field label echoed
    assert prompt_echo("ADVERTISER:Clearfunds loans", prompt)
    assert prompt_echo("Industry: financial services", prompt)
    # a headline that reuses the ad's words (as 38 % of the human references do) is not an echo
    assert not prompt_echo("Clearfunds: loans made simple", prompt)
    assert not prompt_echo("Business loans for small firms", prompt)
    assert not prompt_echo("", prompt)
    # half of the prompt's own words in one verbatim run: the "copies >= 50 % of the prompt"
    short = "Advertiser: Clearfunds\nDescription: Fast loans"
    assert prompt_echo("Clearfunds description fast loans today", short)  # run of 4 of the prompt's 5 words
    assert not prompt_echo("Clearfunds: fast loans", short)  # runs of 1 and 2 words


def test_prompt_echo_flags_the_instruction_repeated():
    prompt = creative_prompt_text(AD, style=CreativePrompt.TUNED)
    assert prompt_echo("Write an advertising headline for this advertiser", prompt)
    outs = ["Write an advertising headline for this advertiser", "Loans in a day", "Advertiser: Clearfunds", ""]
    assert prompt_echo_share(outs, [prompt] * 4) == 0.5
    with pytest.raises(ValueError, match="prompts"):
        prompt_echo_share(outs, [prompt])


def test_report_lists_every_creative_metric_and_samples(tmp_path):
    row = {"variant": "dense", "rouge1": 12.5, "rouge2": 3.25, "rougeL": 11.0, "bleu": 1.5, "meteor": 0.1,
           "distinct1": 0.7, "distinct2": 0.9, "copy_share": 0.5, "echo_share": 0.25, "empty_share": 0.0,
           "invented_share": 0.2, "name_right_share": None, "name_use_share": 0.1, "flagged_share": 0.3, "examples": 10,
           "requests_per_s": 2.0, "ms_per_request": 500.0, "note": "greedy"}
    samples = [{"advertiser": f"adv {i}", "reference": f"ref {i}", "outputs": {"dense": f"out {i}"}}
               for i in range(10)]
    files = write_report(tmp_path, {"targeting": {"skipped": "x"},
                                    "creatives": {"data": "t.csv", "examples": 10, "rows_in_file": 994,
                                                  "rows": [row], "samples": samples}})
    text = files["report"].read_text()
    for col in ("ROUGE-1", "ROUGE-2", "ROUGE-L", "BLEU", "distinct-1", "distinct-2",
                "copy: >= 50% of words from prompt", "echo of prompt", "empty", "invented entity",
                "ad's name right (of uses)", "uses ad's name", "flagged by the checks", "requests/s"):
        assert f" {col} |" in text
    # no headline used the ad's name: its right share is undefined, shown as a dash
    assert ("| dense | 12.500 | 3.250 | 11.000 | 1.500 | 0.100 | 0.700 | 0.900 | 0.500 | 0.250 | 0.000 | 0.200 | – | "
            "0.100 | 0.300 | 10 |") in text
    assert "first 10 of 994 rows" in text and "35.58 / 18.47 / 33.32" in text
    assert sum(line.startswith("| adv ") for line in text.splitlines()) == 10


def test_eval_creatives_on_real_test_rows(shared_data, tmp_path):
    from adbatch.eval.datasets import load_slogan_test
    from pipelines.evaluate import CreativesEvalConfig, eval_creatives

    csv = shared_data / "slogan_gen" / "test-curated.csv"
    if not csv.is_file():
        pytest.skip(f"{csv} not found")
    assert CreativesEvalConfig().max_examples is None  # the default evaluates the whole file
    assert load_slogan_test(csv).num_rows == 994
    cfg = CreativesEvalConfig.from_dict({"csv": str(csv), "max_examples": 4, "batch_size": 4,
                                         "creative": {"max_new_tokens": 3}})
    res = eval_creatives(cfg, str(tiny_model_dir(tmp_path)), None, 0)
    assert res["examples"] == 4 and res["rows_in_file"] == 994
    (row,) = res["rows"]
    for k in ("rouge1", "rouge2", "rougeL", "bleu"):
        assert 0.0 <= row[k] <= 100.0
    for k in ("meteor", "distinct1", "distinct2", "copy_share", "empty_share", "invented_share", "name_use_share",
              "flagged_share"):
        assert 0.0 <= row[k] <= 1.0
    assert row["name_right_share"] is None or 0.0 <= row["name_right_share"] <= 1.0
    assert row["examples"] == 4 and row["requests_per_s"] > 0
    assert len(res["samples"]) == 4 and all(s["reference"] and "dense" in s["outputs"] for s in res["samples"])


def test_refresh_prints_samples_and_what_the_budget_reached(tmp_path):
    """The refresh's closing print (issue 18 item 4): query -> top 3 ads with titles, ad -> headline with
    the copy share, and the training budget line, read back from the stage folders."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from jobs.nightly_refresh import _sample_lines

    work = tmp_path / "work"
    for d in ("index", "generate/targets/targets", "generate/creatives/creatives", "model"):
        (work / d).mkdir(parents=True)
    corpus = tmp_path / "ads.parquet"
    pq.write_table(pa.table({"ad_id": ["a1", "a2", "a3"], "title": ["Bread Daily", "Shoes For Life", "Sun Power"]}),
                   corpus)
    (work / "index" / "manifest.json").write_text(json.dumps({"input_files": [str(corpus)], "config": {}}))
    treq, creq = tmp_path / "treq.parquet", tmp_path / "creq.parquet"
    pq.write_table(pa.table({"request_id": ["t0", "t1"], "query": ["fresh bread", "solar"]}), treq)
    pq.write_table(pa.table({"request_id": ["c0", "c1"], "ad_id": ["a1", "a3"], "advertiser": ["Acme Bakery", "Sunco"],
                             "description": ["Fresh bread every morning.", "Solar panels fitted in a day."]}), creq)
    for task, req in (("targets", treq), ("creatives", creq)):
        (work / "generate" / task / "manifest.json").write_text(json.dumps({"config": {"requests": str(req)}}))
    pq.write_table(pa.table({"request_id": ["t0"] * 3 + ["t1"] * 3, "rank": [2, 1, 3, 1, 2, 3],
                             "ad_id": ["a2", "a1", "a3", "a1", "a3", "a2"],
                             "channel": ["dense", "both", "generative", "both", "dense", "dense"]}),
                   work / "generate/targets/targets/part-0.parquet")
    pq.write_table(pa.table({"ad_id": ["a1", "a3"], "variant": [0, 0],
                             "headline": ["Bread Worth Waking Up For", "Advertiser: Sunco"],
                             "flags": [[], ["echo"]]}),
                   work / "generate/creatives/creatives/part-0.parquet")
    (work / "model" / "adbatch_training.json").write_text(json.dumps(
        {"train": {"steps": 2, "epochs_done": 0.0016, "tokens_per_s": 76.4, "stopped_early": True}}))
    result = {"work": str(work), "model": str(work / "model"),
              "outputs": {"targets": str(work / "generate/targets/targets"),
                          "creatives": str(work / "generate/creatives/creatives")}}
    lines = _sample_lines(result)
    text = "\n".join(lines)
    assert lines[:5] == ["targets (query -> top 3 ads; [the channel that proposed each: generative, dense or both]):",
                         "  'fresh bread'", "    1. a1: Bread Daily [both]", "    2. a2: Shoes For Life [dense]",
                         "    3. a3: Sun Power [generative]"]
    assert "1 distinct top-1 ads over 2 queries; the most common, a1, tops 2" in text
    assert "  Acme Bakery -> 'Bread Worth Waking Up For' [Bread Daily]\n" in text + "\n"
    assert "  Sunco -> 'Advertiser: Sunco' [Sun Power] FLAGGED: echo" in text
    assert "  1 of 2 headlines flagged by the checks" in text
    assert ("  2 headlines: 50% echo the prompt (a field label, or half of its words), 50% take half of their own "
            "words from it, 0% empty") in text
    assert lines[-1].startswith("this budget reached: 2 optimizer steps (0.16% of an epoch at 76 tokens/s, "
                                "stopped by the time/step budget); too little for the model to tell the queries "
                                "apart (a1 tops 2 of 2)")
