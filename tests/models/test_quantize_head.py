"""The int4 LM head (specdecode.models.quantize, head="int4"): the default for an int4 draft model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import VOCAB, make_tiny_model, make_tiny_tokenizer
from selfspec_helpers import one_thread, prompt_ids, saved_model_with_quantizer_log  # noqa: F401
from specdecode import InvalidArgumentError, SpeculativeGenerator
from specdecode.drafters import DraftHead
from specdecode.models import load_model
from specdecode.models.dense_cache import quantized_path, read_quantized, write_quantized
from specdecode.models.quantize import (
    Int4Embedding,
    Int4Linear,
    Int4LinearPaddedRows,
    Int8Embedding,
    Int8Linear,
    apply_quantized,
    quantize_int4,
    quantize_model,
    quantized_tensors,
    unpack_nibbles,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(arch: str = "qwen2", tied: bool = False, **kw) -> nn.Module:
    """A tiny model whose head the int4 kernel takes: 48 rows (a multiple of 16), 32 inputs (one group)."""
    return make_tiny_model(arch, tie_word_embeddings=tied, **{"num_layers": 2, **kw})


def _dequant(nibbles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int = 32) -> torch.Tensor:
    """(q - 8) * s + z element by element in float32 (written apart from the modules')."""
    q = unpack_nibbles(nibbles).float()
    return (q - 8) * scales.float().repeat_interleave(group, 1) + zeros.float().repeat_interleave(group, 1)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_an_int4_head_is_int4_and_its_logits_are_the_dequantized_matmul(tied):
    model = _tiny(tied=tied)
    dense = model.get_output_embeddings().weight.detach().clone()
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    summary = quantize_model(model, "int4", head="int4")
    head = model.get_output_embeddings()
    assert type(head) is Int4Linear and head.nibbles is not None and "rows kept" in repr(head)
    assert summary.head == "int4" and summary.as_dict()["head"] == "int4"
    assert summary.layers == {"int4": n_linear} and "lm_head" not in summary.int8_layers
    # the bytes the kernel reads are int4's (half a byte a weight, a scale and a zero per 32), under int8's
    read = head.packed.numel() * head.packed.element_size() + head.scales_and_zeros.numel() * 4
    assert read == VOCAB * 32 // 2 + VOCAB * 2 * 4 and read < VOCAB * 32 + VOCAB * 4
    assert not any(t.dtype == torch.int8 for t in model.buffers())
    # the kept source tensors are quantize_int4's, and the kernel computes with them
    parts = quantize_int4(dense, torch.float32)
    assert torch.equal(head.nibbles, parts["nibbles"]) and torch.equal(head.scales, parts["scales"])
    assert torch.equal(head.zeros, parts["zeros"])
    h = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = head(h)
    want = h @ _dequant(**parts).t()
    assert got.shape == (3, VOCAB) and (got - want).abs().max() < 1e-4 * want.abs().max()
    dense_logits = h @ dense.t()  # int4 is close to the dense head, not equal
    assert 0 < (got - dense_logits).abs().max() < 0.3 * dense_logits.abs().max()


def test_a_tied_embedding_reads_the_int4_heads_buffers():
    model = _tiny(tied=True)
    summary = quantize_model(model, "int4", head="int4")
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert type(emb) is Int4Embedding and summary.embedding == "int4" and summary.tied_head
    assert "model.embed_tokens" not in summary.int8_layers
    assert emb.nibbles.data_ptr() == head.nibbles.data_ptr()  # no copy of the rows
    size = head.scales_and_zeros.element_size()
    assert (emb.scales.data_ptr(), emb.zeros.data_ptr()) == (head.scales_and_zeros.data_ptr(),
                                                             head.scales_and_zeros.data_ptr() + size)
    # nothing dense or int8 is left, and each buffer is counted once
    assert not any(isinstance(m, (nn.Embedding, Int8Embedding, Int8Linear)) for m in model.modules())
    assert not any(t.is_floating_point() and t.dim() == 2 and t.shape[1] >= 32
                   for t in (*model.parameters(), *model.buffers()))
    quantized = [t for m in model.modules() if isinstance(m, (Int4Linear, Int4Embedding)) for t in m.buffers()]
    assert summary.bytes_after == _storage_bytes(quantized)
    # the lookups are the rows of the weight the head multiplies by
    weight = _dequant(head.nibbles, head.scales, head.zeros)
    ids = torch.cat([prompt_ids(11, seed=1)[0], torch.tensor([0, VOCAB - 1])]).view(1, 13)
    with torch.no_grad():
        rows = emb(ids)
        logits = head(rows)
    assert rows.shape == (1, 13, 32) and torch.equal(rows[0], weight[ids[0]])
    assert (logits[0] - rows[0] @ weight.t()).abs().max() < 1e-4 * logits.abs().max()


def test_the_int8_head_stays_the_default():
    for head in (None, "int8"):
        model = _tiny(tied=True)
        summary = quantize_model(model, "int4", head=head)
        assert summary.head == "int8" and type(model.get_output_embeddings()) is Int8Linear
        assert type(model.get_input_embeddings()) is Int8Embedding
        assert summary.int8_layers["lm_head"].startswith("LM head (kept at int8")
    assert quantize_model(_tiny(), "int8").head == "int8"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_head_the_kernel_refuses_stays_int8_and_says_why(tied):
    model = _tiny(tied=tied, vocab_size=40)  # 40 rows: not a multiple of 16
    assert "lm_head.int4" not in quantized_tensors(model, "int4", head="int4")
    summary = quantize_model(model, "int4", head="int4")
    assert summary.head == "int8" and type(model.get_output_embeddings()) is Int8Linear
    assert summary.int8_layers["lm_head"] == "LM head: 40 output rows is not a multiple of 16 (the int4 kernel's limit)"
    assert type(model.get_input_embeddings()) is (Int8Embedding if tied else Int4Embedding)
    assert isinstance(model.model.layers[0].mlp.up_proj, Int4Linear)


@pytest.mark.parametrize("rows", [16, 32, 5, 17])
def test_select_rows_gives_the_full_heads_columns(rows):
    model = _tiny().to(torch.bfloat16)
    quantize_model(model, "int4", head="int4")
    head = model.get_output_embeddings()
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(rows))[:rows].sort().values
    cut = head.select_rows(ids)
    assert type(cut) is (Int4Linear if rows % 16 == 0 else Int4LinearPaddedRows) and cut.out_features == rows
    h = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        got, full = cut(h), head(h)
    # bf16 outputs of the kernel at another N: equal up to the summation order (a wrong row is far off)
    assert got.shape == (2, 3, rows)
    torch.testing.assert_close(got, full[..., ids], rtol=1e-2, atol=1e-2)
    # through the truncated draft head (FR-Spec), on the whole model
    x = prompt_ids(6, seed=3)
    with torch.no_grad():
        bound = DraftHead.truncated(ids).bind(model)
        with bound.applied():
            truncated = model(x).logits
        torch.testing.assert_close(truncated, model(x).logits[..., ids], rtol=1e-2, atol=1e-2)


