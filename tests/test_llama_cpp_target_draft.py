"""``draft`` and ``cascade`` with the target AND the draft model in llama.cpp (``backend="llama-cpp"``, issue 30).

On stand-ins (``LlamaCppTargetRunner`` over tiny torch models, tests/runner_target_helpers.py): the
tokens are the torch target's own, with a draft that is the target (every token accepted) and one
that is not (rejections, rolled back), under the measured-cost policy, a constant γ and adaptive
exit; the policy charges the draft's measured one-token forward per drafted token and starts from
the draft model's prior. On llama.cpp with float32 GGUF files of tiny models (tests/tiny_gguf.py):
the same methods give llama.cpp's own greedy tokens (``Llama.generate``) of the target's file, the
draft loaded from its spec when a decoder first needs it, and a draft with other tokens refused.
``specdecode generate --backend llama-cpp --method draft|cascade`` loads the draft for llama.cpp and
leaves the draft length to the measured costs (no adaptive exit by default).
"""

from __future__ import annotations

import pytest

from conftest import make_tiny_model, make_tiny_tokenizer
from runner_target_helpers import PROMPT, TorchBackedModel, llama_cpp_greedy
from specdecode import GenerationConfig, SpeculativeGenerator
from specdecode.drafters import CascadeDrafter, DraftModelDrafter
from specdecode.drafters.control import DraftControl
from specdecode.engine.cost_model import DRAFT_MODEL_PRIOR, PROMPT_LOOKUP_PRIOR
from specdecode.engine.speculation_cost import SpeculationCostPolicy
from specdecode.errors import VocabularyMismatchError
from specdecode.models import LoadedModel
from specdecode.models.llama_cpp_target import LlamaCppTargetRunner
from tiny_gguf import write_tiny_gguf

TEXT = " ".join(f"w{t}" for t in PROMPT[1:])  # the tiny tokenizer's words: no BOS added, ids PROMPT[1:]
CONTROLS = {"measured costs": None, "constant": DraftControl(), "adaptive": DraftControl(adaptive_exit=True)}


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model("llama", num_layers=2, seed=2)


def _gen(target_model, draft) -> SpeculativeGenerator:
    return SpeculativeGenerator(LoadedModel(LlamaCppTargetRunner(TorchBackedModel(target_model)), make_tiny_tokenizer(),
                                            "tiny"), llama_cpp_draft=draft)


@pytest.mark.parametrize("control", list(CONTROLS))
@pytest.mark.parametrize("same", [True, False], ids=["draft-is-target", "other-draft"])
@pytest.mark.parametrize("method", ["draft", "cascade"])
def test_tokens_are_the_torch_targets(tiny, method, same, control):
    draft = tiny if same else make_tiny_model("llama", num_layers=1, seed=3)
    gen = _gen(tiny, TorchBackedModel(draft, role="draft model"))
    torch_gen = SpeculativeGenerator(LoadedModel(tiny, make_tiny_tokenizer(), "tiny"))
    config = GenerationConfig(max_new_tokens=30, num_speculative_tokens=3, stop_on_eos=False)
    expected = torch_gen.generate(TEXT, config, method="autoregressive", chat=False).token_ids
    decoder = gen.decoder(method, draft_control=CONTROLS[control])
    assert isinstance(decoder.drafter, CascadeDrafter if method == "cascade" else DraftModelDrafter)
    result = decoder.generate(gen.encode(TEXT, chat=False), config)
    assert result.token_ids == expected
    stats = result.stats
    if control == "constant":  # every round drafts: accepted by the target's twin, some rejected by the other
        assert stats.num_drafted_tokens > 0
        assert (stats.num_accepted_tokens == stats.num_drafted_tokens) == same
        assert stats.num_target_forwards < 30 if same else stats.num_accepted_tokens < stats.num_drafted_tokens


def test_the_measured_cost_policy_charges_the_draft_step(tiny, caplog):
    gen = _gen(tiny, TorchBackedModel(make_tiny_model("llama", num_layers=1, seed=3), role="draft model"))
    with caplog.at_level("INFO", logger="specdecode"):
        policy = gen.decoder("draft").draft_control
    runner = gen.llama_cpp_draft_runner()
    assert isinstance(policy, SpeculationCostPolicy) and list(runner.forward_costs) == [1]
    assert policy.draft_node_s == runner.forward_costs[1] > 0 and policy.prior == DRAFT_MODEL_PRIOR
    assert policy.node_cost() == runner.forward_costs[1]  # fixed: not the measured seconds of propose
    assert "the llama.cpp draft model's step" in caplog.text
    assert gen.decoder("cascade").draft_control.draft_node_s == runner.forward_costs[1]  # measured once
    lookup = gen.decoder("prompt-lookup").draft_control
    assert lookup.draft_node_s == 0.0 and lookup.prior == PROMPT_LOOKUP_PRIOR


