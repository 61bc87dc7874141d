"""Shared fixtures: the ../shared evaluation data (skipped when absent) and tiny real-arch models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("ADBATCH_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` (Home Depot, slogans). Its files are never copied into the repo."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared evaluation data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def home_depot_csv(shared_data: Path) -> Path:
    path = shared_data / "home_depot_relevance" / "train.csv"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    return path


@pytest.fixture(scope="session")
def example_ads() -> Path:
    return REPO / "examples" / "slogan_ads.parquet"


@pytest.fixture(scope="session")
def default_tokenizer():
    """The default model's tokenizer (no weights loaded)."""
    from transformers import AutoTokenizer

    from adbatch.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(), local_files_only=True)


def make_tiny_llama(vocab_size: int = 512, hidden: int = 64, layers: int = 2, seed: int = 0,
                    intermediate: int = 128, heads: int = 4, kv_heads: int = 2):
    """A random-init Llama of real architecture, small enough for CPU tests (fp32, eval mode)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=512, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval()
    return model


@pytest.fixture
def tiny_llama():
    return make_tiny_llama()


@pytest.fixture(scope="module")
def ray_local():
    """One private in-process Ray per test module, shut down after it.

    ``address="local"`` always starts a fresh cluster: a bare ``ray.init()`` would join a
    ``ray start`` head left on the machine. Shutting it down keeps its agents' ports free for tests
    that start their own head.
    """
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield ray
    if started:
        ray.shutdown()


def assert_same_packed(a, b) -> int:
    """Every CompressedLinear of model ``a`` has bit-identical packed tensors in ``b``; returns how many."""
    import torch

    from adbatch.compress import CompressedLinear

    n = 0
    for name, m in a.named_modules():
        if isinstance(m, CompressedLinear):
            other = b.get_submodule(name)
            for k in CompressedLinear.PACKED_KEYS:
                assert torch.equal(getattr(m, k), getattr(other, k)), (name, k)
            n += 1
    return n
