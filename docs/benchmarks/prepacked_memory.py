"""Resident memory of one float32 model with stock or prepacked linears (``models.prepacked_linear``).

Run: ``OMP_NUM_THREADS=2 python docs/benchmarks/prepacked_memory.py qwen2.5-coder-1.5b-instruct prepack|stock``
(record: ``2026-11-26-prepacked-linears-avx2.md``). Prints VmRSS, RssAnon and RssFile from /proc/self/status
(Linux) after loading and after one 50-token forward.
"""
import sys

import torch

from specdecode.models import load_model


def show(when: str) -> None:
    print(when)
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS", "RssAnon", "RssFile")):
                print("   ", line.strip())


if __name__ == "__main__":
    name, mode = sys.argv[1], sys.argv[2]
    loaded = load_model(name, dtype="float32", device="cpu", prepack_linears=mode == "prepack")
    show(f"{name} {mode}, prepacked={loaded.prepacked}: after loading")
    with torch.inference_mode():
        loaded.model(torch.randint(100, 5000, (1, 50)))
    show("after a forward")
