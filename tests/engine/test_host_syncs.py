"""Host syncs per round on the fast path: the round reads the device back once.

Counted: every ``Tensor.item``, ``tolist``, ``cpu``, ``numpy`` and every conversion of a tensor to
a Python bool, int, float or index, made by the decoder and the drafters between forwards. The
model's own forward is not counted: on the fast path it runs as a compiled graph (a CUDA graph
on CUDA), which holds no host code; ``test_fast_path`` checks the graphs give the same tokens.
Here the static cache runs with eager forwards (``graphs=False``), so the round's host logic is
the fast path's and the test stays quick.

The bounds, greedy decoding, no adaptive exit:

- autoregressive, draft model, prompt lookup: exactly one sync per round (the draft, the
  target's choices and the finiteness flags, read together); autoregressive with overlapped rounds
  (``engine.overlap``: the next forward enqueued before the read) too;
- cascade: one more in a round whose n-gram match the draft model checks (how many of the
  n-gram tokens it agrees with decides what it drafts next, a host decision);
- a draft model's token trees (draft and cascade) whose shapes come from earlier rounds
  (``tree_shape="previous-round"``, CUDA's default): as the linear drafts. With "per-round" shapes (a CPU's
  default) the drafter reads each round's values once more (``drafters.draft_tree.grow_trees``).

Draft length controls (the batched engine, B = 4, greedy and sampling rows): the heuristic schedule and the cost
model one sync per round (its calibration's timed forwards aside); a confidence gate too where every gated row is
greedy and linear (its probability computed on the device), else one more.

Sampling rows (the batched engine, B = 4): one sync per round, an exit read with it included (each row's kept
block cut on the device, ``draft_exit.exit_blocks``) and banned words (matched on the host after the read: the
whole block is sampled and kept, and a word drawn is rolled back); two where a draft model's trees are grown from
each round's own values ("per-round").
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import VOCAB, make_tiny_model, make_tiny_tokenizer
from helpers import perturbed_copy
from specdecode import DraftModelDrafter, GenerationConfig, PromptLookupDrafter, SpeculativeDecoder
from specdecode.drafters.cascade import CascadeDrafter
from specdecode.drafters import cascade as cascade_module
from specdecode.drafters.control import ConfidenceGate, DraftControl
from specdecode.engine import verification
from specdecode.engine import batched as batched_module
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.fast_path import ModelRunner
from specdecode.engine.overlap import HostReader
from specdecode.engine.sampling import Sampler

SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class SyncCounter:
    """Counts host-sync calls on tensors while ``active``, except inside the models' forwards."""

    def __init__(self, models) -> None:
        self.count = 0
        self.active = False
        self._depth = 0
        self._models = models

    @contextlib.contextmanager
    def counting(self):
        originals = {name: getattr(torch.Tensor, name) for name in SYNCS}
        forwards = {m: m.forward for m in self._models}

        def wrap(fn):
            def counted(tensor, *args, **kwargs):
                if self.active and self._depth == 0:
                    self.count += 1
                return fn(tensor, *args, **kwargs)

            return counted

        def inside(fn):
            def forward(*args, **kwargs):
                self._depth += 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._depth -= 1

            return forward

        try:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, wrap(fn))
            for model, fn in forwards.items():
                model.forward = inside(fn)
            yield self
        finally:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)
            for model in forwards:
                del model.forward  # back to the class's forward


def _shaped(drafter):
    """The drafter with ``tree_shape="previous-round"``: its trees' shapes come from earlier rounds, read with their
    syncs, so that nothing is read before the verification (``drafters.draft_tree.shaped_trees``)."""
    drafter.tree_shape = "previous-round"
    return drafter


def _counted(find, checks: list, *args, **kwargs):
    found = find(*args, **kwargs)
    if len(found):
        checks.append(1)
    return found


def _count_rounds(monkeypatch, counter: SyncCounter) -> list[int]:
    """Count ``counter``'s syncs inside the batched engine's rounds only; returns the list that gets each round's
    row count."""
    rounds: list[int] = []
    original = BatchedSpeculativeDecoder._round

    def counted_round(self, events):
        counter.active = True
        try:
            return original(self, events)
        finally:
            counter.active = False
            rounds.append(len(self._rows))

    monkeypatch.setattr(BatchedSpeculativeDecoder, "_round", counted_round)
    return rounds


