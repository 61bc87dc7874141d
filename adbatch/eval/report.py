"""Creative-quality metrics and the evaluation report (``report.md`` + PNG plots).

Creative metrics (one implementation each, used by ``adbatch eval`` and the nightly refresh):

- ROUGE-1/2/L F1 (:func:`rouge_f1`): Google's ``rouge-score`` (ROUGE-1.5.5 re-implementation,
  Porter stemmer on), mean sentence F1 x 100: the scale of Jin et al. 2021's 35.58 / 18.47 / 33.32.
- BLEU (:func:`corpus_bleu`): sacrebleu corpus BLEU. METEOR (:func:`meteor_exact_stem`): below.
- distinct-n (:func:`distinct_n`, Li et al. 2016): distinct word n-grams / all word n-grams over the
  outputs (a model that writes the same headline for every ad scores near 0).
- prompt-copy share (:func:`prompt_copy_share`): the share of outputs whose longest run of
  consecutive words found verbatim in their prompt covers ``>= 50 %`` of the output's words
  (:func:`prompt_copy_fraction`): "Advertiser: Clearfunds" copies 100 % of itself from the prompt,
  "Clearfunds: loans made simple" 25 %. Empty outputs are not copies; they count in the empty share.
  Human headlines reuse the ad's words too: 38 % of the slogan test set's references count as copies.
- prompt-echo share (:func:`prompt_echo_share`): the share of outputs that reproduce the prompt instead
  of writing from it -- they carry one of the prompt's field labels ("Advertiser: Clearfunds"), repeat the
  instruction line, or copy ``>= 50 %`` of the prompt's own words in one verbatim run (issue 18's "copy >= 50 % of the prompt").
  This is the failure of an untuned model echoing its input; 0 % of the slogan references do it.
- empty share (:func:`empty_share`): outputs with no word.
- truthfulness (:func:`adbatch.eval.truthfulness.truthfulness`, when the ads' fields are given): the share of
  outputs that name an entity (a name, place, acronym, number, or a changed word of the ad's name) absent
  from their ad's own fields (``invented_share``), the share that use the ad's name (``name_use_share``)
  and, of those, the share that keep it right (``name_right_share``). The rules are in that module's
  docstring; 16.6 % of the slogan test set's 994 human references name an entity their ad's fields lack by
  it (the data's own ``unsupported`` label: 11.8 %; the two agree on 88.5 % of the rows).

METEOR here is the *exact + stem* variant: nltk's implementation (unigram alignment, F-mean with
recall weight, fragmentation penalty) with the WordNet synonym stage switched off, because nltk
downloads WordNet from the internet and our machines have none. Scores are therefore a little lower
than METEOR with synonyms; the report labels the column ``METEOR (exact+stem)``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

log = logging.getLogger(__name__)

_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")


def _tokens(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


class _NoSynonyms:
    """Stands in for nltk's WordNet reader: no synsets, so only exact and stem matches count."""

    def synsets(self, *args: Any, **kwargs: Any) -> list:
        return []