# ---------------------------------------------------------------------------------------------
# llama.cpp on tiny float32 GGUF files


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install 'specdecode[llamacpp]')")
    folder = tmp_path_factory.mktemp("gguf")
    tok = make_tiny_tokenizer()
    return {"target": write_tiny_gguf(make_tiny_model("qwen2", num_layers=2, seed=4), tok, folder / "target.gguf"),
            "other": write_tiny_gguf(make_tiny_model("qwen2", num_layers=1, seed=5), tok, folder / "draft.gguf")}


@pytest.fixture
def llama_target(ggufs):
    from specdecode.models.llama_cpp import LlamaCppModel

    model = LlamaCppModel(ggufs["target"], n_threads=1, role="target model", kv_cache_type="f32")
    yield LoadedModel(LlamaCppTargetRunner(model), make_tiny_tokenizer(), "tiny")
    model.close()


@pytest.mark.parametrize("control", list(CONTROLS))
@pytest.mark.parametrize("draft", ["target", "other"])
def test_draft_and_cascade_are_llama_cpps_greedy(llama_target, ggufs, draft, control):
    n = 40
    reference = llama_cpp_greedy(ggufs["target"], PROMPT[1:], n)
    gen = SpeculativeGenerator(llama_target, llama_cpp_draft=str(ggufs[draft]))  # a spec: loaded on first use
    assert gen.decoder("prompt-lookup") and isinstance(gen._llama_cpp_draft, str)  # not loaded for prompt lookup
    config = GenerationConfig(max_new_tokens=n, num_speculative_tokens=3, stop_on_eos=False)
    for method in ("draft", "cascade"):
        result = gen.generate(TEXT, config, method=method, chat=False, draft_control=CONTROLS[control])
        assert result.token_ids == reference, method
        stats = result.stats
        if control == "constant":
            assert stats.num_drafted_tokens > 0
            assert (stats.num_accepted_tokens == stats.num_drafted_tokens) == (draft == "target"), method
    assert gen.llama_cpp_draft().path == ggufs[draft].resolve()


class _OtherWords:
    """The tiny tokenizer with the words of ids 5 and 6 swapped (for a GGUF file with other tokens)."""

    def __init__(self):
        self.tok = make_tiny_tokenizer()

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def convert_ids_to_tokens(self, ids):
        return [{"w5": "w6", "w6": "w5"}.get(t, t) for t in self.tok.convert_ids_to_tokens(ids)]


def test_a_draft_with_other_tokens_is_refused_when_first_needed(llama_target, tmp_path):
    pytest.importorskip("llama_cpp")
    path = write_tiny_gguf(make_tiny_model("qwen2", num_layers=1, seed=5), _OtherWords(), tmp_path / "swapped.gguf")
    gen = SpeculativeGenerator(llama_target, llama_cpp_draft=str(path))
    gen.generate(TEXT, GenerationConfig(max_new_tokens=4, stop_on_eos=False), method="prompt-lookup", chat=False)
    with pytest.raises(VocabularyMismatchError, match="token id 5 is 'w6' in the llama.cpp draft model"):
        gen.decoder("draft")


@pytest.mark.parametrize("method", ["draft", "cascade"])
def test_generate_runs_draft_and_cascade_on_the_llama_cpp_backend(tiny, capsys, monkeypatch, method):
    import json

    from helpers import run_generate
    from specdecode import pipeline

    gen = _gen(tiny, TorchBackedModel(tiny, role="draft model"))
    loads = []
    monkeypatch.setattr(pipeline.SpeculativeGenerator, "from_pretrained",
                        classmethod(lambda cls, *a, **k: loads.append((a, k)) or gen))
    code, out, err = run_generate(capsys, "--backend", "llama-cpp", "--target", "t.gguf", "--draft", "d.gguf",
                                  "--method", method, "--prompt", TEXT, "--no-chat", "--max-new-tokens", 12, "--json")
    assert code == 0, err
    (args, kwargs), = loads
    assert args == ("t.gguf", "d.gguf") and kwargs["backend"] == kwargs["draft_backend"] == "llama-cpp"
    result = json.loads(out)
    assert result["draft_backend"] == "llama-cpp" and result["draft_control"] is None  # measured costs, no adaptive
    expected = gen.generate(TEXT, GenerationConfig(max_new_tokens=12), method="autoregressive", chat=False)
    assert result["token_ids"] == expected.token_ids
    assert gen.llama_cpp_draft_runner().forward_costs  # the draft's step was measured for the cost policy
