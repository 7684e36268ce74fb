"""Draft-model trees whose shape comes from earlier rounds against trees grown from each round's own values.

``DraftModelDrafter.tree_shape``: "per-round" (the default on a CPU) builds each round's tree from that round's draft
probabilities, read back by a host sync in the drafter, before the target's tree forward can be launched;
"previous-round" chooses the shape from the row's earlier rounds (``drafters.draft_tree.shaped_trees``), so that
nothing is read before the verification. On a CPU that read costs no wait, so what this measures is the price of
the older shape: τ (tokens per target forward, bonus counted), acceptance (accepted ÷ drafted nodes) and decode
tok/s, with plain ``autoregressive`` decoding in the same process for the speedup, and greedy exact match against it.

Usage (run it alone, ``flock /tmp/specdecode-bench.lock``):

    OMP_NUM_THREADS=2 python docs/benchmarks/tree_shape_cpu.py [--prompts 10] [--max-new-tokens 64] \
        [--depth 3] [--nodes 6] [--temperature 0] [--seeds 1] [--dtype bfloat16]

The packaged Qwen2.5-Coder 1.5B target and 0.5B draft (the draft int4 where ``from_pretrained`` quantizes it by
default), the first ``--prompts`` HumanEval prompts and the first ``--prompts`` Spec-Bench prompts
(``SPECDECODE_SPEC_BENCH``). Each prompt runs per-round, previous-round, previous-round, per-round (ABBA, one
process, so drift cancels); with ``--seeds N`` > 1 (sampling: N realizations of each arm's draws, seeds 0 .. N - 1)
each seed runs the two arms once, in turns AB, BA, ...; ``autoregressive`` runs once per prompt, first (seed 0).
Prints one line per prompt and arm, then a table per dataset.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform

import torch

from specdecode import GenerationConfig
from specdecode.bench.datasets import load_prompts
from specdecode.pipeline import SpeculativeGenerator

ARMS = ("per-round", "previous-round")


def cpu_flags() -> str:
    """The CPU's vector flags that decide bf16 speed, from /proc/cpuinfo (Linux), else the platform's name."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return platform.processor()
    wanted = ("fma", "avx", "f16c", "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16")
    return " ".join(f for f in wanted if f in flags)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=10, help="prompts per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--depth", type=int, default=3, help="draft_tree_depth D: chain steps a round at most")
    parser.add_argument("--nodes", type=int, default=6, help="a tree's budget of nodes (γ)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled (seeds 0 ..)")
    parser.add_argument("--seeds", type=int, default=1, help="sampled: realizations per prompt and arm")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    gen = SpeculativeGenerator.from_pretrained("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct",
                                               dtype=args.dtype)
    plain = gen.decoder("autoregressive")
    trees = gen.decoder("draft", draft_tree_depth=args.depth)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, num_speculative_tokens=args.nodes,
                              temperature=args.temperature, seed=0 if args.temperature > 0 else None,
                              stop_on_eos=False)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU flags: {cpu_flags()}; target "
          f"{gen.target.model.dtype}; depth {args.depth}, {args.nodes} nodes, {args.max_new_tokens} tokens, "
          f"temperature {args.temperature}", flush=True)
    for dataset in ("humaneval", "spec-bench"):
        prompts = load_prompts(dataset, limit=args.prompts)
        totals = {arm: [0.0, 0, 0, 0, 0, 0] for arm in ("autoregressive", *ARMS)}  # s, tokens, forwards, acc, drafted,
        # same tokens as autoregressive
        for i, prompt in enumerate(prompts):
            ids = gen.encode(prompt.text, chat=prompt.chat)
            expected = plain.generate(ids, config)
            runs = [("autoregressive", expected)]
            for seed in range(args.seeds):
                order = (*ARMS, *reversed(ARMS)) if args.seeds == 1 else ARMS[:: 1 if seed % 2 == 0 else -1]
                seeded = dataclasses.replace(config, seed=seed if args.temperature > 0 else None)
                for arm in order:
                    trees.drafter.tree_shape = arm
                    runs.append((arm, trees.generate(ids, seeded)))
            for arm, result in runs:
                s, total = result.stats, totals[arm]
                total[0] += s.decode_time_s
                total[1] += s.num_tokens_from_forwards
                total[2] += s.num_target_forwards
                total[3] += s.num_accepted_tokens
                total[4] += s.num_drafted_tokens
                total[5] += result.token_ids == expected.token_ids
                print(f"{dataset} {i} {arm}: τ {s.num_tokens_from_forwards / max(1, s.num_target_forwards):.2f} "
                      f"accepted {s.num_accepted_tokens}/{s.num_drafted_tokens} tok/s {s.decode_tokens_per_s:.2f}",
                      flush=True)
        base = totals["autoregressive"][1] / totals["autoregressive"][0]
        per_arm = 2 if args.seeds == 1 else args.seeds
        print(f"\n{dataset}, {len(prompts)} prompts (the tree arms ran {per_arm} times each):\n"
              "| arm | decode tok/s | × autoregressive | τ | acceptance | same tokens as autoregressive |\n"
              "|---|---:|---:|---:|---:|---:|")
        for arm, (sec, tokens, forwards, accepted, drafted, same) in totals.items():
            runs = 1 if arm == "autoregressive" else per_arm
            print(f"| {arm} | {tokens / sec:.2f} | {tokens / sec / base:.2f} | {tokens / max(1, forwards):.2f} | "
                  f"{accepted / max(1, drafted):.1%} | {same}/{runs * len(prompts)} |", flush=True)
        print(flush=True)


if __name__ == "__main__":
    main()