def meteor_exact_stem(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Mean sentence METEOR (exact + Porter-stem matches, no synonyms) in [0, 1]."""
    from nltk.translate.meteor_score import meteor_score

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses vs {len(references)} references")
    if not hypotheses:
        return 0.0
    wn = _NoSynonyms()
    scores = [meteor_score([_tokens(r)], _tokens(h), wordnet=wn) for h, r in zip(hypotheses, references)]
    return float(sum(scores) / len(scores))


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """sacrebleu corpus BLEU (13a tokenization, 0-100) against one reference per hypothesis."""
    import sacrebleu

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses vs {len(references)} references")
    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


def rouge_f1(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Mean sentence ROUGE-1/2/L F1 x 100 (``rouge-score``, stemmed): keys ``rouge1``, ``rouge2``, ``rougeL``."""
    try:
        from rouge_score import rouge_scorer
    except ImportError as e:  # an install without the dependency (pyproject lists it)
        raise ImportError("ROUGE needs the 'rouge-score' package: pip install rouge-score") from e

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses vs {len(references)} references")
    keys = ("rouge1", "rouge2", "rougeL")
    if not hypotheses:
        return {k: 0.0 for k in keys}
    scorer = rouge_scorer.RougeScorer(list(keys), use_stemmer=True)
    sums = dict.fromkeys(keys, 0.0)
    for h, r in zip(hypotheses, references):
        scores = scorer.score(r, h)  # (target, prediction)
        for k in keys:
            sums[k] += scores[k].fmeasure
    return {k: 100.0 * v / len(hypotheses) for k, v in sums.items()}


def distinct_n(hypotheses: Sequence[str], n: int) -> float:
    """Distinct word n-grams / all word n-grams over ``hypotheses`` (0 when there are none)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    grams = [tuple(w[i:i + n]) for w in map(_tokens, hypotheses) for i in range(len(w) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def _longest_common_run(out: list[str], src: list[str]) -> int:
    """Length of the longest run of consecutive words shared by ``out`` and ``src`` (longest common
    substring over words: one DP row per ``src`` word, O(|out| * |src|))."""
    best, prev = 0, [0] * (len(out) + 1)
    for w in src:
        cur = [0] * (len(out) + 1)
        for j, o in enumerate(out, 1):
            if o == w:
                cur[j] = prev[j - 1] + 1
                best = max(best, cur[j])
        prev = cur
    return best


def prompt_copy_fraction(output: str, prompt: str) -> float:
    """Longest run of consecutive words of ``output`` that occurs as consecutive words of ``prompt``,
    over the output's word count (0 for an output without words)."""
    out = _tokens(output)
    return _longest_common_run(out, _tokens(prompt)) / len(out) if out else 0.0


def _share(outputs: Sequence[str], prompts: Sequence[str], flagged: Callable[[str, str], bool]) -> float:
    """Share of ``outputs`` that ``flagged(output, its prompt)``."""
    if len(outputs) != len(prompts):
        raise ValueError(f"{len(outputs)} outputs vs {len(prompts)} prompts")
    if not outputs:
        return 0.0
    return sum(flagged(o, p) for o, p in zip(outputs, prompts)) / len(outputs)


def prompt_copy_share(outputs: Sequence[str], prompts: Sequence[str], threshold: float = 0.5) -> float:
    """Share of ``outputs`` with :func:`prompt_copy_fraction` ``>= threshold`` against their prompt."""
    return _share(outputs, prompts, lambda o, p: prompt_copy_fraction(o, p) >= threshold)


#: a field label at the start of a prompt line ("Advertiser: ...", "Description: ..."): the prompt's frame
_FIELD_LABEL = re.compile(r"^\s*([A-Za-z][A-Za-z _-]{0,30}):", re.MULTILINE)


def prompt_echo(output: str, prompt: str, threshold: float = 0.5) -> bool:
    """Whether ``output`` echoes ``prompt``: it contains a field label of the prompt's frame (a ``Label:``
    that starts one of the prompt's lines, matched case-insensitively as ``label:``), or a whole unlabelled
    prompt line of >= 3 words (the instruction), or its longest verbatim word run shared with the prompt
    covers ``>= threshold`` of the *prompt's* words."""
    out = _tokens(output)
    if not out:
        return False
    low = output.lower()
    if any(f"{m.strip().lower()}:" in low for m in _FIELD_LABEL.findall(prompt)):
        return True
    # an unlabelled prompt line (the instruction) of >= 3 words reproduced whole
    joined = f" {' '.join(out)} "
    for line in prompt.splitlines():
        words = _tokens(line)
        if len(words) >= 3 and not _FIELD_LABEL.match(line) and f" {' '.join(words)} " in joined:
            return True
    src = _tokens(prompt)
    return bool(src) and _longest_common_run(out, src) >= threshold * len(src)


def prompt_echo_share(outputs: Sequence[str], prompts: Sequence[str], threshold: float = 0.5) -> float:
    """Share of ``outputs`` that :func:`prompt_echo` their prompt."""
    return _share(outputs, prompts, lambda o, p: prompt_echo(o, p, threshold))


def empty_share(outputs: Sequence[str]) -> float:
    """Share of ``outputs`` without a single word."""
    return sum(not _tokens(o) for o in outputs) / len(outputs) if outputs else 0.0


def creative_quality(outputs: Sequence[str], references: Sequence[str], prompts: Sequence[str],
                     ads: Sequence[Mapping[str, Any]] | None = None) -> dict[str, float | None]:
    """Every creative metric of the report for one variant: ``rouge1``, ``rouge2``, ``rougeL``, ``bleu``,
    ``meteor``, ``distinct1``, ``distinct2``, ``copy_share``, ``echo_share``, ``empty_share`` (``prompts``:
    the text each output was generated from, for the copy and echo shares) and, when ``ads`` (each output's
    ad fields) are given, ``invented_share``, ``name_use_share``, ``name_right_share``
    (:func:`adbatch.eval.truthfulness.truthfulness`)."""
    out: dict[str, float | None] = {
        **rouge_f1(outputs, references), "bleu": corpus_bleu(outputs, references),
        "meteor": meteor_exact_stem(outputs, references), "distinct1": distinct_n(outputs, 1),
        "distinct2": distinct_n(outputs, 2), "copy_share": prompt_copy_share(outputs, prompts),
        "echo_share": prompt_echo_share(outputs, prompts), "empty_share": empty_share(outputs)}
    if ads is not None:
        from adbatch.eval.truthfulness import truthfulness

        out.update(truthfulness(outputs, ads))
    return out


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _table(rows: list[dict[str, Any]], cols: list[tuple[str, str]]) -> str:
    head = "| " + " | ".join(title for _, title in cols) + " |"
    sep = "|" + "|".join("---" for _ in cols) + "|"
    body = ["| " + " | ".join(_fmt(r.get(key)) for key, _ in cols) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def _bar_plot(path: Path, labels: list[str], series: dict[str, list[float]], title: str, ylabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels) + 2), 4))
    width = 0.8 / max(len(series), 1)
    for j, (name, vals) in enumerate(series.items()):
        xs = [i + j * width for i in range(len(labels))]
        ax.bar(xs, vals, width=width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))])
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


