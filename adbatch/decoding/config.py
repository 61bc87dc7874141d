"""Configs and enums of the decoding stage (targeting search and creative generation)."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import field

from adbatch.config import ConfigBase, ConfigError


class LinearFormats(str, enum.Enum):
    """Which formats the decoding engine's per-bucket plan may serve a compressed layer in."""

    #: the packed INT4 kernel, its bf16 copy, a semi-structured bf16 copy (2:4 / 1:4 at large buckets)
    INT4 = "int4"
    #: those, plus FP8 and (2:4 / 1:4 layers) 2:4 FP8 copies, at every bucket, where accurate enough
    FP8 = "fp8"


class VerifyMode(str, enum.Enum):
    """When a beam switches from step-by-step decoding to prefix-tree parallel verification."""

    OFF = "off"  #: never: plain trie-constrained beam search
    AUTO = "auto"  #: when the measured cost model says one tree pass is cheaper than the steps left
    ALWAYS = "always"  #: whenever the beam's tree fits the token caps


class FusionMode(str, enum.Enum):
    """Which channels answer a targeting request (adbatch.serving.hybrid)."""

    HYBRID = "hybrid"  #: both channels' candidates, scored on both scales, fused
    GENERATIVE = "generative"  #: trie-constrained beam search alone (the paper's method)
    DENSE = "dense"  #: cosine over the index's ad embeddings alone


class DenseScoring(str, enum.Enum):
    """How hybrid fusion gets a generative score for a dense candidate the beam search did not find."""

    #: teacher-forced, one tree pass per query over those candidates (adbatch.decoding.score_targets)
    EXACT = "exact"
    #: no pass: the query's lowest beam score stands in for it (the search stopped above it); the fusion
    #: fitted for this scoring is used (FusionParams.beam_floor)
    BEAM_FLOOR = "beam_floor"


class CreativeStrategy(str, enum.Enum):
    """How free text is decoded for creatives."""

    GREEDY = "greedy"
    SAMPLE = "sample"  #: temperature + nucleus (top-p) sampling
    BEAM = "beam"  #: beam search ranked by mean log-prob per token


#: the most beams a query may search (``max(num_beams, top_k)``, :attr:`TargetSearchConfig.pool_size`) and a creative
#: beam search may run. The search's buffers are sized by it before the first step (a KV-cache row, a vocabulary-wide
#: log-prob row and a finished-node slot per beam and query), so a larger value asks for memory no machine has or
#: overflows the sizes (issue 58: a top_k of 1e9 and a num_beams of 2**62 ended in an 81 TB allocation and a
#: torch.zeros overflow); 1,024 is 128x the default 8 beams and 16x the most any measurement here used (64).
MAX_BEAMS = 1024


