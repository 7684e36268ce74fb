"""Float32 linears on oneDNN's kernel (``models.prepacked_linear``): the same layer up to float32 rounding,
a bit-identical round trip, greedy speculative decoding still equal to target-only decoding on the
prepacked model (B = 1 and B = 3, every tiny architecture), and the refusals, in their own words."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import make_tiny_model, make_tiny_tokenizer
from helpers import perturbed_copy, save_tiny_folders
from selfspec_helpers import REPETITIVE, one_thread  # noqa: F401 (a fixture)
from specdecode import GenerationConfig, SpeculativeDecoder, SpeculativeGenerator
from specdecode import bench
from specdecode.bench import BenchSettings
from specdecode.bench.command import _prepack
from specdecode.bench.methods import MethodSpec, resolve_methods
from specdecode.defaults import prepack_by_default
from specdecode.drafters import (
    CascadeDrafter,
    DraftModelDrafter,
    EarlyExitDrafter,
    LayerSkipDrafter,
    PromptLookupDrafter,
)
from specdecode.drafters.layer_skip import SkipSet
from specdecode.drafters.control import DraftControl
from specdecode.drafters.draft_head import BoundDraftHead
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.fast_path import ModelRunner
from specdecode.errors import InvalidArgumentError
from specdecode.models import LoadedModel, load_model
from specdecode.models import loading
from specdecode.models.loading import resolve_prepack
from specdecode.models.prepacked_linear import (
    PrepackedLinear,
    has_prepacked_linears,
    prepack_linears,
    unpack_linears,
    why_no_auto_prepack,
    why_no_prepack,
)

pytestmark = pytest.mark.usefixtures("one_thread")
#: The tests that run the kernel (the others check the rules around it, on any torch).
needs_onednn = pytest.mark.skipif(why_no_prepack() is not None, reason=f"no oneDNN: {why_no_prepack()}")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (2, 5, 48)])
@needs_onednn
def test_layer_computes_the_stock_linear(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PrepackedLinear(linear)
    x = torch.randn(*shape)
    with torch.inference_mode():
        y = packed(x)
        assert y.shape == (*shape[:-1], 80) and not y.is_mkldnn
        torch.testing.assert_close(y, linear(x), rtol=1e-5, atol=1e-5)
        # a non-contiguous input (a slice of the last dimension) too
        wide = torch.randn(*shape[:-1], 96)
        torch.testing.assert_close(packed(wide[..., :48]), linear(wide[..., :48]), rtol=1e-5, atol=1e-5)
    assert packed.weight.is_mkldnn and torch.equal(packed.dense_weight(), linear.weight)


@needs_onednn
def test_round_trip_is_bit_identical_and_counts_every_linear():
    model = make_tiny_model("qwen2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert prepack_linears(model) == linears > 0
    assert has_prepacked_linears(model) and not any(type(m) is nn.Linear for m in model.modules())
    assert unpack_linears(model) == linears and not has_prepacked_linears(model)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)


@needs_onednn
def test_prepacked_model_gives_the_stock_logits_and_greedy_tokens(arch):
    stock = make_tiny_model(arch)
    packed = make_tiny_model(arch)
    prepack_linears(packed)
    ids = torch.tensor([REPETITIVE])
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits, stock(ids).logits, rtol=1e-4, atol=1e-4)
    config = GenerationConfig(max_new_tokens=20, stop_on_eos=False)
    assert (SpeculativeDecoder(packed).generate(REPETITIVE, config).token_ids
            == SpeculativeDecoder(stock).generate(REPETITIVE, config).token_ids)


@needs_onednn
def test_select_rows_keeps_those_logits():
    torch.manual_seed(1)
    head = PrepackedLinear(nn.Linear(32, 100, bias=False))
    ids = torch.tensor([3, 17, 42, 99])
    rows = head.select_rows(ids)
    x = torch.randn(2, 3, 32)
    with torch.inference_mode():
        torch.testing.assert_close(rows(x), head(x)[..., ids], rtol=1e-5, atol=1e-5)
    with pytest.raises(InvalidArgumentError, match=r"row ids must be in 0..99, got -1..3"):
        head.select_rows(torch.tensor([-1, 3]))
    # the truncated draft head (FR-Spec) of a prepacked draft takes that path
    draft = make_tiny_model("qwen2", num_layers=2)
    prepack_linears(draft)
    ids = torch.tensor([1, 5, 30, 47])  # the tiny vocabulary's 48 rows
    cut = BoundDraftHead(draft, ids)
    hidden = torch.randn(1, 2, draft.config.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(cut.rows(hidden), draft.get_output_embeddings()(hidden)[..., ids],
                                   rtol=1e-5, atol=1e-5)


def _drafters(target, draft):
    return {
        "draft": lambda: DraftModelDrafter(draft),
        "cascade": lambda: CascadeDrafter(draft),
        "prompt-lookup": lambda: PromptLookupDrafter(),
        "early-exit": lambda: EarlyExitDrafter(target, 2),
        "layer-skip": lambda: LayerSkipDrafter(target, SkipSet(attn=(1,), mlp=(2,))),
    }


@needs_onednn
def test_speculation_on_prepacked_models_equals_target_only_decoding(arch):
    """Greedy float32: every drafter's output on a prepacked target (and prepacked draft) equals the prepacked
    target decoding alone, one row and three rows of different lengths."""
    target = make_tiny_model(arch)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    prepack_linears(target)
    prepack_linears(draft)
    prompts = [[5, 9, 12], REPETITIVE, [7, 3, 30, 41, 8, 11, 19]]
    configs = [GenerationConfig(max_new_tokens=m, stop_on_eos=False, num_speculative_tokens=4) for m in (18, 9, 14)]
    alone = SpeculativeDecoder(target)
    expected = [alone.generate(p, c).token_ids for p, c in zip(prompts, configs)]
    control = DraftControl(adaptive_exit=True, max_draft_tokens=6)
    for name, make in _drafters(target, draft).items():
        one = SpeculativeDecoder(target, make())
        result = one.generate(prompts[1], configs[1])
        assert result.token_ids == expected[1], name
        assert result.stats.num_drafted_tokens > 0, name
        rows = BatchedSpeculativeDecoder(target, make(), max_batch_size=3, max_length=64, num_speculative_tokens=4,
                                         draft_control=None if name == "prompt-lookup" else control)
        assert [r.token_ids for r in rows.generate(prompts, configs)] == expected, name


@needs_onednn
def test_load_model_prepacks_float32_cpu_models_unless_told_not_to(tmp_path):
    tok = make_tiny_tokenizer()
    save_tiny_folders(tmp_path, tok, make_tiny_model("qwen2"), make_tiny_model("qwen2", num_layers=2, seed=2))
    folder, draft_folder = str(tmp_path / "target"), str(tmp_path / "draft")
    default = load_model(folder, dtype="float32", device="cpu")
    assert default.prepacked == (why_no_auto_prepack() is None)  # an x86 CPU with AVX2 or AVX512
    assert load_model(folder, dtype="float32", device="cpu", prepack_linears=True).prepacked
    assert not load_model(folder, dtype="float32", device="cpu", prepack_linears=False).prepacked
    assert not load_model(folder, dtype="bfloat16", device="cpu").prepacked  # bf16 runs oneDNN already
    assert not load_model(folder, dtype="float32", device="cpu", quantize="int8").prepacked
    # the pair: asked for, an int8 draft beside a prepacked target keeps its quantized layers (no refusal)
    gen = SpeculativeGenerator.from_pretrained(folder, draft_folder, dtype="float32", device="cpu",
                                               draft_quantize="int8", prepack_linears=True)
    assert gen.target.prepacked and not gen.draft.prepacked and gen.draft.quantize == "int8"
    gen = SpeculativeGenerator.from_pretrained(folder, draft_folder, dtype="float32", device="cpu",
                                               prepack_linears=True)
    assert gen.target.prepacked and gen.draft.prepacked
    gen = SpeculativeGenerator.from_pretrained(folder, draft_folder, dtype="float32", device="cpu",
                                               prepack_linears=False)
    assert not gen.target.prepacked and not gen.draft.prepacked


def test_resolve_prepack_and_its_refusals():
    f32, bf16, cpu = torch.float32, torch.bfloat16, torch.device("cpu")
    if why_no_auto_prepack() is None:
        assert resolve_prepack(None, f32, cpu, "none") is True
    assert resolve_prepack(None, bf16, cpu, "none") is False
    assert resolve_prepack(None, f32, cpu, "int4") is False
    assert resolve_prepack(None, f32, torch.device("cuda"), "none") is False
    assert resolve_prepack(False, f32, cpu, "none") is False
    with pytest.raises(InvalidArgumentError, match=r"prepack_linears must be True, False or None .*got 'yes'"):
        resolve_prepack("yes", f32, cpu, "none")
    with pytest.raises(InvalidArgumentError, match=r"this model is bfloat16 on cpu with quantize='none'"):
        resolve_prepack(True, bf16, cpu, "none")
    with pytest.raises(InvalidArgumentError, match=r"quantize='int8'"):
        resolve_prepack(True, f32, cpu, "int8")


def test_a_bf16_layer_is_refused_before_any_is_replaced():
    model = make_tiny_model("qwen2").to(torch.bfloat16)
    with pytest.raises(InvalidArgumentError, match=r"float32 on a CPU; layer '.*' is bfloat16 on cpu"):
        prepack_linears(model)
    assert not has_prepacked_linears(model)


@needs_onednn
def test_the_fast_path_refuses_to_compile_prepacked_layers_before_any_forward():
    model = make_tiny_model("qwen2")
    ModelRunner(model, compile=True)  # stock layers compile
    prepack_linears(model)
    with pytest.raises(InvalidArgumentError, match=r"cannot compile the target model's prepacked \(oneDNN\) linear "
                                                   r"layers; load it with prepack_linears=False"):
        ModelRunner(model, compile=True, name="target model")
    ModelRunner(model, compile=False)  # eager: fine
    ModelRunner(model, compile=True, graphs=False)  # the fast path's logic without graphs: fine

    batched = BatchedSpeculativeDecoder  # the batched engine refuses at construction, before any forward
    with pytest.raises(InvalidArgumentError, match=r"cannot compile the target model's prepacked"):
        batched(model, None, max_batch_size=2, max_length=32, compile=True)
    batched(model, None, max_batch_size=2, max_length=32, compile=False)


@needs_onednn
def test_a_prepacked_draft_beside_a_stock_target_is_refused_before_decoding():
    tok = make_tiny_tokenizer()
    target = make_tiny_model("qwen2")
    draft = make_tiny_model("qwen2", num_layers=2, seed=2)
    prepack_linears(draft)
    gen = SpeculativeGenerator(LoadedModel(target, tok, "tiny"), LoadedModel(draft, tok, "tiny-draft"))
    for make in (lambda: gen.decoder("draft", compile=True),
                 lambda: gen.batch_decoder("draft", max_batch_size=2, max_length=32, compile=True)):
        with pytest.raises(InvalidArgumentError, match=r"cannot compile the draft model's prepacked \(oneDNN\)"):
            make()
    assert gen.decoder("draft", compile=False).generate([5, 9, 12], GenerationConfig(max_new_tokens=4)).token_ids


def test_the_commands_turn_prepacking_off_for_compiling_and_refuse_both():
    assert prepack_by_default(None, "--compile") is False  # --compile without a word: stock layers
    assert prepack_by_default(None, None) is None
    assert prepack_by_default(False, None) is False and prepack_by_default(True, None) is True
    with pytest.raises(InvalidArgumentError, match=r"--prepack-linears and --compile: the fast path cannot compile"):
        prepack_by_default(True, "--compile")

    class Args:
        compile = None
        prepack_linears = None

    def specs(*names):
        return [MethodSpec.parse(n) for n in names]

    assert _prepack(Args, specs("autoregressive", "draft+adaptive", "llama-cpp")) is None
    assert _prepack(Args, specs("autoregressive", "autoregressive:compile=1")) is False
    assert _prepack(Args, specs("hf-generate-static")) is False  # transformers compiles the target itself
    Args.prepack_linears = True
    with pytest.raises(InvalidArgumentError, match=r"--prepack-linears and --methods autoregressive:compile=1"):
        _prepack(Args, specs("autoregressive:compile=1"))


@needs_onednn
def test_the_bench_leaves_out_transformers_compiled_baseline_on_a_prepacked_target_and_says_so():
    target = make_tiny_model("qwen2")
    prepack_linears(target)
    gen = SpeculativeGenerator(LoadedModel(target, make_tiny_tokenizer(), "tiny"))
    settings = BenchSettings(max_new_tokens=4)
    with pytest.raises(InvalidArgumentError, match=r"'hf-generate-static' compiles the target's forward, but its "
                                                   r"float32 linear layers run on oneDNN's kernel"):
        resolve_methods(gen, ["hf-generate-static"], settings)
    runners, skipped = resolve_methods(gen, None, settings)
    assert "hf-generate-static" in skipped and "--no-prepack-linears" in skipped["hf-generate-static"]
    assert "hf-generate" in runners and "autoregressive" in runners
    assert bench.run_identity(gen, settings)["prepacked_linears"] == ["target"]
    stock = SpeculativeGenerator(LoadedModel(make_tiny_model("qwen2"), make_tiny_tokenizer(), "tiny"))
    assert "prepacked_linears" not in bench.run_identity(stock, settings)  # older folders still resume


def test_without_the_kernel_or_on_an_unmeasured_cpu_the_default_keeps_nn_linear(monkeypatch, caplog):
    f32, cpu = torch.float32, torch.device("cpu")
    monkeypatch.setattr(loading, "why_no_auto_prepack", lambda: "this CPU's capability is NEON, where it was not measured")
    with caplog.at_level("INFO", logger="specdecode.models.loading"):
        assert resolve_prepack(None, f32, cpu, "none") is False
    assert "float32 linears stay nn.Linear: this CPU's capability is NEON" in caplog.text
    monkeypatch.setattr(loading, "why_no_prepack", lambda: "torch 9.9 was built without oneDNN")
    with pytest.raises(InvalidArgumentError, match=r"prepack_linears=True needs oneDNN: torch 9.9 was built without"):
        resolve_prepack(True, f32, cpu, "none")


def test_a_llama_cpp_target_refuses_prepacking():
    from specdecode.models.llama_cpp_target import check_llama_cpp_target_options

    options = dict(dtype="auto", device="cpu", quantize="none", draft_quantize=None, draft_quantize_head=None,
                   quantize_group_size=None, draft_backend=None)
    check_llama_cpp_target_options(**options, prepack_linears=False)  # nothing to prepack, nothing asked
    with pytest.raises(InvalidArgumentError, match=r"prepack_linears=True .* backend='llama-cpp' runs the target's "
                                                   r"GGUF file in llama.cpp and loads no torch layers"):
        check_llama_cpp_target_options(**options, prepack_linears=True)


@needs_onednn
def test_a_tied_head_loads_prepacked_with_the_stock_logits_and_its_own_memory(tmp_path):
    """The real Qwen pair ties its LM head to the input embedding: the head gets a oneDNN copy, the embedding keeps
    its Parameter (copied off the file's memory map), and the logits are the stock load's."""
    tok = make_tiny_tokenizer()
    tied = make_tiny_model("qwen2", tie_word_embeddings=True)
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight  # the case under test
    save_tiny_folders(tmp_path, tok, tied, make_tiny_model("qwen2", num_layers=2, seed=2))
    folder = str(tmp_path / "target")
    stock = load_model(folder, dtype="float32", device="cpu", prepack_linears=False).model
    packed = load_model(folder, dtype="float32", device="cpu", prepack_linears=True).model
    assert isinstance(packed.get_output_embeddings(), PrepackedLinear)
    embedding = packed.get_input_embeddings().weight
    assert isinstance(embedding, nn.Parameter) and torch.equal(embedding, stock.get_input_embeddings().weight)
    ids = torch.tensor([REPETITIVE])
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits, stock(ids).logits, rtol=1e-4, atol=1e-4)
    unpack_linears(packed)
    head = packed.get_output_embeddings().weight
    assert torch.equal(head, embedding) and head.data_ptr() != embedding.data_ptr()  # its own dense copy


def test_a_compiling_method_keeps_the_stock_layers_and_says_so(caplog):
    with caplog.at_level("INFO", logger="specdecode.defaults"):
        assert prepack_by_default(None, "--methods hf-generate-static") is False
    assert "float32 linears stay nn.Linear for the whole run: --methods hf-generate-static compiles" in caplog.text


@needs_onednn
def test_a_search_study_of_a_prepacked_model_is_its_own():
    from specdecode.search.study import model_identity

    loaded = LoadedModel(make_tiny_model("qwen2"), make_tiny_tokenizer(), "tiny")
    assert "prepacked_linears" not in model_identity(loaded)  # studies made before still match
    prepack_linears(loaded.model)
    assert model_identity(loaded)["prepacked_linears"] is True
