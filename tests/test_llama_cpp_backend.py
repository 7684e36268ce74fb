"""``backend="llama-cpp"``: the target's GGUF file run by llama.cpp under ``SpeculativeGenerator`` and
``specdecode generate --backend llama-cpp`` (issue 30).

The generator's tests run on a stand-in target (a ``LlamaCppTargetRunner`` over a tiny torch model,
tests/engine/test_runner_target.py) where llama.cpp is not needed: what it refuses (methods that need
the target's torch layers, a torch draft, a missing draft, more than one row, torch loading options), the draft
length from measured costs, and the same tokens as the torch target for target-only decoding, stop
strings and banned words. The last tests run llama.cpp on a float32 GGUF file of a tiny model: the
generator's prompt lookup with the measured-cost policy gives llama.cpp's own greedy tokens, and a
stop string and a banned word work there.
"""

from __future__ import annotations

import pytest

from conftest import make_tiny_model, make_tiny_tokenizer
from helpers import run_generate
from runner_target_helpers import PROMPT, TorchBackedModel, llama_cpp_greedy
from specdecode import GenerationConfig, SpeculativeGenerator
from specdecode.drafters.control import DraftControl
from specdecode.engine.cost_model import MEASURED_WIDTHS
from specdecode.engine.speculation_cost import SpeculationCostPolicy
from specdecode.errors import InvalidArgumentError, ModelNotFoundError
from specdecode.models import LoadedModel
from specdecode.models.llama_cpp_target import LlamaCppTargetRunner

TEXT = " ".join(f"w{t}" for t in PROMPT[1:])  # the tiny tokenizer's words: no BOS added, ids PROMPT[1:]


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model("llama", num_layers=2, seed=2)


@pytest.fixture
def gen(tiny):
    return SpeculativeGenerator(LoadedModel(LlamaCppTargetRunner(TorchBackedModel(tiny)), make_tiny_tokenizer(),
                                            "tiny"))


@pytest.mark.parametrize(("options", "message"), [
    (dict(backend="vllm"), r"unknown backend 'vllm'; allowed: torch, llama-cpp"),
    (dict(quantize="int8"), r"quantize='int8' quantize torch weights, but backend='llama-cpp' runs the target's GGUF "
                            r"file with its own quantization"),
    (dict(quantize_group_size=64), r"quantize_group_size=64 quantize torch weights"),
    (dict(dtype="bfloat16"), r"dtype='bfloat16': backend='llama-cpp' runs the GGUF file's own weight types"),
    (dict(draft_backend="torch"), r"draft_backend='torch' with backend='llama-cpp': a torch draft beside a llama.cpp "
                                  r"target is not built; with backend='llama-cpp' the draft model runs in llama.cpp"),
    (dict(device="meta"), r"backend='llama-cpp' runs the target on the CPU, but the device is meta"),
])
def test_from_pretrained_refuses_what_llama_cpp_cannot_apply(options, message):
    options = {"backend": "llama-cpp", **options}
    with pytest.raises(InvalidArgumentError, match=message):
        SpeculativeGenerator.from_pretrained("missing.gguf", **options)


def test_device_auto_is_the_cpu_for_llama_cpp():
    with pytest.raises(ModelNotFoundError, match=r"GGUF file 'missing.gguf' \(backend 'llama-cpp'\) does not exist"):
        SpeculativeGenerator.from_pretrained("missing.gguf", backend="llama-cpp", device="auto")


def test_from_pretrained_refuses_a_target_that_is_not_a_gguf_file(tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"backend='llama-cpp' runs the target's GGUF file, but .* is not "
                                                   r"one; use an offline model"):
        SpeculativeGenerator.from_pretrained(str(tmp_path), backend="llama-cpp")


