"""Helpers of the benchmark scripts that compare this tree's code with an earlier revision's in one process
(``one_sampler_cost.py``, ``tree_sampling_cost.py``): a module as it was at a revision, the machine's CPU line,
and an aten operation counter. Not a benchmark itself."""

from __future__ import annotations

import importlib.util
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]


def module_at(rev: str, path: str, name: str):
    """The module at ``path`` (from the repository root) as it was at ``rev`` (``git show``), imported as ``name``;
    its own imports are this tree's ``specdecode``."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True, capture_output=True,
                            text=True).stdout
    with tempfile.TemporaryDirectory() as folder:
        file = Path(folder) / f"{name}.py"
        file.write_text(source)
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return module


def machine_line() -> str:
    """torch's version, the CPU and its flags that matter here, and the torch threads."""
    flags = ""
    if Path("/proc/cpuinfo").exists():
        line = next(x for x in open("/proc/cpuinfo") if x.startswith("flags"))
        flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in line.split())
    return (f"torch {torch.__version__}, {platform.processor() or platform.machine()} ({flags}), "
            f"{torch.get_num_threads()} threads")


class OpCount(TorchDispatchMode):
    """Counts the aten operations dispatched (views included; on CUDA each that computes is a kernel launch) and,
    among them, the scalar reads to the host (``aten._local_scalar_dense``: ``item``, ``float()``, ``int()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))
