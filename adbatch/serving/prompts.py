"""Prompt rendering shared by targeting, creatives, training and evaluation.

One place decides how a query or an ad becomes the model's input, so a model trained on these
prompts (the train stage) sees exactly what the generate stage feeds it. Instruct models get their
chat template; models without one get a plain-text frame. Free text is encoded the way the
tokenizer wants it (:func:`encode_text`: its BOS where it declares ``add_bos_token``, none where
it does not), here and in every stage that tokenizes text (calibration, perplexity, training).
"""

from __future__ import annotations

import enum
import weakref
from typing import Any, Mapping, Sequence

TARGETING_INSTRUCTION = "Find the ad that best matches this search query."
#: bumped whenever the targeting prompt's rendering changes: a model trained on one rendering must be
#: retrained (the nightly refresh's train stage takes it as an input; checkpoints record it)
TARGETING_PROMPT_VERSION = 2
CREATIVE_INSTRUCTION = "Write a short, catchy advertising headline (at most 10 words) for this advertiser."
#: bumped whenever the creative prompt's rendering changes: headlines generated and creative examples
#: trained on one rendering are stale under another
CREATIVE_PROMPT_VERSION = 2
#: worked examples the creative prompt shows before the ad (version 2). Made-up advertisers written for
#: this repository -- never rows of the slogan data or the example corpus -- whose headlines share no
#: run of words with their descriptions, so the model sees headlines that are not copies.
CREATIVE_EXAMPLES: tuple[tuple[dict[str, str], str], ...] = (
    ({"advertiser": "Northwind Bikes", "description": "Hand-built city and touring bicycles, with free servicing "
      "for the first year.", "industry": "sporting goods"}, "Ride Further on a Bike Built by Hand"),
    ({"advertiser": "Lumen Dental", "description": "Family dental clinic offering check-ups, whitening and "
      "emergency appointments six days a week.", "industry": "medical practice"}, "Brighter Smiles for the Whole Family"),
    ({"advertiser": "Ledgerly", "description": "Cloud bookkeeping software that reconciles bank feeds and files VAT "
      "returns for small businesses.", "industry": "computer software"}, "Bookkeeping That Does Itself"),
)

#: ad fields shown to the creative model, in this order, when present and non-empty
CREATIVE_FIELDS = ("advertiser", "title", "description", "industry", "category", "keywords")


_PROBE = "Hello world, this is a probe."
_FRAMES: "weakref.WeakKeyDictionary[Any, tuple[tuple, tuple[tuple[int, ...], tuple[int, ...]]]]" = \
    weakref.WeakKeyDictionary()


