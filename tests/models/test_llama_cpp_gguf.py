"""``LlamaCppModel`` itself on a float32 GGUF file of a tiny model (tests/tiny_gguf.py, written with the
``gguf`` library) with a float32 KV cache: llama.cpp's logits against the torch model's, every
position of a batch against single steps, the rollback (``remove_from``, ``llama_memory_seq_rm``)
exact to the position, directly and through the draft's runner (``LlamaCppTargetRunner``), greedy
decoding through it against llama.cpp's own greedy decoding of the same file, and the drafters with
a llama.cpp draft in the engine against the torch target's own greedy decoding.

Measured here (llama-cpp-python 0.3.36, AVX512 CPU): every batch of two or more tokens gives a
token the same logits bit for bit, whatever the batch; a batch of one token (another matmul
kernel) differs from them by at most about 5e-7 (a few float32 ulps). With llama.cpp's default
f16 KV cache the logits are the torch model's to about 5e-4; with an f32 one to about 1e-6.

They need llama-cpp-python (``pip install 'specdecode[llamacpp]'``; CI installs it) and no model
package: the file is written in a second.
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model, make_tiny_tokenizer
from helpers import perturbed_copy
from specdecode import GenerationConfig, SpeculativeDecoder, pipeline
from specdecode.drafters import CascadeDrafter, DraftModelDrafter
from specdecode.errors import InvalidArgumentError, UnsupportedModelError
from specdecode.models import LoadedModel
from specdecode.models.llama_cpp import LlamaCppModel
from specdecode.models.llama_cpp_target import LlamaCppTargetRunner
from tiny_gguf import write_tiny_gguf

pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install 'specdecode[llamacpp]')")

PROMPT = [1, 5, 9, 11, 5, 9, 17, 23, 5, 9, 30, 12]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    """(torch model, its float32 GGUF file) of a tiny random llama or qwen2 model."""
    model = make_tiny_model(request.param, num_layers=2, seed=3)
    path = write_tiny_gguf(model, make_tiny_tokenizer(), tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf")
    return model, path


@pytest.fixture
def llama_model(tiny):
    model = LlamaCppModel(tiny[1], n_threads=1, kv_cache_type="f32")
    yield model
    model.close()


def test_the_gguf_file_is_the_torch_model(tiny, llama_model):
    """The conversion is right (tensor names, the llama q/k permutation, rotary, norms): llama.cpp's
    logits at every position are the float32 torch model's, to float rounding."""
    model, _ = tiny
    with torch.no_grad():
        reference = model(torch.tensor([PROMPT])).logits[0]
    ours = llama_model.decode(PROMPT, 0, len(PROMPT))
    assert ours.shape == reference.shape == (len(PROMPT), llama_model.vocab_size)
    assert torch.allclose(ours, reference, atol=1e-5, rtol=1e-5), (ours - reference).abs().max()
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))
    llama_model.check_vocabulary(make_tiny_tokenizer())  # the tiny tokenizer's tokens, id for id


def test_every_position_of_a_batch_equals_single_steps(llama_model):
    """float32 on the CPU: a token's logits do not depend on the batch it is fed in, bit for bit across
    batches of 2 or more tokens (a verification's), and to a few ulps against single steps (another
    matmul kernel: the greedy token is the same unless two logits are within about 1e-6)."""
    batch = llama_model.decode(PROMPT, 0, len(PROMPT))
    for width in (2, 3, 5):
        llama_model.remove_from(0)
        rows = [llama_model.decode(PROMPT[i:i + width], i, len(PROMPT[i:i + width]))
                for i in range(0, len(PROMPT), width)]
        assert torch.equal(torch.cat(rows), batch), width
    llama_model.remove_from(0)
    steps = torch.cat([llama_model.decode([t], i, 1) for i, t in enumerate(PROMPT)])
    assert torch.allclose(steps, batch, atol=2e-6, rtol=0), (steps - batch).abs().max()
    assert torch.equal(steps.argmax(-1), batch.argmax(-1))


def _rollback_then_continue(model: LlamaCppModel, remove_from) -> torch.Tensor:
    """Feed A (5 tokens) and B (4 tokens), drop B with ``remove_from(5)``, feed C at 5: C's logits."""
    model.remove_from(0)
    model.decode(PROMPT[:5], 0, 1)
    model.decode([40, 41, 42, 43], 5, 4)
    remove_from(5)
    return model.decode(PROMPT[5:8], 5, 3)


def test_rollback_is_exact_to_the_position(llama_model):
    """After the rollback llama.cpp's memory ends at position 4 and C's logits are those of A then C in a
    fresh context, bit for bit; an off-by-one either way (a negative control) is caught."""
    lib = llama_model.llama_cpp
    after = _rollback_then_continue(llama_model, llama_model.remove_from)
    memory = lib.llama_get_memory(llama_model._llm.ctx)
    assert lib.llama_memory_seq_pos_max(memory, 0) == 7  # A at 0..4, C at 5..7; B is gone
    llama_model.remove_from(0)
    fresh = llama_model.decode(PROMPT[:8], 0, 3)
    assert torch.equal(after, fresh)

    for shift in (-1, 1):  # remove_from(4) drops A's last token; remove_from(6) keeps B's first
        def off_by_one(position, shift=shift):
            llama_model.remove_from(position + shift)

        try:
            wrong = _rollback_then_continue(llama_model, off_by_one)
        except UnsupportedModelError:  # llama.cpp refuses positions that are not consecutive
            continue
        assert not torch.allclose(wrong, fresh, atol=1e-3), shift


