"""Replay prompt lookup over recorded greedy outputs: acceptance by n-gram size matched, and what the cost model
would make of it with one α_d for every match or one per n-gram size.

Usage: python docs/benchmarks/prompt_lookup_replay.py RECORDS.jsonl DATASET [LIMIT_KIND=N] [COSTS_MS]
  RECORDS.jsonl: a bench record file with a `llama-cpp` method (its token ids are the text replayed);
  DATASET: humaneval or spec-bench, with `limit=10` or `limit_per_category=2` as the bench ran it;
  COSTS_MS: the target's forward costs by width, "1:69.3,2:104.5,3:123.8,4:111.5,5:142.9,6:164.8,7:180,8:196.7"
  (the default: the 2-core Xeon's llama.cpp Q4_K_M 1.5B, docs/benchmarks/2026-11-27-xeon-amx.md).
Each round: the continuation of the most recent earlier match of the last n-gram (n = 3 .. 1,
``drafters.prompt_lookup.match_continuation``), up to γ = 5 tokens; the size kept is the argmax of expected
tokens per second under ``engine.cost_model.DepthAcceptance`` estimates (prior 0.56), a one-token probe after
16 plain steps of a class; the accepted tokens are those equal to the recorded text. Prints the speedup over
plain steps at the same costs (no host time, no k-token rounding differences: an estimate, not a measurement).
The prompts are encoded as the bench does (the target's tokenizer, loaded from the offline GGUF model).
"""
import collections
import json
import sys

import numpy as np

from specdecode.bench.datasets import load_prompts
from specdecode.drafters.prompt_lookup import match_continuation
from specdecode.engine.cost_model import DepthAcceptance
from specdecode.pipeline.generator import SpeculativeGenerator

XEON = "1:69.3,2:104.5,3:123.8,4:111.5,5:142.9,6:164.8,7:180,8:196.7"


def replay(prompts, outputs, cost, by_match, gamma=5, prior=0.56, probe_every=16):
    estimates, plain, tokens, ms = {}, collections.Counter(), 0, 0.0
    by_n = collections.defaultdict(lambda: [0, 0])  # n -> [blocks of gamma, accepted]
    for pid, out in outputs.items():
        seq, i = list(prompts[pid]), 0
        while i < len(out):
            cont, n = match_continuation(np.asarray(seq, dtype=np.int64), gamma, 3, 1)
            cont = cont.tolist()
            full = 0
            while full < len(cont) and i + full < len(out) and cont[full] == out[i + full]:
                full += 1
            if n:
                by_n[n][0] += 1
                by_n[n][1] += full
            key = n if by_match else 0
            depths = estimates.setdefault(key, DepthAcceptance(prior, 2.0, 0.9))
            most = min(len(cont), len(out) - i - 1)
            k = max(range(most + 1), key=lambda k: ((1 + depths.expected_accepted(k)) / cost[k + 1], -k)) if most else 0
            if most and k == 0:
                plain[key] += 1
                k = 1 if plain[key] >= probe_every else 0
            if k:
                plain[key] = 0
                depths.update(k, min(full, k))
            accepted = min(full, k)
            tokens, ms = tokens + accepted + 1, ms + cost[k + 1]
            seq.extend(out[i : i + accepted + 1])
            i += accepted + 1
    return tokens / ms * cost[1], by_n


if __name__ == "__main__":
    records, dataset = sys.argv[1], sys.argv[2]
    limit = dict([sys.argv[3].split("=")]) if len(sys.argv) > 3 else {"limit": "10"}
    cost = {int(w): float(s) for w, s in (p.split(":") for p in (sys.argv[4] if len(sys.argv) > 4 else XEON).split(","))}
    rows = [json.loads(line) for line in open(records)]
    outputs = {r["prompt_id"]: r["token_ids"] for r in rows if r["method"] == "llama-cpp"}
    generator = SpeculativeGenerator.from_pretrained("qwen2.5-coder-1.5b-instruct", None, backend="llama-cpp")
    prompts = {p.id: generator.encode(p.text, p.chat)[0].tolist()
               for p in load_prompts(dataset, **{k: int(v) for k, v in limit.items()}) if p.id in outputs}
    one, by_n = replay(prompts, outputs, cost, by_match=False)
    per_n, _ = replay(prompts, outputs, cost, by_match=True)
    for n, (blocks, accepted) in sorted(by_n.items()):
        print(f"matches of {n} token(s): {blocks} rounds, {accepted / blocks:.2f} of 5 tokens accepted on average")
    print(f"one α_d for every match: {one:.3f}x plain steps; one per n-gram size: {per_n:.3f}x")