def special_tokens_around(tokenizer: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids ``tokenizer`` itself puts before and after a text: ``(prefix, suffix)``.

    Read from the tokenizer, not from its name or config keys: a probe text is encoded with and
    without ``add_special_tokens`` and the difference is the frame (Gemma / Llama: ``((bos,), ())``
    from ``add_bos_token``; SmolLM2: ``((), ())`` although it names a BOS token; ``add_eos_token``
    gives a suffix). Cached per tokenizer object while its BOS/EOS settings stay the same.
    """
    state = tuple(getattr(tokenizer, a, None) for a in ("add_bos_token", "add_eos_token", "bos_token_id",
                                                        "eos_token_id"))
    try:
        hit = _FRAMES.get(tokenizer)
    except TypeError:  # not weak-referenceable: no cache
        hit = None
    if hit is not None and hit[0] == state:
        return hit[1]
    full = list(tokenizer(_PROBE, add_special_tokens=True)["input_ids"])
    bare = list(tokenizer(_PROBE, add_special_tokens=False)["input_ids"])
    n = len(bare)
    starts = [i for i in range(len(full) - n + 1) if full[i:i + n] == bare]
    if not starts:
        raise ValueError("the tokenizer encodes a text differently with and without special tokens beyond "
                         f"adding some around it ({full[:8]}... vs {bare[:8]}...): cannot tell its frame")
    frame = (tuple(full[:starts[0]]), tuple(full[starts[0] + n:]))
    try:
        _FRAMES[tokenizer] = (state, frame)
    except TypeError:
        pass
    return frame


def encode_text(tokenizer: Any, text: str, *, begin: bool = True, end: bool = False) -> list[int]:
    """Token ids of free ``text`` the way ``tokenizer`` wants it: its own prefix (BOS where it adds
    one) when ``begin``, its own suffix (EOS where ``add_eos_token``) when ``end``
    (:func:`special_tokens_around`). A prompt takes ``begin`` only: the model continues it."""
    prefix, suffix = special_tokens_around(tokenizer)
    body = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return [*(prefix if begin else ()), *body, *(suffix if end else ())]


def with_prefix(tokenizer: Any, ids: list[int]) -> list[int]:
    """``ids`` starting with the tokenizer's prefix (BOS where it adds one), never twice: a chat template
    that writes ``{{ bos_token }}`` itself (Gemma, Llama 3) is left alone, one that omits it gets it."""
    prefix = list(special_tokens_around(tokenizer)[0])
    return ids if ids[:len(prefix)] == prefix else prefix + ids


def _apply_template(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if isinstance(ids, Mapping) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return with_prefix(tokenizer, list(ids))


def _messages(turns: Sequence[tuple[str, str | None]], system: str | None, system_turn: bool) -> list[dict[str, str]]:
    """Chat messages of ``(user, assistant or None)`` turns: ``system`` as the system turn, or (a
    template without one) folded into the first user turn."""
    msgs = [{"role": "system", "content": system}] if system_turn and system is not None else []
    for i, (user, assistant) in enumerate(turns):
        if i == 0 and system is not None and not system_turn:
            user = f"{system}\n{user}"
        msgs.append({"role": "user", "content": user})
        if assistant is not None:
            msgs.append({"role": "assistant", "content": assistant})
    return msgs


def _chat_or_plain(tokenizer: Any, user_text: str, plain_suffix: str, system: str | None = None,
                   examples: Sequence[tuple[str, str]] = ()) -> list[int]:
    """Chat-template ids of one user turn (``system`` as the system turn when given), or a plain frame.

    A system turn replaces a template's default system prompt (SmolLM2's is 16 tokens), which
    matters for training cost: every targeting example repeats the prompt. Templates that reject a
    system role (Gemma) get the instruction folded into the first user turn instead. ``examples``:
    worked ``(user, assistant)`` turns before the user turn (few-shot); the plain frame writes each
    as ``user + plain_suffix + " " + assistant`` and a blank line.
    """
    turns = [*examples, (user_text, None)]
    template = getattr(tokenizer, "chat_template", None)
    if template:
        if system is not None:
            try:
                return _apply_template(tokenizer, _messages(turns, system, True))
            except Exception:  # jinja raise_exception("System role not supported") and the like
                pass
        return _apply_template(tokenizer, _messages(turns, system, False))
    text = "".join(f"{u}{plain_suffix} {a}\n\n" for u, a in examples) + user_text
    if system is not None:
        text = f"{system}\n{text}"
    return encode_text(tokenizer, text + plain_suffix)


def encode_targeting_prompt(tokenizer: Any, query: str, max_query_tokens: int = 48) -> list[int]:
    """Token ids of the targeting prompt for ``query``; the ad's target sequence follows directly.

    Rendering version :data:`TARGETING_PROMPT_VERSION`: the instruction is the system turn, the
    query the user turn (version 1 put both in the user turn after the template's default system
    prompt: 45 vs 28 tokens for a two-word query with SmolLM2).
    """
    return encode_targeting_prompts(tokenizer, [query], max_query_tokens)[0]


def _targeting_prompt_one(tokenizer: Any, query: str) -> list[int]:
    """The reference rendering of one (stripped, truncated) query: the chat template applied to it."""
    return _chat_or_plain(tokenizer, f"Query: {query}", "\nAd:", system=TARGETING_INSTRUCTION)


_QUERY_SLOT = "\ue000"  # a private-use character: marks where the query goes in a rendered frame
_PROBE_QUERIES = ("cordless drill 18v", "Who, what & why? 12 in. x 3/4 ft")
_TARGETING_FRAMES: "weakref.WeakKeyDictionary[Any, tuple[Any, tuple[str, str] | None]]" = weakref.WeakKeyDictionary()


def _targeting_frame(tokenizer: Any) -> tuple[str, str] | None:
    """``(head, tail)``: the targeting prompt's text around the query, so that tokenizing
    ``head + query + tail`` (special-token text parsed, as ``apply_chat_template`` does) gives the
    reference ids. Rendered once per tokenizer with a placeholder and accepted only if probe queries
    encode identically both ways; None (then every query takes the reference path) for a template
    that transforms the content, or a tokenizer whose texts do not concatenate like that."""
    state = (getattr(tokenizer, "chat_template", None), special_tokens_around(tokenizer))
    try:
        hit = _TARGETING_FRAMES.get(tokenizer)
    except TypeError:
        hit = None
    if hit is not None and hit[0] == state:
        return hit[1]
    frame: tuple[str, str] | None = None
    if getattr(tokenizer, "chat_template", None):
        try:
            rendered = _render_targeting(tokenizer, _QUERY_SLOT)
        except Exception:  # a template that cannot render the frame: the reference path
            rendered = None
    else:
        rendered = f"{TARGETING_INSTRUCTION}\nQuery: {_QUERY_SLOT}\nAd:"  # _chat_or_plain's plain frame
    if isinstance(rendered, str) and rendered.count(_QUERY_SLOT) == 1:
        head, tail = rendered.split(_QUERY_SLOT)
        probes = [list(ids) for ids in tokenizer([head + q + tail for q in _PROBE_QUERIES],
                                                 add_special_tokens=False)["input_ids"]]
        if all(with_prefix(tokenizer, p) == _targeting_prompt_one(tokenizer, q) for p, q in zip(probes, _PROBE_QUERIES)):
            frame = (head, tail)
    try:
        _TARGETING_FRAMES[tokenizer] = (state, frame)
    except TypeError:
        pass
    return frame


def _render_targeting(tokenizer: Any, query: str) -> Any:
    """The chat-template text of the targeting prompt: the same messages and branch as
    :func:`_chat_or_plain` (system turn, else the instruction folded into the user turn), rendered
    instead of tokenized; the probe check in :func:`_targeting_frame` confirms the ids agree."""
    turns = [(f"Query: {query}", None)]
    try:
        return tokenizer.apply_chat_template(_messages(turns, TARGETING_INSTRUCTION, True), tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # a template without a system role (Gemma)
        return tokenizer.apply_chat_template(_messages(turns, TARGETING_INSTRUCTION, False), tokenize=False,
                                             add_generation_prompt=True)


def encode_targeting_prompts(tokenizer: Any, queries: Sequence[str], max_query_tokens: int = 48) -> list[list[int]]:
    """:func:`encode_targeting_prompt` of every query, in one batched tokenizer call: the frame around
    the query is rendered once (:func:`_targeting_frame`), not the chat template per query, so
    training-set preparation over a million pseudo-queries takes seconds, not minutes. The ids are
    the reference rendering's (checked on probe queries per tokenizer; else each query takes it)."""
    queries = [q.strip() for q in queries]
    if not queries:
        return []
    # the query cut to max_query_tokens tokens (decoded back), batched, for the queries that may be too
    # long: an ASCII text has at most one token per character plus one (SentencePiece's word-start mark;
    # no normalizer expands ASCII); any other text is tokenized to know
    long = [i for i, q in enumerate(queries) if not q.isascii() or len(q) + 1 > max_query_tokens]
    if long:
        ids = tokenizer([queries[i] for i in long], add_special_tokens=False)["input_ids"]
        for i, q_ids in zip(long, ids):
            if len(q_ids) > max_query_tokens:
                queries[i] = tokenizer.decode(q_ids[:max_query_tokens])
    frame = _targeting_frame(tokenizer)
    if frame is None:
        return [_targeting_prompt_one(tokenizer, q) for q in queries]
    head, tail = frame
    body = tokenizer([head + q + tail for q in queries], add_special_tokens=False)["input_ids"]
    prefix = list(special_tokens_around(tokenizer)[0])  # with_prefix, its frame read once for the batch
    n = len(prefix)
    return [list(ids) if ids[:n] == prefix else prefix + list(ids) for ids in body]


