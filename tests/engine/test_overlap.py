"""Overlapped rounds (``engine.overlap``): a round without a drafter enqueues its successor's forward before its
read. On a CPU nothing overlaps, but the logic is the same as on CUDA, so forcing ``overlap_rounds=True`` here
checks that the output is exactly that of rounds run one after the other (float32 greedy, and sampling with
the same seeds), that a forward run ahead is used only where the rows are what it assumed, and the errors."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model
from runner_target_helpers import TorchBackedModel
from selfspec_helpers import one_thread  # noqa: F401 (a fixture)
from specdecode import GenerationConfig, SpeculativeDecoder
from specdecode.drafters import PromptLookupDrafter
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.overlap import (HostReader, RoundAhead, can_run_ahead, engine_overlap_rounds, next_tokens,
                                       run_ahead, taken)
from specdecode.engine.stats import SpecDecodingStats
from specdecode.engine.verification import SampledRows
from specdecode.models.llama_cpp_target import LlamaCppTargetRunner
from specdecode.errors import InvalidArgumentError

PROMPTS = [[5, 9, 12], [7, 3, 30, 41, 8, 11, 19], [44], [13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [6, 6, 6, 6]]
LENGTHS = [20, 9, 25, 14, 17]


class Staged:
    """Counts the rounds that ran their successor ahead (``HostReader.stage``)."""

    def __init__(self, engine: BatchedSpeculativeDecoder) -> None:
        self.count = 0
        stage = engine._reader.stage

        def counted(values):
            self.count += 1
            stage(values)

        engine._reader.stage = counted


def _engine(target, overlap: bool, fast: bool = False, **kw) -> BatchedSpeculativeDecoder:
    fast_path = dict(compile=True, graphs=False) if fast else dict(compile=False)
    return BatchedSpeculativeDecoder(target, None, max_batch_size=3, max_length=96, overlap_rounds=overlap,
                                     **fast_path, **kw)


def _drain(dec: BatchedSpeculativeDecoder) -> dict[int, list[int]]:
    """Step ``dec`` until it is idle: request id -> its tokens."""
    out = {}
    while dec.has_work:
        for event in dec.step():
            if event.result is not None:
                out[event.request_id] = event.result.token_ids
    return out


def _two_rows_stepped(arch: str, max_new_tokens: int, steps: int):
    """(config, each of the first 3 prompts decoded alone, an overlapping engine running the first two for
    ``steps`` steps, their request ids)."""
    target = make_tiny_model(arch)
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    alone = SpeculativeDecoder(target, overlap_rounds=False)
    expected = [alone.generate(p, config).token_ids for p in PROMPTS[:3]]
    dec = _engine(target, True)
    first, second = dec.add(PROMPTS[0], config), dec.add(PROMPTS[1], config)
    for _ in range(steps):
        dec.step()
    return config, expected, dec, first, second


def _eos_of(target) -> int:
    """A token the serial greedy outputs hit mid-way, so rows finish at EOS in different rounds."""
    out = [r.token_ids for r in _engine(target, False).generate(PROMPTS[:3], [GenerationConfig(max_new_tokens=m)
                                                                              for m in LENGTHS[:3]])]
    counts: dict[int, int] = {}
    for row in out:
        for t in row[2:]:
            counts[t] = counts.get(t, 0) + 1
    return max(counts, key=counts.get)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("fast", [False, True])
def test_overlapped_greedy_rows_equal_rounds_one_after_the_other(arch, fast):
    """Rows join as others finish (more requests than slots), finish at EOS and at their lengths."""
    target = make_tiny_model(arch)
    eos = _eos_of(target)
    configs = [GenerationConfig(max_new_tokens=m) for m in LENGTHS]
    serial = _engine(target, False, fast, eos_token_ids=[eos])
    expected = [r.token_ids for r in serial.generate(PROMPTS, configs)]
    assert any(len(t) < m for t, m in zip(expected, LENGTHS)), "no row finished at EOS"
    dec = _engine(target, True, fast, eos_token_ids=[eos])
    staged = Staged(dec)
    got = [r.token_ids for r in dec.generate(PROMPTS, configs)]
    assert got == expected
    assert staged.count > 0 and dec.stats.num_rounds == serial.stats.num_rounds
    assert serial.stats.num_discarded_forwards == 0 and staged.count >= dec.stats.num_discarded_forwards
    # Three rows in three slots (no request waits), rows ending at EOS: those left go on using the forwards
    # run ahead; only the forward run ahead of the last row's EOS has no one left to use it.
    expected = [r.token_ids for r in _engine(target, False, fast, eos_token_ids=[eos]).generate(PROMPTS[:3],
                                                                                               configs[:3])]
    assert any(len(t) < m for t, m in zip(expected, LENGTHS)), "no row finished at EOS"
    dec = _engine(target, True, fast, eos_token_ids=[eos])
    assert [r.token_ids for r in dec.generate(PROMPTS[:3], configs[:3])] == expected
    longest = max(len(t) for t in expected)  # the rows of the last round; it ran ahead if one was not at its length
    dropped = any(len(t) < m for t, m in zip(expected, LENGTHS) if len(t) == longest)
    assert dec.stats.num_discarded_forwards == int(dropped)


@pytest.mark.usefixtures("one_thread")
def test_every_forward_run_ahead_is_used_or_counted_as_dropped():
    target = make_tiny_model("qwen2")
    eos = _eos_of(target)
    dec = _engine(target, True, eos_token_ids=[eos])
    calls = []
    runner = dec.runner

    class Spy:
        def __getattr__(self, name):
            return getattr(runner, name)

        def forward_greedy(self, ids, starts, keep, trees=None):
            calls.append(list(starts))
            return runner.forward_greedy(ids, starts, keep, trees)

    dec.runner = Spy()
    staged = Staged(dec)
    dec.generate(PROMPTS, [GenerationConfig(max_new_tokens=m) for m in LENGTHS])
    # Forwards through the runner: each round's own, or one run ahead (used by the next round, or dropped).
    assert len(calls) == dec.stats.num_rounds - (staged.count - dec.stats.num_discarded_forwards) + staged.count
    assert 0 < dec.stats.num_discarded_forwards < staged.count


@pytest.mark.usefixtures("one_thread")
def test_overlapped_sampling_draws_the_same_tokens_with_the_same_seeds():
    target = make_tiny_model("llama")
    configs = [GenerationConfig(max_new_tokens=m, temperature=0.9, top_p=0.9, seed=100 + i) for i, m in
               enumerate(LENGTHS)]
    configs[1] = GenerationConfig(max_new_tokens=LENGTHS[1])  # a greedy row beside the sampling ones
    expected = [r.token_ids for r in _engine(target, False).generate(PROMPTS, configs)]
    dec = _engine(target, True)
    staged = Staged(dec)
    assert [r.token_ids for r in dec.generate(PROMPTS, configs)] == expected
    assert staged.count > 0


@pytest.mark.usefixtures("one_thread")
def test_a_row_whose_law_is_not_one_fails_alone_while_its_round_runs_ahead():
    """A sampling row whose law turns NaN (``sampling.race`` gives -1 on the device) in an overlapped round: the
    forward run ahead takes a valid id in its place (``next_tokens``), the row ends with "error" at the read, and
    the other rows' tokens are those of rounds run one after the other."""
    target = make_tiny_model("llama")
    configs = [GenerationConfig(max_new_tokens=12, temperature=t, seed=100 + i, stop_on_eos=False)
               for i, t in enumerate((0.7, 0.9, 0.9))]
    expected = [r.token_ids for r in _engine(target, False).generate(PROMPTS[:3], configs)]
    dec = _engine(target, True)
    staged = Staged(dec)
    ids = [dec.add(p, c) for p, c in zip(PROMPTS[:3], configs)]
    dec.step()  # the prefills and a first round
    broken = next(row for row in dec._rows if row.request_id == ids[0])
    broken.sampler.probs = lambda logits: torch.full((logits.shape[0], dec.vocab_size), float("nan"))
    ended = {}
    while dec.has_work:
        for event in dec.step():
            if event.finish_reason:
                ended[event.request_id] = event
    assert ended[ids[0]].finish_reason == "error" and "sampling distribution was NaN" in ended[ids[0]].error
    assert [ended[i].result.token_ids for i in ids[1:]] == expected[1:]
    assert staged.count > 0


