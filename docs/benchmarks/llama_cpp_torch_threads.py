"""Torch's threads around a llama.cpp target: wall and CPU ms per greedy token, llama.cpp's own
``Llama.generate`` against a decode loop over ``LlamaCppTargetRunner`` that runs the engine's per-token
torch ops (finiteness check, argmax, one host copy) at 2 or 1 torch threads, or numpy's argmax only.

Usage: python docs/benchmarks/llama_cpp_torch_threads.py [TOKENS]   (default 48; 2 llama.cpp threads;
100 prompt ids; 3 repeats, the variants alternating). Needs llama-cpp-python and the packaged
Qwen2.5-Coder 1.5B Q4_K_M GGUF. Result: ``engine.runner_target.torch_threads``'s docstring.
"""
import sys, time
import torch
from specdecode.models.llama_cpp import LlamaCppModel, gguf_path
from specdecode.models.llama_cpp_target import LlamaCppTargetRunner
torch.set_num_threads(2)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 48
model = LlamaCppModel(gguf_path("qwen2.5-coder-1.5b-instruct"), n_threads=2, name="t", role="target model")
runner = LlamaCppTargetRunner(model)
llm = model._llm
ids = list(range(1000, 1100))
def own():
    out = []; t0 = c0 = None
    for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        if t0 is None: t0, c0 = time.perf_counter(), time.process_time()
        out.append(tok)
        if len(out) >= N: break
    return out, time.perf_counter() - t0, time.process_time() - c0
def loop(torch_ops=True, threads=2):
    torch.set_num_threads(threads)
    logits = runner.prefill(ids, N)
    out = [int(logits.argmax())]
    t0, c0 = time.perf_counter(), time.process_time()
    while len(out) < N:
        lg = runner.forward([out[-1]], len(ids) + len(out) - 1, 1)
        if torch_ops:
            f = torch.isfinite(lg).all(); out.append(int(torch.cat([lg.argmax(-1), f.long().view(1)]).tolist()[0]))
        else:
            out.append(int(lg.numpy().argmax()))
    torch.set_num_threads(2)
    return out, time.perf_counter() - t0, time.process_time() - c0
for rep in range(3):
    for name, fn in (("own", own), ("loop torch2", lambda: loop(True, 2)), ("loop torch1", lambda: loop(True, 1)), ("loop numpy", lambda: loop(False, 2))):
        out, wall, cpu = fn()
        print(f"rep {rep} {name:12s} wall {wall / (N - 1) * 1e3:6.1f} ms/tok  cpu {cpu / (N - 1) * 1e3:6.1f} ms/tok  first {out[:4]}", flush=True)
