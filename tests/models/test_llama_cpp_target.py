"""The llama.cpp target runner (specdecode.models.llama_cpp_target.LlamaCppTargetRunner).

The first tests run its bookkeeping on a stand-in model that runs a tiny torch model (no
llama.cpp): positions, implicit rollbacks, ownership, bad input. The rest run llama.cpp on a
float32 GGUF file of a tiny model (tests/tiny_gguf.py): after a rejected draft and its rollback
the logits are those of a fresh decode, greedy speculative decoding through the runner gives
llama.cpp's own greedy output, and the forward costs are measured at warm-up.
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model, make_tiny_tokenizer
from specdecode.engine.cost_model import ForwardCosts
from specdecode.engine.speculation_cost import SpeculationCostPolicy
from specdecode.engine.kv_cache import new_cache
from specdecode.errors import InvalidArgumentError
from specdecode.models.llama_cpp import LlamaCppModel
from specdecode.models.llama_cpp_target import LlamaCppTargetRunner

PROMPT = [1, 5, 9, 11, 5, 9, 17, 23, 5, 9, 30, 12]


class TorchBackedModel:
    """A ``LlamaCppModel`` stand-in running a tiny transformers model on a ``DynamicCache``; ``decode``
    refuses a position that is not the end of what it holds (llama.cpp's own rule)."""

    n_ctx = 1 << 20
    name = "torch-backed"
    role = "target model"
    n_threads = 1

    def __init__(self, model):
        self.model = model
        self.generation = 0
        self.vocab_size = model.config.vocab_size
        self.cache = new_cache(model)
        self.removed: list[int] = []

    def ensure_context(self, num_positions, cached):
        pass

    take_over = LlamaCppModel.take_over  # the real bookkeeping over this stand-in's remove_from and ensure_context

    def remove_from(self, position):
        self.removed.append(position)
        held = self.cache.get_seq_length()
        if position == 0:
            self.cache = new_cache(self.model)
        elif position < held:
            self.cache.crop(position - held)

    @torch.inference_mode()
    def decode(self, ids, first_position, logits_to_keep):
        held = self.cache.get_seq_length()
        if first_position != held:
            raise AssertionError(f"forward at position {first_position}, but the model holds {held}")
        out = self.model(torch.tensor([ids]), past_key_values=self.cache, use_cache=True,
                         logits_to_keep=logits_to_keep)
        return out.logits[0].float()


@pytest.fixture
def backed():
    return TorchBackedModel(make_tiny_model("llama", num_layers=2, seed=2))


def test_positions_and_implicit_rollbacks(backed):
    runner = LlamaCppTargetRunner(backed)
    last = runner.prefill(PROMPT)
    assert last.shape == (backed.vocab_size,) and runner.num_cached == len(PROMPT)
    rows = runner.verify([3, 4, 5], len(PROMPT))  # a pending token and two drafted ones
    assert rows.shape == (3, backed.vocab_size) and runner.num_cached == len(PROMPT) + 3
    backed.removed.clear()
    runner.forward([6, 7], len(PROMPT) + 1, 1)  # one draft rejected: its positions go first
    assert backed.removed == [len(PROMPT) + 1] and runner.tokens == PROMPT + [3, 6, 7]
    logits = runner(torch.tensor([[8, 9]]), [len(PROMPT) + 3], 2)  # BatchRunner's call at one row
    assert logits.shape == (1, 2, backed.vocab_size) and runner.num_cached == len(PROMPT) + 5
    runner.rollback(4)
    assert runner.tokens == PROMPT[:4] and runner.num_forwards == 4


def test_its_logits_are_the_models_after_any_rollback(backed):
    """The same tiny model without the runner: the logits after prompt + [3, 6] match."""
    runner = LlamaCppTargetRunner(backed)
    runner.prefill(PROMPT)
    runner.verify([3, 4, 5], len(PROMPT))
    after = runner.verify([6, 7], len(PROMPT) + 1)
    with torch.no_grad():
        reference = backed.model(torch.tensor([PROMPT + [3, 6, 7]])).logits[0, -2:]
    assert torch.allclose(after, reference, atol=1e-5)


def test_bad_positions_and_ownership_are_refused(backed):
    runner = LlamaCppTargetRunner(backed)
    with pytest.raises(InvalidArgumentError, match="target model: no sequence yet; prefill a prompt first"):
        runner.forward([3], 0)
    runner.prefill(PROMPT[:4])
    with pytest.raises(InvalidArgumentError, match=r"a forward must start at a position in 0..4 \(the positions "
                                                   r"held\), got 5"):
        runner.forward([3], 5)
    with pytest.raises(InvalidArgumentError, match=r"a rollback keeps 0..4 positions \(those held\), got 9"):
        runner.rollback(9)
    with pytest.raises(InvalidArgumentError, match="a forward of the target model needs at least one token id"):
        runner.forward([], 4)
    with pytest.raises(InvalidArgumentError, match=r"runs one sequence at a time, got ids of shape \(2, 1\)"):
        runner(torch.tensor([[3], [4]]), [4, 4], 1)
    LlamaCppTargetRunner(backed).prefill(PROMPT[:2])  # another runner of the same model takes the context
    with pytest.raises(InvalidArgumentError, match="another generation started on the llama.cpp target model "
                                                   "'torch-backed' and took over its context"):
        runner.forward([3], 4)


# ---------------------------------------------------------------------------------------------
# llama.cpp on a tiny float32 GGUF file


@pytest.fixture
def target(tiny_gguf):
    model = LlamaCppModel(tiny_gguf, n_threads=1, role="target model", kv_cache_type="f32")
    yield LlamaCppTargetRunner(model)
    model.close()


def test_after_a_rejected_draft_and_rollback_the_logits_are_a_fresh_decodes(target, tiny_gguf):
    n = len(PROMPT)
    target.prefill(PROMPT)
    target.verify([7, 8, 9, 10], n)  # pending 7; drafts 8, 9, 10: 8 accepted, 9 rejected
    after = target.verify([20, 21, 22], n + 2)  # the next round at the accepted length: 9, 10 dropped
    fresh_model = LlamaCppModel(tiny_gguf, n_threads=1, role="target model", kv_cache_type="f32")
    fresh = LlamaCppTargetRunner(fresh_model)
    fresh.prefill(PROMPT + [7, 8])
    reference = fresh.verify([20, 21, 22], n + 2)
    assert torch.equal(after, reference)
    assert target.tokens == fresh.tokens == PROMPT + [7, 8, 20, 21, 22]
    target.rollback(n)  # and an explicit rollback: the prompt's next-token logits again
    assert torch.equal(target.forward([7], n), fresh.forward([7], n))
    fresh_model.close()


def test_greedy_speculative_decoding_through_the_runner_is_llama_cpps_greedy(target, tiny_gguf):
    """The batched round's calls at B = 1 (``runner(ids, [start], k + 1)``, the rollback implicit in the next
    forward) with drafts that are partly wrong: llama.cpp's own greedy output (llama-cpp-python's
    ``Llama.generate``, greedy sampler)."""
    import llama_cpp

    n = 32
    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=str(tiny_gguf), n_ctx=256, n_threads=1, n_threads_batch=1, type_k=f32,
                          type_v=f32, verbose=False)
    reference = []
    for token in llm.generate(PROMPT, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        reference.append(int(token))
        if len(reference) == n:
            break
    llm.close()

    pending = int(target.prefill(PROMPT).argmax())
    sequence, out, drafted, accepted, rounds = list(PROMPT), [], 0, 0, 0
    while len(out) < n:
        out.append(pending)
        done = len(out)
        draft = (reference + [3] * 8)[done: done + 3]
        if rounds % 3 < len(draft):  # one wrong token per block, at 0, 1, 2 in turn
            draft[rounds % 3] = (draft[rounds % 3] + 5) % target.vocab_size
        rounds += 1
        argmax = target(torch.tensor([[pending, *draft]]), [len(sequence)], len(draft) + 1)[0].argmax(-1).tolist()
        sequence.append(pending)
        a = 0
        while a < len(draft) and draft[a] == argmax[a]:
            a += 1
        sequence += draft[:a]
        out += draft[:a]
        drafted, accepted = drafted + len(draft), accepted + a
        pending = argmax[a]
    assert out[:n] == reference
    assert 0 < accepted < drafted


def test_forward_costs_are_measured_at_warm_up(target):
    costs = target.measure_forward_costs(PROMPT * 4, widths=(1, 2, 4, 8), repeats=2)
    assert list(costs) == [1, 2, 4, 8] and all(s > 0 for s in costs.values())
    assert target.forward_costs == costs and target.num_cached == len(PROMPT) * 4  # the context is kept
    policy = SpeculationCostPolicy(ForwardCosts(costs), prior=0.5, max_size=7)  # what the cost model takes
    assert 0 <= policy.controller(8).round_cap() <= 7
    with pytest.raises(InvalidArgumentError, match=r"widths must be integers >= 1, got \[0\]"):
        target.measure_forward_costs(PROMPT, widths=(0,))
