"""The batched engine's fast path (``engine.batch_runner``) gives exactly the eager tokens.

Two levels, as ``test_fast_path.py`` for the single-sequence path:

* ``graphs=False``: the static full-capacity forwards (rows and width buckets, padding rows in
  free slots, in-graph masks over every allocated position) run eagerly: every architecture
  and drafter, B = 1 and B > 1 with rows joining mid-flight and finishing at different lengths.
* ``graphs=True``: inductor on CPU compiles each bucket; two small cases bound the test time.

The reference is target-only decoding of each prompt alone (float32, greedy).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import make_tiny_model
from helpers import perturbed_copy
from selfspec_helpers import REPETITIVE, one_thread  # noqa: F401 (a fixture)
from specdecode import DraftControl, GenerationConfig, SpeculativeDecoder
from specdecode.drafters import (
    CascadeDrafter,
    DraftModelDrafter,
    EarlyExitDrafter,
    LayerSkipDrafter,
    PromptLookupDrafter,
)
from specdecode.drafters.layer_skip import SkipSet
from specdecode.engine.batch_runner import BatchRunner
from specdecode.engine.bucket_functions import check_row_buckets, row_buckets
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.errors import InvalidArgumentError

PROMPTS = [[5, 9, 12], REPETITIVE, [7, 3, 30, 41, 8, 11, 19], [44], [13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]
LENGTHS = [20, 9, 25, 14, 17]


def _configs() -> list[GenerationConfig]:
    return [GenerationConfig(max_new_tokens=m) for m in LENGTHS]


def _alone(target, prompts, configs) -> list[list[int]]:
    dec = SpeculativeDecoder(target, compile=False)
    return [dec.generate(p, c).token_ids for p, c in zip(prompts, configs)]


def _drafters(target, draft) -> dict:
    return {
        "autoregressive": lambda: None,
        "draft": lambda: DraftModelDrafter(draft),
        "prompt-lookup": lambda: PromptLookupDrafter(),
        "layer-skip": lambda: LayerSkipDrafter(target, SkipSet(attn=(1,), mlp=(2,))),
        "early-exit": lambda: EarlyExitDrafter(target, 2),
    }


def _continuous(dec: BatchedSpeculativeDecoder, prompts, configs) -> list[list[int]]:
    """Two requests first; the others join one per step while the batch runs (``add`` during ``step``)."""
    out: dict[int, list[int]] = {}
    ids = [dec.add(prompts[0], configs[0]), dec.add(prompts[1], configs[1])]
    pending = list(zip(prompts[2:], configs[2:]))
    while dec.has_work or pending:
        for event in dec.step():
            out.setdefault(event.request_id, []).extend(event.token_ids)
        if pending:
            ids.append(dec.add(*pending.pop(0)))
    return [out.get(i, []) for i in ids]


class _Recording(BatchRunner):
    """A ``BatchRunner`` that records each forward's (rows, width) before running it."""

    shapes: list

    def _forward(self, ids, starts, logits_to_keep, trees):  # every forward: __call__, forward_greedy, greedy_steps
        self.shapes.append(tuple(ids.shape))
        return super()._forward(ids, starts, logits_to_keep, trees)


def _recording(runner: BatchRunner) -> list:
    runner.__class__ = _Recording
    runner.shapes = []
    return runner.shapes


