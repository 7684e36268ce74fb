"""A preview of prompt lookup on a llama.cpp target, before the engine is wired to one (issue 30).

Usage: OMP_NUM_THREADS=2 python docs/benchmarks/llama_cpp_target_preview.py [N_PROMPTS] [MAX_NEW_TOKENS]

A greedy decode loop of its own (not specdecode's engine) on LlamaCppTargetRunner with the
Qwen2.5-Coder 1.5B Q4_K_M GGUF file, 2 threads, on the first N HumanEval prompts (chat template,
the cached tokenizer of the offline model), whole prompts timed:
  plain         one forward per token (what `llama-cpp` times);
  lookup k=2    an n-gram match (3, 2, then 1 tokens) drafts up to 2 tokens every round;
  lookup cost   the same drafter, k per round from the cost model (engine.speculation_cost;
                forward costs measured at warm-up on this prompt set's first prompt, running α by
                depth from a prior of 0.5, 0 = a plain step; the 2026-11-25 record ran the linear
                model of engine.cost_model then, one running α).
Prints tok/s, α, and whether each output equals the plain one (Q4 batches round differently).
"""
import sys
import time

import numpy as np
import torch
from transformers import AutoTokenizer

from specdecode.bench.datasets import load_prompts
from specdecode.engine.cost_model import ForwardCosts
from specdecode.engine.speculation_cost import SpeculationCostPolicy
from specdecode.models.llama_cpp import LlamaCppModel, gguf_path
from specdecode.models.llama_cpp_target import LlamaCppTargetRunner
from specdecode.models.registry import default_cache_dir


def lookup(seq: np.ndarray, k: int) -> list[int]:
    """Up to k tokens after the latest earlier match of the last 3, 2 or 1 tokens."""
    for n in (3, 2, 1):
        if len(seq) <= n:
            continue
        tail = seq[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        hits = np.nonzero((windows == tail).all(1))[0]
        if len(hits):
            start = hits[-1] + n
            return seq[start:start + k].tolist()
    return []


def decode(runner, prompt, max_new, eos, policy):
    """Greedy decoding; policy(controller-less) -> k per round. Returns (tokens, seconds, drafted, accepted)."""
    t0 = time.perf_counter()
    pending = int(runner.prefill(prompt, max_new).argmax())
    seq = np.array(prompt, dtype=np.int64)
    out, drafted, accepted = [], 0, 0
    while True:
        out.append(pending)
        seq = np.append(seq, pending)
        if pending in eos or len(out) >= max_new:
            break
        k = min(policy.cap(), max_new - len(out))
        draft = lookup(seq, k) if k else []
        rows = runner.forward([pending, *draft], len(seq) - 1, len(draft) + 1).argmax(-1).tolist()
        a = 0
        while a < len(draft) and draft[a] == rows[a]:
            a += 1
        if draft:
            policy.record(len(draft), a)
        drafted, accepted = drafted + len(draft), accepted + a
        for t in draft[:a]:
            out.append(t)
            seq = np.append(seq, t)
            if t in eos or len(out) >= max_new:
                return out, time.perf_counter() - t0, drafted, accepted
        pending = rows[a]
    return out, time.perf_counter() - t0, drafted, accepted


class Fixed:
    def __init__(self, k):
        self.k = k

    def cap(self):
        return self.k

    def record(self, drafted, accepted):
        pass


class Cost:
    def __init__(self, controller):
        self.c = controller
        self.k = 0

    def cap(self):
        self.k = self.c.round_cap()
        return self.k

    def record(self, drafted, accepted):
        self.c.record(self.k, drafted, accepted)
        self.c.record_round(self.k, drafted, 0.0, depth=drafted)


if __name__ == "__main__":
    torch.set_num_threads(2)
    n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    max_new = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    tok = AutoTokenizer.from_pretrained(default_cache_dir() / "dense" / "qwen2.5-coder-1.5b-instruct-bfloat16")
    eos = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    prompts = [tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True)
               for p in load_prompts("humaneval", limit=n_prompts)]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    model = LlamaCppModel(gguf_path("qwen2.5-coder-1.5b-instruct"), role="target model")
    runner = LlamaCppTargetRunner(model)
    costs = dict(runner.measure_forward_costs(prompts[0], widths=(1, 2, 4, 8), repeats=5))
    print("forward ms: " + ", ".join(f"{w}: {s * 1e3:.1f}" for w, s in costs.items()), flush=True)
    decode(runner, prompts[0], 8, eos, Fixed(2))  # warm-up
    arms = {"plain": lambda: Fixed(0), "lookup k=2": lambda: Fixed(2),
            "lookup cost": lambda: Cost(SpeculationCostPolicy(ForwardCosts(costs), draft_node_s=0.0, prior=0.5,
                                                              max_size=8).controller(8))}
    reference = {}
    for name, make in arms.items():
        total_tokens, total_s, drafted, accepted, same = 0, 0.0, 0, 0, []
        for i, p in enumerate(prompts):
            out, s, d, a = decode(runner, p, max_new, eos, make())
            total_tokens, total_s, drafted, accepted = total_tokens + len(out), total_s + s, drafted + d, accepted + a
            reference.setdefault(i, out)
            same.append(out == reference[i])
        alpha = f"{accepted / drafted:.1%}" if drafted else "-"
        print(f"{name}: {total_tokens / total_s:.2f} tok/s, {total_tokens} tokens, drafted {drafted}, "
              f"accepted {accepted} (α {alpha}), same tokens as plain: {same}", flush=True)
    model.close()
