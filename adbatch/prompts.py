"""Prompt rendering shared by targeting, creatives, training and evaluation.

One place decides how a query or an ad becomes the model's input, so a model trained on these
prompts (the train stage) sees exactly what the generate stage feeds it. Instruct models get their
chat template; models without one get a plain-text frame.
"""

from __future__ import annotations

from typing import Any, Mapping

TARGETING_INSTRUCTION = "Find the ad that best matches this search query."
CREATIVE_INSTRUCTION = "Write a short, catchy advertising headline (at most 10 words) for this advertiser."

#: ad fields shown to the creative model, in this order, when present and non-empty
CREATIVE_FIELDS = ("advertiser", "title", "description", "industry", "category", "keywords")


def _chat_or_plain(tokenizer: Any, user_text: str, plain_suffix: str) -> list[int]:
    template = getattr(tokenizer, "chat_template", None)
    if template:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": user_text}], tokenize=True, add_generation_prompt=True
        )
        if isinstance(ids, Mapping) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(user_text + plain_suffix, add_special_tokens=True)["input_ids"])


def truncate_text_tokens(tokenizer: Any, text: str, max_tokens: int) -> str:
    """Cut ``text`` to at most ``max_tokens`` tokens (decoded back to a string)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    return tokenizer.decode(ids[:max_tokens])


def encode_targeting_prompt(tokenizer: Any, query: str, max_query_tokens: int = 48) -> list[int]:
    """Token ids of the targeting prompt for ``query``; the ad's target sequence follows directly."""
    query = truncate_text_tokens(tokenizer, query.strip(), max_query_tokens)
    return _chat_or_plain(tokenizer, f"{TARGETING_INSTRUCTION}\nQuery: {query}", "\nAd:")


def render_ad_fields(ad: Mapping[str, Any], max_chars: int = 600) -> str:
    parts = []
    for key in CREATIVE_FIELDS:
        value = ad.get(key)
        if value is None:
            continue
        value = str(value).strip()
        if value:
            parts.append(f"{key.capitalize()}: {value}")
    return "\n".join(parts)[:max_chars]


def encode_creative_prompt(tokenizer: Any, ad: Mapping[str, Any], max_chars: int = 600) -> list[int]:
    """Token ids of the creative prompt for one ad/product record (fields in CREATIVE_FIELDS)."""
    return _chat_or_plain(tokenizer, f"{CREATIVE_INSTRUCTION}\n{render_ad_fields(ad, max_chars)}", "\nHeadline:")