@pytest.mark.usefixtures("one_thread")
def test_static_path_greedy_equals_autoregressive(arch):
    """Every drafter on the static path (no torch.compile): B = 1, and B = 3 with rows joining
    mid-flight; every decode-time forward runs in a bucket, padded in rows and in width."""
    target = make_tiny_model(arch, num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    configs = _configs()
    expected = _alone(target, PROMPTS, configs)
    for name, make in _drafters(target, draft).items():
        for batch in (1, 3):
            dec = BatchedSpeculativeDecoder(target, make(), max_batch_size=batch, max_length=96,
                                            num_speculative_tokens=4, compile=True, graphs=False)
            shapes = _recording(dec.runner)
            got = _continuous(dec, PROMPTS, configs)
            assert got == expected, (arch, name, batch)
            assert dec.runner.num_eager_forwards == 0, (name, batch)  # only prefills ran eagerly
            if name != "autoregressive":
                assert 0 < dec.stats.num_accepted_tokens < dec.stats.num_drafted_tokens, (name, batch)
            if batch == 3:
                assert dec.stats.max_rows == 3
                assert {n for n, _ in shapes} >= {1, 3}  # 1 row ran in bucket 1; 3 rows in bucket 4 -> padded
                assert dec.cache.fast.rows == (1, 2, 3)


WIDE_FEEDS = {  # drafters whose rounds feed the draft model more than 2 tokens at once
    "cascade": lambda draft: (CascadeDrafter(draft), None),
    "cascade+adaptive": lambda draft: (CascadeDrafter(draft), DraftControl(adaptive_exit=True)),
    "cascade-unchecked": lambda draft: (CascadeDrafter(draft, ngram_check=False), None),
    "cascade-tree": lambda draft: (CascadeDrafter(draft, tree_depth=3), None),
    "draft-tree-expand": lambda draft: (DraftModelDrafter(draft, tree_depth=3, tree_expand=2), None),
}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", list(WIDE_FEEDS))
def test_wide_draft_forwards_run_in_a_bucket(name):
    """The cascade's check (each row's uncached tokens, then its n-gram candidates) and EAGLE-2's tree
    expansion feed the draft model more than 2 tokens: its runner gets the cache's widest bucket, and a
    check that would not fit keeps only the n-gram tokens that do (``CascadeDrafter._fit``), so no
    decode-time forward of either model runs eagerly (on CUDA an eager forward costs many graph
    replays). Tokens equal target-only decoding; B = 1, and B = 3 with rows joining."""
    target = make_tiny_model("llama", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    configs = _configs()
    expected = _alone(target, PROMPTS, configs)
    for batch in (1, 3):
        drafter, control = WIDE_FEEDS[name](draft)
        dec = BatchedSpeculativeDecoder(target, drafter, max_batch_size=batch, max_length=96, num_speculative_tokens=4,
                                        draft_control=control, compile=True, graphs=False)
        assert _continuous(dec, PROMPTS, configs) == expected, (name, batch)
        assert dec.runner.num_eager_forwards == 0 and drafter.runner.num_eager_forwards == 0, (name, batch)
        widest = dec.cache.fast.max_width
        assert drafter.runner.widths == (1, 2, widest)
        assert any(w == widest and b.calls for (_, w, _), b in drafter.runner._buckets.items()), (name, batch)
        assert 0 < dec.stats.num_accepted_tokens < dec.stats.num_drafted_tokens, (name, batch)
    # A long repetitive generation: rounds drafted by n-grams alone leave the draft model behind, and the
    # row catches up by a chunked prefill, not by a first forward wider than every bucket.
    config = GenerationConfig(max_new_tokens=70)
    expected = _alone(target, [REPETITIVE], [config])
    drafter, control = WIDE_FEEDS[name](draft)
    dec = BatchedSpeculativeDecoder(target, drafter, max_batch_size=1, max_length=128, num_speculative_tokens=4,
                                    draft_control=control, compile=True, graphs=False)
    assert [r.token_ids for r in dec.generate([REPETITIVE], [config])] == expected
    assert dec.runner.num_eager_forwards == 0 and drafter.runner.num_eager_forwards == 0, name


def test_drafters_sharing_a_runner_add_their_widths():
    """A draft model's drafters on one target cache share its draft cache and runner; the cascade adds the
    widest bucket to a runner a plain draft made (``BatchRunner.add_widths``), and bad widths are refused."""
    target = make_tiny_model("llama", num_layers=2)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    dec = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft), max_batch_size=2, max_length=64,
                                    num_speculative_tokens=4, compile=True, graphs=False)
    plain = dec.drafter
    assert plain.runner.widths == (1, 2)
    cascade = CascadeDrafter(draft)
    cascade.bind(dec.cache)
    assert cascade.runner is plain.runner and plain.runner.widths == (1, 2, 5)
    with pytest.raises(InvalidArgumentError, match=r"draft model: width buckets must be integers in 1..5, got \[6\]"):
        plain.runner.add_widths([6])


