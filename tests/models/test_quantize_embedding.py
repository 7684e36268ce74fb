"""The quantized input embedding of a quantized model (specdecode.models.quantized_embedding: Int8Embedding, Int4Embedding)."""

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
    QUANTIZER_VERSION,
    Int4Embedding,
    Int8Embedding,
    Int8Linear,
    apply_quantized,
    quantize_int4,
    quantize_int8,
    quantize_model,
    quantized_tensors,
    unpack_nibbles,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(arch: str, tied: bool, **kw) -> nn.Module:
    model = make_tiny_model(arch, tie_word_embeddings=tied, **kw)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    return model


def _loaded_twice(tmp_path, arch: str, tied: bool, scheme: str):
    """A tiny model saved to a folder, loaded and quantized through the loader twice (the second
    time from the quantized file the first one cached in ``tmp_path / "dense"``)."""
    from specdecode.models import loading

    folder = tmp_path / "m"
    _tiny(arch, tied, num_layers=2).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    dense = tmp_path / "dense"
    dense.mkdir()
    return [loading._quantize(loading._load_dense(folder, "m", torch.float32, torch.device("cpu")), scheme, dense)
            for _ in range(2)]


def _dequant_int4(parts: dict[str, torch.Tensor], group: int = 32) -> torch.Tensor:
    """(q - 8) * s + z of the packed weight, element by element in float32 (written apart from the module's)."""
    q = unpack_nibbles(parts["nibbles"]).float()
    return (q - 8) * parts["scales"].float().repeat_interleave(group, 1) + parts["zeros"].float().repeat_interleave(group, 1)


def _dequantized_embedding(emb: nn.Module, storage: str = "int8") -> nn.Module:
    """A copy of the dense embedding module (its own forward: lookup, Gemma's scale) with the int8- or int4-rounded rows."""
    ref = copy.deepcopy(emb)
    if storage == "int8":
        parts = quantize_int8(emb.weight, emb.weight.dtype)
        rows = parts["qweight"].float() * parts["scales"].float()[:, None]
    else:
        rows = _dequant_int4(quantize_int4(emb.weight, emb.weight.dtype))
    with torch.no_grad():
        ref.weight.copy_(rows.to(emb.weight.dtype))
    return ref


def _storage(scheme: str, tied: bool) -> str:
    """An untied embedding takes the scheme's format; a tied one reads the LM head's, which is int8 under both."""
    return "int4" if scheme == "int4" and not tied else "int8"


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_embedding_is_quantized_and_gives_the_dequantized_rows(arch, scheme, tied):
    model = _tiny(arch, tied, num_layers=2)
    storage = _storage(scheme, tied)
    ref = _dequantized_embedding(model.get_input_embeddings(), storage)
    summary = quantize_model(model, scheme)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert type(emb) is (Int4Embedding if storage == "int4" else Int8Embedding)
    assert summary.embedding == storage and summary.dense_modules == {} and summary.tied_head == tied
    assert not any(isinstance(m, nn.Embedding) for m in model.modules())
    if storage == "int8":
        shared = (emb.qweight.data_ptr() == head.qweight.data_ptr(), emb.scales.data_ptr() == head.scales.data_ptr())
        assert emb.qweight.dtype == torch.int8 and shared == (tied, tied)  # a tied one reads the int8 head's buffers
    else:
        assert emb.nibbles.dtype == torch.uint8 and emb.nibbles.shape == (VOCAB, 16) and emb.scales.shape == (VOCAB, 1)
    if scheme == "int4":  # the head stays int8, and a tied embedding with it
        assert ("model.embed_tokens" in summary.int8_layers) == tied
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
    hidden = model.config.hidden_size  # an int4 embedding's (V, 1) scales and zeros are no dense matrix
    floats = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point() and t.dim() == 2
              and t.shape[1] >= hidden]
    assert floats == []
    int8 = {t.data_ptr() for t in model.buffers() if t.dtype == torch.int8}
    assert len(int8) == 1  # the head's rows, shared by a tied embedding; an untied one is int4
    assert isinstance(model.get_input_embeddings(), Int8Embedding if tied else Int4Embedding)
    assert summary.bytes_before == matrices


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_cache_round_trip_gives_the_same_logits(tmp_path, tied, scheme):
    model = _tiny("gemma3", tied, num_layers=2)
    tensors = quantized_tensors(model, scheme)
    storage = _storage(scheme, tied)
    own = {k.removeprefix("model.embed_tokens.") for k in tensors if k.startswith("model.embed_tokens.")}
    assert own == (set() if tied else {"qweight", "scales"} if storage == "int8" else {"nibbles", "scales", "zeros", "int4"})
    write_quantized(tmp_path, scheme, tensors)
    apply_quantized(model, tensors, scheme)
    fresh = _tiny("gemma3", tied, num_layers=2)
    back = read_quantized(tmp_path, scheme)
    assert all(back[k].dtype == tensors[k].dtype and torch.equal(back[k], tensors[k]) for k in tensors)
    summary = apply_quantized(fresh, back, scheme)
    emb = fresh.get_input_embeddings()
    assert type(emb) is type(model.get_input_embeddings()) and summary.tied_head == tied and summary.embedding == storage
    assert all(torch.equal(a, b) for a, b in zip(emb.buffers(), model.get_input_embeddings().buffers()))
    x = prompt_ids(9, seed=5)
    with torch.inference_mode():
        assert torch.equal(model(x).logits, fresh(x).logits)


