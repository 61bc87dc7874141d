"""Special tokens follow the tokenizer's own settings (issue 18 item 5).

A tokenizer that declares ``add_bos_token`` (Gemma, Llama) gets its BOS at the start of every
calibration / perplexity row, every prompt and every training example, exactly once; one that does
not (the default SmolLM2, whose BOS token exists but is not added) gets none. Tokenizers: the
default model's, with its settings overridden at load time.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from adbatch.compress.calibration import token_blocks
from adbatch.serving.prompts import (encode_creative_prompt, encode_targeting_prompt, encode_text,
                             special_tokens_around)

TEXTS = ["Fresh bread delivered to your door every morning.", "Cloud accounting for small firms.",
         "Hand-made leather shoes since 1921.", "Solar panels installed in a day."] * 6
#: a chat template that, unlike Gemma's and Llama 3's, does not write {{ bos_token }} itself
NO_BOS_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}assistant:{% endif %}")
#: Gemma-style: the template writes the BOS itself
BOS_TEMPLATE = "{{ bos_token }}" + NO_BOS_TEMPLATE


def _load(**overrides):
    from transformers import AutoTokenizer

    from adbatch.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(), local_files_only=True, **overrides)


@contextlib.contextmanager
def _template(template, *toks):
    """The tokenizers with ``template`` as their chat template for the block."""
    saved = [t.chat_template for t in toks]
    for t in toks:
        t.chat_template = template
    try:
        yield toks
    finally:
        for t, s in zip(toks, saved):
            t.chat_template = s


@pytest.fixture(scope="module")
def plain():
    return _load()


@pytest.fixture(scope="module")
def bos():
    return _load(add_bos_token=True)


@pytest.fixture(scope="module")
def bos_eos():
    return _load(add_bos_token=True, add_eos_token=True)


def test_frame_read_from_the_tokenizer(plain, bos, bos_eos):
    # SmolLM2 names a BOS token (<|im_start|>, id 1) but does not add it
    assert plain.bos_token_id == 1 and special_tokens_around(plain) == ((), ())
    assert special_tokens_around(bos) == ((1,), ())
    assert special_tokens_around(bos_eos) == ((1,), (2,))
    body = plain("a headline", add_special_tokens=False)["input_ids"]
    assert encode_text(bos_eos, "a headline") == [1, *body]
    assert encode_text(bos_eos, "a headline", end=True) == [1, *body, 2]
    assert encode_text(plain, "a headline", end=True) == body


def test_token_blocks_without_bos_unchanged(plain):
    blocks = token_blocks(plain, TEXTS, 32)
    stream = [t for enc in plain(TEXTS, add_special_tokens=False)["input_ids"] for t in (*enc, plain.eos_token_id)]
    rows = len(stream) // 32
    assert blocks.tolist() == torch.tensor(stream[: rows * 32]).reshape(rows, 32).tolist()
    assert (blocks[:, 0] != 1).all()


def test_token_blocks_start_every_row_with_bos(plain, bos):
    blocks = token_blocks(bos, TEXTS, 32)
    assert blocks.shape[1] == 32 and blocks.shape[0] >= 4
    assert (blocks[:, 0] == 1).all()
    assert not (blocks[:, 1:] == 1).any()  # once per row, not per text
    # the rest of each row is the same EOS-joined stream, cut at 31
    stream = [t for enc in plain(TEXTS, add_special_tokens=False)["input_ids"] for t in (*enc, plain.eos_token_id)]
    assert blocks[:, 1:].reshape(-1).tolist() == stream[: blocks.shape[0] * 31]
    # tiny input: one shorter row, still with its BOS
    short = token_blocks(bos, ["Solar panels."], 64)
    assert short.shape[0] == 1 and short[0, 0] == 1 and short.shape[1] < 64


def test_model_sees_bos_in_calibration_and_perplexity(plain, bos):
    """Through ``calibrate`` and the compress report's perplexity on a tiny random-init Llama: the
    embedding's input ids start with BOS exactly when the tokenizer declares it."""
    from adbatch.compress.calibration import calibrate
    from adbatch.compress.recipe import CalibrationConfig
    from adbatch.compress.report import EvalSets, perplexity
    from tests.conftest import make_tiny_llama

    model = make_tiny_llama(vocab_size=len(plain), layers=1)
    seen: list[torch.Tensor] = []
    model.get_input_embeddings().register_forward_hook(lambda m, inp, out: seen.append(inp[0].detach().clone()))
    cfg = CalibrationConfig(batch_size=2, use_gradients=False, mode="full")
    for tok, want in ((plain, False), (bos, True)):
        seen.clear()
        calibrate(model, token_blocks(tok, TEXTS, 32), cfg)
        sets = EvalSets.build(tok, TEXTS[:8], seq_len=32)
        ppl = perplexity(model, sets.ads)
        assert ppl > 1.0
        assert seen and all(bool((ids[:, 0] == 1).all()) is want for ids in seen)
        assert all(bool((ids[:, 1:] == 1).any()) is False for ids in seen)