TARGETING_COLS = [("variant", "variant"), ("channel", "channel"), ("scheme", "scheme"), ("verify", "verify"),
                  ("recall@1", "recall@1"), ("recall@10", "recall@10"), ("mrr@10", "MRR@10"),
                  ("ndcg@10", "nDCG@10"), ("queries", "queries"), ("queries_per_s", "queries/s"),
                  ("ms_per_query", "ms/query"), ("note", "note")]
CREATIVE_COLS = [("variant", "variant"), ("rouge1", "ROUGE-1"), ("rouge2", "ROUGE-2"), ("rougeL", "ROUGE-L"),
                 ("bleu", "BLEU"), ("meteor", "METEOR (exact+stem)"), ("distinct1", "distinct-1"),
                 ("distinct2", "distinct-2"), ("copy_share", "copy: >= 50% of words from prompt"),
                 ("echo_share", "echo of prompt"), ("empty_share", "empty"),
                 ("invented_share", "invented entity"), ("name_right_share", "ad's name right (of uses)"),
                 ("name_use_share", "uses ad's name"), ("flagged_share", "flagged by the checks"),
                 ("examples", "examples"), ("requests_per_s", "requests/s"),
                 ("ms_per_request", "ms/request"), ("note", "note")]


def write_report(out: Path, results: dict[str, Any]) -> dict[str, Path]:
    """Write ``out/report.md`` and its plots from :func:`pipelines.evaluate.run_eval`'s results."""
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    lines = ["# adbatch evaluation report", ""]
    meta = results.get("meta", {})
    lines += [f"- created: {meta.get('created')}", f"- machine: {meta.get('machine')}",
              f"- code version: {meta.get('code_version')}", ""]

    t = results.get("targeting", {})
    lines += ["## Targeting (Home Depot search relevance)", ""]
    if t.get("skipped"):
        lines += [f"Skipped: {t['skipped']}", ""]
    else:
        lines += [f"- catalogue: {t.get('catalogue')}", f"- queries: {t.get('query_split')}",
                  "- relevant = relevance >= 2.67; graded gains for nDCG; unjudged products count "
                  "as not relevant (judgments are pooled, so absolute recall is a lower bound)",
                  f"- index: {t.get('index')}", ""]
        rows = t.get("rows", [])
        lines += [_table(rows, TARGETING_COLS), ""]
        ok = [r for r in rows if r.get("recall@10") is not None]
        if ok:
            png = out / "targeting_quality.png"
            _bar_plot(png, [f"{r['variant']}/{r.get('channel') or '-'}/{r.get('verify') or '-'}" for r in ok],
                      {m: [float(r[m]) for r in ok] for m in ("recall@1", "recall@10", "mrr@10", "ndcg@10")},
                      "Targeting quality (Home Depot test queries)", "score")
            png2 = out / "targeting_throughput.png"
            _bar_plot(png2, [f"{r['variant']}/{r.get('channel') or '-'}/{r.get('verify') or '-'}" for r in ok],
                      {"queries/s": [float(r["queries_per_s"]) for r in ok]},
                      "Targeting throughput (this machine)", "queries per second")
            files.update({"targeting_quality": png, "targeting_throughput": png2})
            lines += [f"![targeting quality]({png.name})", "", f"![targeting throughput]({png2.name})", ""]

    c = results.get("creatives", {})
    lines += ["## Creatives (slogan test-curated)", ""]
    if c.get("skipped"):
        lines += [f"Skipped: {c['skipped']}", ""]
    else:
        lines += [f"- data: {c.get('data')}; first {c.get('examples')} of {c.get('rows_in_file', '?')} rows",
                  "- ROUGE-1/2/L: rouge-score F1 x 100 (stemmed), mean over sentences; published anchor on the "
                  "same test set (Jin et al. 2021, arXiv 2102.05924): 35.58 / 18.47 / 33.32",
                  "- BLEU: sacrebleu corpus BLEU, one human reference per ad",
                  "- METEOR (exact+stem): nltk METEOR without WordNet synonyms (offline), mean "
                  "over sentences",
                  "- distinct-1/2: distinct word uni/bigrams over all outputs; copy: share of outputs whose "
                  "longest verbatim word run from the prompt is >= half their words (38 % of the human "
                  "references on this test set); echo: share of outputs that carry a field label of the prompt "
                  "(\"Advertiser:\") or copy >= half of the prompt's own words; empty: share of outputs with no "
                  "word",
                  "- invented entity: share of outputs naming a name, place, acronym, number or changed word of the "
                  "ad's name absent from the ad's own fields (adbatch.eval.truthfulness; 16.6 % of the human references); "
                  "ad's name right: of the outputs that use the ad's name, the share that keep it unchanged; flagged: "
                  "share of written headlines that failed a generation check (adbatch.serving.checks)", ""]
        rows = c.get("rows", [])
        lines += [_table(rows, CREATIVE_COLS), ""]
        ok = [r for r in rows if r.get("bleu") is not None]
        if ok:
            png = out / "creatives_quality.png"
            _bar_plot(png, [r["variant"] for r in ok],
                      {"ROUGE-L/100": [float(r.get("rougeL") or 0.0) / 100 for r in ok],
                       "BLEU/100": [float(r["bleu"]) / 100 for r in ok],
                       "METEOR": [float(r["meteor"]) for r in ok],
                       "copy share": [float(r.get("copy_share") or 0.0) for r in ok],
                       "echo share": [float(r.get("echo_share") or 0.0) for r in ok]},
                      "Creative quality (slogan test-curated)", "score")
            files["creatives_quality"] = png
            lines += [f"![creatives quality]({png.name})", ""]
        samples = c.get("samples", [])
        if samples:
            lines += ["### Samples", "", "| advertiser | reference | " +
                      " | ".join(s for s in samples[0]["outputs"]) + " |",
                      "|---|---|" + "|".join("---" for _ in samples[0]["outputs"]) + "|"]
            for s in samples:
                cells = [s["advertiser"], s["reference"], *s["outputs"].values()]
                lines.append("| " + " | ".join(str(x).replace("|", "/") for x in cells) + " |")
            lines.append("")
    path = out / "report.md"
    from adbatch.artifacts import atomic_path

    with atomic_path(path) as tmp:
        tmp.write_text("\n".join(lines) + "\n")
    files["report"] = path
    return files