@pytest.mark.usefixtures("one_thread")
def test_padding_rows_and_widths_are_exercised_and_harmless():
    """Rows buckets (2, 4) with 3 rows: a padding row runs in the free slot each round, and
    verifications narrower than the widest bucket are padded on the right; tokens stay exact."""
    target = make_tiny_model("mistral", num_layers=3)  # sliding window of 6
    draft = perturbed_copy(target, noise=0.3, seed=1)
    configs = _configs()
    expected = _alone(target, PROMPTS, configs)
    dec = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft), max_batch_size=4, max_length=96,
                                    num_speculative_tokens=4, compile=True, graphs=False, row_buckets=(2,))
    shapes = _recording(dec.runner)
    draft_shapes = _recording(dec.drafter.runner)
    got = _continuous(dec, PROMPTS[:3], configs[:3])
    assert got == expected[:3]
    assert dec.cache.fast.rows == (2, 4)
    assert any(n == 3 for n, _ in shapes), shapes  # 3 rows in the 4-row bucket
    assert any(n == 1 for n, _ in shapes), shapes  # 1 row in the 2-row bucket
    assert any(1 < w < dec.max_block + 1 for _, w in shapes), shapes  # a short block, padded to 5 tokens
    assert {w for _, w in draft_shapes} == {1, 2}
    assert dec.runner.num_eager_forwards == 0 and dec.drafter.runner.num_eager_forwards == 0


