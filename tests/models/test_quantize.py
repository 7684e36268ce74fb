"""Weight-only int8 / int4 quantization (specdecode.models.quantize) and lossless decoding on the quantized model."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from conftest import make_tiny_model, make_tiny_tokenizer
from selfspec_helpers import (METHOD_OPTIONS, one_thread, prompt_ids, quantized_pair,  # noqa: F401
                              saved_model_with_quantizer_log)
from specdecode import GenerationConfig, InvalidArgumentError
from specdecode.models import LoadedModel, load_model
from specdecode.models.dense_cache import quantized_path, read_quantized, write_quantized
from specdecode.models.quantize import (
    Int4Linear,
    Int8Linear,
    apply_quantized,
    check_quantize,
    pack_nibbles,
    quantization_of,
    quantize_int4,
    quantize_int8,
    quantize_model,
    quantized_tensors,
    unpack_nibbles,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _dequant_int8(parts):
    return parts["qweight"].float() * parts["scales"].float()[:, None]


def _dequant_int4(parts, group=32):
    q = unpack_nibbles(parts["nibbles"]).float()
    s = parts["scales"].float().repeat_interleave(group, 1)
    z = parts["zeros"].float().repeat_interleave(group, 1)
    return (q - 8) * s + z


def test_nibbles_round_trip():
    q = torch.randint(0, 16, (32, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_nibbles(q)
    assert packed.shape == (32, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed), q)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantization_error_is_within_half_a_step(scheme):
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    if scheme == "int8":
        parts = quantize_int8(w, torch.float32)
        err, step = (_dequant_int8(parts) - w).abs(), parts["scales"][:, None]
    else:
        parts = quantize_int4(w, torch.float32)
        err, step = (_dequant_int4(parts) - w).abs(), parts["scales"].repeat_interleave(32, 1)
    assert torch.all(err <= step / 2 + 1e-6)
    assert err.max() > 0  # it really is quantized


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_compute_the_dequantized_matmul(scheme, dtype):
    g = torch.Generator().manual_seed(2)
    lin = nn.Linear(96, 48, bias=True).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 96, generator=g))
    if scheme == "int8":
        parts = quantize_int8(lin.weight, dtype)
        layer, ref_w = Int8Linear(parts["qweight"], parts["scales"], lin.bias), _dequant_int8(parts)
    else:
        parts = quantize_int4(lin.weight, dtype)
        layer, ref_w = Int4Linear(parts["nibbles"], parts["scales"], parts["zeros"], lin.bias), _dequant_int4(parts)
    x = torch.randn(2, 5, 96, generator=g).to(dtype)
    y = layer(x)
    ref = x.float() @ ref_w.t() + lin.bias.float()
    assert y.shape == (2, 5, 48) and y.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 0.05
    assert (y.float() - ref).abs().max() / ref.abs().max() < tol
    # each row is computed alone: one token gives the same as that token inside a block
    assert torch.equal(layer(x[:1, 2:3]), y[:1, 2:3])


def test_quantize_model_replaces_every_linear_and_reports():
    model = make_tiny_model("qwen2", num_layers=2)
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    summary = quantize_model(model, "int4")
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert summary.layers == {"int4": n_linear - 1, "int8": 1}  # the LM head stays int8
    assert list(summary.int8_layers) == ["lm_head"]
    assert summary.bytes_after < summary.bytes_before / 4
    assert quantization_of(model) == "int4"
    assert LoadedModel(model, None, "m").quantize == "int4"  # the wrapper reads it off the model
    assert model.get_output_embeddings().out_features == model.config.vocab_size


def test_int4_refused_shapes_fall_to_int8_and_are_named():
    model = make_tiny_model("llama", num_layers=1, intermediate_size=40)  # 40 rows: not a multiple of 16
    summary = quantize_model(model, "int4")
    names = summary.int8_layers
    assert "model.layers.0.mlp.gate_proj" in names and "40 output rows" in names["model.layers.0.mlp.gate_proj"]
    assert "40 inputs" in names["model.layers.0.mlp.down_proj"]
    assert isinstance(model.model.layers[0].self_attn.q_proj, Int4Linear)


def test_int8_select_rows_matches_full_layer():
    model = make_tiny_model("qwen2", num_layers=1)
    quantize_model(model, "int8")
    head = model.get_output_embeddings()
    ids = torch.tensor([3, 17, 40])
    h = torch.randn(1, 2, 32)
    assert torch.equal(head.select_rows(ids)(h), head(h)[..., ids])


def test_bad_schemes_and_devices():
    with pytest.raises(InvalidArgumentError, match=r"unknown quantize 'int3'; allowed: none, int8, int4"):
        check_quantize("int3")
    with pytest.raises(InvalidArgumentError, match=r"quantize='int8' runs on CPU only.*cuda"):
        check_quantize("int8", torch.device("cuda"))
    assert check_quantize("none", torch.device("cuda")) == "none"
    with pytest.raises(InvalidArgumentError, match="unknown quantize 'fp8'"):
        load_model("/nonexistent/folder", quantize="fp8")
    w = torch.randn(32, 96)
    with pytest.raises(InvalidArgumentError, match=r"int4 group size 64 does not fit 96 inputs"):
        quantize_int4(w, torch.float32, group_size=64)
    with pytest.raises(InvalidArgumentError, match=r"int4 group size 48 does not fit"):
        quantize_int4(w, torch.float32, group_size=48)
    parts = quantize_int4(w, torch.float32)
    with pytest.raises(InvalidArgumentError, match=r"int4 group size 16 is not supported; allowed: \(32, 64"):
        Int4Linear(parts["nibbles"], parts["scales"], parts["zeros"], None, group_size=16)
    with pytest.raises(InvalidArgumentError, match=r"need K a multiple of 64, N a multiple of 16 and scales/zeros of 32x1; got \(32, 3\)"):
        Int4Linear(parts["nibbles"], parts["scales"], parts["zeros"], None, group_size=64)


def test_torch_without_the_int4_kernel_gets_a_clear_error(monkeypatch):
    aten = torch.ops.aten

    class NoInt4:
        def __getattr__(self, name):
            if name == "_weight_int4pack_mm_for_cpu":
                raise AttributeError(name)
            return getattr(aten, name)

    monkeypatch.setattr(torch.ops, "aten", NoInt4())
    with pytest.raises(InvalidArgumentError, match=r"needs the CPU kernel aten._weight_int4pack_mm_for_cpu.*int4 needs "
                                                   r"torch >= 2\.6"):
        check_quantize("int4", torch.device("cpu"))
    assert check_quantize("int8", torch.device("cpu")) == "int8"


def test_stale_cache_for_another_model_is_refused():
    small, other = make_tiny_model("qwen2", num_layers=1), make_tiny_model("qwen2", num_layers=1, hidden_size=64)
    tensors = quantized_tensors(other, "int8")
    with pytest.raises(InvalidArgumentError, match="do not match layer"):
        apply_quantized(small, tensors, "int8")


def test_cache_file_round_trip(tmp_path):
    model = make_tiny_model("gemma3", num_layers=2)
    tensors = quantized_tensors(model, "int4")
    assert read_quantized(tmp_path, "int4") is None
    write_quantized(tmp_path, "int4", tensors)
    assert [p.name for p in tmp_path.iterdir()] == [quantized_path(tmp_path, "int4").name]  # no partial left
    back = read_quantized(tmp_path, "int4")
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert read_quantized(tmp_path, "int8") is None  # another scheme is another file


def test_second_load_reads_the_cache_instead_of_quantizing(tmp_path, monkeypatch):
    """A model folder has no dense copy; drive the GGUF path's cache logic through a saved folder."""
    from specdecode.models import loading

    model = make_tiny_model("qwen2", num_layers=2)
    folder, dense, calls = saved_model_with_quantizer_log(tmp_path, monkeypatch, model, lambda s, h, g: s)
    a = loading._quantize(loading._load_dense(folder, "m", torch.float32, torch.device("cpu")), "int8", dense)
    b = loading._quantize(loading._load_dense(folder, "m", torch.float32, torch.device("cpu")), "int8", dense)
    assert calls == ["int8"] and a.quantize == b.quantize == "int8"
    x = prompt_ids(7, seed=3)
    with torch.inference_mode():
        assert torch.equal(a.model(x).logits, b.model(x).logits)
    assert json.loads(json.dumps(b.model.specdecode_quantization.as_dict()))["layers"] == {"int8": 15}