@pytest.mark.usefixtures("one_thread")
def test_a_request_joining_drops_the_forward_run_ahead_and_one_leaving_keeps_it_for_the_others():
    config, expected, dec, first, second = _two_rows_stepped("mistral", 12, 4)
    assert dec._ahead is not None  # a forward is in flight for the two rows
    third = dec.add(PROMPTS[2], config)  # joins at the next step: the rows change
    dec.step()
    assert dec.stats.num_discarded_forwards == 1
    for _ in range(3):
        dec.step()
    staged = Staged(dec)
    pending = len(dec.request(third).tokens) - 1  # written by the forward run ahead, in slot 2
    keys = [layer.keys[2, :, pending].clone() for layer in dec.cache.layers]
    dec.cancel(second)  # the third row moves into slot 1: the forward run ahead serves the rows left
    assert all(torch.equal(layer.keys[1, :, pending], k) for layer, k in zip(dec.cache.layers, keys))
    dec.step()
    assert dec.stats.num_discarded_forwards == 1 and staged.count == 1
    out = _drain(dec)
    assert out[first] == expected[0] and out[third] == expected[2]


@pytest.mark.usefixtures("one_thread")
def test_a_row_swapped_for_another_between_steps_drops_the_forward_run_ahead():
    """As many rows as before, but not the same: the forward run ahead is not theirs (``RoundAhead.order``)."""
    config, expected, dec, first, second = _two_rows_stepped("qwen2", 10, 3)
    dec.cancel(second)
    third = dec.add(PROMPTS[2], config)
    out = _drain(dec)
    assert dec.stats.num_discarded_forwards == 1
    assert out[first] == expected[0] and out[third] == expected[2]


