"""Replay prompt lookup's sources (the sequence, a datastore) over recorded greedy outputs, with the
engine's own drafter (``PromptLookupDrafter``) and cost model (``SpeculationCostPolicy``'s controller and ``trim``).

Usage: python docs/benchmarks/prompt_lookup_sources_replay.py RECORDS.jsonl DATASET [LIMIT_KIND=N] [METHOD]
  RECORDS.jsonl: a bench record file (its METHOD's token ids are the text replayed; default `llama-cpp`);
  DATASET: humaneval or spec-bench, with `limit=10` or `limit_per_category=2` as the bench ran it.
Each prompt runs as the engine runs it: the controller's cap, the drafter's block and source, ``trim`` by the
source's and n-gram size's own acceptance, the tokens equal to the recorded text accepted. Time is the target's
forward cost at each width (the 2-core Xeon's llama.cpp Q4_K_M 1.5B, ``COSTS_MS``; no host time, no k-token
rounding differences), so the printed rate over plain steps is an estimate, not a measurement. Variants: the
sequence alone (the default before the datastore) and + a python-stdlib datastore. (A history of earlier outputs,
measured with this script before it was removed, added 1.206x -> 1.225x here and nothing in the bench.)
On the sequence-alone variant over the `prompt-lookup` method's own outputs it reproduces that run's rounds,
drafted and accepted tokens (1,025 rounds, 371 drafted, 245 accepted against 1,025, 367, 245 measured,
docs/benchmarks/data/2026-11-27-llama-cpp-by-match/new-he10).
"""
import json
import sys

import torch

from specdecode.bench.datasets import load_prompts
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.engine.cost_model import ForwardCosts
from specdecode.engine.speculation_cost import SpeculationCostPolicy
from specdecode.pipeline.generator import SpeculativeGenerator

COSTS_MS = {1: 67.3, 2: 104.2, 3: 127.6, 4: 117.7, 6: 174.8, 8: 214.3}


class _Cache:
    device = "cpu"


def replay(prompts: dict, outputs: dict, drafter: PromptLookupDrafter, gamma: int = 5) -> tuple[float, dict]:
    costs = ForwardCosts({w: ms / 1e3 for w, ms in COSTS_MS.items()})
    policy = SpeculationCostPolicy(costs, draft_node_s=0.0, max_size=7)
    policy.prime(drafter)
    drafter.bind(_Cache())
    seconds = plain = 0.0
    counts = {"rounds": 0, "drafted": 0, "accepted": 0}
    by_source: dict = {}
    for pid, out in outputs.items():
        controller = policy.controller(gamma)
        drafter.join(0, torch.tensor([prompts[pid]]), None)
        seq, i = list(prompts[pid]) + [out[0]], 1  # the first token comes from the prefill
        while i < len(out):
            cap = max(0, min(controller.round_cap(), gamma, len(out) - i - 1))
            k, source, block = 0, None, []
            if cap:
                draft = drafter.propose([seq], [cap])
                k, n, source = draft.num_tokens[0], draft.ngram_sizes[0], draft.match_sources[0]
                block = draft.tokens[0, :k].tolist()
                if k:
                    k = controller.trim(k, n, source)
            accepted = 0
            while accepted < k and block[accepted] == out[i + accepted]:
                accepted += 1
            if k:
                controller.record(cap, k, accepted)
                stats = by_source.setdefault(source, [0, 0, 0])
                stats[0], stats[1], stats[2] = stats[0] + 1, stats[1] + k, stats[2] + accepted
            round_s = costs.at(k + 1)
            controller.record_round(cap, k, round_s, draft_seconds=0.0)
            counts["rounds"] += 1
            counts["drafted"] += k
            counts["accepted"] += accepted
            seconds += round_s
            seq.extend(out[i:i + accepted + 1])
            i += accepted + 1
        plain += (len(out) - 1) * costs.at(1)
    return plain / seconds, {**counts, "by_source": by_source}


if __name__ == "__main__":
    records, dataset = sys.argv[1], sys.argv[2]
    limit = dict([sys.argv[3].split("=")]) if len(sys.argv) > 3 else {"limit": "10"}
    method = sys.argv[4] if len(sys.argv) > 4 else "llama-cpp"
    rows = [json.loads(line) for line in open(records)]
    outputs = {r["prompt_id"]: r["token_ids"] for r in rows if r["method"] == method}
    generator = SpeculativeGenerator.from_pretrained("qwen2.5-coder-1.5b-instruct", None, backend="llama-cpp")
    prompts = {p.id: generator.encode(p.text, p.chat)[0].tolist()
               for p in load_prompts(dataset, **{k: int(v) for k, v in limit.items()}) if p.id in outputs}
    outputs = {pid: outputs[pid] for pid in prompts}
    store = generator.datastore("python-stdlib")
    for name, drafter in (("sequence", PromptLookupDrafter()), ("+ datastore", PromptLookupDrafter(datastore=store))):
        rate, counts = replay(prompts, outputs, drafter)
        print(f"{name}: {rate:.3f}x plain steps; {counts}")
