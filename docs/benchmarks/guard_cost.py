"""What dynamo's guards cost per compiled call, with and without the guards on the model's modules.

Each call of a ``torch.compile``d function first runs dynamo's guards (its cache lookup). For a
transformers model most of them are on its modules, and their number grows with its layers, not its
widths. ``engine.compat`` drops them (``torch.compiler.skip_guard_on_all_nn_modules_unsafe`` as
``options["guard_filter_fn"]``); this script measures what that saves, with the engine's own compiled
bucket function (a ``BatchRunner``'s one-row, one-token forward, the call each draft step and each
``autoregressive`` round makes), compiled once with the filter (the default) and once without
(``compile_function(..., module_guards=True)``), the two alternated ``--repeats`` times:

- ``lookup ms/call``: the profiler's "TorchDynamo Cache Lookup" time per call (the guards);
- ``wall ms/call``: the whole call, the compiled graph included, without the profiler.

The model is a random ``--arch`` model of ``--layers`` layers with tiny widths (hidden size 64,
vocabulary 1024), so that the graph costs little next to the guards: 28 layers is the packaged
Qwen2.5-Coder 1.5B target's depth, 24 the 0.5B draft's. On CUDA the same guards run on the host
before each graph replay (``--device cuda``); ``graphs="captured"`` replays skip them altogether.

Usage (from the project root; the figures name the machine's CPU)::

    flock /tmp/specdecode-bench.lock env PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 \\
        python docs/benchmarks/guard_cost.py --layers 28

About 3 minutes on a 2-core AMD EPYC (the two compilations, about 2 minutes the first time).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig, AutoModelForCausalLM

from specdecode.engine import bucket_functions, compat
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode import GenerationConfig

LOOKUP = "TorchDynamo Cache Lookup"


def _model(arch: str, layers: int, device: str) -> torch.nn.Module:
    config = AutoConfig.for_model(arch, vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval().to(device)


def _runner(model: torch.nn.Module, module_guards: bool):
    """The engine's target runner, its buckets compiled with or without the guards on modules, warmed up."""
    original = bucket_functions.compile_function
    bucket_functions.compile_function = functools.partial(original, module_guards=module_guards)
    try:
        dec = BatchedSpeculativeDecoder(model, max_batch_size=1, max_length=96, compile=True, graphs=True)
        t0 = time.perf_counter()
        dec.generate([[5, 9, 12, 4, 8]], [GenerationConfig(max_new_tokens=4, stop_on_eos=False)])
    finally:
        bucket_functions.compile_function = original
    return dec.runner, time.perf_counter() - t0


def _per_call(runner, ids: torch.Tensor, calls: int) -> tuple[float, float]:
    """(wall ms, lookup ms) per call of the one-row, one-token bucket."""
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    for _ in range(3):
        runner(ids, [10], 1)
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        runner(ids, [10], 1)
    sync()
    wall = (time.perf_counter() - t0) / calls * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            runner(ids, [10], 1)
        sync()
    lookup = sum(e.cpu_time_total for e in prof.events() if e.name == LOOKUP) / calls / 1e3
    return wall, lookup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="qwen2", help="a transformers model type (default qwen2)")
    parser.add_argument("--layers", type=int, default=28, help="decoder layers (default 28: the 1.5B target's)")
    parser.add_argument("--calls", type=int, default=200, help="calls timed per repeat (default 200)")
    parser.add_argument("--repeats", type=int, default=3, help="alternated repeats (default 3)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.layers < 1 or args.calls < 1 or args.repeats < 1:
        parser.error(f"--layers, --calls and --repeats must be >= 1, got {args.layers}, {args.calls}, {args.repeats}")

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}, "
          f"{args.arch} with {args.layers} layers; module guard filter: {compat.module_guard_filter() is not None}")
    model = _model(args.arch, args.layers, args.device)
    ids = torch.tensor([[7]], device=args.device)
    settings = {"guards on modules kept": True, "dropped (default)": False}
    runners = {}
    for name, keep in settings.items():
        runners[name], seconds = _runner(model, keep)
        print(f"{name}: compiled and warmed up in {seconds:.1f} s")
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in settings}
    for _ in range(args.repeats):
        for name in settings:
            results[name].append(_per_call(runners[name], ids, args.calls))
    print("\n| compiled call | wall ms/call, each repeat | median | lookup ms/call, each repeat | median |")
    print("|---|---|---:|---|---:|")
    for name, rows in results.items():
        walls, lookups = [w for w, _ in rows], [u for _, u in rows]
        print(f"| {name} | {' / '.join(f'{w:.3f}' for w in walls)} | {statistics.median(walls):.3f} | "
              f"{' / '.join(f'{u:.3f}' for u in lookups)} | {statistics.median(lookups):.3f} |")


if __name__ == "__main__":
    main()
