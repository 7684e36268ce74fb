"""Warm-up paid once per machine: a second process loads its compiled graphs from specdecode's cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import specdecode
from specdecode.engine import compile_cache
from specdecode.models import default_cache_dir

# One process start: a tiny float32 model, one compiled width on the fast path; prints where
# inductor's caches went and inductor's FX graph cache counters.
_START = """
import json, os
import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM
from specdecode.engine.batch_cache import BatchKVCache, batch_prefill
from specdecode.engine.fast_path import FastPath
from specdecode.engine.batch_runner import BatchRunner

torch.set_num_threads(1)
torch.manual_seed(0)
config = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                     num_key_value_heads=2, num_hidden_layers=1, max_position_embeddings=64)
model = LlamaForCausalLM(config).eval()
cache = BatchKVCache(model, 1, 16, fast=FastPath((1,), 1))
runner = BatchRunner(model, cache, (1,), "target model")
with torch.inference_mode():
    batch_prefill(model, cache, torch.tensor([[3, 4, 5]]), 0)  # the prefill: eager
    logits = runner(torch.tensor([[6]]), [3], 1)  # width 1: compiled
print(json.dumps({"dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"), "compile_time_s": runner.compile_time_s,
                  "hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"],
                  "logits": logits.flatten().tolist()}))
"""


def _start(specdecode_cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["SPECDECODE_CACHE"] = str(specdecode_cache)
    src = str(Path(specdecode.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    done = subprocess.run([sys.executable, "-c", _START], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_process_loads_compiled_graphs_from_the_specdecode_cache(tmp_path):
    """The first start compiles (FX graph cache misses) into ``<SPECDECODE_CACHE>/compile``; the
    second, in a fresh process, hits that cache for every graph and gives the same logits."""
    first = _start(tmp_path)
    assert first["dir"] == str(tmp_path / "compile")
    assert first["misses"] > 0 and first["hits"] == 0, first
    assert (tmp_path / "compile" / "fxgraph").is_dir()
    second = _start(tmp_path)
    assert second["dir"] == str(tmp_path / "compile")
    assert second["hits"] == first["misses"] and second["misses"] == 0, second
    assert second["logits"] == first["logits"]


def test_the_compile_folder_is_in_the_specdecode_cache(monkeypatch, tmp_path):
    """``compile_cache_dir`` (the engine may not import models) follows ``models.default_cache_dir``."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "sd"))
    assert compile_cache.compile_cache_dir() == default_cache_dir() / "compile" == tmp_path / "sd" / "compile"
    monkeypatch.delenv("SPECDECODE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.compile_cache_dir() == default_cache_dir() / "compile" == tmp_path / "xdg/specdecode/compile"
    monkeypatch.delenv("XDG_CACHE_HOME")
    home = Path.home() / ".cache" / "specdecode" / "compile"
    assert compile_cache.compile_cache_dir() == default_cache_dir() / "compile" == home


def test_a_users_folder_is_kept_and_torchs_default_replaced(monkeypatch, tmp_path, caplog):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default

    caplog.set_level("INFO", logger="specdecode.engine.compile_cache")
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "sd"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache.use_compile_cache() == tmp_path / "mine"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    assert f"torch's compile caches stay in {tmp_path / 'mine'}" in caplog.text
    # Importing torch._dynamo sets the variable to torch's default folder: that is no user's choice.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", torch_default())
    assert compile_cache.use_compile_cache() == tmp_path / "sd" / "compile"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "sd" / "compile")
    assert f"are in {tmp_path / 'sd' / 'compile'}" in caplog.text
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert compile_cache.use_compile_cache() == tmp_path / "sd" / "compile"
