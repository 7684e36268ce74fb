"""Milliseconds per llama.cpp forward by number of tokens fed (the protocol of forward_cost.py).

Usage: OMP_NUM_THREADS=2 python docs/benchmarks/llama_cpp_forward_cost.py qwen2.5-coder-1.5b-instruct,qwen2.5-coder-0.5b-instruct
Each spec is an offline model or a .gguf path, run by specdecode.models.llama_cpp (2 threads, as torch's)
through ``LlamaCppTargetRunner.measure_forward_costs`` (the runner of a llama.cpp target or draft).
Prints one line per model: per width, the median of 7 forwards (after 2 untimed ones) over a 200-token
context, every row's logits kept (as a verification), each rolled back after it. The fed tokens repeat
the context's last one (the forward's cost does not depend on the ids).
Needs llama-cpp-python (pip install 'specdecode[llamacpp]').
"""
import sys

import torch
from forward_cost import WIDTHS  # this folder's script: run from the repository root as shown

from specdecode.models.llama_cpp import LlamaCppModel, gguf_path
from specdecode.models.llama_cpp_target import LlamaCppTargetRunner


def forward_ms(runner: LlamaCppTargetRunner) -> dict[int, float]:
    ctx = torch.randint(100, 5000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    costs = runner.measure_forward_costs(ctx, widths=WIDTHS, repeats=7, warmup=2)
    return {w: round(seconds * 1e3, 1) for w, seconds in costs.items()}


if __name__ == "__main__":
    torch.set_num_threads(2)
    for spec in sys.argv[1].split(","):
        runner = LlamaCppTargetRunner(LlamaCppModel(gguf_path(spec), name=spec), name=f"llama.cpp {spec}")
        print(f"{spec} llama.cpp (threads {runner.model.n_threads}): {forward_ms(runner)}", flush=True)
