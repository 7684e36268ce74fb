"""``models.context_length``: a model's context length read from its files without loading its weights, the
value the loaded model states (``serve`` checks --max-length against it before loading)."""

from __future__ import annotations

import importlib.util

import gguf
import pytest
from transformers import AutoConfig

from conftest import make_tiny_model, make_tiny_tokenizer
from specdecode.engine.kv_cache import context_length
from specdecode.models import OFFLINE_MODELS, load_model
from specdecode.models.context_length import StoredContextLength, gguf_context_length, stored_context_length
from tiny_gguf import write_tiny_gguf


def write_gguf(path, arch: str, *, context: int | None, before: dict | None = None):
    """A GGUF file with metadata only: ``before`` keys (name -> list of strings) first, then the context length."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, values in (before or {}).items():
        writer.add_array(key, values)
    if context is not None:
        writer.add_context_length(context)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_model_folder_s_is_its_config_s_as_the_loaded_model_states_it(tmp_path):
    model = make_tiny_model("qwen2", num_layers=2, max_position_embeddings=384)
    model.save_pretrained(tmp_path)
    make_tiny_tokenizer().save_pretrained(tmp_path)
    assert stored_context_length(str(tmp_path)) == StoredContextLength(384, "max_position_embeddings")
    assert context_length(load_model(str(tmp_path), dtype="float32", device="cpu").model) == 384
    assert stored_context_length(str(tmp_path), backend="llama-cpp") is None  # llama.cpp runs GGUF files only


def test_a_gguf_file_s_is_its_metadata_s_as_transformers_reads_it(tmp_path):
    path = write_tiny_gguf(make_tiny_model("qwen2", num_layers=2, max_position_embeddings=384),
                           make_tiny_tokenizer(), tmp_path / "tiny.gguf")
    stored = stored_context_length(str(path))
    assert stored == StoredContextLength(384, "the GGUF file's qwen2.context_length")
    assert AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name).max_position_embeddings == 384
    assert stored_context_length(str(path), backend="llama-cpp") == stored  # llama.cpp's n_ctx_train: the same key


def test_the_gguf_metadata_is_read_past_large_arrays_and_only_up_to_the_key(tmp_path):
    words = [f"w{i}" for i in range(200_000)]
    path = write_gguf(tmp_path / "m.gguf", "llama", context=4096, before={"tokenizer.ggml.tokens": words})
    assert stored_context_length(str(path)) == StoredContextLength(4096, "the GGUF file's llama.context_length")
    with open(path, "rb") as f:
        assert gguf_context_length(f) == ("llama", 4096)
        assert f.tell() < path.stat().st_size  # it stopped at the key: the tensor infos were never read


def test_files_that_do_not_state_it_give_none(tmp_path):
    assert stored_context_length(str(write_gguf(tmp_path / "none.gguf", "llama", context=None))) is None
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    assert stored_context_length(str(tmp_path / "junk.gguf")) is None
    whole = write_gguf(tmp_path / "whole.gguf", "llama", context=4096, before={"a.list": ["x"] * 1000})
    (tmp_path / "cut.gguf").write_bytes(whole.read_bytes()[:100])  # ends inside the metadata
    assert stored_context_length(str(tmp_path / "cut.gguf")) is None
    assert stored_context_length(str(tmp_path / "missing.gguf")) is None
    assert stored_context_length(str(tmp_path / "no-such-folder")) is None
    assert stored_context_length("nobody-here/not-a-model") is None  # a hub id not cached: no download


def test_an_architecture_transformers_does_not_map_is_left_to_the_check_after_loading(tmp_path):
    """transformers' GGUF loader does not make bloom's context_length the config's max_position_embeddings, so
    the loaded torch model would not state 2048; llama.cpp's n_ctx_train is that key whatever the architecture."""
    path = write_gguf(tmp_path / "bloom.gguf", "bloom", context=2048)
    assert stored_context_length(str(path)) is None
    assert stored_context_length(str(path), backend="llama-cpp").positions == 2048


@pytest.mark.skipif(importlib.util.find_spec(OFFLINE_MODELS["qwen2.5-coder-0.5b-instruct"].chunks[0][0]) is None,
                    reason="the offline models' chunk packages are not installed")
def test_an_offline_model_s_is_read_from_its_chunk_files_without_assembling_them(tmp_path):
    """With an empty cache folder (no dense copy, no assembled file): the GGUF metadata at the start of the first
    chunk file, 32768 for the packaged Qwen2.5-Coder 0.5B (its config's max_position_embeddings)."""
    stored = stored_context_length("qwen2.5-coder-0.5b-instruct", cache_dir=tmp_path)
    assert stored == StoredContextLength(32768, "the GGUF file's qwen2.context_length")
    assert not (tmp_path / "gguf").exists()
