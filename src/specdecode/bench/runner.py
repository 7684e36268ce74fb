"""The run: every method on every prompt, interleaved, each record stored as it finishes (``run_bench``)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import sys
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from specdecode import pipeline
from specdecode.bench.datasets import Prompt
from specdecode.bench.methods import PromptPrefix, resolve_methods
from specdecode.bench.records import RecordStore, environment, record_key, run_identity
from specdecode.bench.report import write_reports
from specdecode.bench.settings import BenchSettings
from specdecode.engine import kv_cache
from specdecode.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


def _ids_digest(ids: torch.Tensor) -> str:
    """Short fingerprint of encoded prompt ids (detects a changed chat setting or dataset on resume)."""
    return hashlib.sha256(json.dumps(ids[0].tolist()).encode()).hexdigest()[:16]


def prompt_seed(base_seed: int, prompt_id: str, repeat: int) -> int:
    """The sampling seed of one (prompt, repeat), the same for every method and every run."""
    return (base_seed * 1_000_003 + zlib.crc32(f"{prompt_id}\0{repeat}".encode())) % (2**31)


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float | None:
    """Peak resident set size of this process in MB (VmHWM on Linux, else ru_maxrss)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            m = re.search(r"^VmHWM:\s+(\d+)\s+kB", f.read(), re.MULTILINE)
        if m:
            return int(m.group(1)) / 1024
    except OSError:
        pass
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


ProgressCallback = Callable[[int, int, str], None]


