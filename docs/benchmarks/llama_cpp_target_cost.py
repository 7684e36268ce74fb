"""A llama.cpp target's forward costs at warm-up, and the draft lengths the cost model picks from them.

Usage: OMP_NUM_THREADS=2 python docs/benchmarks/llama_cpp_target_cost.py qwen2.5-coder-1.5b-instruct [CONTEXTS] [DRAFT_STEP_MS]
CONTEXTS: comma-separated context lengths (default 200); DRAFT_STEP_MS: the drafter's cost per token
(default 0: prompt lookup). Each context: LlamaCppTargetRunner.measure_forward_costs (2 threads,
widths 1, 2, 3, 4, 5, 6, 8; median of 7 after one warm-up forward, each rolled back; every
position's logits copied out, as a verification does) on random token ids, then the cost
model (specdecode.engine.speculation_cost, one α at every depth: the linear model of
specdecode.engine.cost_model when the 2026-11-25 record was made, which chooses the same) on those
costs: the break-even acceptance rate of each draft length against a plain step, and the best
length at α = 0.3 .. 1.0.
Needs llama-cpp-python (pip install 'specdecode[llamacpp]').
"""
import sys

import torch

from specdecode.engine.cost_model import ForwardCosts
from specdecode.engine.speculation_cost import SpeculationCostPolicy
from specdecode.models.llama_cpp import LlamaCppModel, gguf_path
from specdecode.models.llama_cpp_target import LlamaCppTargetRunner

WIDTHS = (1, 2, 3, 4, 5, 6, 8)

if __name__ == "__main__":
    torch.set_num_threads(2)
    spec = sys.argv[1]
    contexts = [int(c) for c in sys.argv[2].split(",")] if len(sys.argv) > 2 else [200]
    draft_step_s = float(sys.argv[3]) / 1e3 if len(sys.argv) > 3 else 0.0
    model = LlamaCppModel(gguf_path(spec), name=spec, role="target model")
    runner = LlamaCppTargetRunner(model)
    print(f"{spec}: llama.cpp target, {model.n_threads} threads, draft step {draft_step_s * 1e3:.1f} ms")
    for n in contexts:
        ids = torch.randint(100, 5000, (n,), generator=torch.Generator().manual_seed(0)).tolist()
        costs = runner.measure_forward_costs(ids, widths=WIDTHS, repeats=7, warmup=1)
        print(f"context {n}: ms by width " + ", ".join(f"{w}: {s * 1e3:.1f}" for w, s in costs.items()), flush=True)
        forward = ForwardCosts(dict(costs))
        cost_model = SpeculationCostPolicy(forward, draft_node_s=draft_step_s, max_size=7)
        even = {k: cost_model.break_even(k) for k in range(1, 8)}

        def best_length(alpha: float) -> int:
            """The first round's k at α (the prior, nothing learned yet; no probe in the first round)."""
            return SpeculationCostPolicy(forward, draft_node_s=draft_step_s, prior=alpha, max_size=7).controller(
                7).round_cap()

        print("  break-even α (k: α at which drafting k ties a plain step): "
              + ", ".join(f"{k}: {'never' if a is None else f'{a:.2f}'}" for k, a in even.items()))
        print("  best k by α: " + ", ".join(f"{a:.2f}: {best_length(a)}"
                                            for a in (0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)), flush=True)
    model.close()