def test_the_draft_runner_rolls_llama_cpp_back(tiny):
    """The draft's runner (``LlamaCppTargetRunner``) after rejected tokens, rolled back explicitly or by the
    next forward's lower start: the same logits, bit for bit, as a context that never saw them."""
    model = LlamaCppModel(tiny[1], n_threads=1, kv_cache_type="f32")
    runner = LlamaCppTargetRunner(model, name="llama.cpp draft model")
    runner.prefill(PROMPT[:6])
    runner.forward([44, 45, 46], 6, 3)
    runner.rollback(6)
    assert runner.num_cached == 6
    after = runner.forward(PROMPT[6:9], 6, 3)
    runner.forward([44, 45, 46], 6, 3)
    implicit = runner.forward(PROMPT[6:9], 6, 3)  # no rollback first: the forward drops 44, 45, 46
    assert runner.tokens == PROMPT[:9]
    runner.prefill(PROMPT[:1])
    reference = runner.forward(PROMPT[:9], 0, 3)  # a fresh context: one batch of 9, as before the port
    assert torch.equal(after, reference)
    assert torch.equal(implicit, reference)
    model.close()


def _llama_cpp_greedy(path, prompt: list[int], n: int) -> list[int]:
    """llama.cpp's own greedy decoding (llama-cpp-python's ``Llama.generate`` with its greedy sampler)."""
    import llama_cpp

    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=1, n_threads_batch=1, logits_all=False,
                          n_gpu_layers=0, type_k=f32, type_v=f32, verbose=False)
    out = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        out.append(int(token))
        if len(out) == n:
            break
    llm.close()
    return out


def _speculative_greedy(model: LlamaCppModel, prompt: list[int], n: int, propose) -> tuple[list[int], int, int]:
    """Greedy speculative decoding through ``LlamaCppModel`` as the target: each round feeds the pending
    token and ``propose(sequence)``'s draft in one forward, keeps the longest agreeing prefix and rolls
    the rest back. Returns (tokens, drafted, accepted)."""
    model.remove_from(0)
    sequence = list(prompt)
    pending = int(model.decode(prompt, 0, 1)[0].argmax())
    out, drafted, accepted = [], 0, 0
    while len(out) < n:
        out.append(pending)
        draft = propose(sequence + [pending])
        start = len(sequence)
        rows = model.decode([pending] + draft, start, len(draft) + 1).argmax(-1).tolist()
        sequence.append(pending)
        a = 0
        while a < len(draft) and draft[a] == rows[a]:
            a += 1
        drafted, accepted = drafted + len(draft), accepted + a
        sequence += draft[:a]
        out += draft[:a]
        model.remove_from(len(sequence))  # the rejected drafts
        pending = rows[a]
    return out[:n], drafted, accepted


def test_greedy_decoding_through_it_equals_llama_cpps_own(tiny, llama_model):
    """Drafts that are right at first and wrong later (the reference with one token changed per block),
    verified and rolled back through ``LlamaCppModel``: the output is llama.cpp's own greedy output."""
    n = 40
    reference = _llama_cpp_greedy(tiny[1], PROMPT, n)
    rounds = []

    def propose(sequence):
        done = len(sequence) - len(PROMPT)
        block = (reference + [3] * 8)[done: done + 4]
        wrong = len(rounds) % 5  # 0..3: that token is wrong; 4: the whole block is right
        rounds.append(wrong)
        if wrong < len(block):
            block[wrong] = (block[wrong] + 7) % llama_model.vocab_size
        return block

    ours, drafted, accepted = _speculative_greedy(llama_model, PROMPT, n, propose)
    assert ours == reference
    assert 0 < accepted < drafted  # both accepted and rejected tokens, so rollbacks happened


@pytest.mark.parametrize("method", ["draft", "cascade"])
def test_a_llama_cpp_draft_keeps_greedy_decoding_exact(tiny, tmp_path, method):
    """The torch target with a llama.cpp draft (the GGUF file of a perturbed copy, so some drafts are
    rejected and rolled back): float32 greedy output is the target's own autoregressive output, through
    ``SpeculativeDecoder`` and the generator's one-row batch decoder; two rows are refused."""
    target, _ = tiny
    tok = make_tiny_tokenizer()
    path = write_tiny_gguf(perturbed_copy(target, 0.3, seed=5), tok, tmp_path / "draft.gguf")
    draft = LlamaCppModel(path, n_threads=1, kv_cache_type="f32")
    gen = pipeline.SpeculativeGenerator(LoadedModel(target, tok, "tiny-target"), llama_cpp_draft=draft)
    config = GenerationConfig(max_new_tokens=32, stop_on_eos=False)
    prompt = torch.tensor([PROMPT])
    reference = gen.decoder("autoregressive").generate(prompt, config).token_ids
    drafter = {"draft": DraftModelDrafter, "cascade": CascadeDrafter}[method](runner=gen.llama_cpp_draft_runner())
    ours = SpeculativeDecoder(target, drafter).generate(prompt, config)
    assert ours.token_ids == reference
    assert 0 < ours.stats.num_accepted_tokens < ours.stats.num_drafted_tokens  # rollbacks happened
    [batched] = gen.batch_decoder(method, draft_backend="llama-cpp", max_batch_size=1).generate([prompt], config)
    assert batched.token_ids == reference
    with pytest.raises(InvalidArgumentError, match=r"max_batch_size is 2, but llama.cpp's draft runs one sequence"):
        gen.batch_decoder(method, draft_backend="llama-cpp", max_batch_size=2)
    draft.close()