@pytest.mark.usefixtures("one_thread")
def test_a_full_batch_runs_ahead_while_requests_wait():
    """A waiting request can join only where a row leaves, which the forward run ahead survives anyway."""
    target = make_tiny_model("qwen2")
    config = GenerationConfig(max_new_tokens=6)
    expected = [r.token_ids for r in _engine(target, False).generate(PROMPTS[:4], config)]
    dec = BatchedSpeculativeDecoder(target, None, max_batch_size=2, max_length=96, overlap_rounds=True,
                                    compile=False)
    ids = [dec.add(p, config) for p in PROMPTS[:4]]
    dec.step()
    assert dec.num_waiting == 2 and dec._ahead is not None
    out = _drain(dec)
    assert [out[i] for i in ids] == expected


@pytest.mark.usefixtures("one_thread")
def test_rows_that_need_the_host_first_do_not_run_ahead():
    """Rows with logits processors run their rounds one by one (as rows with banned words do: ``can_run_ahead``);
    a row's last token runs nothing ahead, so generations ending at their length drop nothing."""
    target = make_tiny_model("qwen2")
    prompts = PROMPTS[:2]
    for config in (GenerationConfig(max_new_tokens=10, repetition_penalty=1.3),
                   GenerationConfig(max_new_tokens=10, logit_bias={7: 2.0})):
        expected = [r.token_ids for r in _engine(target, False).generate(prompts, config)]
        dec = _engine(target, True)
        staged = Staged(dec)
        assert [r.token_ids for r in dec.generate(prompts, config)] == expected
        assert staged.count == 0
    dec = _engine(target, True)
    staged = Staged(dec)
    dec.generate(prompts, GenerationConfig(max_new_tokens=10))
    assert staged.count == 8 and dec.stats.num_rounds == 9 and dec.stats.num_discarded_forwards == 0
    # rows ending at different lengths: a row at its last token does not stop the others running ahead
    dec = _engine(target, True)
    staged = Staged(dec)
    dec.generate(prompts, [GenerationConfig(max_new_tokens=5), GenerationConfig(max_new_tokens=10)])
    assert staged.count == 8 and dec.stats.num_rounds == 9 and dec.stats.num_discarded_forwards == 0
    # a drafter: never (its next round needs the host's draft)
    spec = BatchedSpeculativeDecoder(target, PromptLookupDrafter(), max_batch_size=2, max_length=96,
                                     overlap_rounds=True, compile=False)
    staged = Staged(spec)
    spec.generate(prompts, GenerationConfig(max_new_tokens=10))
    assert staged.count == 0


@pytest.mark.usefixtures("one_thread")
def test_one_sequence_overlaps_with_speculative_decoder_and_streams():
    target = make_tiny_model("gemma3")
    config = GenerationConfig(max_new_tokens=16)
    expected = SpeculativeDecoder(target, overlap_rounds=False).generate(PROMPTS[3], config).token_ids
    dec = SpeculativeDecoder(target, overlap_rounds=True)
    assert dec.generate(PROMPTS[3], config).token_ids == expected
    assert dec._engine.overlap_rounds and dec._engine.stats.num_rounds == 15
    chunks = list(dec.stream(PROMPTS[3], config))
    assert [t for c in chunks for t in c] == expected and len(chunks) == 16
    dec.overlap_rounds = False  # read at the next generation's start
    assert dec.generate(PROMPTS[3], config).token_ids == expected and not dec._engine.overlap_rounds


def test_the_default_is_cuda_only_and_bad_values_are_refused():
    target = make_tiny_model("llama", num_layers=1)
    assert engine_overlap_rounds(None, target) is False  # a CPU model
    assert engine_overlap_rounds(True, target) is True and engine_overlap_rounds(False, target) is False
    with pytest.raises(InvalidArgumentError, match=r"overlap_rounds must be True, False or None .* got 'yes'"):
        BatchedSpeculativeDecoder(target, None, overlap_rounds="yes")
    with pytest.raises(InvalidArgumentError, match=r"overlap_rounds must be True, False or None .* got 1"):
        SpeculativeDecoder(target, overlap_rounds=1)
    backed = LlamaCppTargetRunner(TorchBackedModel(target))
    assert engine_overlap_rounds(None, backed) is False
    with pytest.raises(InvalidArgumentError, match="overlap_rounds=True .* runs in llama.cpp: use None or False"):
        SpeculativeDecoder(backed, overlap_rounds=True)


