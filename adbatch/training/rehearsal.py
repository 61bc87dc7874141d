"""Creative rehearsal: keep the model able to write headlines while it learns the ad index.

Measured on the H200 (bench/results/train.md, round 5): after DSI training the default model answers a
creative prompt with an index sequence ("heater fan > southwire wire > Builders Edge 15 ft."); slogan
test BLEU fell from 1.61 (base model) to 0.064. The training data holds no creative example, so
nothing holds that skill in place. Rehearsal adds some: for a sample of the index's ads, the
*starting* model's own greedy headline for the creative prompt (the same prompt and decoder the
creatives stage uses) becomes a training target. No labelled headlines are needed, and the target is
what the model already did — the loss only pulls it back there (self-distillation on hard labels).

Cost: one greedy generation per sampled ad before training (``ads`` of them, ``max_new_tokens``
each) and ``repeat`` extra short examples per epoch. The nightly refresh still writes creatives with
the base model by default (``generate.creatives_model``); whether rehearsal lets the served model do
both is what the next device run measures.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Hashable, Mapping

import torch

from adbatch.config import ConfigBase, ConfigError

log = logging.getLogger(__name__)

#: sampled ads whose headlines are decoded together (bounds the decode's memory; no effect on the texts)
DECODE_BATCH = 32


@dataclasses.dataclass
class CreativeRehearsalConfig(ConfigBase):
    """Creative examples mixed into DSI training (:mod:`adbatch.training.rehearsal`)."""

    enabled: bool = dataclasses.field(default=False, metadata={"help": "mix creative examples into training"})
    ads: int = dataclasses.field(default=256, metadata={"help": "ads sampled for creative examples"})
    repeat: int = dataclasses.field(default=1, metadata={"help": "copies of each creative example per epoch"})
    max_new_tokens: int = dataclasses.field(default=16, metadata={"help": "headline tokens generated per ad"})
    seed: int = dataclasses.field(default=0, metadata={"help": "seed of the ad sample"})

    def validate(self) -> None:
        for name in ("ads", "repeat", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"CreativeRehearsalConfig.{name} must be >= 1, got {getattr(self, name)}")


def rehearsal_examples(model: Any, tokenizer: Any, ad_ids: list[Hashable], ad_texts: Mapping[Hashable, str],
                       config: CreativeRehearsalConfig) -> tuple[Any, dict[str, Any]]:
    """``(TrainingExamples of kind CREATIVE, stats)``: the creative prompt of ``config.ads`` sampled
    ads (title = their text) -> the model's own greedy headline + EOS. ``model`` must be the starting
    model, on its training device. Ads whose headline comes out empty are skipped (counted)."""
    from adbatch.decoding.config import CreativeConfig
    from adbatch.decoding.creative import generate_creatives
    from adbatch.serving.prompts import encode_creative_prompt
    from adbatch.training.data import ExampleKind, build_prompted

    gen = torch.Generator().manual_seed(config.seed)
    pick = torch.randperm(len(ad_ids), generator=gen)[:config.ads].sort().values.tolist()
    prompts = [encode_creative_prompt(tokenizer, {"title": ad_texts.get(ad_ids[r], "")}) for r in pick]
    decoding = CreativeConfig(max_new_tokens=config.max_new_tokens)
    outs = [out for s in range(0, len(prompts), DECODE_BATCH)
            for out in generate_creatives(model, tokenizer, prompts[s:s + DECODE_BATCH], decoding)]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    keep = [(r, prompt, out[0][0]) for r, prompt, out in zip(pick, prompts, outs) if out and out[0][0].strip()]
    rows = [r for r, _, _ in keep]
    keep_prompts = [p for _, p, _ in keep]
    # the decoder's text after the prompt; the model writes a leading space after "Headline:"
    texts = [(t if t[:1].isspace() else " " + t).rstrip() for _, _, t in keep]
    targets = [ids + eos for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []
    stats = {"sampled": len(pick), "examples": len(rows), "empty": len(pick) - len(rows),
             "samples": [tokenizer.decode(t, skip_special_tokens=True) for t in targets[:3]]}
    log.info("creative rehearsal: %s", stats)
    return build_prompted(keep_prompts, targets, ExampleKind.CREATIVE, rows), stats
