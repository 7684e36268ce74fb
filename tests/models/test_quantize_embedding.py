"""The int8 input embedding of a quantized model (specdecode.models.quantize.Int8Embedding)."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from conftest import VOCAB, make_tiny_model, make_tiny_tokenizer
from selfspec_helpers import METHOD_OPTIONS, one_thread, prompt_ids  # noqa: F401
from specdecode import GenerationConfig, InvalidArgumentError, SpeculativeGenerator
from specdecode.models import LoadedModel, dense_cache
from specdecode.models.dense_cache import read_quantized, write_quantized
from specdecode.models.quantize import (
    Int8Embedding,
    Int8Linear,
    apply_quantized,
    quantize_int8,
    quantize_model,
    quantized_tensors,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(arch: str, tied: bool, **kw) -> nn.Module:
    model = make_tiny_model(arch, tie_word_embeddings=tied, **kw)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    return model


def _dequantized_embedding(emb: nn.Module) -> nn.Module:
    """A copy of the dense embedding module (its own forward: lookup, Gemma's scale) with the int8-rounded rows."""
    ref = copy.deepcopy(emb)
    parts = quantize_int8(emb.weight, emb.weight.dtype)
    with torch.no_grad():
        ref.weight.copy_((parts["qweight"].float() * parts["scales"].float()[:, None]).to(emb.weight.dtype))
    return ref


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_embedding_becomes_int8_and_gives_the_dequantized_rows(arch, scheme, tied):
    model = _tiny(arch, tied, num_layers=2)
    ref = _dequantized_embedding(model.get_input_embeddings())
    summary = quantize_model(model, scheme)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(emb, Int8Embedding) and emb.qweight.dtype == torch.int8
    assert summary.embedding == "int8" and summary.dense_modules == {} and summary.tied_head == tied
    assert not any(isinstance(m, nn.Embedding) for m in model.modules())
    shared = (emb.qweight.data_ptr() == head.qweight.data_ptr(), emb.scales.data_ptr() == head.scales.data_ptr())
    assert shared == (tied, tied)  # a tied embedding reads the int8 head's own buffers
    ids = torch.arange(VOCAB).view(2, -1)
    with torch.no_grad():
        got, want = emb(ids), ref(ids)
    assert got.shape == (2, VOCAB // 2, 32) and got.dtype == torch.float32
    assert torch.equal(got, want) and want.abs().max() > 0


def test_bfloat16_rows_and_gemma_scale_are_reproduced_exactly():
    model = _tiny("gemma3", tied=True, num_layers=1).to(torch.bfloat16)
    dense_emb = model.get_input_embeddings()
    assert type(dense_emb).__name__ == "Gemma3TextScaledWordEmbedding" and float(dense_emb.embed_scale) != 1.0
    ref = _dequantized_embedding(dense_emb)
    quantize_model(model, "int4")
    ids = prompt_ids(11, seed=2)
    with torch.no_grad():
        got, want = model.get_input_embeddings()(ids), ref(ids)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_dense_embedding_is_released(tied):
    """No dense (V, H) matrix is left in the model, and nothing else keeps the old one alive."""
    model = _tiny("qwen2", tied, num_layers=1)
    dense = weakref.ref(model.get_input_embeddings().weight)
    matrices = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 2)  # a tied one once
    summary = quantize_model(model, "int4")
    gc.collect()
    assert dense() is None
    floats = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point() and t.dim() == 2]
    assert floats == []
    int8 = {t.data_ptr() for t in model.buffers() if t.dtype == torch.int8}
    assert len(int8) == (1 if tied else 2)  # the head's rows, and the embedding's own when untied
    assert summary.bytes_before == matrices


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_cache_round_trip_gives_the_same_logits(tmp_path, tied, scheme):
    model = _tiny("gemma3", tied, num_layers=2)
    tensors = quantized_tensors(model, scheme)
    assert ("model.embed_tokens.qweight" in tensors) == (not tied)  # a tied embedding stores nothing of its own
    write_quantized(tmp_path, scheme, tensors)
    apply_quantized(model, tensors, scheme)
    fresh = _tiny("gemma3", tied, num_layers=2)
    summary = apply_quantized(fresh, read_quantized(tmp_path, scheme), scheme)
    assert isinstance(fresh.get_input_embeddings(), Int8Embedding) and summary.tied_head == tied
    x = prompt_ids(9, seed=5)
    with torch.inference_mode():
        assert torch.equal(model(x).logits, fresh(x).logits)


