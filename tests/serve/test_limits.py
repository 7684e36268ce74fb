"""``serve.limits``: the memory the rows' KV caches may take, and the rows' length against the models'
context lengths (the command-line paths are in test_serve_command.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import make_tiny_model
from specdecode.errors import InvalidArgumentError
from specdecode.serve.limits import available_memory_bytes, check_cache_memory, kv_bytes_per_position

GIB = 1 << 30


@pytest.fixture
def cuda_memory(monkeypatch):
    """A CUDA device (none needed) with 3 GiB free, and torch's caching allocator holding 10 GiB of which 4 GiB
    are allocated to tensors: 6 GiB reserved and free for new tensors, which mem_get_info counts as used."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 * GIB)


def test_cuda_free_memory_counts_what_the_caching_allocator_holds_unallocated(cuda_memory):
    assert available_memory_bytes("cuda:0") == 9 * GIB  # was 3 GiB: mem_get_info alone


class _OnCuda(torch.nn.Module):
    """A tiny model's config and dtype, placed (for the check's arithmetic only) on a CUDA device."""

    def __init__(self, model) -> None:
        super().__init__()
        self.config, self.dtype, self.device = model.config, model.dtype, torch.device("cuda:0")


def test_a_batch_that_fits_in_the_allocator_s_reserve_is_allowed(cuda_memory):
    """Rows taking 8 GiB in all fit in 3 GiB free + 6 GiB reserved and unallocated: the check once refused
    them (only 3 GiB counted)."""
    tiny = _OnCuda(make_tiny_model("llama", num_layers=4))
    gen = SimpleNamespace(target=SimpleNamespace(model=tiny), draft=None)
    per_row = kv_bytes_per_position(tiny) * 1024  # 512 KiB a row at 1,024 positions
    rows = 8 * GIB // per_row
    check_cache_memory(gen, "autoregressive", max_batch_size=rows, max_length=1024)
    with pytest.raises(InvalidArgumentError, match=rf"more than the 9\.0 GiB available on cuda:0; allowed: "
                                                   rf"--max-batch-size 1\.\.{9 * GIB // per_row} at --max-length 1024"):
        check_cache_memory(gen, "autoregressive", max_batch_size=2 * rows, max_length=1024)


def test_a_llama_cpp_draft_s_training_context_limits_the_rows():
    """A draft run in llama.cpp (the generator's llama_cpp_draft) states its training context, n_ctx_train."""
    from specdecode.serve.limits import fit_max_length, loaded_context_limits

    target = make_tiny_model("llama", num_layers=2)  # 512 positions
    llama_draft = SimpleNamespace(n_ctx_train=200, name="draft.gguf")
    gen = SimpleNamespace(target=SimpleNamespace(model=target, name="tiny"), draft=None,
                          default_draft_backend=lambda: "llama-cpp", llama_cpp_draft=lambda: llama_draft)
    limits = loaded_context_limits(gen, "draft", draft_name="/models/draft.gguf")
    assert [(lim.role, lim.name, lim.positions) for lim in limits] == [("target", "tiny", 512),
                                                                      ("draft model", "/models/draft.gguf", 200)]
    assert fit_max_length(None, 5, limits) == 206
    with pytest.raises(InvalidArgumentError, match=r"--max-length 300 is more than a row can use: the draft model "
                                                   r"'/models/draft.gguf' has a context length of 200 positions "
                                                   r"\(llama.cpp's n_ctx_train\), fewer than the target's 512 .* "
                                                   r"allowed: --max-length 8\.\.206"):
        fit_max_length(300, 5, limits)
    assert [lim.role for lim in loaded_context_limits(gen, "prompt-lookup")] == ["target"]  # no draft model