@dataclasses.dataclass
class TargetSearchConfig(ConfigBase):
    """Trie-constrained beam search over an ad index (see docs/decoding.md for the scoring rule)."""

    fusion: FusionMode = field(
        default=FusionMode.HYBRID, metadata={"help": "hybrid (both channels, fused) | generative | dense (see "
                                                     "docs/generate.md, 'Two channels')"})
    dense_k: int = field(default=20, metadata={"help": "dense-channel candidates per query (hybrid, dense)"})
    # exact by default: +0.6 / +0.9 points of recall@10 over beam_floor on the trained 5k / full models, at about half
    # the queries/s (bench/RESULTS.md, "Two channels")
    dense_scoring: DenseScoring = field(
        default=DenseScoring.EXACT, metadata={
            "help": "hybrid: the generative score of a dense candidate the beams did not find: exact (teacher-forced "
                    "tree pass) | beam_floor (the query's lowest beam score; no pass, faster, a little less accurate)"})
    num_beams: int = field(default=8, metadata={"help": "running beams per query (raised to top_k when smaller); at "
                                                    f"most {MAX_BEAMS}: the search's buffers are sized by it up front"})
    top_k: int = field(default=10, metadata={"help": f"ad rows returned per query; at most {MAX_BEAMS} (the search "
                                                     "keeps max(num_beams, top_k) beams, its buffers sized up front)"})
    verify: VerifyMode = field(default=VerifyMode.AUTO, metadata={"help": "off | auto | always"})
    max_tree_tokens: int = field(
        default=256, metadata={"help": "a beam is verifiable only if its tree feeds <= this many tokens"})
    max_tokens_per_pass: int = field(
        default=4096, metadata={"help": "cap on padded tree tokens (beams x longest tree) in one pass"})
    length_penalty: float = field(
        default=0.0, metadata={"help": "final score = sum log-prob / length**length_penalty (0 = plain sum)"})
    max_steps: int = field(default=0, metadata={"help": "decode steps cap; 0 = the trie's height"})
    prior_weight: float = field(
        default=0.0, metadata={"help": "dense prior (PAG planning-ahead): beams are ranked by log-prob + this x "
                                       "the best dense cosine below their node (needs the dense channel; 0 = off)"})
    # fp8 by default: the 8B shape's search 1.06x / 1.64x / 1.83x / 1.96x dense at 16 / 64 / 256 / 1,024 queries vs
    # 0.87-0.98x with int4, the trained 135M model's hybrid recall@10 within 0.7 points of int4 (H100, 2026-12-06;
    # bench/RESULTS.md, "Per-bucket formats")
    linear_formats: LinearFormats = field(
        default=LinearFormats.FP8, metadata={
            "help": "formats a compressed model's layers may run in, chosen per row bucket by timing: int4 (packed "
                    "INT4 kernel, bf16 copy, 2:4 bf16 copy) | fp8 (also FP8 and, with torchao installed, 2:4 FP8 copies "
                    "at >= 64 rows where accurate enough; activations quantized per row). See docs/decoding.md"})
    logprob_chunk: int = field(
        default=1024, metadata={"help": "positions per chunk when turning tree hidden states into log-probs"})
    profile: bool = field(
        default=False, metadata={"help": "time phases into stats (adds a device sync per phase)"})

    def validate(self) -> None:
        if not 1 <= self.num_beams <= MAX_BEAMS:
            raise ConfigError(f"TargetSearchConfig.num_beams must be in [1, {MAX_BEAMS}], got {self.num_beams} (the "
                              "search sizes its buffers by it before the first step)")
        if self.dense_k < 1:
            raise ConfigError(f"TargetSearchConfig.dense_k must be >= 1, got {self.dense_k}")
        if not 1 <= self.top_k <= MAX_BEAMS:
            raise ConfigError(f"TargetSearchConfig.top_k must be in [1, {MAX_BEAMS}], got {self.top_k} (the search "
                              "keeps max(num_beams, top_k) beams per query, its buffers sized before the first step)")
        if self.max_tree_tokens < 1:
            raise ConfigError(f"TargetSearchConfig.max_tree_tokens must be >= 1, got {self.max_tree_tokens}")
        if self.max_tokens_per_pass < self.max_tree_tokens:
            raise ConfigError("TargetSearchConfig.max_tokens_per_pass must be >= max_tree_tokens "
                              f"({self.max_tokens_per_pass} < {self.max_tree_tokens})")
        if self.max_steps < 0:
            raise ConfigError(f"TargetSearchConfig.max_steps must be >= 0, got {self.max_steps}")
        if not (self.prior_weight >= 0 and self.prior_weight != float("inf")):  # also refuses nan
            raise ConfigError(f"TargetSearchConfig.prior_weight must be a finite number >= 0, got {self.prior_weight}")
        if self.logprob_chunk < 1:
            raise ConfigError(f"TargetSearchConfig.logprob_chunk must be >= 1, got {self.logprob_chunk}")

    @property
    def pool_size(self) -> int:
        """Beams searched and finished trie nodes kept per query: max(num_beams, top_k)."""
        return max(self.num_beams, self.top_k)


