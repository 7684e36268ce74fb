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
from specdecode import GenerationConfig, SpeculativeDecoder
from specdecode.defaults import prepack_by_default
from specdecode.drafters import CascadeDrafter, DraftModelDrafter, EarlyExitDrafter, PromptLookupDrafter
from specdecode.drafters.control import DraftControl
from specdecode.drafters.draft_head import BoundDraftHead
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.fast_path import ModelRunner
from specdecode.errors import InvalidArgumentError
from specdecode.models import load_model
from specdecode.models.loading import resolve_prepack
from specdecode.models.prepacked_linear import (
    PrepackedLinear,
    has_prepacked_linears,
    prepack_linears,
    unpack_linears,
    why_no_prepack,
)

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(why_no_prepack() is not None, reason=f"no oneDNN: {why_no_prepack()}")]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (2, 5, 48)])
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


def test_select_rows_keeps_those_logits():
    torch.manual_seed(1)
    head = PrepackedLinear(nn.Linear(32, 100, bias=False))
    ids = torch.tensor([3, 17, 42, 99])
    rows = head.select_rows(ids)
    x = torch.randn(2, 3, 32)
    with torch.inference_mode():
        torch.testing.assert_close(rows(x), head(x)[..., ids], rtol=1e-5, atol=1e-5)
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
    }


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


def test_load_model_prepacks_float32_cpu_models_unless_told_not_to(tmp_path):
    tok = make_tiny_tokenizer()
    target = make_tiny_model("qwen2")
    save_tiny_folders(tmp_path, tok, target, make_tiny_model("qwen2", num_layers=2, seed=2))
    folder = str(tmp_path / "target")
    assert load_model(folder, dtype="float32", device="cpu").prepacked
    assert not load_model(folder, dtype="float32", device="cpu", prepack_linears=False).prepacked
    assert not load_model(folder, dtype="bfloat16", device="cpu").prepacked  # bf16 runs oneDNN already
    assert not load_model(folder, dtype="float32", device="cpu", quantize="int8").prepacked


def test_resolve_prepack_and_its_refusals():
    f32, bf16, cpu = torch.float32, torch.bfloat16, torch.device("cpu")
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


def test_the_fast_path_refuses_to_compile_prepacked_layers_and_the_commands_turn_them_off():
    model = make_tiny_model("qwen2")
    ModelRunner(model, compile=True)  # stock layers compile
    prepack_linears(model)
    with pytest.raises(InvalidArgumentError, match=r"cannot compile the target model's prepacked \(oneDNN\) linear "
                                                   r"layers; load it with prepack_linears=False"):
        ModelRunner(model, compile=True, name="target model")
    ModelRunner(model, compile=False)  # eager: fine
    ModelRunner(model, compile=True, graphs=False)  # the fast path's logic without graphs: fine
    assert prepack_by_default(None, True) is False  # --compile without a word: stock layers
    assert prepack_by_default(None, None) is None and prepack_by_default(None, False) is None
    assert prepack_by_default(True, True) is True  # asked for both: the runner's refusal says why
    assert prepack_by_default(False, None) is False
