"""How a float32 linear's time grows with the rows M on this CPU: F.linear vs torch.utils.mkldnn's prepacked linear.

Run: ``OMP_NUM_THREADS=2 python docs/benchmarks/float32_linear_rows.py`` (about a minute; record:
``2026-11-26-cost-model-arms-avx2.md``). Prints ms per pass over 8 Qwen2.5-Coder-1.5B-shaped MLP linears.
"""
import time, torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
print(torch.__version__, torch.backends.cpu.get_cpu_capability(), "threads", torch.get_num_threads(), "mkl", torch.backends.mkl.is_available(), "mkldnn", torch.backends.mkldnn.is_available())
layers = [nn.Linear(1536, 8960, bias=False) if i % 2 == 0 else nn.Linear(8960, 1536, bias=False) for i in range(8)]
seq = nn.Sequential(*layers).eval()  # 8 x 55 MB of float32 weights: memory-bound like the target
def bench(f, M, reps=5):
    x = torch.randn(1, M, 1536)
    with torch.inference_mode():
        f(x)
        ts = []
        for _ in range(reps):
            t = time.perf_counter(); f(x); ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts)//2] * 1e3
Ms = [1, 2, 3, 4, 6, 8, 13, 16]
base = {M: bench(seq, M) for M in Ms}
print("F.linear      ms:", {M: round(v, 1) for M, v in base.items()})
try:
    from torch.utils import mkldnn as mk
    packed = mk.to_mkldnn(nn.Sequential(*[nn.Linear(l.in_features, l.out_features, bias=False) for l in layers]).eval())
    def run(x):
        return packed(x.reshape(-1, x.shape[-1]))
    pk = {M: bench(run, M) for M in Ms}
    print("mkldnn packed ms:", {M: round(v, 1) for M, v in pk.items()})
except Exception as e:
    print("mkldnn failed:", type(e).__name__, e)
try:
    ws = [l.weight for l in layers]
    def mv(x):
        x = x.reshape(-1, x.shape[-1])
        for w in ws:
            x = torch.stack([torch.mv(w, r) for r in x])
        return x
    print("row-wise mv   ms:", {M: round(bench(mv, M), 1) for M in Ms[:5]})
except Exception as e:
    print("mv failed", e)