def run_bench(
    generator: pipeline.SpeculativeGenerator,
    prompts: Sequence[Prompt],
    methods: Sequence[str] | None = None,
    settings: BenchSettings | None = None,
    out_dir: str | Path = "bench-out",
    *,
    progress: ProgressCallback | None = None,
    run_info: Mapping[str, Any] | None = None,
) -> dict:
    """Benchmark ``methods`` on ``prompts`` and write the reports to ``out_dir``.

    Finished (method, prompt, repeat) records already in ``out_dir`` are kept and
    not run again (see the ``specdecode.bench`` docstring). The reports cover exactly this
    call's methods × prompts × repeats.

    Args:
        generator: The loaded target (and draft); with ``backend="llama-cpp"``
            (``SpeculativeGenerator.from_pretrained``) specdecode's methods run the target's GGUF file
            in llama.cpp, without a prompt cache (``prompt_cache`` None turns it off), transformers'
            methods are refused (skipped when ``methods`` is None) and the llama.cpp references run
            the same file with the same threads and KV cache type.
        prompts: Prompts with unique ids.
        methods: Methods to run (``available_methods()``); None: all whose requirements are met.
        settings: Generation settings (default ``BenchSettings()``).
        out_dir: Results folder: records.jsonl, settings.json, results.json, results.md, the PNGs.
        progress: Called as ``progress(done, total, description)`` before the first and after
            every generation; ``total`` counts the generations still to run.
        run_info: Extra JSON-ready facts stored in results.json (e.g. dataset, command line).

    Returns:
        The content of results.json; ``methods[name]["warmup_s"]`` is the wall time in seconds
        of that method's warm-up generation (compilation included), None when it had nothing
        left to run.

    Raises:
        InvalidArgumentError: Unknown or unusable methods, no prompts, duplicate prompt ids,
            a prompt whose tokens plus ``max_new_tokens`` exceed the target's context length
            (checked before any generation), or an ``out_dir`` made with different settings.
        KeyboardInterrupt: Passed on; the records finished so far stay in records.jsonl.
    """
    settings = settings or BenchSettings()
    prompts = list(prompts)
    if not prompts:
        raise InvalidArgumentError("no prompts to benchmark (check the dataset, categories and limits)")
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise InvalidArgumentError(f"prompt ids must be unique; {dup!r} appears {ids.count(dup)} times")
    encoded = {p.id: generator.encode(p.text, p.chat) for p in prompts}
    model = generator.target.model
    for p in prompts:  # before anything runs: transformers' methods would run past the context silently
        try:
            kv_cache.check_context_length(model, int(encoded[p.id].shape[1]), settings.max_new_tokens)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"prompt {p.id!r}: {e}") from None
    max_positions = max(int(t.shape[1]) for t in encoded.values()) + settings.max_new_tokens
    runners, skipped = resolve_methods(generator, methods, settings, max_positions=max_positions)
    unsupported = [name for name, runner in runners.items() if not getattr(runner, "supports_prompt_cache", False)]
    if settings.prompt_cache and unsupported:
        why = ("the target runs in llama.cpp (backend 'llama-cpp'), which holds no torch cache to copy"
               if generator.backend == "llama-cpp" else
               "transformers re-encodes the whole prompt on the first assisted step")
        raise InvalidArgumentError(
            f"prompt_cache=True, but {', '.join(unsupported)} cannot start from a cached prompt ({why}); "
            "leave prompt_cache unset (auto) or False"
        )
    if settings.prompt_cache is None:  # auto
        settings = dataclasses.replace(settings, prompt_cache=not unsupported)
    store = RecordStore(out_dir)
    resumed = store.check_settings(run_identity(generator, settings))
    stored = store.load()
    prompt_sha = {pid: _ids_digest(prompt_ids) for pid, prompt_ids in encoded.items()}
    for rec in stored:
        if rec["prompt_id"] in prompt_sha and rec.get("prompt_sha") not in (None, prompt_sha[rec["prompt_id"]]):
            raise InvalidArgumentError(
                f"prompt {rec['prompt_id']!r} now encodes to different tokens than in {store.records_path} "
                "(another --chat setting, dataset text or tokenizer); use the same ones or another --out folder"
            )
    done = {record_key(rec) for rec in stored}
    plan = [(p, r, m) for p in prompts for r in range(settings.repeats) for m in runners]
    pending = [(p, r, m) for p, r, m in plan if (m, p.id, r) not in done]
    logger.info("%d generations planned, %d already done%s", len(plan), len(plan) - len(pending),
                " (resuming)" if resumed else "")
    if progress:
        progress(0, len(pending), "warm-up")
    todo_methods = list(dict.fromkeys(m for _, _, m in pending))
    prefixes: dict[str, PromptPrefix | None] = {}  # only the current prompt's is kept

    def prefix_of(prompt_id: str) -> PromptPrefix | None:
        if not settings.prompt_cache:
            return None
        if prompt_id not in prefixes:
            prefixes.clear()
            prefixes[prompt_id] = PromptPrefix.encode(model, encoded[prompt_id])
        return prefixes[prompt_id]

    warm_id = pending[0][0].id if pending else prompts[0].id
    warmup_s: dict[str, float] = {}
    for name in todo_methods:  # one short generation each: first-call allocations, lazy inits, compilation
        logger.info("warm-up: %s", name)
        prefix = prefix_of(warm_id)  # encoded outside the warm-up's time
        t0 = time.perf_counter()
        runners[name](encoded[warm_id], min(settings.warmup_tokens, settings.max_new_tokens), settings.seed, prefix)
        warmup_s[name] = time.perf_counter() - t0
        logger.info("warm-up of %s: %.2f s", name, warmup_s[name])
    for i, (prompt, repeat, name) in enumerate(pending, start=1):
        prefix = prefix_of(prompt.id)
        reset = _reset_peak_rss()
        seed = prompt_seed(settings.seed, prompt.id, repeat)
        out = runners[name](encoded[prompt.id], settings.max_new_tokens, seed, prefix)
        new_tokens = len(out["token_ids"])
        record = {
            "method": name,
            "prompt_id": prompt.id,
            "category": prompt.category,
            "repeat": repeat,
            "prompt_tokens": int(encoded[prompt.id].shape[1]),
            "prompt_cache_tokens": prefix.num_tokens if prefix is not None else 0,
            "prompt_cache_s": prefix.seconds if prefix is not None else None,
            "prompt_sha": prompt_sha[prompt.id],
            "new_tokens": new_tokens,
            "tokens_per_s": new_tokens / out["seconds"] if out["seconds"] > 0 else None,
            **out,
            "seed": None if settings.greedy else seed,
            "peak_rss_mb": _peak_rss_mb(),
            "peak_rss_scope": "generation" if reset else "process lifetime",
            "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        store.append(record)
        logger.debug("%s %s #%d: %d tokens in %.2f s", name, prompt.id, repeat, new_tokens, out["seconds"])
        if progress:
            progress(i, len(pending), f"{name} {prompt.id}")
    keys = {(m, p.id, r) for p, r, m in plan}
    records = [rec for rec in store.load() if record_key(rec) in keys]
    info = {
        "backend": generator.backend,  # what ran the target of specdecode's methods: "torch" or "llama-cpp"
        "environment": environment(generator),
        "identity": run_identity(generator, settings),
        "settings": settings.to_dict(),
        "methods": {name: {**runner.describe(), "warmup_s": warmup_s.get(name)} for name, runner in runners.items()},
        "skipped_methods": skipped,
        "categories": list(dict.fromkeys(p.category for p in prompts)),
        "num_prompts": len(prompts),
        "run_info": dict(run_info or {}),
    }
    return write_reports(out_dir, records, info)