def test_select_rows_needs_the_kept_rows():
    model = _tiny()
    quantize_model(model, "int4", head="int4")
    layer = model.model.layers[0].mlp.up_proj  # an int4 linear that is no head keeps no rows
    assert type(layer) is Int4Linear and layer.nibbles is None
    with pytest.raises(InvalidArgumentError, match=r"this Int4Linear \(64x32\) did not keep its rows \(keep_rows=False\): "
                                                   r"its packed weight cannot be cut by row"):
        layer.select_rows(torch.tensor([0, 1]))
    with pytest.raises(InvalidArgumentError, match=r"needs a non-empty 1-D tensor of row ids, got shape \(0,\)"):
        model.get_output_embeddings().select_rows(torch.tensor([], dtype=torch.long))


def test_cache_round_trip_and_the_two_heads_have_their_own_files(tmp_path):
    model = _tiny(tied=True)
    int4_head, int8_head = quantized_tensors(model, "int4", head="int4"), quantized_tensors(model, "int4")
    assert "lm_head.int4" in int4_head and "lm_head.int4" not in int8_head
    write_quantized(tmp_path, "int4", int8_head)
    assert read_quantized(tmp_path, "int4", head="int4") is None  # the int8 head's file is not the int4 head's
    write_quantized(tmp_path, "int4", int4_head, head="int4")
    assert quantized_path(tmp_path, "int4").name == "quantized-int4.safetensors"  # the name it always had
    assert quantized_path(tmp_path, "int4", "int4").name == "quantized-int4-head-int4.safetensors"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quantized-int4-head-int4.safetensors",
                                                          "quantized-int4.safetensors"]
    back4, back8 = read_quantized(tmp_path, "int4", head="int4"), read_quantized(tmp_path, "int4")
    assert back4.keys() == int4_head.keys() and all(torch.equal(back4[k], int4_head[k]) for k in int4_head)
    assert back8.keys() == int8_head.keys()
    # a file at the int4 head's name whose metadata says otherwise is stale
    quantized_path(tmp_path, "int4").replace(quantized_path(tmp_path, "int4", "int4"))
    assert read_quantized(tmp_path, "int4", head="int4") is None
    # the same logits from the tensors and from their cached copy
    write_quantized(tmp_path, "int4", int4_head, head="int4")
    fresh = _tiny(tied=True)
    apply_quantized(model, int4_head, "int4")
    assert apply_quantized(fresh, read_quantized(tmp_path, "int4", head="int4"), "int4").head == "int4"
    x = prompt_ids(9, seed=5)
    with torch.inference_mode():
        assert torch.equal(model(x).logits, fresh(x).logits)