@pytest.mark.parametrize(("method", "options", "message"), [
    ("layer-skip", dict(skip_layers="attn=1"), r"method 'layer-skip' does not run with backend='llama-cpp': it "
                                               r"drafts with the target's own torch layers"),
    ("early-exit", dict(exit_layer=1), r"method 'early-exit' does not run with backend='llama-cpp': it drafts with "
                                       r"the target's own torch layers"),
    ("draft", dict(draft_backend="torch"), r"draft_backend='torch' with backend='llama-cpp': a torch draft beside a "
                                           r"llama.cpp target is not built"),
    ("cascade", {}, r"methods 'draft' and 'cascade' need a draft model; with backend='llama-cpp' pass draft="),
    ("draft", dict(draft_vocab_size=20), r"draft_vocab_size=20 \(FR-Spec's truncated head\) needs torch layers"),
])
def test_what_needs_torch_layers_or_a_missing_draft_model_is_refused(gen, method, options, message):
    assert gen.backend == "llama-cpp"
    with pytest.raises(InvalidArgumentError, match=message):
        gen.decoder(method, **options)
    with pytest.raises(InvalidArgumentError, match=message):
        gen.batch_decoder(method, max_batch_size=1, **options)


def test_one_sequence_at_a_time(gen):
    with pytest.raises(InvalidArgumentError, match=r"llama.cpp's target runs one sequence at a time .*: use "
                                                   r"max_batch_size=1, got max_batch_size=8"):
        gen.batch_decoder("prompt-lookup")
    result = gen.batch_decoder("prompt-lookup", max_batch_size=1).generate(
        [PROMPT[1:]], GenerationConfig(max_new_tokens=6, stop_on_eos=False))[0]
    assert result.token_ids == gen.generate(TEXT, GenerationConfig(max_new_tokens=6, stop_on_eos=False),
                                            method="autoregressive", chat=False).token_ids


def test_prompt_lookup_takes_its_draft_length_from_measured_costs(gen, caplog):
    runner = gen.target.model
    with caplog.at_level("INFO", logger="specdecode"):
        decoder = gen.decoder("prompt-lookup")
    assert isinstance(decoder.draft_control, SpeculationCostPolicy)
    assert list(runner.forward_costs) == list(MEASURED_WIDTHS)
    assert "draft length from measured costs of the target model (1 tok" in caplog.text
    assert gen.decoder("autoregressive").draft_control is None
    given = DraftControl(length_schedule="heuristic")
    assert gen.decoder("prompt-lookup", draft_control=given).draft_control is given  # the user's control wins


def test_prompt_lookup_s_datastore_is_the_standard_library_by_default_on_this_backend_only(gen, tiny, tmp_path):
    gen.cache_dir = tmp_path  # its datastore cache, not the user's
    assert len(gen.make_drafter("prompt-lookup").datastore) > 1000  # "auto": the standard library's sources
    assert list((tmp_path / "datastore").iterdir())
    assert gen.make_drafter("prompt-lookup", prompt_lookup_datastore="none").datastore is None
    assert gen.make_drafter("prompt-lookup", prompt_lookup_branches=2).datastore is None  # a tree: none
    assert gen.make_drafter("prompt-lookup").datastore is gen.make_drafter("prompt-lookup").datastore  # made once
    with pytest.raises(InvalidArgumentError, match=r"prompt_lookup_datastore='none' \(--prompt-lookup-datastore\) "
                                                   r"applies to the method 'prompt-lookup', not to 'draft'"):
        gen.make_drafter("draft", prompt_lookup_datastore="none")
    torch_gen = SpeculativeGenerator(LoadedModel(tiny, make_tiny_tokenizer(), "tiny"), cache_dir=tmp_path)
    assert torch_gen.make_drafter("prompt-lookup").datastore is None


def test_tokens_stop_strings_and_banned_words_are_the_torch_targets(gen, tiny):
    torch_gen = SpeculativeGenerator(LoadedModel(tiny, make_tiny_tokenizer(), "tiny"))
    free = torch_gen.generate(TEXT, GenerationConfig(max_new_tokens=30, stop_on_eos=False), method="autoregressive",
                              chat=False).token_ids
    j = next(i for i, t in enumerate(free) if i >= 2 and t >= 10 and t not in free[:i])
    word = make_tiny_tokenizer().decode([free[j]])
    for extra in ({}, dict(stop_strings=(word,)), dict(banned_words=(word,))):
        config = GenerationConfig(max_new_tokens=30, stop_on_eos=False, **extra)
        expected = torch_gen.generate(TEXT, config, method="prompt-lookup", chat=False)
        got = gen.generate(TEXT, config, method="prompt-lookup", chat=False)
        assert (got.token_ids, got.text, got.finish_reason) == (expected.token_ids, expected.text,
                                                                 expected.finish_reason)
        assert got.token_ids[:j] == free[:j]
        assert (got.token_ids == free[: j + 1]) == ("stop_strings" in extra)
        assert (word in got.text.split()) == ("banned_words" not in extra)


