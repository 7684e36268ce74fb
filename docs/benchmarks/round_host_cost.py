"""The host's work per round on the fast path, measured where no GPU is: tiny models, so a round's time is the host's.

Issue 28 asks for a per-round overhead of at most 0.5 ms on an H100 for ``draft`` and
``prompt-lookup`` (``gpu_engine.py``'s ``rounds`` section measures it there). Most of that overhead
is the host's: Python, the small tensor operations between compiled forwards (each a kernel launch
on CUDA) and its reads. This script measures those on any machine, per method and batch size, with
the engine's fast-path logic (``compile=True, graphs=False``: the static cache, its buckets and
padding, every forward through ``BatchRunner``, but no ``torch.compile``) on a tiny random Llama
target and a perturbed copy of it as the draft model (vocabulary 256, 2 layers, hidden size 64):

- ``host ms/round``: decode time less the time inside the runners' bucket functions
  (``BatchRunner._run``, which on the real fast path is one compiled graph) and inside eager forwards
  (``batch_cache.batch_forward``: a draft model's deferred prefill and catch-ups), per round; the
  fastest of ``--repeats`` runs;
- ``ops/round``: aten operations dispatched in the rounds (``BatchedSpeculativeDecoder._round``; a
  request's admission is not counted) outside those forwards (``TorchDispatchMode``); on CUDA each
  one that computes is a kernel launch;
- ``kernels/round``: those of the ops that compute (not views or aliases, ``OpOverload.is_view``, nor
  ``lift_fresh``/``detach_``, which only wrap a host tensor, nor ``empty*``, which only allocate): on CUDA
  each is a kernel launch or a copy (a host-to-device copy is not counted on a CPU, where it is none);
- ``draws/round``: calls of the requests' ``torch.Generator``s (``exponential_`` for tokens, ``rand``; before
  2026-11-29 ``multinomial``): per row with a seed of its own, one for all the rows without one
  (``sampling.draw_tokens``). A ``torch.multinomial`` was one op and one kernel above, but ran 20 computing ops
  below the dispatcher (its input checks, ``exponential_``, a division, ``argmax``: torch 2.13, listed by
  ``torch.profiler`` on a CPU). ``sampling.race`` runs the ``exponential_`` per generator, then the division and
  ``argmax`` once for all the rows, and in the verification a gather, a comparison and a ``where`` (its check):
  counted here, so ops and kernels per draw went up while the hidden ones went;
- ``syncs/round``: host reads (``item``, ``tolist``, ``cpu``, ``numpy``, tensor truth and number
  conversions) in the rounds, outside them;
- ``prefill fwd``: the other eager forwards in the rounds, over all of them: a draft model's deferred prompt
  prefill (a request's first round that drafts) and catch-ups (a row whose draft cache fell behind), in
  prefill chunks;
- ``eager fwd``: decode-time forwards that ran eagerly (``BatchRunner.num_eager_forwards``): no
  bucket held them, so on CUDA each costs a whole eager forward. Should be 0.

Usage (from the project root; the numbers name the machine's CPU in the note that reports them)::

    flock /tmp/specdecode-bench.lock env PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 \\
        python docs/benchmarks/round_host_cost.py --batch-sizes 1,8

About a minute on a 2-core Xeon. ``--device cuda`` runs the same on a GPU, where the host time
also holds the launches' cost and any wait for the device at the round's read.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import platform
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if importlib.util.find_spec("specdecode") is None:  # not installed, no PYTHONPATH: this tree's src
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from specdecode import DraftControl, GenerationConfig  # noqa: E402
from specdecode.drafters import CascadeDrafter, DraftModelDrafter, LayerSkipDrafter, PromptLookupDrafter  # noqa: E402
from specdecode.drafters.layer_skip import SkipSet  # noqa: E402
from specdecode.engine import batch_cache, batch_runner  # noqa: E402
from specdecode.engine.batched import BatchedSpeculativeDecoder  # noqa: E402

VOCAB = 256
NOISE = 0.03  # the draft's weights: the target's plus this much noise, relative to their mean size
SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
METHODS = ("autoregressive", "draft", "draft+adaptive", "prompt-lookup", "cascade", "cascade+adaptive", "layer-skip",
           "autoregressive:sampling", "draft:sampling", "prompt-lookup:sampling", "draft+masked:sampling",
           "draft:sampling-unseeded", "draft+masked:sampling-unseeded")
#: wrap a host tensor, or only allocate: no kernel, no copy
NO_KERNEL = (torch.ops.aten.lift_fresh, torch.ops.aten.detach_, torch.ops.aten.empty, torch.ops.aten.empty_strided,
             torch.ops.aten.empty_like)
TEMPERATURE = 0.8  # ":sampling" methods: every request samples (its own seed; "-unseeded": none), top-p 0.95
#: a generator's draws: each a call of a request's ``torch.Generator`` (``torch.multinomial`` counts once here)
DRAWS = (torch.ops.aten.multinomial, torch.ops.aten.rand, torch.ops.aten.uniform_, torch.ops.aten.exponential_)


def tiny_models(device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A random float32 Llama target (its head sharpened, so greedy paths are not ties) and a copy of it
    with noise on every weight, as the draft model (acceptance well between 0 and 1)."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(8.0)
    draft = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * NOISE * p.abs().mean())
    return target.to(device), draft.to(device)


def prompts(count: int) -> list[list[int]]:
    """Prompts that repeat themselves (so prompt lookup and the cascade find matches), each its own."""
    generator = torch.Generator().manual_seed(2)
    out = []
    for _ in range(count):
        half = torch.randint(3, VOCAB, (16,), generator=generator).tolist()
        out.append(half + half + half[:6])
    return out


def drafter(method: str, target, draft):
    base = method.split(":")[0].split("+")[0]
    if base == "autoregressive":
        return None
    if base == "draft":
        return DraftModelDrafter(draft)
    if base == "prompt-lookup":
        return PromptLookupDrafter()
    if base == "cascade":
        return CascadeDrafter(draft)
    if base == "layer-skip":
        return LayerSkipDrafter(target, SkipSet(attn=(1,), mlp=(1,)))
    raise ValueError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")


class Counting(TorchDispatchMode):
    """Counts aten operations dispatched in a round (``probe``) while ``depth`` is 0 (outside forwards)."""

    def __init__(self, probe) -> None:
        super().__init__()
        self.ops = 0
        self.kernels = 0
        self.draws = 0
        self.depth = 0
        self._probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.depth == 0 and self._probe._rounds:
            self.ops += 1
            self.kernels += not (func.is_view or func.overloadpacket in NO_KERNEL)
            self.draws += func.overloadpacket in DRAWS
        return func(*args, **(kwargs or {}))


class Probe:
    """Wraps ``BatchedSpeculativeDecoder._round``, ``BatchRunner._run`` and ``batch_cache.batch_forward``
    (restored in ``finally``): seconds inside forwards during rounds, the eager forwards in rounds, and a
    depth that the op and sync counters skip."""

    def __init__(self, device: torch.device) -> None:
        self.inside_s = 0.0
        self.syncs = 0
        self.eager_in_rounds = 0  # ``batch_forward`` calls during rounds (runner fallbacks included)
        self.counting: Counting | None = None
        self._depth = 0
        self._rounds = 0  # inside ``BatchedSpeculativeDecoder._round``: only rounds are counted
        self._cuda = device.type == "cuda"

    @contextlib.contextmanager
    def active(self, count: bool):
        original_run = batch_runner.BatchRunner._run
        original_round = BatchedSpeculativeDecoder._round
        original_forward = batch_cache.batch_forward  # eager forwards: prefills, catch-ups (and eager fwd)
        originals = {name: vars(torch.Tensor).get(name) for name in SYNCS} if count else {}
        probe = self

        def inside(fn):
            def forward(*args, **kwargs):
                if probe._cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                probe._depth += 1
                if probe.counting is not None:
                    probe.counting.depth += 1  # inside a forward: not counted
                try:
                    out = fn(*args, **kwargs)
                    if probe._cuda:
                        torch.cuda.synchronize()
                    return out
                finally:
                    probe._depth -= 1
                    if probe.counting is not None:
                        probe.counting.depth -= 1
                    if probe._rounds:  # an admission's prefill is not in the decode time either
                        probe.inside_s += time.perf_counter() - t0
            return forward

        def round_(engine, events):
            probe._rounds += 1
            try:
                return original_round(engine, events)
            finally:
                probe._rounds -= 1

        def counted(fn):
            def sync(tensor, *args, **kwargs):
                if probe._depth == 0 and probe._rounds:
                    probe.syncs += 1
                return fn(tensor, *args, **kwargs)
            return sync

        batch_runner.BatchRunner._run = inside(original_run)
        timed_forward = inside(original_forward)

        def eager_forward(*args, **kwargs):
            probe.eager_in_rounds += bool(probe._rounds)
            return timed_forward(*args, **kwargs)

        batch_cache.batch_forward = batch_runner.batch_forward = eager_forward
        BatchedSpeculativeDecoder._round = round_
        try:
            for name in originals:
                setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
            if count:
                self.counting = Counting(self)
                with self.counting:
                    yield self
            else:
                yield self
        finally:
            batch_runner.BatchRunner._run = original_run
            batch_cache.batch_forward = batch_runner.batch_forward = original_forward
            BatchedSpeculativeDecoder._round = original_round
            for name, fn in originals.items():  # the class as it was: inherited methods are not copied in
                if fn is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, fn)
            self.counting = None


def decode(engine: BatchedSpeculativeDecoder, requests: list[list[int]], max_new_tokens: int, sampling: bool,
           seeded: bool = True) -> None:
    for i, p in enumerate(requests):
        config = GenerationConfig(max_new_tokens=max_new_tokens, stop_on_eos=False,
                                  temperature=TEMPERATURE if sampling else 0.0, top_p=0.95 if sampling else 1.0,
                                  seed=i if sampling and seeded else None)
        engine.add(p, config)
    while engine.has_work:
        engine.step()


def measure(method: str, batch: int, args, target, draft, device) -> list:
    control = DraftControl(adaptive_exit=True) if method.split(":")[0].endswith("+adaptive") else \
        DraftControl(adaptive_exit=True, exit_mode="masked") if method.split(":")[0].endswith("+masked") else None
    sampling, seeded = ":sampling" in method, not method.endswith("-unseeded")
    engine = BatchedSpeculativeDecoder(target, drafter(method, target, draft), max_batch_size=batch, max_length=512,
                                       num_speculative_tokens=args.gamma, draft_control=control, compile=True,
                                       graphs=False)
    engine.warm_up()
    requests = prompts(max(batch, args.prompts))
    decode(engine, requests, args.max_new_tokens, sampling, seeded)  # the first rounds: calibration, first calls
    best = None
    for _ in range(args.repeats):
        before = (engine.stats.decode_time_s, engine.stats.num_rounds)
        with Probe(device).active(count=False) as probe:
            decode(engine, requests, args.max_new_tokens, sampling, seeded)
        seconds = engine.stats.decode_time_s - before[0]
        rounds = engine.stats.num_rounds - before[1]
        host = (seconds - probe.inside_s) / rounds
        best = host if best is None else min(best, host)
    eager = engine.runner.num_eager_forwards + getattr(getattr(engine.drafter, "runner", None),
                                                      "num_eager_forwards", 0)
    before = (engine.stats.num_rounds, engine.stats.num_drafted_tokens, engine.stats.num_accepted_tokens)
    with Probe(device).active(count=True) as probe:
        decode(engine, requests, args.max_new_tokens, sampling, seeded)
        ops, kernels, draws = probe.counting.ops, probe.counting.kernels, probe.counting.draws
    eager = engine.runner.num_eager_forwards + getattr(getattr(engine.drafter, "runner", None),
                                                      "num_eager_forwards", 0) - eager
    prefills = probe.eager_in_rounds - eager
    rounds = engine.stats.num_rounds - before[0]
    drafted = engine.stats.num_drafted_tokens - before[1]
    accepted = engine.stats.num_accepted_tokens - before[2]
    alpha = f"{accepted / drafted:.0%}" if drafted else "-"
    return [method, batch, rounds, alpha, f"{1000 * best:.3f}", f"{ops / rounds:.1f}", f"{kernels / rounds:.1f}",
            f"{draws / rounds:.1f}", f"{probe.syncs / rounds:.2f}",
            prefills, eager]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompts", type=int, default=8, help="requests per run (at least the batch size)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    target, draft = tiny_models(device)
    flags = ""
    with contextlib.suppress(OSError):
        line = next(x for x in open("/proc/cpuinfo") if x.startswith("flags"))
        flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in line.split())
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()} ({flags}), "
          f"{torch.get_num_threads()} threads, device {device}")
    rows = []
    with torch.inference_mode():
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            for method in args.methods.split(","):
                rows.append(measure(method, batch, args, target, draft, device))
                print("  " + " | ".join(map(str, rows[-1])), file=sys.stderr)
    headers = ["method", "B", "rounds", "α", "host ms/round", "ops/round", "kernels/round", "draws/round",
               "syncs/round", "prefill fwd", "eager fwd"]
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join("---" for _ in headers) + "|")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")


if __name__ == "__main__":
    main()