def test_a_cache_file_from_before_the_int4_head_is_read_for_the_int8_head_only(tmp_path):
    """Files written before the head was recorded (metadata without "head") hold the int8 head."""
    from safetensors.torch import save_file

    from specdecode.models.dense_cache import CACHE_FORMAT_VERSION
    from specdecode.models.quantize import QUANTIZER_VERSION

    tensors = quantized_tensors(_tiny(tied=True), "int4")  # the int8 head, as every file before had
    old_meta = {"format": str(CACHE_FORMAT_VERSION), "scheme": "int4", "quantizer": str(QUANTIZER_VERSION)}
    save_file(tensors, str(quantized_path(tmp_path, "int4")), metadata=old_meta)
    back = read_quantized(tmp_path, "int4")
    assert back is not None and back.keys() == tensors.keys()
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert read_quantized(tmp_path, "int4", head="int4") is None  # no file of the int4 head's name
    # nor is it taken for the int4 head under that name: its metadata means an int8 head
    quantized_path(tmp_path, "int4").replace(quantized_path(tmp_path, "int4", "int4"))
    assert read_quantized(tmp_path, "int4", head="int4") is None


def test_the_loader_caches_each_head_apart(tmp_path, monkeypatch):
    """A target (int8 head) and a draft (int4 head) of one dense copy: two files, each read back by its own kind."""
    from specdecode.models import loading

    folder, dense, calls = saved_model_with_quantizer_log(tmp_path, monkeypatch, _tiny(tied=True), lambda s, h, g: h)

    def load(head):
        loaded = loading._load_dense(folder, "m", torch.float32, torch.device("cpu"))
        return loading._quantize(loaded, "int4", dense, head)

    first = {head: load(head) for head in ("int4", None)}
    again = {head: load(head) for head in ("int4", None)}
    assert calls == ["int4", "int8"]  # the second round reads both files
    files = sorted(p.name for p in dense.iterdir())
    assert files == ["quantized-int4-head-int4.safetensors", "quantized-int4.safetensors"]
    x = prompt_ids(7, seed=3)
    for head, storage in (("int4", "int4"), (None, "int8")):
        a, b = first[head], again[head]
        assert a.quantize_head == b.quantize_head == storage and a.quantize == "int4"
        assert type(b.model.get_output_embeddings()) is (Int4Linear if storage == "int4" else Int8Linear)
        with torch.inference_mode():
            assert torch.equal(a.model(x).logits, b.model(x).logits)


def test_from_pretrained_gives_an_int4_draft_the_int4_head(tmp_path):
    folder = tmp_path / "m"
    _tiny(tied=True).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    m = str(folder)
    gen = SpeculativeGenerator.from_pretrained(m, m, dtype="float32", device="cpu", draft_quantize="int4")
    assert (gen.target.quantize_head, gen.draft.quantize_head) == (None, "int4")
    gen = SpeculativeGenerator.from_pretrained(m, m, dtype="float32", device="cpu", quantize="int4")
    assert (gen.target.quantize_head, gen.draft.quantize_head) == ("int8", "int4")  # the target's stays int8
    assert isinstance(gen.draft.model.get_input_embeddings(), Int4Embedding)
    gen = SpeculativeGenerator.from_pretrained(m, m, dtype="float32", device="cpu", quantize="int4",
                                               draft_quantize_head="int8")
    assert (gen.target.quantize_head, gen.draft.quantize_head) == ("int8", "int8")
    gen = SpeculativeGenerator.from_pretrained(m, m, dtype="float32", device="cpu", draft_quantize="int8")
    assert gen.draft.quantize_head == "int8"


def test_bad_heads_get_clear_errors():
    model = _tiny()
    with pytest.raises(InvalidArgumentError, match=r"an int4 LM head needs quantize='int4', but quantize='int8'; allowed "
                                                   r"head with 'int8': int8 \(or None\)"):
        quantize_model(model, "int8", head="int4")
    with pytest.raises(InvalidArgumentError, match=r"an int4 LM head needs quantize='int4', but quantize='int8'"):
        quantized_tensors(model, "int8", head="int4")
    with pytest.raises(InvalidArgumentError, match=r"an int4 LM head needs quantize='int4', but quantize='none'"):
        quantize_model(model, "none", head="int4")
    with pytest.raises(InvalidArgumentError, match=r"unknown quantize head 'fp8'; allowed: int8, int4 \(or None: the "
                                                   r"scheme's default, int8\)"):
        quantize_model(model, "int4", head="fp8")
    assert all(type(m) is not Int4Linear for m in model.modules())  # refused before anything changed
    # checked before anything is looked up or loaded
    with pytest.raises(InvalidArgumentError, match=r"an int4 LM head needs quantize='int4', but quantize='int8'"):
        load_model("/nonexistent/folder", quantize="int8", quantize_head="int4")
    with pytest.raises(InvalidArgumentError, match=r"but quantize='int8'; allowed head with 'int8'"):
        SpeculativeGenerator.from_pretrained("/nonexistent/t", "/nonexistent/d", quantize="int4", draft_quantize="int8",
                                             draft_quantize_head="int4")
    with pytest.raises(InvalidArgumentError, match=r"unknown quantize head 'int2'"):
        SpeculativeGenerator.from_pretrained("/nonexistent/t", "/nonexistent/d", draft_quantize_head="int2")
