"""Resident memory of the default target/draft pair after loading and during one generation (Linux).

Usage: python docs/benchmarks/resident_memory.py QUANTIZE [DRAFT_QUANTIZE [GROUP_SIZE]]   e.g. int4, none int4,
or int4 int4 64 (int4 groups of 64: --quantize-group-size 64)
"""
import sys

import torch

from specdecode import GenerationConfig, SpeculativeGenerator


def status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon and RssFile of this process in MB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) // 1024
    return out


if __name__ == "__main__":
    torch.set_num_threads(2)
    quantize = sys.argv[1]
    draft_quantize = sys.argv[2] if len(sys.argv) > 2 else None
    group_size = int(sys.argv[3]) if len(sys.argv) > 3 else None
    gen = SpeculativeGenerator.from_pretrained(quantize=quantize, draft_quantize=draft_quantize,
                                               quantize_group_size=group_size)
    after_load = status()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak mark: VmHWM below is the generation's peak
    gen.generate("Write a Python function that checks whether a number is prime.",
                 GenerationConfig(max_new_tokens=32, num_speculative_tokens=3), method="draft")
    print(f"quantize={quantize} draft_quantize={draft_quantize} group_size={group_size}: after load {after_load} MB; "
          f"peak during generation {status()['VmHWM']} MB")
