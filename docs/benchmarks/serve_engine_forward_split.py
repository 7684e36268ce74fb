"""Where one request's time goes: generate's one-row engine against the server's batched engine at one row.

Same process, same models (the real default pair: Qwen2.5-Coder 1.5B target, 0.5B int4 draft, `cascade`,
adaptive draft exit, the 512-token prompt limit), greedy, the chat prompt of `serve_single_request.py`.
Variants, alternated (the order reversed every other repeat), after one untimed run each:
A `SpeculativeGenerator.decoder` (`specdecode generate`'s engine: one row, cache sized to the request,
prefill padded to 1), B `batch_decoder(max_batch_size=8, max_length=2048)` (the server's engine),
C `batch_decoder(max_batch_size=1, max_length=256)`, D as B with the prefill padded to 1,
E as B with no verification budget. Each run prints its tok/s and the seconds and calls of the target's
and the draft's forwards (wrapped `forward`), the rest being host work, and whether its tokens equal
the first run's.

Usage (run it alone: `flock /tmp/specdecode-bench.lock` on shared machines):

    PYTHONPATH=src python docs/benchmarks/serve_engine_forward_split.py MAX_NEW_TOKENS REPEATS B,C[,D,E]
"""
import functools
import statistics
import sys
import time

import torch

from specdecode.config import GenerationConfig
from specdecode.drafters.control import DraftControl
from specdecode.pipeline import SpeculativeGenerator

PROMPT = "Write a Python function that checks whether a number is prime."


def timed_forwards(model, name: str, acc: dict) -> None:
    """Wrap ``model.forward`` so each call adds its seconds and a count to ``acc[name]``."""
    orig = model.forward

    @functools.wraps(orig)
    def forward(*args, **kwargs):
        t = time.perf_counter()
        out = orig(*args, **kwargs)
        seconds_calls = acc.setdefault(name, [0.0, 0])
        seconds_calls[0] += time.perf_counter() - t
        seconds_calls[1] += 1
        return out

    model.forward = forward


def main() -> None:
    n, repeats, which = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
    gen = SpeculativeGenerator.from_pretrained(draft_quantize="int4")
    print("dtype", gen.target.model.dtype, "threads", torch.get_num_threads(), flush=True)
    ids = gen.encode(PROMPT, chat=True)
    control = DraftControl(adaptive_exit=True)
    acc: dict = {}
    timed_forwards(gen.target.model, "target", acc)
    timed_forwards(gen.draft.model, "draft", acc)
    config = GenerationConfig(max_new_tokens=n)
    single = gen.decoder("cascade", draft_control=control, max_model_prompt_tokens=512)
    variants = {"A generate's engine": lambda: single.generate(ids, config).token_ids}

    def batched(**kw):
        return gen.batch_decoder("cascade", draft_control=control, max_model_prompt_tokens=512, **kw)

    engines = {}
    if "B" in which:
        engines["B server's engine 8x2048"] = batched(max_batch_size=8, max_length=2048)
    if "C" in which:
        engines["C batched 1x256"] = batched(max_batch_size=1, max_length=256)
    if "D" in which:
        engines["D 8x2048, prefill pad 1"] = batched(max_batch_size=8, max_length=2048)
        engines["D 8x2048, prefill pad 1"].cache.prefill_pad_multiple = 1
    if "E" in which:
        engines["E 8x2048, no verify budget"] = batched(max_batch_size=8, max_length=2048, max_verify_tokens=None)
    for name, engine in engines.items():
        variants[name] = (lambda e: lambda: e.generate([ids[0].tolist()], config)[0].token_ids)(engine)
    for fn in variants.values():  # untimed: first shapes
        fn()
    ref = None
    results: dict = {name: [] for name in variants}
    for r in range(repeats):
        order = list(variants.items()) if r % 2 == 0 else list(reversed(variants.items()))
        for name, fn in order:
            acc.clear()
            t = time.perf_counter()
            tokens = fn()
            seconds = time.perf_counter() - t
            ref = tokens if ref is None else ref
            results[name].append(len(tokens) / seconds)
            target, draft = acc["target"], acc["draft"]
            print(f"{name}: {len(tokens) / seconds:.3f} tok/s, {seconds:.1f} s, target {target[0]:.1f} s / {target[1]}"
                  f" forwards, draft {draft[0]:.1f} s / {draft[1]}, host {seconds - target[0] - draft[0]:.1f} s,"
                  f" same tokens {tokens == ref}", flush=True)
    for name, values in results.items():
        print(f"median {name}: {statistics.median(values):.3f} tok/s", flush=True)


if __name__ == "__main__":
    main()