@pytest.mark.parametrize("encode", [lambda t: encode_targeting_prompt(t, "angle bracket"),
                                    lambda t: encode_creative_prompt(t, {"advertiser": "Acme", "industry": "tools"})],
                         ids=["targeting", "creative"])
def test_prompts_bos_once_where_declared(encode, plain, bos):
    default_ids = encode(plain)
    # SmolLM2's own template already starts with <|im_start|> (its BOS id): nothing doubled
    assert encode(bos) == default_ids
    for template in (NO_BOS_TEMPLATE, BOS_TEMPLATE):
        with _template(template, plain, bos):
            ids_plain, ids_bos = encode(plain), encode(bos)
        assert ids_bos[0] == 1 and ids_bos[1] != 1  # exactly one BOS where the tokenizer adds one
        if template is NO_BOS_TEMPLATE:
            assert ids_plain[0] != 1 and ids_bos == [1, *ids_plain]
        else:  # the template's own BOS is kept, not doubled
            assert ids_bos == ids_plain


def test_plain_frame_prompt_begins_with_bos_and_never_ends_with_eos(plain, bos_eos):
    with _template(None, plain, bos_eos):
        ids_plain = encode_targeting_prompt(plain, "saw")
        ids = encode_targeting_prompt(bos_eos, "saw")
    assert ids_plain[0] != 1 and ids == [1, *ids_plain]
    assert ids[-1] != 2  # the model continues after "Ad:", not after an EOS


def test_training_examples_begin_with_bos_where_declared(plain, bos):
    from adbatch.training.data import build_examples

    ad_ids, targets = ["a1", "a2"], [[500, 501], [502]]
    texts = {"a1": "bread", "a2": "shoes"}
    for tok, want in ((plain, False), (bos, True)):
        with _template(NO_BOS_TEMPLATE, tok):
            ex, _ = build_examples(tok, ad_ids, targets, texts, [("fresh loaf", "a1")])
        assert len(ex) == 3
        for e in range(len(ex)):
            tokens = ex.tokens[ex.offsets[e]:ex.offsets[e + 1]].tolist()
            assert (tokens[0] == 1) is want and tokens[1] != 1
            assert tokens[int(ex.prompt_lens[e]):] == targets[int(ex.rows[e])]


#: queries whose prompts must not depend on the batched path: spaces, non-ASCII, special-token text,
#: more than max_query_tokens tokens (in words, and in bytes of one word), empty
QUERIES = ["angle bracket", "  spaced  out ", "Émile's 12 in. x 3/4 ft — café ✓ 😀", "a <|im_end|> b",
           " ".join(["long"] * 80), "x" * 300, "😀" * 30, ""]


@pytest.mark.parametrize("template", ["own", None, NO_BOS_TEMPLATE, BOS_TEMPLATE])
def test_batched_targeting_prompts_equal_the_reference_rendering(template, plain, bos):
    from adbatch.serving.prompts import _targeting_frame, _targeting_prompt_one, encode_targeting_prompts

    def truncated(tok, q, limit=48):  # the reference truncation: tokens of the stripped query, decoded
        ids = tok(q.strip(), add_special_tokens=False)["input_ids"]
        return q.strip() if len(ids) <= limit else tok.decode(ids[:limit])

    for tok in (plain, bos):
        with contextlib.nullcontext() if template == "own" else _template(template, tok):
            assert _targeting_frame(tok) is not None  # the batched path, not the per-query fallback
            got = encode_targeting_prompts(tok, QUERIES)
            assert got == [_targeting_prompt_one(tok, truncated(tok, q)) for q in QUERIES]
            assert got[1] == encode_targeting_prompt(tok, QUERIES[1])