def _prompt() -> torch.Tensor:
    """A prompt that repeats itself, so prompt lookup and the cascade find matches."""
    half = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    return torch.cat([half, half, half[:, :5]], dim=1)


@pytest.mark.parametrize("method", ["autoregressive", "autoregressive-overlapped", "draft", "prompt-lookup",
                                    "cascade", "draft-tree", "cascade-tree"])
def test_one_host_sync_per_round_on_the_fast_path(method, monkeypatch):
    target = make_tiny_model("llama", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    target_runner = ModelRunner(target, compile=True, graphs=False, name="target")
    drafter = {
        "autoregressive": lambda: None,
        "autoregressive-overlapped": lambda: None,
        "draft": lambda: DraftModelDrafter(draft),
        "prompt-lookup": lambda: PromptLookupDrafter(),
        "cascade": lambda: CascadeDrafter(draft),
        "draft-tree": lambda: _shaped(DraftModelDrafter(draft, tree_depth=3)),
        "cascade-tree": lambda: _shaped(CascadeDrafter(draft, tree_depth=3)),
    }[method]()
    checks = []  # rounds with n-gram candidates: the cascade's check reads how many it kept (one sync)
    find = cascade_module.find_continuation
    monkeypatch.setattr(cascade_module, "find_continuation", lambda *a, **k: _counted(find, checks, *a, **k))
    config = GenerationConfig(max_new_tokens=40, num_speculative_tokens=4, stop_on_eos=False)
    expected = SpeculativeDecoder(target, runner=target_runner).generate(_prompt(), config).token_ids

    trees = []
    if method.endswith("tree"):
        propose = drafter.propose
        drafter.propose = lambda *a, **k: (lambda d: trees.extend(t for t in d.trees or [] if t) or d)(propose(*a, **k))
    counter = SyncCounter([target, draft])
    overlap = method == "autoregressive-overlapped"
    staged = []
    if overlap:  # count the rounds that ran their successor ahead
        stage = HostReader.stage
        monkeypatch.setattr(HostReader, "stage", lambda self, values: (staged.append(1), stage(self, values)))
    stream = SpeculativeDecoder(target, drafter, runner=target_runner, overlap_rounds=overlap).stream(_prompt(), config)
    rounds = iter(stream)
    first = next(rounds)  # the prefill (and the drafter's) may sync: not a round
    checks.clear()
    with counter.counting():
        counter.active = True
        tokens = first + [t for block in rounds for t in block]
    assert tokens == expected
    num_rounds = stream.stats.num_target_forwards
    assert num_rounds > 3
    if method in ("prompt-lookup", "cascade"):
        assert stream.stats.num_drafted_tokens > 0, "the prompt should give n-gram matches"
    allowed = num_rounds + len(checks)
    assert counter.count <= allowed, f"{counter.count} host syncs in {num_rounds} rounds ({len(checks)} checks)"
    if not method.startswith("cascade"):
        assert not checks
    if method.endswith("tree"):  # trees of shapes chosen before their rounds, verified as trees
        assert stream.stats.num_drafted_tokens > stream.stats.num_target_forwards * 2 and trees, trees
    if overlap:
        assert len(staged) >= num_rounds - 2  # every round but the last ones ran its successor ahead


@pytest.mark.parametrize("case", ["sampling", "sampling+unseeded", "sampling+masked-exit",
                                  "sampling+previous-round-exit", "sampling+banned-words",
                                  "sampling+trees", "sampling+unseeded+trees", "sampling+lookup-trees",
                                  "sampling+shaped-trees", "sampling+unseeded+shaped-trees"])
def test_sampling_rounds_read_back_once(case, monkeypatch):
    """Batched rounds with three sampling rows (each its own settings and seed, or rows 0 and 2 without a seed,
    drawing together) and a greedy one: their speculative sampling is decided on the device and read with the
    round's one sync, token trees (a draft model's, with its drawn path; prompt lookup's branches, without q),
    blocks cut at an exit read with the sync (``exit_mode="masked"``: the cut made on the device) and rows with
    banned words (matched after the read, which rolls a drawn word back) included. A draft model's trees grown
    from the round's own values ("per-round" shapes) read once more, in the drafter."""
    target = make_tiny_model("llama", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    control = DraftControl(adaptive_exit=True, exit_mode="masked") if case.endswith("masked-exit") else \
        DraftControl(adaptive_exit=True, exit_mode="previous-round") if case.endswith("previous-round-exit") else None
    banned = ("w5", "w9", "w17", "w30 w31") if case.endswith("banned-words") else ()
    drafter = PromptLookupDrafter(branches=3) if case.endswith("lookup-trees") else \
        _shaped(DraftModelDrafter(draft, tree_depth=2)) if case.endswith("shaped-trees") else \
        DraftModelDrafter(draft, tree_depth=2) if case.endswith("trees") else DraftModelDrafter(draft)
    engine = BatchedSpeculativeDecoder(target, drafter, max_batch_size=4, num_speculative_tokens=4,
                                       draft_control=control, compile=True, graphs=False,
                                       tokenizer=make_tiny_tokenizer() if banned else None)
    settings = [dict(temperature=0.8, top_p=0.9), dict(temperature=1.0), dict(temperature=0.6, top_k=8), {}]
    configs = [GenerationConfig(max_new_tokens=24, stop_on_eos=False, banned_words=banned, **kw,
                                seed=None if "unseeded" in case and i in (0, 2) else i)
               for i, kw in enumerate(settings)]
    counter = SyncCounter([target, draft])
    rounds = _count_rounds(monkeypatch, counter)
    verified_trees, tree_rows = [], verification.tree_rejection_sample_rows
    monkeypatch.setattr(verification, "tree_rejection_sample_rows",
                        lambda *a, **k: verified_trees.append(1) or tree_rows(*a, **k))
    drawn_together, exponential = [], Sampler.exponential  # the rows of each noise draw
    monkeypatch.setattr(Sampler, "exponential", lambda self, out: drawn_together.append(
        1 if out.dim() == 1 else out.shape[0]) or exponential(self, out))
    prompts = [_prompt()[0].tolist()[: 10 + 3 * i] for i in range(4)]
    with counter.counting():
        results = engine.generate(prompts, configs)
    assert all(r.finish_reason == "length" and len(r.token_ids) == 24 for r in results)
    if banned:  # the sampling rows drew banned words, matched after the read and rolled back
        rollbacks = sum(r.stats.num_banned_word_rollbacks for r, c in zip(results, configs) if c.temperature)
        assert rollbacks > 0, "no sampling row drew a banned word"
    assert max(drawn_together) == (2 if "unseeded" in case else 1)  # the rows without a seed: one draw
    assert len(rounds) > 5 and max(rounds) == 4 and engine.stats.num_drafted_tokens > 0
    if case.endswith("trees"):  # the tree sampler ran: sampling rows' trees were verified as trees
        assert verified_trees, "no round verified a sampling row's tree"
    # two: a draft model's tree, grown on the host from its chain's values (one sync in the drafter,
    # ``draft_tree.grow_trees``), then verified and read with the round's one; one with shapes chosen before the
    # round (``draft_tree.shaped_trees``)
    per_round = 2 if case in ("sampling+trees", "sampling+unseeded+trees") else 1
    assert counter.count <= per_round * len(rounds), f"{counter.count} host syncs in {len(rounds)} rounds"


GATE = 0.1  # the tiny target's probability of its token lies on both sides of it: some rounds gated, some not


@pytest.mark.parametrize("case", ["heuristic", "cost-model", "adaptive+cost-model", "gate", "greedy-gate",
                                  "masked-exit+greedy-gate"])
def test_draft_length_controls_read_back_once_a_round(case, monkeypatch):
    """Batched rounds (B = 4, a draft model; two greedy rows and two sampling rows, or four greedy rows) under serve's
    and generate's draft length controls: the heuristic schedule and the cost model (alone, or over an adaptive exit
    read with the round's sync, ``exit_mode="masked"``) decide each row's next block from values the round's one read
    brings; the cost model's calibration, which times target forwards before the first round, is not a round's read.
    A confidence gate over greedy linear rows reads its values with the round's sync too (``batch_rows.
    greedy_gate_probs``: the acceptance counted on the device, one position's softmax), and its rounds are those of
    the gate read after the round (``observe_gates``), which sampling rows still take: two reads a round."""
    target = make_tiny_model("llama", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    control = {"heuristic": DraftControl(length_schedule="heuristic"),
               "cost-model": DraftControl(length_schedule="cost-model"),
               "adaptive+cost-model": DraftControl(adaptive_exit=True, length_schedule="cost-model",
                                                   exit_mode="masked"),  # "per-step" would read after each step
               "masked-exit+greedy-gate": DraftControl(adaptive_exit=True, exit_mode="masked", confidence_gate=GATE),
               }.get(case, DraftControl(confidence_gate=GATE))
    prompts = [_prompt()[0].tolist()[: 10 + 3 * i] for i in range(4)]
    greedy = case.endswith("greedy-gate")
    configs = [GenerationConfig(max_new_tokens=24, stop_on_eos=False, seed=i,
                                temperature=0.8 if i % 2 and not greedy else 0.0) for i in range(4)]

    observed, cuts, exit_blocks = [], [], batched_module.exit_blocks
    monkeypatch.setattr(ConfidenceGate, "observe", lambda self, p, observe=ConfidenceGate.observe: (
        observed.append(p), observe(self, p))[1])
    monkeypatch.setattr(batched_module, "exit_blocks", lambda points, exits, k, rule: (
        lambda cut: cuts.append(any(c < kb for c, kb in zip(cut.tolist(), k))) or cut)(
        exit_blocks(points, exits, k, rule)))  # whether a masked exit cut a block (a read outside the count)

    def run(count: bool):
        engine = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft), max_batch_size=4,
                                           num_speculative_tokens=4, draft_control=control, compile=True, graphs=False)
        if not count:
            return engine.generate(prompts, configs), engine, []
        counter = SyncCounter([target, draft])
        with monkeypatch.context() as patch:
            rounds, measure = _count_rounds(patch, counter), BatchedSpeculativeDecoder._measure_forwards

            def uncounted_measure(self, *args, **kwargs):  # the cost model's calibration: timed forwards, each read
                active, counter.active = counter.active, False
                try:
                    return measure(self, *args, **kwargs)
                finally:
                    counter.active = active

            patch.setattr(BatchedSpeculativeDecoder, "_measure_forwards", uncounted_measure)
            with counter.counting():
                results = engine.generate(prompts, configs)
                counter.count -= len(cuts)  # the test's own reads of the masked exits' cuts
        per_round = 2 if case == "gate" else 1
        assert counter.count <= per_round * len(rounds), f"{counter.count} host syncs in {len(rounds)} rounds"
        return results, engine, rounds

    results, engine, rounds = run(count=True)
    assert all(len(r.token_ids) == 24 for r in results)
    assert len(rounds) > 5 and engine.stats.num_drafted_tokens > 0
    if case.endswith("gate"):
        gated = sum(r.stats.num_gated_steps for r in results)
        assert gated > 0, "the gate should stop some rounds' drafting"
        assert engine.stats.num_gated_steps == gated  # the engine's stats: the sum of its rows' (was 0)
    if case.startswith("masked-exit"):
        assert any(cuts), "no masked exit cut a block"
    if greedy:  # the same probabilities, gate decisions and rounds as when read after the round
        on_device, observed[:] = list(observed), []
        monkeypatch.setattr(batched_module, "greedy_gate_probs", lambda *args: ([], None))
        after, _, _ = run(count=False)
        assert observed == on_device and len(observed) > len(rounds)  # every gated row's value, every round
        assert [(r.token_ids, r.stats.rounds_by_draft_cap, r.stats.num_gated_steps) for r in results] == \
            [(r.token_ids, r.stats.rounds_by_draft_cap, r.stats.num_gated_steps) for r in after]


def test_gate_values_are_taken_from_the_read_after_the_readback():
    """The round's read ends with the gate values, the drafter's readback and the draft's finiteness flag: once the
    readback is taken out, ``take_gate_probs`` takes the gate values (float32 bits, read exactly, negative ints
    included) from just before the flag and leaves the rest as it was."""
    import struct

    from specdecode.engine.batch_rows import take_gate_probs

    probs = [0.5, 0.1234567, -0.25]  # a negative float's bits are a negative int
    bits = list(struct.unpack("3i", struct.pack("3f", *probs)))
    host = [7, 8, 9, *bits, 1]  # (the readback already taken out), then the flag
    values = take_gate_probs([0, 2, 3], host)
    assert host == [7, 8, 9, 1]
    assert values[0] == 0.5 and values[2] == struct.unpack("f", struct.pack("f", 0.1234567))[0]
    assert values[3] == -0.25 and bits[2] < 0
    assert take_gate_probs([], host) == {} and host == [7, 8, 9, 1]