AD_PROMPT_CHARS = 600  # ad text a creative prompt keeps: the tiny default model's context stays short


def render_ad_fields(ad: Mapping[str, Any], max_chars: int | None = AD_PROMPT_CHARS) -> str:
    """``Field: value`` lines of the ad's CREATIVE_FIELDS, cut to ``max_chars`` (None: whole)."""
    parts = []
    for key in CREATIVE_FIELDS:
        value = ad.get(key)
        if value is None:
            continue
        value = str(value).strip()
        if value:
            parts.append(f"{key.capitalize()}: {value}")
    return "\n".join(parts)[:max_chars]


class CreativePrompt(str, enum.Enum):
    """Which creative prompt rendering a model reads (declared by the model, never guessed).

    ``few_shot`` (version :data:`CREATIVE_PROMPT_VERSION`): what an untuned instruct model needs -- the
    instruction as the system turn, :data:`CREATIVE_EXAMPLES` as worked user/assistant turns, then the ad.
    ``tuned`` (version :data:`TUNED_CREATIVE_PROMPT_VERSION`): a model fine-tuned on (ad fields -> human
    headline) pairs (:mod:`adbatch.training.creatives`) learned the task from the pairs, so its prompt is
    the short instruction and the ad's fields only (~45 instead of ~230 tokens for an example ad): the
    same rendering in training and serving.
    """

    FEW_SHOT = "few_shot"
    TUNED = "tuned"