def test_a_tied_model_saved_and_loaded_shares_its_int8_rows_after_the_cache(tmp_path):
    """Through the loader: from_pretrained re-ties the weights, and the cached file has no embedding of its own."""
    a, b = _loaded_twice(tmp_path, "llama", True, "int8")
    for loaded in (a, b):
        emb, head = loaded.model.get_input_embeddings(), loaded.model.get_output_embeddings()
        assert isinstance(head, Int8Linear) and emb.qweight is head.qweight
    assert not any(k.startswith("model.embed_tokens.") for k in read_quantized(tmp_path / "dense", "int8"))
    x = prompt_ids(7, seed=3)
    with torch.inference_mode():
        assert torch.equal(a.model(x).logits, b.model(x).logits)


def test_a_cache_without_the_embedding_is_refused_and_an_older_version_is_recomputed(tmp_path, monkeypatch):
    model = _tiny("qwen2", False, num_layers=1)
    tensors = {k: v for k, v in quantized_tensors(model, "int8").items() if not k.startswith("model.embed_tokens.")}
    with pytest.raises(InvalidArgumentError, match=r"do not match the input embedding 'model.embed_tokens' \(48x32\)"):
        apply_quantized(_tiny("qwen2", False, num_layers=1), tensors, "int8")
    for older in (2, 3):  # before embeddings were quantized; before an untied one was int4 under int4
        monkeypatch.setattr(dense_cache, "QUANTIZER_VERSION", older)
        write_quantized(tmp_path, "int8", tensors)
        monkeypatch.undo()
        assert QUANTIZER_VERSION > older and read_quantized(tmp_path, "int8") is None


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


@pytest.mark.parametrize("scheme, draft_head", [("int8", None), ("int4", None), ("int4", "int4")],
                         ids=["int8", "int4", "int4-draft-head-int4"])
