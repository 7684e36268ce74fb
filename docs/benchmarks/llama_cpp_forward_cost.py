"""Milliseconds per llama.cpp forward by number of tokens fed (the protocol of forward_cost.py).

Usage: OMP_NUM_THREADS=2 python docs/benchmarks/llama_cpp_forward_cost.py qwen2.5-coder-1.5b-instruct,qwen2.5-coder-0.5b-instruct
Each spec is an offline model or a .gguf path, run by specdecode.models.llama_cpp (2 threads, as torch's).
Prints one line per model: the median of 7 forwards over a 200-token context, rolled back after each.
Needs llama-cpp-python (pip install 'specdecode[llamacpp]').
"""
import sys

import torch
from forward_cost import median_ms  # this folder's script: run from the repository root as shown

from specdecode.models.llama_cpp import LlamaCppModel, LlamaCppModelRunner, gguf_path


def forward_ms(runner: LlamaCppModelRunner) -> dict[int, float]:
    ctx = torch.randint(100, 5000, (1, 200), generator=torch.Generator().manual_seed(0))
    cache = runner.new_cache()
    runner(ctx, cache, 1)
    # every row's logits, as a verification would
    return median_ms(lambda x: runner(x, cache, x.shape[1]), lambda k: cache.crop(-k))


if __name__ == "__main__":
    torch.set_num_threads(2)
    for spec in sys.argv[1].split(","):
        runner = LlamaCppModelRunner(LlamaCppModel(gguf_path(spec), name=spec))
        print(f"{spec} llama.cpp (threads {runner.model.n_threads}): {forward_ms(runner)}", flush=True)