TUNED_CREATIVE_INSTRUCTION = "Write an advertising headline for this advertiser."
#: bumped whenever the tuned creative prompt's rendering (or the headline target after it) changes: a
#: model fine-tuned on one rendering must be fine-tuned again (the refresh takes it as an input; the model
#: declares the version it learned, see :func:`declare_creative_prompt`)
TUNED_CREATIVE_PROMPT_VERSION = 1
#: the ``model.config`` attribute (saved in config.json, so it survives save_pretrained and the compress
#: stage) where a fine-tuned model declares the creative prompt it learned: ``{"style", "version"}``
CREATIVE_PROMPT_ATTR = "adbatch_creative_prompt"


class CreativePromptMismatchError(ValueError):
    """A model declares a creative prompt rendering this code does not render (another version)."""


def creative_prompt_version(style: CreativePrompt) -> int:
    """The rendering version of ``style`` in this code."""
    return TUNED_CREATIVE_PROMPT_VERSION if CreativePrompt(style) is CreativePrompt.TUNED else CREATIVE_PROMPT_VERSION


def declare_creative_prompt(model: Any, style: CreativePrompt = CreativePrompt.TUNED) -> None:
    """Record on ``model.config`` that the model was trained on the ``style`` creative prompt (this code's
    version), so every later load -- dense folder or compressed checkpoint -- renders that prompt."""
    style = CreativePrompt(style)
    setattr(model.config, CREATIVE_PROMPT_ATTR, {"style": style.value, "version": creative_prompt_version(style)})