def test_a_tied_model_saved_and_loaded_shares_its_int8_rows_after_the_cache(tmp_path):
    """Through the loader: from_pretrained re-ties the weights, and the cached file has no embedding of its own."""
    from specdecode.models import loading

    folder = tmp_path / "m"
    _tiny("llama", True, num_layers=2).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    dense = tmp_path / "dense"
    dense.mkdir()
    a, b = [loading._quantize(loading._load_dense(folder, "m", torch.float32, torch.device("cpu")), "int8", dense)
            for _ in range(2)]
    for loaded in (a, b):
        emb, head = loaded.model.get_input_embeddings(), loaded.model.get_output_embeddings()
        assert isinstance(head, Int8Linear) and emb.qweight is head.qweight
    assert not any(k.startswith("model.embed_tokens.") for k in read_quantized(dense, "int8"))
    x = prompt_ids(7, seed=3)
    with torch.inference_mode():
        assert torch.equal(a.model(x).logits, b.model(x).logits)


def test_a_cache_without_the_embedding_is_refused_and_an_older_version_is_recomputed(tmp_path, monkeypatch):
    model = _tiny("qwen2", False, num_layers=1)
    tensors = {k: v for k, v in quantized_tensors(model, "int8").items() if not k.startswith("model.embed_tokens.")}
    with pytest.raises(InvalidArgumentError, match=r"do not match the input embedding 'model.embed_tokens' \(48x32\)"):
        apply_quantized(_tiny("qwen2", False, num_layers=1), tensors, "int8")
    monkeypatch.setattr(dense_cache, "QUANTIZER_VERSION", 2)  # a file written before embeddings were quantized
    write_quantized(tmp_path, "int8", tensors)
    monkeypatch.undo()
    assert read_quantized(tmp_path, "int8") is None


class _ShiftedEmbedding(nn.Embedding):
    def forward(self, input_ids):
        return super().forward(input_ids) + 1.0


def test_an_embedding_that_is_more_than_a_lookup_stays_dense():
    model = _tiny("llama", False, num_layers=1)
    old = model.get_input_embeddings()
    odd = _ShiftedEmbedding(old.num_embeddings, old.embedding_dim)
    odd.weight = old.weight
    model.set_input_embeddings(odd)
    assert "model.embed_tokens.qweight" not in quantized_tensors(model, "int8")
    summary = quantize_model(model, "int8")
    assert model.get_input_embeddings() is odd and summary.embedding == "dense"
    assert "_ShiftedEmbedding may compute more than a row lookup" in summary.dense_modules["model.embed_tokens"]
    assert not any(type(m) is nn.Linear for m in model.modules())


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_greedy_speculative_equals_autoregressive_on_tied_quantized_models(arch, scheme):
    """The exactness test of test_quantize.py, on tied models (the embedding reads the int8 head)."""
    tok = make_tiny_tokenizer()
    target, draft = _tiny(arch, True, num_layers=4, seed=0), _tiny(arch, True, num_layers=2, seed=5)
    for model in (target, draft):
        assert quantize_model(model, scheme).tied_head
        assert isinstance(model.get_input_embeddings(), Int8Embedding)
    gen = SpeculativeGenerator(LoadedModel(target, tok, "tiny", scheme), LoadedModel(draft, tok, "tiny-draft", scheme))
    config = GenerationConfig(max_new_tokens=24, num_speculative_tokens=4, stop_on_eos=False)
    prompt = "w5 w9 w12 w7 w5 w9 w12 w7 w5 w30 w31"
    expected = gen.generate(prompt, config, method="autoregressive").token_ids
    assert len(expected) == 24
    for method, options in METHOD_OPTIONS.items():
        assert gen.generate(prompt, config, method=method, **options).token_ids == expected, f"{arch} {scheme} {method}"


def test_int8_quantization_in_row_blocks_equals_one_block(monkeypatch):
    """A vocabulary matrix is quantized a block of rows at a time (small temporaries), with the same result."""
    from specdecode.models import quantize

    w = torch.randn(50, 24, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    monkeypatch.setattr(quantize, "_INT8_BLOCK_ROWS", 1 << 30)
    whole = quantize_int8(w, torch.bfloat16)
    monkeypatch.setattr(quantize, "_INT8_BLOCK_ROWS", 7)  # 50 rows: 7 full blocks and a short one
    blocked = quantize_int8(w, torch.bfloat16)
    assert all(torch.equal(whole[k], blocked[k]) for k in ("qweight", "scales"))
    assert blocked["qweight"].dtype == torch.int8 and blocked["scales"].dtype == torch.bfloat16