@dataclasses.dataclass
class CreativeConfig(ConfigBase):
    """Free-text generation for creatives on the shared KV-cache loop."""

    strategy: CreativeStrategy = field(default=CreativeStrategy.GREEDY,
                                       metadata={"help": "greedy | sample | beam"})
    max_new_tokens: int = field(default=32, metadata={"help": "tokens generated at most"})
    num_return: int = field(default=1, metadata={"help": "texts returned per prompt"})
    # 0 (= num_return) by default: today's throughput (the GPU has not measured what more costs); with sample or
    # beam, more candidates let the generator write a passing headline instead of a flagged one (docs/generate.md)
    candidates: int = field(default=0, metadata={
        "help": "texts decoded per prompt, of which the creatives generator writes the num_return best that pass "
                "its checks (adbatch.serving.checks; failing ones only when too few pass, flagged); 0 = num_return; "
                "else >= num_return, 1 for greedy, <= num_beams for beam"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus mass kept when sampling"})
    num_beams: int = field(default=4, metadata={"help": f"beams per prompt (strategy beam); at most {MAX_BEAMS} "
                                                    "(TargetSearchConfig.num_beams)"})
    stop_strings: list[str] = field(default_factory=lambda: ["\n"],
                                    metadata={"help": "text is cut before the first of these"})
    # both guards on by default: measured on the example's creative model (docs/decoding.md, creatives)
    no_repeat_ngram_size: int = field(default=3, metadata={
        "help": "never repeat an n-gram of this many tokens within a generated text (0 = off); the prompt's "
                "n-grams stay allowed (an advertiser's name spans several tokens)"})
    prompt_ngram_block: int = field(default=6, metadata={
        "help": "never generate an n-gram of this many tokens that occurs in the prompt (0 = off): a headline "
                "does not copy its ad's description; shorter runs (a name) stay allowed"})
    seed: int = field(default=0, metadata={"help": "sampling seed"})
    # int4 here: FP8 activations were measured on targeting (recall), never on headlines (ROUGE)
    linear_formats: LinearFormats = field(default=LinearFormats.INT4, metadata={
        "help": "formats a compressed creative model's layers may run in per row bucket on a GPU: int4 | fp8 "
                "(TargetSearchConfig.linear_formats; fp8 is not measured on headline quality)"})

    @property
    def num_candidates(self) -> int:
        """Texts decoded per prompt: ``candidates``, or ``num_return`` when it is 0."""
        return self.candidates or self.num_return

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"CreativeConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_return < 1:
            raise ConfigError(f"CreativeConfig.num_return must be >= 1, got {self.num_return}")
        if self.temperature <= 0:
            raise ConfigError(f"CreativeConfig.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"CreativeConfig.top_p must be in (0, 1], got {self.top_p}")
        if not 1 <= self.num_beams <= MAX_BEAMS:
            raise ConfigError(f"CreativeConfig.num_beams must be in [1, {MAX_BEAMS}], got {self.num_beams}")
        if self.strategy is CreativeStrategy.BEAM and self.num_return > self.num_beams:
            raise ConfigError("CreativeConfig.num_return must be <= num_beams for strategy beam "
                              f"({self.num_return} > {self.num_beams})")
        if self.strategy is CreativeStrategy.GREEDY and self.num_return != 1:
            raise ConfigError("CreativeConfig.num_return must be 1 for strategy greedy "
                              f"(got {self.num_return}); use sample or beam for several")
        if self.candidates and self.candidates < self.num_return:
            raise ConfigError(f"CreativeConfig.candidates must be 0 or >= num_return ({self.candidates} < "
                              f"{self.num_return})")
        if self.candidates < 0:
            raise ConfigError(f"CreativeConfig.candidates must be >= 0, got {self.candidates}")
        if self.strategy is CreativeStrategy.GREEDY and self.candidates > 1:
            raise ConfigError(f"CreativeConfig.candidates must be 1 for strategy greedy (got {self.candidates}); use "
                              "sample or beam for several")
        if self.strategy is CreativeStrategy.BEAM and self.candidates > self.num_beams:
            raise ConfigError("CreativeConfig.candidates must be <= num_beams for strategy beam "
                              f"({self.candidates} > {self.num_beams})")
        if any(not s for s in self.stop_strings):
            raise ConfigError("CreativeConfig.stop_strings must not contain an empty string")
        if self.prompt_ngram_block < 0 or self.prompt_ngram_block == 1:
            raise ConfigError("CreativeConfig.prompt_ngram_block must be 0 (off) or >= 2, got "
                              f"{self.prompt_ngram_block}")
        if self.no_repeat_ngram_size < 0 or self.no_repeat_ngram_size == 1:
            raise ConfigError("CreativeConfig.no_repeat_ngram_size must be 0 (off) or >= 2, got "
                              f"{self.no_repeat_ngram_size}")
