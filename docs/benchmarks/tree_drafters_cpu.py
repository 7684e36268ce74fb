"""τ and decode tok/s of the tree drafters against prompt lookup and autoregressive decoding, one process.

Usage: python docs/benchmarks/tree_drafters_cpu.py [MAX_NEW_TOKENS [PROMPTS [METHOD:γ ...]]]
(defaults 64, 4, and autoregressive:1 prompt-lookup:5 token-recycling:8). The real Qwen2.5-Coder 1.5B
target (packaged), the device's default dtype, greedy, the first PROMPTS HumanEval prompts in order
(each method in turn over all of them; Token Recycling's matrix starts empty and learns across the
prompts). Prints per prompt and per method τ (tokens per target forward, bonus counted), acceptance
rate (accepted ÷ drafted: a tree drafts every node, so it is low by construction) and decode tok/s.
Run it alone (``flock /tmp/specdecode-bench.lock``).
"""
import sys

from specdecode import GenerationConfig
from specdecode.bench.datasets import load_prompts
from specdecode.pipeline import SpeculativeGenerator

if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    runs = [(m.split(":")[0], int(m.split(":")[1])) for m in sys.argv[3:]] or [
        ("autoregressive", 1), ("prompt-lookup", 5), ("token-recycling", 8)]
    gen = SpeculativeGenerator.from_pretrained("qwen2.5-coder-1.5b-instruct", None)
    prompts = load_prompts("humaneval", limit=k)
    print(f"target dtype {gen.target.model.dtype}, {n} tokens, {k} HumanEval prompts", flush=True)
    for method, gamma in runs:
        dec = gen.decoder(method)
        seconds = tokens = forwards = 0
        for i, p in enumerate(prompts):
            s = dec.generate(gen.encode(p.text, chat=p.chat), GenerationConfig(max_new_tokens=n,
                                                                               num_speculative_tokens=gamma)).stats
            seconds, tokens, forwards = seconds + s.decode_time_s, tokens + s.num_tokens_from_forwards, \
                forwards + s.num_target_forwards
            print(f"{method} γ={gamma} prompt {i}: τ {s.num_tokens_from_forwards / max(1, s.num_target_forwards):.2f}"
                  f" acceptance {s.acceptance_rate} decode tok/s {s.decode_tokens_per_s:.2f}", flush=True)
        print(f"== {method} γ={gamma}: τ {tokens / forwards:.2f}, decode tok/s {tokens / seconds:.2f}", flush=True)
