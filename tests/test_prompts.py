"""Targeting prompt rendering (version 2) and the guard against models trained on another rendering."""

from __future__ import annotations

import json

import pytest

from adbatch.serving.prompts import TARGETING_INSTRUCTION, TARGETING_PROMPT_VERSION, encode_targeting_prompt


def test_targeting_prompt_puts_instruction_in_system_turn(default_tokenizer):
    ids = encode_targeting_prompt(default_tokenizer, "  angle bracket ")
    text = default_tokenizer.decode(ids)
    # the instruction replaces the template's default system prompt (the v1 prompt was 45 tokens)
    assert text.startswith(f"<|im_start|>system\n{TARGETING_INSTRUCTION}<|im_end|>")
    assert "SmolLM" not in text
    assert "<|im_start|>user\nQuery: angle bracket<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert len(ids) == 28


class _NoSystemRoleTokenizer:
    """A chat template that rejects a system turn, as Gemma's does."""

    chat_template = "<user>...</user>"

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, text, **kw):
        return self.tok(text, **kw)

    def apply_chat_template(self, messages, **kw):
        if any(m["role"] == "system" for m in messages):
            raise ValueError("System role not supported")
        return self.tok("".join(f"<user>{m['content']}</user>" for m in messages), add_special_tokens=False)["input_ids"]


def test_template_without_system_role_gets_instruction_in_user_turn(default_tokenizer):
    ids = encode_targeting_prompt(_NoSystemRoleTokenizer(default_tokenizer), "drill")
    assert default_tokenizer.decode(ids) == f"<user>{TARGETING_INSTRUCTION}\nQuery: drill</user>"


class _PlainTokenizer:
    """A tokenizer without a chat template (base models)."""

    chat_template = None

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, text, **kw):
        return self.tok(text, **kw)


def test_plain_tokenizer_frame(default_tokenizer):
    ids = encode_targeting_prompt(_PlainTokenizer(default_tokenizer), "saw")
    assert default_tokenizer.decode(ids) == f"{TARGETING_INSTRUCTION}\nQuery: saw\nAd:"


@pytest.mark.parametrize("version, ok", [(None, False), (1, False), (TARGETING_PROMPT_VERSION, True)])
def test_model_trained_on_other_prompt_version_is_refused(tmp_path, version, ok):
    from adbatch.serving.generators import ModelSpec, check_model_index
    from adbatch.training import IndexMismatchError

    record = {"trained_on_index": "ab" * 32}
    if version is not None:
        record["targeting_prompt_version"] = version
    (tmp_path / "adbatch_training.json").write_text(json.dumps(record))
    (tmp_path / "config.json").write_text("{}")
    from adbatch.index.trie import Trie

    Trie.from_sequences([[5, 6, 2]]).save(tmp_path / "trie.safetensors")  # the driver reads its vocabulary bound
    manifest = {"index_hash": "ab" * 32, "scheme": "text"}
    spec = ModelSpec(model=str(tmp_path))
    if ok:
        assert check_model_index(spec, tmp_path, manifest)["trained_on_index"] == "ab" * 32
    else:
        with pytest.raises(IndexMismatchError, match="targeting prompts of version 1"):
            check_model_index(spec, tmp_path, manifest)


def test_long_ad_text_cut_in_the_prompt_is_logged_once(caplog, monkeypatch):
    """Validation accepts up to 4,000 characters of ad fields, the prompt keeps AD_PROMPT_CHARS: the cut
    is logged (once per process), not silent."""
    import logging

    import adbatch.serving.generators as gen
    from adbatch.serving.prompts import AD_PROMPT_CHARS, render_ad_fields

    monkeypatch.setattr(gen, "_CUT_WARNED", False)
    short = {"request_id": "s", "title": "Cordless drill"}
    long = {"request_id": "l", "title": "Saw", "description": "x" * (AD_PROMPT_CHARS + 50)}
    assert len(render_ad_fields(long)) == AD_PROMPT_CHARS and len(render_ad_fields(long, None)) > AD_PROMPT_CHARS
    with caplog.at_level(logging.WARNING, logger="adbatch.serving.generators"):
        gen._warn_cut_ad_text([short])
        assert not caplog.records
        gen._warn_cut_ad_text([short, long, long])
        gen._warn_cut_ad_text([long])
    assert len(caplog.records) == 1
    assert "request l (and 1 more" in caplog.records[0].getMessage()


def test_creative_prompt_v2_is_few_shot_chat(default_tokenizer):
    """Version 2: instruction as the system turn, each worked example a user turn answered by its
    headline, then the ad; the examples' headlines are not copies of their own fields."""
    from adbatch.serving.prompts import (CREATIVE_EXAMPLES, CREATIVE_INSTRUCTION, CREATIVE_PROMPT_VERSION,
                                 creative_prompt_text, encode_creative_prompt, render_ad_fields)
    from adbatch.eval.report import prompt_copy_fraction

    assert CREATIVE_PROMPT_VERSION == 2 and len(CREATIVE_EXAMPLES) == 3
    ad = {"advertiser": "Acme", "description": "Power tools for trades.", "industry": "tools"}
    text = default_tokenizer.decode(encode_creative_prompt(default_tokenizer, ad))
    assert text.startswith(f"<|im_start|>system\n{CREATIVE_INSTRUCTION}<|im_end|>\n")
    for example, headline in CREATIVE_EXAMPLES:
        assert (f"<|im_start|>user\n{render_ad_fields(example)}<|im_end|>\n"
                f"<|im_start|>assistant\n{headline}<|im_end|>\n") in text
        assert prompt_copy_fraction(headline, render_ad_fields(example)) < 0.5
    assert text.endswith(f"<|im_start|>user\n{render_ad_fields(ad)}<|im_end|>\n<|im_start|>assistant\n")
    plain = default_tokenizer.decode(encode_creative_prompt(_PlainTokenizer(default_tokenizer), ad))
    first, headline = CREATIVE_EXAMPLES[0]
    assert plain.startswith(f"{CREATIVE_INSTRUCTION}\n{render_ad_fields(first)}\nHeadline: {headline}\n\n")
    assert plain.endswith(f"{render_ad_fields(ad)}\nHeadline:")
    # the copy metric's text holds everything the model is shown
    shown = creative_prompt_text(ad)
    assert all(h in shown for _, h in CREATIVE_EXAMPLES) and shown.endswith(render_ad_fields(ad))