def test_greedy_speculative_equals_autoregressive_on_tied_quantized_models(arch, scheme, draft_head):
    """The exactness test of test_quantize.py, on tied models (the embedding reads the int8 head, or the
    draft's int4 head)."""
    tok = make_tiny_tokenizer()
    target, draft = _tiny(arch, True, num_layers=4, seed=0), _tiny(arch, True, num_layers=2, seed=5)
    for model, head in ((target, None), (draft, draft_head)):
        assert quantize_model(model, scheme, head).tied_head
        assert isinstance(model.get_input_embeddings(), Int4Embedding if head == "int4" else Int8Embedding)
    gen = SpeculativeGenerator(LoadedModel(target, tok, "tiny", scheme), LoadedModel(draft, tok, "tiny-draft", scheme))
    config = GenerationConfig(max_new_tokens=24, num_speculative_tokens=4, stop_on_eos=False)
    prompt = "w5 w9 w12 w7 w5 w9 w12 w7 w5 w30 w31"
    expected = gen.generate(prompt, config, method="autoregressive").token_ids
    assert len(expected) == 24
    for method, options in METHOD_OPTIONS.items():
        assert gen.generate(prompt, config, method=method, **options).token_ids == expected, f"{arch} {scheme} {method}"


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantization_in_row_blocks_equals_one_block(monkeypatch, scheme):
    """A vocabulary matrix is quantized a block of rows at a time (small temporaries), with the same result."""
    from specdecode.models import quantized_embedding

    quantize = quantize_int8 if scheme == "int8" else quantize_int4
    w = torch.randn(50, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    monkeypatch.setattr(quantized_embedding, "_QUANTIZE_BLOCK_ROWS", 1 << 30)
    whole = quantize(w, torch.bfloat16)
    monkeypatch.setattr(quantized_embedding, "_QUANTIZE_BLOCK_ROWS", 7)  # 50 rows: 7 full blocks and a short one
    blocked = quantize(w, torch.bfloat16)
    assert whole.keys() == blocked.keys() and all(torch.equal(whole[k], blocked[k]) for k in whole)
    assert all(t.dtype == torch.bfloat16 for k, t in blocked.items() if k in ("scales", "zeros"))
    assert blocked["qweight" if scheme == "int8" else "nibbles"].dtype == (torch.int8 if scheme == "int8" else torch.uint8)


# --- int4 input embeddings (untied models under --quantize int4) ---------------------------


def _embedding_bytes(emb: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for name, t in emb.named_buffers() if name != "embed_scale")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_untied_int4_embedding_is_packed_and_smaller_than_int8(dtype):
    model8, model4 = (_tiny("qwen2", False, num_layers=1, hidden_size=64).to(dtype) for _ in range(2))
    v, k = model4.get_input_embeddings().weight.shape
    quantize_model(model8, "int8")
    summary = quantize_model(model4, "int4")
    emb8, emb4 = model8.get_input_embeddings(), model4.get_input_embeddings()
    assert type(emb8) is Int8Embedding and type(emb4) is Int4Embedding and summary.embedding == "int4"
    assert {n: (t.dtype, tuple(t.shape)) for n, t in emb4.named_buffers()} == {
        "nibbles": (torch.uint8, (v, k // 2)), "scales": (dtype, (v, k // 32)), "zeros": (dtype, (v, k // 32))}
    assert "model.embed_tokens" not in summary.int8_layers and "int4 group 32" in repr(emb4)
    # two nibbles a byte and a scale and a zero per 32 values: 0.625 (bf16) / 0.75 (float32) bytes a weight
    per_weight = 0.5 + 2 * dtype.itemsize / 32
    assert _embedding_bytes(emb4) == v * k * per_weight
    assert _embedding_bytes(emb4) < 0.8 * _embedding_bytes(emb8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch_name", ["llama", "gemma3"])
def test_int4_lookups_equal_the_dequantized_packed_weight_exactly(arch_name, dtype):
    """Any ids, repeated, in any shape: the rows of the packed weight de-quantized in full, then Gemma's scale."""
    model = _tiny(arch_name, False, num_layers=1).to(dtype)
    dense_emb = model.get_input_embeddings()
    ref = _dequantized_embedding(dense_emb, "int4")
    quantize_model(model, "int4")
    emb = model.get_input_embeddings()
    assert isinstance(emb, Int4Embedding)
    full = _dequant_int4({"nibbles": emb.nibbles, "scales": emb.scales, "zeros": emb.zeros}).to(dtype)
    assert torch.equal(full, ref.weight)  # the module's buffers are what quantize_int4 returned
    ids = torch.cat([prompt_ids(13, seed=9)[0], torch.tensor([0, VOCAB - 1, 5, 5])]).view(1, 17)
    for shaped in (ids, ids.view(17), ids.view(17, 1)):
        with torch.no_grad():
            got, want = emb(shaped), ref(shaped)
        assert got.shape == (*shaped.shape, 32) and got.dtype == dtype and torch.equal(got, want)
    if arch_name == "gemma3":
        with torch.no_grad():  # the scale is applied, as by the dense module
            assert emb.embed_scale is not None and not torch.equal(emb(ids), full[ids])


def test_greedy_speculative_equals_autoregressive_with_int4_embeddings():
    """The exactness test of test_quantize.py (every architecture there) on untied models with int4 embeddings."""
    tok = make_tiny_tokenizer()
    for arch_name in ("qwen2", "gemma3"):
        target, draft = _tiny(arch_name, False, num_layers=4, seed=0), _tiny(arch_name, False, num_layers=2, seed=5)
        for model in (target, draft):
            assert quantize_model(model, "int4").embedding == "int4"
            assert isinstance(model.get_input_embeddings(), Int4Embedding)
        gen = SpeculativeGenerator(LoadedModel(target, tok, "tiny", "int4"), LoadedModel(draft, tok, "tiny-draft", "int4"))
        config = GenerationConfig(max_new_tokens=24, num_speculative_tokens=4, stop_on_eos=False)
        prompt = "w5 w9 w12 w7 w5 w9 w12 w7 w5 w30 w31"
        expected = gen.generate(prompt, config, method="autoregressive").token_ids
        assert len(expected) == 24
        for method, options in METHOD_OPTIONS.items():
            assert gen.generate(prompt, config, method=method, **options).token_ids == expected, f"{arch_name} {method}"


def test_an_untied_model_saved_and_loaded_keeps_its_int4_embedding_through_the_cache(tmp_path):
    a, b = _loaded_twice(tmp_path, "qwen2", False, "int4")  # the second one reads the cached file
    stored = read_quantized(tmp_path / "dense", "int4")
    assert stored["model.embed_tokens.nibbles"].dtype == torch.uint8 and int(stored["model.embed_tokens.int4"][0]) == 32
    for loaded in (a, b):
        emb = loaded.model.get_input_embeddings()
        assert isinstance(emb, Int4Embedding) and all(t.data_ptr() % 64 == 0 for t in emb.buffers())
    x = prompt_ids(7, seed=3)
    with torch.inference_mode():
        assert torch.equal(a.model(x).logits, b.model(x).logits)


def test_an_embedding_width_off_the_group_stays_int8_and_is_named():
    model = _tiny("llama", False, num_layers=1, hidden_size=48)  # 48 is not a multiple of 32
    summary = quantize_model(model, "int4")
    assert isinstance(model.get_input_embeddings(), Int8Embedding) and summary.embedding == "int8"
    assert summary.int8_layers["model.embed_tokens"] == "48 inputs is not a multiple of the group size 32"


def test_bad_int4_group_sizes_and_shapes_get_clear_errors():
    w = torch.randn(VOCAB, 64, generator=torch.Generator().manual_seed(3))
    parts = quantize_int4(w, torch.float32)
    with pytest.raises(InvalidArgumentError, match=r"int4 group size 16 is not supported; allowed: \(32, 64, 128, 256\)"):
        Int4Embedding(parts["nibbles"], parts["scales"], parts["zeros"], group_size=16)
    with pytest.raises(InvalidArgumentError, match=r"int4 group size 128 does not fit 64 inputs; allowed: a divisor of 64"):
        Int4Embedding(parts["nibbles"], parts["scales"], parts["zeros"], group_size=128)
    with pytest.raises(InvalidArgumentError, match=r"48x64 with group size 64 needs scales and zeros of 48x1 .*got "
                                                   r"torch.float32 \(48, 2\)"):
        Int4Embedding(parts["nibbles"], parts["scales"], parts["zeros"], group_size=64)
    with pytest.raises(InvalidArgumentError, match=r"needs nibbles \(V, K/2\) uint8; got torch.int8"):
        Int4Embedding(parts["nibbles"].to(torch.int8), parts["scales"], parts["zeros"])
    # a cached file whose group-size marker is off: the error names the embedding and what is allowed
    model = _tiny("qwen2", False, num_layers=1)
    tensors = quantized_tensors(model, "int4")
    tensors["model.embed_tokens.int4"] = torch.tensor([48], dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match=r"do not match the input embedding 'model.embed_tokens' \(48x32\): "
                                                   r"int4 group size 48 is not supported; allowed: \(32, 64"):
        apply_quantized(_tiny("qwen2", False, num_layers=1), tensors, "int4")
    del tensors["model.embed_tokens.zeros"]
    with pytest.raises(InvalidArgumentError, match=r"'model.embed_tokens' \(48x32\): they lack 'model.embed_tokens.zeros'"):
        apply_quantized(_tiny("qwen2", False, num_layers=1), tensors, "int4")
    other = quantized_tensors(_tiny("qwen2", False, num_layers=1, vocab_size=64), "int4")
    with pytest.raises(InvalidArgumentError, match=r"'model.embed_tokens' \(48x32\): they are 64x32 \(int4 group 32\)"):
        apply_quantized(_tiny("qwen2", False, num_layers=1), {**tensors, **{k: v for k, v in other.items()
                                                                            if k.startswith("model.embed_tokens.")}}, "int4")