@pytest.mark.usefixtures("one_thread")
def test_warm_up_runs_every_bucket_and_leaves_decoding_exact():
    target = make_tiny_model("gemma3", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    configs = _configs()
    expected = _alone(target, PROMPTS, configs)
    for make in (lambda: DraftModelDrafter(draft), lambda: LayerSkipDrafter(target, SkipSet(attn=(1,)))):
        dec = BatchedSpeculativeDecoder(target, make(), max_batch_size=3, max_length=96, num_speculative_tokens=3,
                                        compile=True, graphs=False)
        dec.warm_up()
        for runner, widths in ((dec.runner, (1, 4)), (dec.drafter.runner, dec.drafter.runner.widths)):
            assert set(runner._buckets) == {(r, w, False) for r in (1, 2, 3) for w in widths}  # (rows, width, tree)
            assert all(b.calls >= 1 for b in runner._buckets.values())
        assert dec.drafter.runner.widths == ((1, 2) if isinstance(dec.drafter, DraftModelDrafter) else (1,))
        assert [r.token_ids for r in dec.generate(PROMPTS, configs)] == expected


def test_compile_option_and_row_buckets_are_checked():
    target = make_tiny_model("llama", num_layers=2)
    assert BatchedSpeculativeDecoder(target, max_batch_size=2).compile is False  # the CPU default (measured)
    assert BatchedSpeculativeDecoder(target, max_batch_size=2).cache.fast is None
    assert BatchedSpeculativeDecoder(target, max_batch_size=2, compile=True, graphs=False).cache.num_positions == 2048 + 2
    with pytest.raises(InvalidArgumentError, match=r"compile must be True, False or None .* got 'yes'"):
        BatchedSpeculativeDecoder(target, compile="yes")
    with pytest.raises(InvalidArgumentError, match=r"row_buckets must be integers in 1..4 \(max_batch_size\), got \(0,\)"):
        BatchedSpeculativeDecoder(target, max_batch_size=4, compile=True, row_buckets=(0,))
    with pytest.raises(InvalidArgumentError, match="dynamic_shapes must be True or False, .*got 'yes' with compile=True"):
        BatchedSpeculativeDecoder(target, max_batch_size=4, compile=True, dynamic_shapes="yes")
    with pytest.raises(InvalidArgumentError, match="got True with compile=False, graphs=True"):  # the CPU default
        BatchedSpeculativeDecoder(target, max_batch_size=4, dynamic_shapes=True)
    assert row_buckets(1) == (1,) and row_buckets(8) == (1, 2, 4, 8) and row_buckets(12) == (1, 2, 4, 8, 12)
    assert check_row_buckets((4, 1), 6) == (1, 4, 6)


def test_batch_decoder_and_bench_pass_compile_through():
    """``SpeculativeGenerator.batch_decoder(compile=...)`` and bench's ``--compile`` reach the engine."""
    from conftest import make_tiny_tokenizer
    from specdecode.bench.batched import BatchMethod, _runner
    from specdecode.bench.settings import BenchSettings
    from specdecode.models import LoadedModel
    from specdecode.pipeline import SpeculativeGenerator

    target = make_tiny_model("llama", num_layers=2)
    tok = make_tiny_tokenizer()
    gen = SpeculativeGenerator(LoadedModel(target, tok, "tiny"), LoadedModel(perturbed_copy(target, 0.3), tok, "d"))
    assert gen.batch_decoder("draft", max_batch_size=2, compile=True).compile is True
    assert gen.batch_decoder("draft", max_batch_size=2, compile=True).drafter.cache.fast is not None
    assert gen.batch_decoder("prompt-lookup", max_batch_size=2).compile is False  # the CPU default
    assert gen.batch_decoder("draft", max_batch_size=4, compile=True).cache.fast.rows == (1, 2, 4)
    one_bucket = gen.batch_decoder("draft", max_batch_size=4, compile=True, row_buckets=(4,))
    assert one_bucket.cache.fast.rows == (4,) and one_bucket.drafter.cache.fast.rows == (4,)
    for name, flag, want in (("autoregressive", True, True), ("autoregressive:compile=0", True, False),
                             ("prompt-lookup", None, False), ("draft:compile=1", False, True)):
        run = _runner(gen, BatchMethod.parse(name), BenchSettings(compile=flag), 2, 64)
        assert run.args[0].compile is want, name


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("one_thread")
def test_compiled_prompt_lookup_equals_autoregressive(fresh_dynamo):
    """Inductor-compiled buckets (one rows bucket, widths 1 and γ + 1: two graphs) with rows
    joining mid-flight; a second batch of other prompt lengths compiles nothing more."""
    target = make_tiny_model("qwen2", num_layers=2)
    configs = _configs()
    expected = _alone(target, PROMPTS, configs)
    dec = BatchedSpeculativeDecoder(target, PromptLookupDrafter(), max_batch_size=3, max_length=96,
                                    num_speculative_tokens=3, compile=True, row_buckets=(3,))
    graphs = counters["stats"]["unique_graphs"]
    assert _continuous(dec, PROMPTS, configs) == expected
    assert counters["stats"]["unique_graphs"] - graphs == 2
    assert dec.compile_time_s > 0 and dec.stats.warmup_s == pytest.approx(dec.compile_time_s)
    assert dec.runner.num_eager_forwards == 0
    graphs = counters["stats"]["unique_graphs"]
    again = [p + [3, 4] for p in reversed(PROMPTS)]
    assert [r.token_ids for r in dec.generate(again, configs)] == _alone(target, again, configs)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.usefixtures("one_thread")
def test_dynamic_shapes_compile_one_function_per_width(fresh_dynamo):
    """``dynamic_shapes``: the rows buckets above 1 (here 2 and 4) share one compiled forward per width class, so
    warm-up compiles 2 graphs (widths 1 and γ + 1) where a graph per bucket makes 4; decoding then gives
    the eager tokens with 1 to 4 rows (rows joining and leaving, a lone row in the 2-row bucket) and
    compiles nothing more. Gemma 3: the sliding-window and global masks, both over a symbolic rows count."""
    target = make_tiny_model("gemma3", num_layers=2)
    configs = _configs()
    expected = _alone(target, PROMPTS, configs)
    dec = BatchedSpeculativeDecoder(target, PromptLookupDrafter(), max_batch_size=4, max_length=96,
                                    num_speculative_tokens=3, compile=True, row_buckets=(2,), dynamic_shapes=True)
    assert dec.cache.fast.rows == (2, 4) and dec.runner.widths == (1, 4)
    graphs = counters["stats"]["unique_graphs"]
    dec.warm_up()
    assert counters["stats"]["unique_graphs"] - graphs == 2
    assert _continuous(dec, PROMPTS, configs) == expected
    assert counters["stats"]["unique_graphs"] - graphs == 2
    assert dec.runner.num_eager_forwards == 0


@pytest.mark.usefixtures("one_thread")
def test_dynamic_shapes_with_token_trees_and_ranges_of_one_size(fresh_dynamo):
    """``dynamic_shapes`` with a draft model growing EAGLE-2 token trees: the tree forwards' depth and ancestor
    buffers take symbolic rows and widths too, and rows joining and leaving give the eager tokens. An engine of 2
    slots has a rows range of one size (2 .. 2), which dynamo would refuse as a symbol: it stays static."""
    target = make_tiny_model("llama", num_layers=2)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    configs = _configs()
    expected = _alone(target, PROMPTS, configs)
    drafter = DraftModelDrafter(draft, tree_depth=3, tree_expand=2)
    dec = BatchedSpeculativeDecoder(target, drafter, max_batch_size=4, max_length=96, num_speculative_tokens=4,
                                    compile=True, row_buckets=(2,), dynamic_shapes=True)
    assert _continuous(dec, PROMPTS, configs) == expected
    assert ("N", "N", True) in dec.runner._forwards  # the target's tree verification, rows and width symbolic
    assert {key[0] for key in [*dec.runner._forwards, *drafter.runner._forwards]} == {"N"}
    assert 0 < dec.stats.num_accepted_tokens < dec.stats.num_drafted_tokens
    two = BatchedSpeculativeDecoder(target, PromptLookupDrafter(), max_batch_size=2, max_length=96,
                                    num_speculative_tokens=3, compile=True, dynamic_shapes=True)
    assert [r.token_ids for r in two.generate(PROMPTS[:2], configs[:2])] == expected[:2]
    assert {key[0] for key in two.runner._forwards} <= {1, 2} and (2, "N", False) in two.runner._forwards


_SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture
def sync_counter(monkeypatch):
    """Records every tensor-to-host read (``_SYNC_METHODS``) as (method, caller's file, caller's function)."""
    import sys

    calls: list[tuple[str, str, str]] = []
    for name in _SYNC_METHODS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            frame = sys._getframe(1)
            calls.append((_name, frame.f_code.co_filename, frame.f_code.co_name))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


def round_syncs(dec: BatchedSpeculativeDecoder, sync_counter: list) -> list[list]:
    """Steps ``dec`` until its requests are done; per round, the host reads it made (``sync_counter``'s records)."""
    round_calls: list[list] = []
    original = dec._round

    def counted_round(events):
        before = len(sync_counter)
        original(events)
        round_calls.append(sync_counter[before:])

    dec._round = counted_round
    while dec.has_work:
        dec.step()
    return round_calls


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("sampling", [False, True])
@pytest.mark.parametrize("name", ["autoregressive", "draft", "prompt-lookup"])
def test_one_host_sync_per_batched_round(name, sampling, sync_counter):
    """Rounds on the fast path read the device back once: the round's one ``tolist`` of drafts,
    argmaxes, finiteness flags and, with sampling rows (here rows 0 and 2, each its own temperature
    and seed), their speculative sampling's verdicts, decided on the device (``sample_rows``), and
    their draft steps' draws. Prompt lookup drafts on the host with numpy, over the rows' token
    lists, so it adds no tensor read at all."""
    target = make_tiny_model("qwen2", num_layers=2)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    dec = BatchedSpeculativeDecoder(target, _drafters(target, draft)[name](), max_batch_size=3, max_length=96,
                                    num_speculative_tokens=4, compile=True, graphs=False)
    configs = _configs()
    if sampling:
        configs[0] = GenerationConfig(max_new_tokens=LENGTHS[0], temperature=0.8, top_p=0.9, seed=1)
        configs[2] = GenerationConfig(max_new_tokens=LENGTHS[2], temperature=1.3, top_k=8, seed=2)
    for prompt, config in zip(PROMPTS[:3], configs):
        dec.add(prompt, config)
    round_calls = round_syncs(dec, sync_counter)
    assert len(round_calls) == dec.stats.num_rounds > 5
    for calls in round_calls:
        assert [(m, f) for m, _, f in calls] == [("tolist", "_round")], calls
    if name == "prompt-lookup":
        assert dec.stats.num_drafted_tokens > 0  # host drafting ran in these rounds