@pytest.mark.parametrize(("flags", "message"), [
    (["--method", "layer-skip", "--skip-layers", "attn=1"],
     "--method layer-skip does not run with --backend llama-cpp: it drafts with the target's own torch layers"),
    (["--method", "draft", "--draft-backend", "torch"],
     "draft_backend='torch' with backend='llama-cpp': a torch draft beside a llama.cpp target is not built"),
    (["--method", "cascade"], "GGUF file 'missing.gguf' (backend 'llama-cpp') does not exist"),  # no refusal
    (["--method", "draft", "--draft", "nodraft.gguf"],
     "GGUF file 'nodraft.gguf' (the llama.cpp draft model) does not exist"),  # checked before the target
    (["--quantize", "int8"], "quantize='int8' quantize torch weights, but backend='llama-cpp'"),
    ([], "GGUF file 'missing.gguf' (backend 'llama-cpp') does not exist"),  # prompt-lookup by default, not cascade
])
def test_generate_refuses_before_loading(capsys, flags, message):
    code, _, err = run_generate(capsys, "--backend", "llama-cpp", "--target", "missing.gguf", "--prompt", "w5 w9",
                                *flags)
    assert code != 0 and message in err


# ---------------------------------------------------------------------------------------------
# llama.cpp on a tiny float32 GGUF file


@pytest.fixture
def llama_gen(tiny_gguf):
    from specdecode.models.llama_cpp import LlamaCppModel

    model = LlamaCppModel(tiny_gguf, n_threads=1, role="target model", kv_cache_type="f32")
    yield SpeculativeGenerator(LoadedModel(LlamaCppTargetRunner(model), make_tiny_tokenizer(), "tiny"))
    model.close()


def test_prompt_lookup_with_measured_costs_is_llama_cpps_greedy(llama_gen, tiny_gguf):
    n = 40
    reference = llama_cpp_greedy(tiny_gguf, PROMPT[1:], n)
    assert llama_gen._eos == {2}  # the tokenizer's and the GGUF file's end of sequence
    for method in ("autoregressive", "prompt-lookup"):
        result = llama_gen.generate(TEXT, GenerationConfig(max_new_tokens=n, stop_on_eos=False), method=method,
                                    chat=False)
        assert result.token_ids == reference, method
    assert list(llama_gen.target.model.forward_costs) == list(MEASURED_WIDTHS)


def test_a_stop_string_and_a_banned_word_on_llama_cpp(llama_gen, tiny_gguf):
    n = 30
    free = llama_cpp_greedy(tiny_gguf, PROMPT[1:], n)
    j = next(i for i, t in enumerate(free) if i >= 2 and t >= 10 and t not in free[:i])
    word = make_tiny_tokenizer().decode([free[j]])
    stopped = llama_gen.generate(TEXT, GenerationConfig(max_new_tokens=n, stop_strings=(word,), stop_on_eos=False),
                                 method="prompt-lookup", chat=False)
    assert stopped.token_ids == free[: j + 1] and stopped.finish_reason == "stop_string"
    banned = llama_gen.generate(TEXT, GenerationConfig(max_new_tokens=n, banned_words=(word,), stop_on_eos=False),
                                method="prompt-lookup", chat=False)
    assert banned.token_ids[:j] == free[:j] and word not in banned.text.split()
    # at j the target's best token but the banned one: llama.cpp's logits after the same prefix
    runner = llama_gen.target.model
    logits = runner.prefill(PROMPT[1:] + free[:j])
    logits[free[j]] = float("-inf")
    assert banned.token_ids[j] == int(logits.argmax())
