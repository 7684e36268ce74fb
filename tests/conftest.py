"""Tiny random-initialised models and a tiny tokenizer, built in-process (no download)."""

from __future__ import annotations

import os

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

# Tiny models gain nothing from a second thread, and one thread leaves a core free
# (OpenMP threads oversubscribed on a 2-core machine slow everything down many times).
torch.set_num_threads(int(os.environ.get("SPECDECODE_TEST_THREADS", "1")))

VOCAB = 48
ARCHITECTURES = ("llama", "qwen2", "mistral", "gemma2", "gemma3")

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def make_tiny_model(arch: str, num_layers: int = 4, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random float32 causal LM of the given architecture, in eval mode.

    Gemma2/3 and Mistral get a sliding window of 6 tokens, so ordinary test
    sequences cross it and exercise sliding-window cache rollback.
    """
    kw = dict(_COMMON, num_hidden_layers=num_layers, **overrides)
    if arch == "llama":
        config, cls = LlamaConfig(**kw), LlamaForCausalLM
    elif arch == "qwen2":
        config, cls = Qwen2Config(**kw), Qwen2ForCausalLM
    elif arch == "mistral":
        config, cls = MistralConfig(**{"sliding_window": 6, **kw}), MistralForCausalLM
    elif arch == "gemma2":
        config, cls = Gemma2Config(**{"head_dim": 8, "sliding_window": 6, **kw}), Gemma2ForCausalLM
    elif arch == "gemma3":
        config, cls = (
            Gemma3TextConfig(**{"head_dim": 8, "sliding_window": 6, "sliding_window_pattern": 2, **kw}),
            Gemma3ForCausalLM,
        )
    else:
        raise ValueError(f"unknown test architecture {arch!r}; allowed: {ARCHITECTURES}")
    torch.manual_seed(seed)
    model = cls(config).eval()
    # Random init gives near-uniform logits; sharpen them so greedy paths and
    # acceptance are not decided by ties.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def make_tiny_tokenizer(vocab_size: int = VOCAB) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: ids 0-2 are <pad>, <s>, </s>; id i >= 3 is the word 'w{i}'."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>"
    )


@pytest.fixture(params=ARCHITECTURES)
def arch(request) -> str:
    return request.param


@pytest.fixture
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """A float32 GGUF file of a tiny qwen2 (2 layers, seed 4) and the tiny tokenizer, written once per
    test session (``tests/tiny_gguf.py``); skips where llama-cpp-python is not installed."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install 'specdecode[llamacpp]')")
    from tiny_gguf import write_tiny_gguf

    model = make_tiny_model("qwen2", num_layers=2, seed=4)
    return write_tiny_gguf(model, make_tiny_tokenizer(), tmp_path_factory.mktemp("gguf") / "qwen2.gguf")


@pytest.fixture
def avx512_cpu(monkeypatch):
    """torch's CPU capability reads "AVX512" (``specdecode.defaults.cpu_capability``), the machines on which
    the commands' int4 draft default applies, whatever this machine has."""
    from specdecode import defaults

    monkeypatch.setattr(defaults, "cpu_capability", lambda: "AVX512")


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: the cores this process may use (not the host's, in a container) and at most one
    worker per 6 GB of memory (each imports torch and transformers; the largest real model a test loads
    is the 0.5B Qwen, so workers loading real models at once stay well within that)."""
    import psutil

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, int(psutil.virtual_memory().total / 6e9)))