# --- lossless decoding on the quantized model ------------------------------------------


@pytest.mark.parametrize("scheme, draft_head", [("int8", None), ("int4", None), ("int4", "int4")],
                         ids=["int8", "int4", "int4-draft-head-int4"])
def test_greedy_speculative_equals_the_quantized_models_autoregressive_output(arch, scheme, draft_head):
    """Float32 activations: every method reproduces the quantized target's own greedy tokens (also with the
    draft's LM head in int4, the default for an int4 draft)."""
    gen = quantized_pair(arch, scheme, draft_head)
    config = GenerationConfig(max_new_tokens=24, num_speculative_tokens=4, stop_on_eos=False)
    prompt = "w5 w9 w12 w7 w5 w9 w12 w7 w5 w30 w31"
    expected = gen.generate(prompt, config, method="autoregressive").token_ids
    assert len(expected) == 24
    for method, options in METHOD_OPTIONS.items():
        got = gen.generate(prompt, config, method=method, **options).token_ids
        assert got == expected, f"{arch} {scheme} {method}"


def test_quantized_model_is_a_different_model():
    """The point of the README's warning: quantization changes the logits (so outputs may differ)."""
    dense = make_tiny_model("llama", num_layers=2)
    quant = make_tiny_model("llama", num_layers=2)
    quantize_model(quant, "int4")
    x = prompt_ids(9, seed=4)
    with torch.inference_mode():
        a, b = dense(x).logits, quant(x).logits
    assert not torch.equal(a, b)
    assert (a - b).abs().max() < 0.5 * a.abs().max()  # close, not equal


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_misaligned_weights_are_realigned(scheme):
    """Weights read from a file can start anywhere; the int8 kernel crashed on them for long inputs."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    parts = quantize_int8(w, torch.float32) if scheme == "int8" else quantize_int4(w, torch.float32)

    def misaligned(t):
        raw = torch.empty(t.numel() * t.element_size() + 64, dtype=torch.uint8)
        start = next(i for i in range(1, 64) if (raw.data_ptr() + i) % 64 and (raw.data_ptr() + i) % t.element_size() == 0)
        out = raw[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        out.copy_(t)
        assert out.data_ptr() % 64
        return out

    parts = {k: misaligned(v) for k, v in parts.items()}
    layer = (Int8Linear(parts["qweight"], parts["scales"], None) if scheme == "int8"
             else Int4Linear(parts["nibbles"], parts["scales"], parts["zeros"], None))
    assert all(b.data_ptr() % 64 == 0 for b in layer.buffers())
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(6))
    ref = x @ (_dequant_int8(parts) if scheme == "int8" else _dequant_int4(parts)).t()
    assert (layer(x) - ref).abs().max() < 1e-3 * ref.abs().max()


def test_a_cached_file_of_another_model_is_named_in_the_error(tmp_path):
    from specdecode.models import loading

    dense = tmp_path / "dense"
    dense.mkdir()
    write_quantized(dense, "int8", quantized_tensors(make_tiny_model("qwen2", 1, hidden_size=64), "int8"))
    loaded = LoadedModel(make_tiny_model("qwen2", 1), make_tiny_tokenizer(), "m")
    with pytest.raises(InvalidArgumentError, match=r"do not match layer .*quantized-int8\.safetensors does not belong "
                                                   r"to this model: delete it"):
        loading._quantize(loaded, "int8", dense)


def test_an_unwritable_cache_still_gives_the_quantized_model(tmp_path, monkeypatch, caplog):
    from specdecode.models import loading

    def refuse(*_args):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(loading, "write_quantized", refuse)
    loaded = LoadedModel(make_tiny_model("qwen2", 1), make_tiny_tokenizer(), "m")
    with caplog.at_level("WARNING", logger="specdecode.models.loading"):
        out = loading._quantize(loaded, "int4", tmp_path)
    assert out.quantize == "int4" and isinstance(out.model.model.layers[0].mlp.up_proj, Int4Linear)
    assert "could not cache the int4 weights" in caplog.text and "read-only file system" in caplog.text


def test_skipped_attention_on_a_fresh_cache_of_a_quantized_model():
    """Llama's attention has no parameters left once quantized (its weights are int8 buffers): the
    placeholder keys a skipped attention appends take the hidden states' dtype instead."""
    from specdecode.drafters.layer_skip import SkipSet, draft_mode
    from specdecode.engine import kv_cache

    model = make_tiny_model("llama", num_layers=2)
    quantize_model(model, "int8")
    assert not list(model.model.layers[0].self_attn.parameters())
    cache = kv_cache.new_cache(model)
    with torch.inference_mode(), draft_mode(model, SkipSet(attn=(0,))):
        model(prompt_ids(5, seed=1), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 5 and cache.layers[0].keys.dtype == torch.float32


@pytest.mark.parametrize("scheme, head", [("int8", None), ("int4", None), ("int4", "int4")],
                         ids=["int8", "int4", "int4-tied-head-int4"])
def test_quantized_model_on_the_compiled_fast_path(scheme, head):
    """The quantized linears trace under torch.compile (fullgraph) and give the eager tokens (also an int4 LM
    head with the tied embedding on its buffers' views)."""
    from specdecode import SpeculativeDecoder
    from specdecode.engine.fast_path import ModelRunner

    torch._dynamo.reset()
    model = make_tiny_model("llama", num_layers=2, hidden_size=64, intermediate_size=128, vocab_size=64,
                            tie_word_embeddings=head == "int4")
    assert quantize_model(model.to(torch.bfloat16), scheme, head).head == (head or "int8")
    prompt = torch.randint(3, 60, (1, 9), generator=torch.Generator().manual_seed(0))
    config = GenerationConfig(max_new_tokens=12, stop_on_eos=False)
    eager = SpeculativeDecoder(model, compile=False).generate(prompt, config).token_ids
    runner = ModelRunner(model, compile=True)
    dec = SpeculativeDecoder(model, runner=runner)
    result = dec.generate(prompt, config)
    assert result.token_ids == eager
    # The one-row round's BatchRunner compiled; every decode forward ran a graph (the prefill is eager,
    # outside the runner).
    assert dec.compile_time_s() > 0 and runner.one_row_engine.runner.num_eager_forwards == 0
    torch._dynamo.reset()


@pytest.mark.parametrize("rows", [64 * 3, 64 * 3 + 32, 64 * 2 + 48])
def test_int4_packing_in_row_chunks_equals_one_shot_packing(monkeypatch, rows):
    """Int4Linear packs PACK_ROWS rows at a time (bounded int32 temporary); the packed tensor and
    the layer's output must equal one-shot packing, tails included."""
    import specdecode.models.quantized_linear as quantize_module

    torch.manual_seed(0)
    w = torch.randn(rows, 64, dtype=torch.bfloat16)
    parts = quantize_int4(w, torch.bfloat16)
    one_shot = Int4Linear(parts["nibbles"], parts["scales"], parts["zeros"], None, 32)
    monkeypatch.setattr(quantize_module, "PACK_ROWS", 64)
    chunked = Int4Linear(parts["nibbles"], parts["scales"], parts["zeros"], None, 32)
    assert torch.equal(chunked.packed, one_shot.packed)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(chunked(x), one_shot(x))
    # and both are the matmul with the de-quantized weight
    dequant = ((unpack_nibbles(parts["nibbles"]).float() - 8).view(rows, 2, 32)
               * parts["scales"].float()[..., None] + parts["zeros"].float()[..., None]).view(rows, 64)
    torch.testing.assert_close(chunked(x).float(), x.float() @ dequant.T, rtol=2e-2, atol=5e-2)