def creative_prompt_of(model: Any) -> CreativePrompt:
    """The creative prompt ``model`` reads: what its config declares (:func:`declare_creative_prompt`), else
    ``few_shot`` (an untuned model). Raises :class:`CreativePromptMismatchError` when the declared version
    is not this code's: the model must be fine-tuned again on the current rendering."""
    config = getattr(model, "config", None)
    declared = getattr(config, CREATIVE_PROMPT_ATTR, None) if config is not None else None
    if not declared:
        return CreativePrompt.FEW_SHOT
    try:
        style = CreativePrompt(declared["style"])
        version = int(declared["version"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CreativePromptMismatchError(f"model config {CREATIVE_PROMPT_ATTR} = {declared!r} is not "
                                          "{'style': few_shot|tuned, 'version': int}") from exc
    if version != creative_prompt_version(style):
        raise CreativePromptMismatchError(
            f"the model was fine-tuned on {style.value} creative prompts of version {version}; this code renders "
            f"version {creative_prompt_version(style)}: fine-tune it again (adbatch refresh does when the version changes)")
    return style


def creative_prompt_text(ad: Mapping[str, Any], max_chars: int = AD_PROMPT_CHARS,
                         style: CreativePrompt = CreativePrompt.FEW_SHOT) -> str:
    """All the text the creative prompt shows the model for one ad, without the chat template: the
    instruction, the worked examples (``few_shot``) and the ad's fields. The prompt-copy metric
    (:func:`adbatch.eval.report.prompt_copy_share`) compares a headline against it, so copying an example's
    headline counts as copying too."""
    if CreativePrompt(style) is CreativePrompt.TUNED:
        return "\n".join([TUNED_CREATIVE_INSTRUCTION, render_ad_fields(ad, max_chars)])
    shots = [f"{render_ad_fields(ex)}\n{headline}" for ex, headline in CREATIVE_EXAMPLES]
    return "\n".join([CREATIVE_INSTRUCTION, *shots, render_ad_fields(ad, max_chars)])


def encode_creative_prompt(tokenizer: Any, ad: Mapping[str, Any], max_chars: int = AD_PROMPT_CHARS,
                           style: CreativePrompt = CreativePrompt.FEW_SHOT) -> list[int]:
    """Token ids of the creative prompt for one ad/product record (fields in CREATIVE_FIELDS).

    ``few_shot``, rendering version :data:`CREATIVE_PROMPT_VERSION`: the instruction as the system turn,
    then each of :data:`CREATIVE_EXAMPLES` as a user turn (its fields) answered by an assistant turn (its
    headline), then the ad's fields (version 1 was the instruction and the fields in one user turn: the
    default model echoed the prompt, "Advertiser: Clearfunds").
    ``tuned``, version :data:`TUNED_CREATIVE_PROMPT_VERSION`: :data:`TUNED_CREATIVE_INSTRUCTION` as the
    system turn and the ad's fields as the user turn; the fine-tune's target follows it
    (:func:`encode_creative_target`).
    """
    if CreativePrompt(style) is CreativePrompt.TUNED:
        return _chat_or_plain(tokenizer, render_ad_fields(ad, max_chars), "\nHeadline:",
                              system=TUNED_CREATIVE_INSTRUCTION)
    examples = [(render_ad_fields(ex), headline) for ex, headline in CREATIVE_EXAMPLES]
    return _chat_or_plain(tokenizer, render_ad_fields(ad, max_chars), "\nHeadline:", system=CREATIVE_INSTRUCTION,
                          examples=examples)


def encode_creative_target(tokenizer: Any, headline: str) -> list[int]:
    """Token ids a creative fine-tune learns after :func:`encode_creative_prompt`: the headline as the
    assistant turn writes it (after a chat template's ``assistant\\n``; after the plain frame's
    ``Headline:`` with a leading space) and the tokenizer's EOS, which ends decoding. Empty headline:
    ValueError."""
    return _answer_ids(tokenizer, headline, "headline")


def _answer_ids(tokenizer: Any, answer: str, what: str) -> list[int]:
    """The assistant turn's ids for ``answer`` (spaces collapsed) + EOS: what a fine-tune on one of the
    prompts above learns to write (a chat template puts ``assistant\\n`` before it; the plain frame's
    ``Label:`` wants a leading space)."""
    answer = " ".join(str(answer).split())
    if not answer:
        raise ValueError(f"empty {what}")
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer has no EOS token: a fine-tuned {what} could not end")
    text = answer if getattr(tokenizer, "chat_template", None) else " " + answer
    return [*tokenizer(text, add_special_tokens=False)["input_ids"], int(tokenizer.eos_token_id)]


QUERY_GEN_INSTRUCTION = "Write a search query a shopper would type to find this product."
#: bumped whenever the query-generation prompt's rendering (or the query target after it) changes: a
#: generator fine-tuned on one rendering is stale under another, and so are the queries it generated
#: (the train job's generated-query cache is keyed by it)
QUERY_GEN_PROMPT_VERSION = 1
QUERY_GEN_AD_CHARS = 300  # a product title is ~60 characters; longer ad texts are cut (prompt cost per ad)


def encode_query_gen_prompt(tokenizer: Any, ad_text: str, max_chars: int = QUERY_GEN_AD_CHARS) -> list[int]:
    """Token ids of the query-generation prompt for one ad's text (docT5query / DSI-QG's ad -> query
    direction; :mod:`adbatch.training.query_generation`): :data:`QUERY_GEN_INSTRUCTION` as the system turn,
    ``Product: <text>`` as the user turn, rendering version :data:`QUERY_GEN_PROMPT_VERSION`; the tokenizer's
    own special tokens around it (:func:`special_tokens_around`, via the chat template or the plain frame).
    The fine-tune's target follows it (:func:`encode_query_gen_target`)."""
    text = " ".join(str(ad_text or "").split())[:max_chars]
    return _chat_or_plain(tokenizer, f"Product: {text}", "\nQuery:", system=QUERY_GEN_INSTRUCTION)


def encode_query_gen_target(tokenizer: Any, query: str) -> list[int]:
    """Token ids the query generator learns after :func:`encode_query_gen_prompt`: the query as the
    assistant turn writes it, then EOS (which ends sampling). Empty query: ValueError."""
    return _answer_ids(tokenizer, query, "query")
