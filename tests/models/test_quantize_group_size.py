"""A chosen int4 group size (specdecode.models.quantize, group_size=): groups of 64 store fewer bytes."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model, make_tiny_tokenizer
from selfspec_helpers import one_thread, prompt_ids, quantized_pair, saved_model_with_quantizer_log  # noqa: F401
from specdecode import GenerationConfig, InvalidArgumentError, SpeculativeGenerator
from specdecode.models import load_model
from specdecode.models.dense_cache import CACHE_FORMAT_VERSION, quantized_path, read_quantized, write_quantized
from specdecode.models.quantize import (
    QUANTIZER_VERSION,
    Int4Embedding,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    apply_quantized,
    check_quantize_group_size,
    quantize_model,
    quantized_tensors,
)

pytestmark = pytest.mark.usefixtures("one_thread")

# Every linear's input width a multiple of 64: hidden 64, MLP 128, attention 4 heads of 16 (Gemma's
# conftest default of 8 would give its o_proj 32 inputs).
WIDE = dict(hidden_size=64, intermediate_size=128)
WIDE_ARCHS = ("llama", "qwen2", "gemma3")


def _wide_kw(arch: str) -> dict:
    return {**WIDE, **({"head_dim": 16} if arch.startswith("gemma") else {})}


def _wide(arch: str = "qwen2", **kw) -> torch.nn.Module:
    return make_tiny_model(arch, **{"num_layers": 2, **_wide_kw(arch), **kw})


def _int4_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, (Int4Linear, Int4Embedding))]


def _rows_and_width(m: torch.nn.Module) -> tuple[int, int]:
    return (m.out_features, m.in_features) if isinstance(m, Int4Linear) else (m.num_embeddings, m.embedding_dim)


@pytest.mark.parametrize("arch", WIDE_ARCHS)
def test_group_64_makes_every_int4_module_group_64_and_stores_fewer_bytes(arch):
    models, summaries = {}, {}
    for g in (32, 64):
        models[g] = _wide(arch)
        summaries[g] = quantize_model(models[g], "int4", head="int4", group_size=g)
    model, summary = models[64], summaries[64]
    assert summary.group_size == 64 and summary.as_dict()["group_size"] == 64 and summaries[32].group_size == 32
    # every module is int4, LM head and untied input embedding included: none was refused at 64
    assert summary.int8_layers == {} and summary.head == "int4" and summary.embedding == "int4"
    assert not any(isinstance(m, (Int8Linear, Int8Embedding, torch.nn.Linear)) for m in model.modules())
    for m in _int4_modules(model):
        n, k = _rows_and_width(m)
        assert m.group_size == 64 and tuple(m.scales.shape) == tuple(m.zeros.shape) == (n, k // 64), m
    assert {m.group_size for m in _int4_modules(models[32])} == {32}
    # a (float32) scale and zero per 64 weights instead of per 32: exactly those bytes fewer
    weights = sum(n * k for n, k in map(_rows_and_width, _int4_modules(model)))
    assert summaries[32].bytes_before == summary.bytes_before
    assert summaries[32].bytes_after - summary.bytes_after == weights // 64 * 2 * 4 > 0


@pytest.mark.parametrize("arch", WIDE_ARCHS)
def test_greedy_speculative_equals_the_quantized_models_autoregressive_output_at_group_64(arch):
    """Float32 activations: draft and cascade reproduce the group-64 int4 target's own greedy tokens
    (its draft int4 at 64 too, with the int4 LM head)."""
    gen = quantized_pair(arch, "int4", draft_head="int4", group_size=64, **_wide_kw(arch))
    for loaded in (gen.target, gen.draft):
        assert loaded.quantize_group_size == 64 and {m.group_size for m in _int4_modules(loaded.model)} == {64}
    assert list(gen.target.model.specdecode_quantization.int8_layers) == ["lm_head"]  # the target's head: int8
    assert gen.draft.model.specdecode_quantization.int8_layers == {}
    config = GenerationConfig(max_new_tokens=24, num_speculative_tokens=4, stop_on_eos=False)
    prompt = "w5 w9 w12 w7 w5 w9 w12 w7 w5 w30 w31"
    expected = gen.generate(prompt, config, method="autoregressive").token_ids
    assert len(expected) == 24
    for method in ("draft", "cascade"):
        assert gen.generate(prompt, config, method=method).token_ids == expected, f"{arch} {method}"


def test_a_module_whose_width_is_off_the_group_stays_int8_and_the_reason_names_the_group_size():
    """The conftest models' 32-wide layers (and head, and embedding) stay int8 at 64; the reasons say 64, both
    when quantizing and when applying stored tensors (whose markers hold the group size)."""
    off = "32 inputs is not a multiple of the group size 64"
    model = make_tiny_model("llama", num_layers=1)  # hidden 32, MLP 64
    summary = quantize_model(model, "int4", head="int4", group_size=64)
    assert summary.int8_layers["model.layers.0.self_attn.q_proj"] == off
    assert summary.int8_layers["lm_head"] == f"LM head: {off} (the int4 kernel's limit)"
    assert summary.int8_layers["model.embed_tokens"] == off and summary.embedding == "int8"
    down = model.model.layers[0].mlp.down_proj  # 64 inputs: one group
    assert type(down) is Int4Linear and down.group_size == 64 and summary.group_size == 64
    assert "model.layers.0.mlp.down_proj" not in summary.int8_layers
    tensors = quantized_tensors(make_tiny_model("llama", num_layers=1), "int4", head="int4", group_size=64)
    applied = apply_quantized(make_tiny_model("llama", num_layers=1), tensors, "int4")  # no group size given
    assert applied.group_size == 64 and applied.int8_layers == summary.int8_layers


def test_cache_round_trip_at_group_64_in_files_of_its_own(tmp_path):
    model = _wide()
    t32, t64 = quantized_tensors(model, "int4"), quantized_tensors(model, "int4", group_size=64)
    t64_head = quantized_tensors(model, "int4", head="int4", group_size=64)
    assert int(t64["model.layers.0.mlp.up_proj.int4"][0]) == 64 and int(t32["model.layers.0.mlp.up_proj.int4"][0]) == 32
    # the default keeps the names files always had; another group size has its own
    names = {(h, g): quantized_path(tmp_path, "int4", h, g).name for h in ("int8", "int4") for g in (32, 64)}
    assert names == {("int8", 32): "quantized-int4.safetensors", ("int4", 32): "quantized-int4-head-int4.safetensors",
                     ("int8", 64): "quantized-int4-g64.safetensors",
                     ("int4", 64): "quantized-int4-head-int4-g64.safetensors"}
    assert quantized_path(tmp_path, "int4") == quantized_path(tmp_path, "int4", "int8", 32)
    write_quantized(tmp_path, "int4", t32)
    assert read_quantized(tmp_path, "int4", group_size=64) is None  # the group-32 file is not read for 64
    write_quantized(tmp_path, "int4", t64, group_size=64)
    write_quantized(tmp_path, "int4", t64_head, "int4", 64)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[k] for k in (("int8", 32), ("int8", 64),
                                                                                  ("int4", 64)))
    back32, back64 = read_quantized(tmp_path, "int4"), read_quantized(tmp_path, "int4", group_size=64)
    back64_head = read_quantized(tmp_path, "int4", "int4", 64)
    for back, made in ((back32, t32), (back64, t64), (back64_head, t64_head)):
        assert back.keys() == made.keys() and all(torch.equal(back[k], made[k]) for k in made)
    # the same logits from the tensors and from their cached copy; and group 64 is another model than 32
    fresh, at32 = _wide(), _wide()
    assert apply_quantized(model, t64, "int4", 64).group_size == 64
    assert apply_quantized(fresh, back64, "int4").group_size == 64
    apply_quantized(at32, back32, "int4")
    x = prompt_ids(9, seed=5)
    with torch.inference_mode():
        logits = model(x).logits
        assert torch.equal(logits, fresh(x).logits) and not torch.equal(logits, at32(x).logits)
    # a file at the group-64 name whose metadata says 32, or says nothing (files before the key: 32), is stale
    quantized_path(tmp_path, "int4").replace(quantized_path(tmp_path, "int4", group_size=64))
    assert read_quantized(tmp_path, "int4", group_size=64) is None
    from safetensors.torch import save_file

    old_meta = {"format": str(CACHE_FORMAT_VERSION), "scheme": "int4", "quantizer": str(QUANTIZER_VERSION)}
    save_file(t64, str(quantized_path(tmp_path, "int4", group_size=64)), metadata=old_meta)
    assert read_quantized(tmp_path, "int4", group_size=64) is None


def test_the_loader_caches_each_group_size_apart(tmp_path, monkeypatch):
    from specdecode.models import loading

    folder, dense, calls = saved_model_with_quantizer_log(tmp_path, monkeypatch, _wide(), lambda s, h, g: g)

    def load(group):
        return loading._quantize(loading._load_dense(folder, "m", torch.float32, torch.device("cpu")), "int4", dense,
                                 None, group)

    first = {g: load(g) for g in (64, None)}
    again = {g: load(g) for g in (64, None)}
    assert calls == [64, 32]  # the second round reads both files
    assert sorted(p.name for p in dense.iterdir()) == ["quantized-int4-g64.safetensors", "quantized-int4.safetensors"]
    x = prompt_ids(7, seed=3)
    with torch.inference_mode():
        for g, size in ((64, 64), (None, 32)):
            a, b = first[g], again[g]
            assert a.quantize_group_size == b.quantize_group_size == size
            assert {m.group_size for m in _int4_modules(b.model)} == {size}
            assert torch.equal(a.model(x).logits, b.model(x).logits)


def test_from_pretrained_gives_every_int4_model_of_the_pair_the_group_size(tmp_path):
    folder = tmp_path / "m"
    _wide("llama").save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    m = str(folder)

    def sizes(**kw):
        gen = SpeculativeGenerator.from_pretrained(m, m, dtype="float32", device="cpu", quantize_group_size=64, **kw)
        return [(x.quantize, x.quantize_head, x.quantize_group_size,
                 sorted({y.group_size for y in _int4_modules(x.model)})) for x in (gen.target, gen.draft)]

    # the draft int4 alone (generate's default on CPU): the target stays dense
    assert sizes(draft_quantize="int4") == [("none", None, None, []), ("int4", "int4", 64, [64])]
    assert sizes(quantize="int4") == [("int4", "int8", 64, [64]), ("int4", "int4", 64, [64])]
    assert sizes(quantize="int4", draft_quantize="int8") == [("int4", "int8", 64, [64]), ("int8", "int8", None, [])]
    loaded = load_model(m, dtype="float32", device="cpu", quantize="int4", quantize_group_size=64)
    assert loaded.quantize_group_size == 64 and {x.group_size for x in _int4_modules(loaded.model)} == {64}
    assert load_model(m, dtype="float32", device="cpu", quantize="int4").quantize_group_size == 32


def test_bad_group_sizes_get_clear_errors():
    assert [check_quantize_group_size(g, s) for g, s in ((None, "int4"), (64, "int4"), (None, "int8"), (32, "none"))] \
        == [32, 64, 32, 32]
    model = _wide()
    unknown = r"^unknown int4 group size {}; allowed: 32, 64, 128, 256 \(or None: 32\)$"
    for bad in (48, "64", 64.0, True):
        with pytest.raises(InvalidArgumentError, match=unknown.format(repr(bad))):
            quantize_model(model, "int4", group_size=bad)
    with pytest.raises(InvalidArgumentError, match=unknown.format(48)):
        quantized_tensors(model, "int4", group_size=48)
    int8 = r"^int4 group size 64 needs quantize='int4', but quantize='int8'; allowed group size with 'int8': 32 \(or None\)$"
    with pytest.raises(InvalidArgumentError, match=int8):
        quantize_model(model, "int8", group_size=64)
    with pytest.raises(InvalidArgumentError, match=int8):
        quantized_tensors(model, "int8", group_size=64)
    with pytest.raises(InvalidArgumentError, match=r"^int4 group size 128 needs quantize='int4', but quantize='none'"):
        quantize_model(model, "none", group_size=128)
    assert not _int4_modules(model) and not any(isinstance(m, Int8Linear) for m in model.modules())  # unchanged
    # checked before anything is looked up or loaded (these paths do not exist)
    with pytest.raises(InvalidArgumentError, match=unknown.format(48)):
        load_model("/nonexistent/folder", quantize="int4", quantize_group_size=48)
    with pytest.raises(InvalidArgumentError, match=int8):
        load_model("/nonexistent/folder", quantize="int8", quantize_group_size=64)
    with pytest.raises(InvalidArgumentError, match=unknown.format(48)):
        SpeculativeGenerator.from_pretrained("/nonexistent/t", "/nonexistent/d", quantize_group_size=48)
    for kw, draft, target in ((dict(quantize="int8"), "/nonexistent/d", "'int8'"),
                              (dict(quantize="int8", draft_quantize="none"), "/nonexistent/d", "'int8'"),
                              (dict(draft_quantize="int4"), None, "'none'")):
        here = ("no draft model" if draft is None else f"draft_quantize={kw['draft_quantize']!r}"
                if "draft_quantize" in kw else "as quantize='int8'")
        with pytest.raises(InvalidArgumentError) as refused:
            SpeculativeGenerator.from_pretrained("/nonexistent/t", draft, quantize_group_size=64, **kw)
        assert str(refused.value) == (
            f"quantize_group_size=64 applies to int4 weights, but neither the target (quantize={target}) nor the "
            f"draft ({here}) is int4; use quantize='int4' or draft_quantize='int4', or leave quantize_group_size out"
        )
