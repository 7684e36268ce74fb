"""Host syncs per round of draft-model trees, per tree shape, counted as ``tests/engine/test_host_syncs.py`` counts
them (every ``item``, ``tolist``, ``cpu``, ``numpy`` and Python scalar conversion of a tensor in a round, the models'
forwards excepted). Tiny Llama target and perturbed draft, fast-path logic without compilation (``graphs=False``).

Usage, from the project root: ``python docs/benchmarks/data/2026-11-29-tree-shape/syncs.py``
"""

import sys

sys.path.insert(0, "tests")
sys.path.insert(0, "tests/engine")

from conftest import make_tiny_model  # noqa: E402
from helpers import perturbed_copy  # noqa: E402
from test_host_syncs import SyncCounter, _prompt  # noqa: E402

from specdecode import GenerationConfig, SpeculativeDecoder  # noqa: E402
from specdecode.drafters import CascadeDrafter, DraftModelDrafter  # noqa: E402
from specdecode.engine.batched import BatchedSpeculativeDecoder  # noqa: E402
from specdecode.engine.fast_path import ModelRunner  # noqa: E402


def greedy(kind: str, shape: str) -> str:
    """B = 1, greedy, 40 tokens, γ = 4 nodes, depth 3 (``test_one_host_sync_per_round_on_the_fast_path``)."""
    target = make_tiny_model("llama", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    drafter = (DraftModelDrafter if kind == "draft" else CascadeDrafter)(draft, tree_depth=3, tree_shape=shape)
    runner = ModelRunner(target, compile=True, graphs=False, name="target")
    config = GenerationConfig(max_new_tokens=40, num_speculative_tokens=4, stop_on_eos=False)
    stream = SpeculativeDecoder(target, drafter, runner=runner).stream(_prompt(), config)
    rounds = iter(stream)
    next(rounds)  # the prefill: not a round
    counter = SyncCounter([target, draft])
    with counter.counting():
        counter.active = True
        for _ in rounds:
            pass
    return f"{counter.count} / {stream.stats.num_target_forwards}"


def sampling(shape: str) -> str:
    """B = 4: three seeded sampling rows and a greedy one, depth 2, γ = 4 (``test_sampling_rounds_read_back_...``)."""
    target = make_tiny_model("llama", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    engine = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft, tree_depth=2, tree_shape=shape),
                                       max_batch_size=4, num_speculative_tokens=4, compile=True, graphs=False)
    settings = [dict(temperature=0.8, top_p=0.9), dict(temperature=1.0), dict(temperature=0.6, top_k=8), {}]
    configs = [GenerationConfig(max_new_tokens=24, stop_on_eos=False, seed=i, **kw) for i, kw in enumerate(settings)]
    counter, rounds, original = SyncCounter([target, draft]), [], BatchedSpeculativeDecoder._round

    def counted(self, events):
        counter.active = True
        try:
            return original(self, events)
        finally:
            counter.active = False
            rounds.append(1)

    BatchedSpeculativeDecoder._round = counted
    try:
        with counter.counting():
            engine.generate([_prompt()[0].tolist()[: 10 + 3 * i] for i in range(4)], configs)
    finally:
        BatchedSpeculativeDecoder._round = original
    return f"{counter.count} / {len(rounds)}"


if __name__ == "__main__":
    print("| case | per-round: syncs / rounds | previous-round: syncs / rounds |\n|---|---:|---:|")
    print(f"| draft, greedy, B = 1 | {greedy('draft', 'per-round')} | {greedy('draft', 'previous-round')} |")
    print(f"| cascade, greedy, B = 1 (its n-gram check adds a sync where it checks) | {greedy('cascade', 'per-round')} "
          f"| {greedy('cascade', 'previous-round')} |")
    print(f"| draft, B = 4, three sampling rows | {sampling('per-round')} | {sampling('previous-round')} |")