def test_next_tokens_take_the_argmax_or_the_sampled_token_and_the_read_gives_them_back():
    logits = torch.tensor([[[0.1, 3.0, 0.2]], [[5.0, 0.0, 1.0]], [[0.0, 0.0, 9.0]]])
    sampled = SampledRows([1], torch.tensor([[0, 2]]))
    assert next_tokens(logits.argmax(-1), sampled).tolist() == [[1], [2], [2]]
    assert next_tokens(logits.argmax(-1), SampledRows()).tolist() == [[1], [0], [2]]
    assert next_tokens(logits.argmax(-1), None).tolist() == [[1], [0], [2]]
    reader = HostReader("cpu")
    reader.stage(torch.tensor([4, 5, 6]))
    assert reader.read() == [4, 5, 6]


class _Row:
    def __init__(self, request_id, tokens):
        self.request_id, self.tokens = request_id, tokens


def test_run_ahead_reads_the_tokens_it_fed_and_taken_finds_each_row_by_request_position_and_token():
    logits = torch.tensor([[[0.1, 3.0, 0.2]], [[5.0, 0.0, 1.0]]])
    calls = []

    class Runner:
        @staticmethod
        def forward_greedy(ids, starts, keep):
            calls.append((ids.tolist(), starts, keep))
            return ids.float().view(-1, 1, 1) * 10, torch.stack([ids, ids + 100], dim=-1)  # a greedy per row

    runner = Runner()

    rows = [_Row(7, [4, 4, 4]), _Row(9, [5, 5])]
    ahead, values = run_ahead(runner, HostReader("cpu"), torch.tensor([11, 12]), logits.argmax(-1), SampledRows(), rows,
                              [2, 1])
    assert values == [11, 12] and calls == [([[1], [0]], [3, 2], 1)]
    assert ahead.key == [(7, 3, 1), (9, 2, 0)]
    stats = SpecDecodingStats()
    after = [_Row(7, [4, 4, 4, 1]), _Row(9, [5, 5, 0])]
    ids, out, greedy = taken(ahead, after, 0, stats)
    assert ids.tolist() == [[1], [0]] and out.flatten().tolist() == [10.0, 0.0]
    assert greedy.tolist() == [[[1, 101]], [[0, 100]]]
    ids, out, greedy = taken(ahead, after[::-1], 0, stats)  # a row moved: found at its old index
    assert ids.tolist() == [[0], [1]] and out.flatten().tolist() == [0.0, 10.0]
    assert greedy.tolist() == [[[0, 100]], [[1, 101]]]  # its epilogue moved with it
    assert taken(ahead, after[1:], 0, stats)[0].tolist() == [[0]]  # a row left
    assert stats.num_discarded_forwards == 0
    for wrong in (_Row(8, [4, 4, 4, 1]),  # another request
                  _Row(7, [4, 4, 4, 2]),  # another token
                  _Row(7, [4, 4, 4, 4, 1])):  # another position
        assert RoundAhead(ahead.logits, ahead.ids, ahead.greedy, ahead.key).order([wrong, after[1]]) is None
        assert taken(ahead, [wrong, after[1]], 0, stats) is None
    assert taken(ahead, after, 2, stats) is None  # a round that drafts
    assert stats.num_discarded_forwards == 4 and taken(None, after, 0, stats) is None


def test_can_run_ahead_needs_rows_without_host_work_and_with_room():
    target = make_tiny_model("qwen2", num_layers=1)
    dec = _engine(target, True)
    dec.add([5, 9, 12], GenerationConfig(max_new_tokens=4))
    dec.step(decode=False)
    rows = list(dec._rows)
    assert can_run_ahead(rows, SampledRows(), 96)
    assert not can_run_ahead(rows, SampledRows(errors={0: "sampling failed"}), 96)
    assert not can_run_ahead(rows, SampledRows(), len(rows[0].tokens))  # no room for one more position
    rows[0].banned = object()  # banned words: a rollback may change the sequence
    assert not can_run_ahead(rows, SampledRows(), 96)
    rows[0].banned = None
    rows[0].output.extend([1, 1, 1])  # one token left: nothing after it
    assert not can_run_ahead(rows, SampledRows(), 96)
    dec.add([7, 3], GenerationConfig(max_new_tokens=4))
    dec.step(decode=False)
    rows = list(dec._rows)
    assert can_run_ahead(rows, SampledRows(), 96)  # the other row goes on
    assert not can_run_ahead(rows, SampledRows(), 96, joinable=True)  # the row that ends would let a request join
