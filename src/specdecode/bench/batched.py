"""Throughput of batched decoding (``specdecode bench --batch-size B[,B...]``).

For each batch size B the prompts are cut into groups (per category, in dataset order, B at a
time; a category's leftover makes a smaller group), and every method decodes each group at
once, the methods interleaved group by group:

* a method of ``pipeline.BATCH_METHODS``: ``SpeculativeGenerator.batch_decoder`` (one per
  (method, B)); ``exit_rule=row|batch`` sets the adaptive draft exit's rule (with ``+adaptive``);
* ``hf-generate``: transformers ``model.generate`` on the left-padded group (pad ids first,
  ``attention_mask`` 0 there, as a ``padding_side="left"`` tokenizer pads), the pipeline's EOS
  ids; a row's new tokens end at its first EOS, included;
* ``NAME:decoder=single``: NAME's single-sequence ``SpeculativeDecoder``, one prompt at a time,
  at B = 1 only (the batched engine's batch-1 reference).

Names otherwise follow ``MethodSpec``. Before the timed groups of each B, each method decodes
the B's first group once, untimed, for ``warmup_tokens`` tokens (first-call allocations, lazy
inits, fast-path compilation): ``warmup_s``. Whole prompts are timed (no prompt cache).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from specdecode import method_registry, pipeline
from specdecode.bench.datasets import Prompt
from specdecode.bench.hf_methods import HF_METHODS, _HFRunner, _seeded
from specdecode.bench.methods import _OPTION_SPLIT, MethodSpec, _accepted_keywords, available_methods, build_decoder
from specdecode.bench.records import environment, run_identity
from specdecode.bench.report import format_value
from specdecode.bench.runner import prompt_seed
from specdecode.bench.settings import BenchSettings
from specdecode.engine import kv_cache
from specdecode.engine.protocol import BATCH_EXIT_RULES
from specdecode.errors import InvalidArgumentError
from specdecode.files import write_text_atomic

logger = logging.getLogger(__name__)

BATCHED_JSON = "batched_results.json"
BATCHED_MD = "batched_results.md"
HF_BATCH_METHOD = "hf-generate"
BATCH_ONLY_OPTIONS = ("exit_rule", "decoder")
SINGLE, BATCHED, TRANSFORMERS = "single", "batched", "transformers"
CAPACITY_MARGIN = 16  # cache positions past the longest prompt + max_new_tokens

BATCH_NOTES = MappingProxyType({
    "total tok/s": "sum of new tokens / sum of group wall seconds (time.perf_counter around one generate of the "
    "whole group, prefills included) over every group of the B",
    "per-request tok/s": "mean over requests of the request's new tokens / its own seconds (batched: its prefill + "
    "the rounds it took part in, not the other rows' prefills it waited for; hf-generate: the group's wall "
    "seconds; decoder=single: prefill + decode)",
    "speedup": "total tok/s / total tok/s of batched autoregressive (resp. hf-generate) at the same B",
    "acceptance": "accepted draft tokens / drafted tokens, summed over requests",
    "τ": "tokens per row and verification round, the bonus token counted (accepted + row-rounds) / row-rounds, "
    "summed over groups; 1.0 for autoregressive",
    "exact vs AR": "share of requests whose tokens equal batched autoregressive's at the same B (greedy only; in "
    "bfloat16 batch shapes and left padding may round differently; in float32 speculative methods must match)",
    "warm-up": "each method decodes the B's first group once, untimed, for warmup_tokens tokens, before timing",
})


def parse_batch_sizes(text: str | Sequence[str]) -> list[int]:
    """``"1,2,4"`` (or a list of such strings) -> sorted unique batch sizes.

    Raises:
        InvalidArgumentError: An item that is not an integer >= 1 (named), or no item at all.
    """
    sizes = []
    for item in (v.strip() for part in ([text] if isinstance(text, str) else text) for v in part.split(",")):
        if not item.isdigit() or int(item) < 1:
            raise InvalidArgumentError(
                f"--batch-size: {item!r} is not an integer >= 1; give a comma-separated list such as 1,2,4,8"
            )
        sizes.append(int(item))
    return sorted(set(sizes))


def batch_methods() -> list[str]:
    """The base methods a batched run takes: ``pipeline.BATCH_METHODS`` and ``hf-generate``."""
    return [*pipeline.BATCH_METHODS, HF_BATCH_METHOD]


@dataclass(frozen=True)
class BatchMethod:
    """One method of a batched run: ``MethodSpec`` syntax plus ``exit_rule=row|batch`` and
    ``decoder=single``.

    Attributes:
        name: The full string (its name in the records and the table).
        kind: ``"batched"`` (the batched engine), ``"single"`` (``SpeculativeDecoder``, B = 1
            only) or ``"transformers"`` (``hf-generate`` on the left-padded group).
        spec: The rest of the name, parsed by ``MethodSpec``.
        exit_rule: The adaptive draft exit's batch rule (``BATCH_EXIT_RULES``).
    """

    name: str
    kind: str
    spec: MethodSpec
    exit_rule: str = "row"

    @property
    def label(self) -> str:
        """The name as the table shows it."""
        return f"{self.name} (batch-1 decoder)" if self.kind == SINGLE else self.name

    @classmethod
    def parse(cls, name: str) -> BatchMethod:
        """Parse a method name of a batched run.

        Raises:
            InvalidArgumentError: No batch mode (the allowed methods are listed), a bad option or
                modifier, ``exit_rule`` without ``+adaptive`` or not in ``BATCH_EXIT_RULES``, a
                ``decoder`` but single/batched.
        """
        head, *modifiers = name.split("+")
        base, sep, text = head.partition(":")
        if base not in batch_methods():
            what = "has no batch mode" if base in available_methods() else "is unknown"
            raise InvalidArgumentError(
                f"method {name!r}: {base!r} {what}; allowed with --batch-size: {', '.join(batch_methods())} "
                "(as NAME[:KEY=VALUE,...][+MODIFIER...]; batch options: exit_rule=row|batch with +adaptive, "
                "decoder=single for the single-sequence decoder at B=1)"
            )
        extra, kept = {}, []
        for item in _OPTION_SPLIT.split(text) if sep else []:
            key, eq, value = item.partition("=")
            if eq and key in BATCH_ONLY_OPTIONS:
                extra[key] = value.strip()
            else:
                kept.append(item)
        rest = base + (":" + ",".join(kept) if kept else "") + "".join("+" + m for m in modifiers)
        spec = dataclasses.replace(MethodSpec.parse(rest), name=name)
        if base == HF_BATCH_METHOD:
            if extra:
                raise InvalidArgumentError(f"method {name!r}: {base!r} takes no options or modifiers")
            return cls(name, TRANSFORMERS, spec)
        decoder = extra.get("decoder", BATCHED)
        if decoder not in (SINGLE, BATCHED):
            raise InvalidArgumentError(f"method {name!r}: decoder={decoder!r}; allowed: single, batched")
        rule = extra.get("exit_rule")
        if rule is not None:
            if rule not in BATCH_EXIT_RULES:
                raise InvalidArgumentError(
                    f"method {name!r}: exit_rule={rule!r}; allowed: {', '.join(BATCH_EXIT_RULES)}"
                )
            if decoder == SINGLE or spec.draft_control is None or not spec.draft_control.adaptive_exit:
                raise InvalidArgumentError(
                    f"method {name!r}: exit_rule applies to the batched engine's adaptive draft exit; add +adaptive"
                    + (" and drop decoder=single" if decoder == SINGLE else "")
                )
        return cls(name, decoder, spec, rule or "row")


def default_batch_methods(generator: pipeline.SpeculativeGenerator, settings: BenchSettings) -> list[str]:
    """The methods of a batched run without ``--methods``: autoregressive, the draft model's (plain,
    adaptive exit with each rule, and its batch-1 reference) when there is one, prompt lookup,
    layer-skip/early-exit when the run's drafter options give a skip set or an exit layer, hf-generate."""
    draft = ["draft", "draft+adaptive", "draft:exit_rule=batch+adaptive", "draft:decoder=single"]
    options = settings.drafter_options
    return ["autoregressive", *(draft if generator.draft is not None else []), "prompt-lookup",
            *(["layer-skip"] if "skip_layers" in options or "skip_config" in options else []),
            *(["early-exit"] if "exit_layer" in options else []), HF_BATCH_METHOD]


def prompt_groups(prompts: Sequence[Prompt], batch_size: int) -> list[list[Prompt]]:
    """Per category (in order of first appearance), its prompts in dataset order, ``batch_size`` at a time."""
    by_category: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    return [ps[i : i + batch_size] for ps in by_category.values() for i in range(0, len(ps), batch_size)]


# ---------------------------------------------------------------------------------------------
# runners: decode one group, return (group seconds, per-request dicts, (verify tokens, verify forwards))


def _options(method: BatchMethod, settings: BenchSettings, takes: set[str] | None) -> dict:
    if method.spec.base == "autoregressive":
        return {}
    entry = method_registry.get(method.spec.base)
    takes_method = entry.options if entry is not None else frozenset()
    # Run-wide draft-model options go to the methods that take them (the registry's) alone.
    run_wide = {k: v for k, v in settings.drafter_options.items()
                if k not in ("draft_vocab_size", "draft_context_window", "max_model_prompt_tokens", "draft_tree_depth",
                             "draft_tree_expand", "draft_tree_shape", "prompt_lookup_datastore")
                or k in takes_method}
    options = {**run_wide, **method.spec.options}
    if takes is not None and not set(options) <= takes:
        raise InvalidArgumentError(
            f"method {method.name!r}: option(s) {', '.join(sorted(set(options) - takes))} are not taken in batch "
            f"mode; SpeculativeGenerator.batch_decoder takes: {', '.join(sorted(takes))}"
        )
    return options


def _runner(generator, method: BatchMethod, settings: BenchSettings, batch_size: int, positions: int) -> Callable:
    """``decode(ids, configs) -> (group seconds, per-request dicts, (verify tokens, verify forwards))``."""
    spec = method.spec
    gamma = spec.num_speculative_tokens or settings.num_speculative_tokens
    if method.kind == TRANSFORMERS:
        return functools.partial(_hf_group, _HFRunner(HF_METHODS[HF_BATCH_METHOD], generator, settings))
    compile_ = spec.compile if spec.compile is not None else settings.compile
    if method.kind == SINGLE:
        options = _options(method, settings, None)
        options.update({"draft_control": spec.draft_control} if spec.draft_control is not None else {})
        options.update({"compile": compile_} if compile_ is not None else {})
        return functools.partial(_single_group, build_decoder(generator, spec.base, options), gamma)
    control = spec.draft_control if spec.base != "autoregressive" else None
    block = max(gamma, control.max_draft_tokens if control is not None and control.adaptive_exit else 0)
    takes = _accepted_keywords(generator.batch_decoder)
    fixed = {"max_batch_size", "max_length", "num_speculative_tokens", "draft_control", "exit_rule", "compile"}
    decoder = generator.batch_decoder(
        spec.base, max_batch_size=batch_size, max_length=positions + max(CAPACITY_MARGIN, block + 1),
        num_speculative_tokens=gamma, draft_control=control, exit_rule=method.exit_rule,
        **({"compile": compile_} if compile_ is not None else {}),
        **_options(method, settings, None if takes is None else takes - fixed),
    )
    return functools.partial(_batched_group, decoder)


def _batched_group(decoder, ids: list[torch.Tensor], configs: list) -> tuple[float, list[dict], tuple[int, int]]:
    if decoder.compile and not decoder.warmed_up:  # the first (warm-up) group compiles every bucket
        decoder.warm_up()
    stats = decoder.stats
    accepted, rounds, compiling = stats.num_accepted_tokens, stats.num_row_rounds, decoder.compile_time_s
    t0 = time.perf_counter()
    results = decoder.generate(ids, configs)
    seconds = time.perf_counter() - t0 - (decoder.compile_time_s - compiling)  # compilation is warm-up
    rounds = stats.num_row_rounds - rounds
    rows = [_row(r.token_ids, r.finish_reason, r.stats.prefill_time_s + r.stats.decode_time_s,
                 r.stats.num_drafted_tokens, r.stats.num_accepted_tokens) for r in results]
    return seconds, rows, (stats.num_accepted_tokens - accepted + rounds, rounds)


def _single_group(decoder, gamma: int, ids: list[torch.Tensor], configs: list) -> tuple[float, list[dict], tuple]:
    seconds, rows, verify_tokens, verify_forwards = 0.0, [], 0, 0
    for one, config in zip(ids, configs):
        t0 = time.perf_counter()
        r = decoder.generate(one, dataclasses.replace(config, num_speculative_tokens=gamma))
        s = r.stats
        seconds += time.perf_counter() - t0 - s.warmup_s  # compilation is warm-up, never decoding
        rows.append(_row(r.token_ids, r.finish_reason, s.prefill_time_s + s.decode_time_s,
                         s.num_drafted_tokens, s.num_accepted_tokens))
        verify_tokens += s.num_accepted_tokens + s.num_target_forwards  # as the batched engine's τ
        verify_forwards += s.num_target_forwards
    return seconds, rows, (verify_tokens, verify_forwards)


def _hf_group(hf: _HFRunner, ids: list[torch.Tensor], configs: list) -> tuple[float, list[dict], tuple[int, int]]:
    model, width, max_new = hf.model, max(int(t.shape[1]) for t in ids), configs[0].max_new_tokens
    batch = torch.full((len(ids), width), hf.pad if hf.pad is not None else 0, dtype=torch.long, device=model.device)
    mask = torch.zeros_like(batch)
    for b, t in enumerate(ids):  # left padding
        batch[b, width - t.shape[1]:], mask[b, width - t.shape[1]:] = t[0].to(model.device), 1
    with _seeded(None if hf.settings.greedy else configs[0].seed, model.device), torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(batch, attention_mask=mask, generation_config=hf.generation_config(max_new))
        seconds = time.perf_counter() - t0
    rows = []
    for tokens in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(tokens) if t in hf.eos), None)
        tokens = tokens[:cut] if cut is not None else tokens
        finish = "eos" if cut is not None else ("length" if len(tokens) >= max_new else "other")
        rows.append(_row(tokens, finish, seconds, None, None))
    return seconds, rows, (0, 0)


def _row(tokens, finish, seconds, drafted, accepted) -> dict:
    return {"token_ids": list(tokens), "new_tokens": len(tokens), "seconds": seconds, "finish_reason": finish,
            "drafted": drafted, "accepted": accepted}


# ---------------------------------------------------------------------------------------------
# the run


def run_batched_bench(
    generator: pipeline.SpeculativeGenerator,
    prompts: Sequence[Prompt],
    methods: Sequence[str] | None,
    batch_sizes: Sequence[int],
    settings: BenchSettings | None = None,
    *,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[dict]:
    """Decode ``prompts`` in groups of each batch size with every method; one record per (method, B).

    Args:
        generator: The loaded target (and draft).
        prompts: Prompts with unique ids, grouped by category (``prompt_groups``).
        methods: ``BatchMethod`` names (None: ``default_batch_methods``).
        batch_sizes: B >= 1 each; ``decoder=single`` methods run at B = 1 only.
        settings: max_new_tokens, temperature, γ, seed, warmup_tokens, drafter options, ``compile``
            (``decoder=single`` only); repeats 1, no banned words, no prompt cache.
        progress: ``progress(done, total, description)``, before the first and after every timed group.

    Returns:
        Records in (B, method) order: ``method``, ``label``, ``kind``, ``batch_size``, ``groups``
        (prompt ids, wall ``seconds``), ``new_tokens``, ``seconds``, ``tokens_per_s`` and
        ``per_request_tokens_per_s`` (tokens/s), ``acceptance_rate``, ``mean_accepted_tokens`` (τ),
        ``exact_match_rate``, ``speedup_vs_ar``/``speedup_vs_hf`` (``compare``), ``warmup_s``
        (seconds) and ``outputs`` (per request: tokens, seconds).

    Raises:
        InvalidArgumentError: No prompts, duplicate ids, a bad batch size, method or setting, a
            prompt past the context length, ``decoder=single`` without B = 1, a missing draft model.
    """
    settings = settings or BenchSettings()
    prompts, sizes = list(prompts), sorted(set(batch_sizes))
    if not prompts:
        raise InvalidArgumentError("no prompts to benchmark (check the dataset, categories and limits)")
    if len({p.id for p in prompts}) != len(prompts):
        raise InvalidArgumentError("prompt ids must be unique")
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
        raise InvalidArgumentError(f"batch sizes must be integers >= 1, got {list(batch_sizes)!r}")
    if settings.repeats != 1 or settings.banned_words or settings.prompt_cache:
        raise InvalidArgumentError("batch mode runs each group once, without banned words or a prompt cache: "
                                   "leave --repeats, --banned-words-file and --prompt-cache unset")
    parsed = [BatchMethod.parse(m) for m in dict.fromkeys(methods or default_batch_methods(generator, settings))]
    if any(m.kind == SINGLE for m in parsed) and 1 not in sizes:
        raise InvalidArgumentError("decoder=single methods are reported at B=1: add 1 to --batch-size")
    encoded = {p.id: generator.encode(p.text, p.chat) for p in prompts}
    for p in prompts:
        try:
            kv_cache.check_context_length(generator.target.model, encoded[p.id].shape[1], settings.max_new_tokens)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"prompt {p.id!r}: {e}") from None
    positions = max(int(t.shape[1]) for t in encoded.values()) + settings.max_new_tokens
    for m in parsed:  # every requirement before anything runs (batch caches allocate on first use)
        _runner(generator, m, settings, 1, positions)
    plan = {b: [m for m in parsed if m.kind != SINGLE or b == 1] for b in sizes}
    groups = {b: prompt_groups(prompts, b) for b in sizes}
    total, done = sum(len(groups[b]) * len(plan[b]) for b in sizes), 0
    if progress:
        progress(0, total, "warm-up")

    max_new = settings.max_new_tokens

    def configs(group: list[Prompt], max_new_tokens: int) -> list:
        return [settings.generation_config(max_new_tokens, prompt_seed(settings.seed, p.id, 0)) for p in group]

    records = []
    for b in sizes:
        runners = {m.name: _runner(generator, m, settings, b, positions) for m in plan[b]}
        acc = {m.name: {"groups": [], "outputs": [], "verify": [0, 0], "warmup_s": None} for m in plan[b]}
        warm = groups[b][0]
        for m in plan[b]:
            t0 = time.perf_counter()
            runners[m.name]([encoded[p.id] for p in warm], configs(warm, min(settings.warmup_tokens, max_new)))
            acc[m.name]["warmup_s"] = time.perf_counter() - t0
            logger.info("warm-up of %s at B=%d: %.2f s", m.name, b, acc[m.name]["warmup_s"])
        for group in groups[b]:
            for m in plan[b]:
                ids = [encoded[p.id] for p in group]
                seconds, rows, verify = runners[m.name](ids, configs(group, max_new))
                a = acc[m.name]
                a["groups"].append({"category": group[0].category, "prompt_ids": [p.id for p in group],
                                    "seconds": seconds, "new_tokens": sum(r["new_tokens"] for r in rows)})
                a["outputs"] += [{"prompt_id": p.id, "category": p.category, **r} for p, r in zip(group, rows)]
                a["verify"] = [a["verify"][0] + verify[0], a["verify"][1] + verify[1]]
                done += 1
                logger.debug("%s B=%d %s: %.2f s", m.name, b, group[0].id, seconds)
                if progress:
                    progress(done, total, f"B={b} {m.name}")
        records += [_summary(m, b, acc[m.name]) for m in plan[b]]
        del runners
    compare(records, settings.greedy)
    return records


def _summary(method: BatchMethod, batch_size: int, acc: Mapping[str, Any]) -> dict:
    outputs = acc["outputs"]
    new_tokens, seconds = sum(o["new_tokens"] for o in outputs), math.fsum(g["seconds"] for g in acc["groups"])
    rates = [o["new_tokens"] / o["seconds"] for o in outputs if o["seconds"] > 0]
    drafted = sum(o["drafted"] or 0 for o in outputs)
    verify_tokens, verify_forwards = acc["verify"]
    return {
        "method": method.name, "label": method.label, "kind": method.kind, "base_method": method.spec.base,
        "exit_rule": method.exit_rule if method.kind == BATCHED else None, "batch_size": batch_size,
        "requests": len(outputs), "new_tokens": new_tokens, "seconds": seconds,
        "tokens_per_s": new_tokens / seconds if seconds > 0 else None,
        "per_request_tokens_per_s": statistics.fmean(rates) if rates else None,
        "drafted": drafted, "accepted": sum(o["accepted"] or 0 for o in outputs),
        "acceptance_rate": sum(o["accepted"] or 0 for o in outputs) / drafted if drafted else None,
        "mean_accepted_tokens": verify_tokens / verify_forwards if verify_forwards else None,
        "warmup_s": acc["warmup_s"], "groups": acc["groups"], "outputs": outputs,
    }


def compare(records: list[dict], greedy: bool = True) -> None:
    """Set ``speedup_vs_ar``, ``speedup_vs_hf`` and ``exact_match_rate`` of every record, in place.

    The baselines at each B are the batched ``autoregressive`` record and the ``hf-generate``
    record of that B; a value is None when its baseline is missing (or has no tokens/s), and
    ``exact_match_rate`` also when sampling (``greedy`` False) or for the AR record itself.
    """
    for r in records:
        b = r["batch_size"]
        ar = next((x for x in records if x["batch_size"] == b and x["kind"] == BATCHED
                   and x["base_method"] == "autoregressive"), None)
        hf = next((x for x in records if x["batch_size"] == b and x["kind"] == TRANSFORMERS), None)
        for key, base in (("speedup_vs_ar", ar), ("speedup_vs_hf", hf)):
            ok = base is not None and base["tokens_per_s"] and r["tokens_per_s"] is not None
            r[key] = r["tokens_per_s"] / base["tokens_per_s"] if ok else None
        r["exact_match_rate"] = r["exact_matches"] = r["compared"] = None
        if greedy and ar is not None and r is not ar:
            ref = {o["prompt_id"]: o["token_ids"] for o in ar["outputs"]}
            same = [o["token_ids"] == ref[o["prompt_id"]] for o in r["outputs"] if o["prompt_id"] in ref]
            r["compared"], r["exact_matches"] = len(same), sum(same)
            r["exact_match_rate"] = sum(same) / len(same) if same else None


# ---------------------------------------------------------------------------------------------
# the table

TABLE_COLUMNS = ("B", "method", "total tok/s", "per-request tok/s", "speedup vs batched AR", "speedup vs hf-generate",
                 "acceptance", "τ", "exact vs AR")


def table_rows(records: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """The table's cells (``TABLE_COLUMNS``), one row per record, formatted."""
    rows = []
    for r in records:
        is_ar = r["kind"] == BATCHED and r["base_method"] == "autoregressive"
        exact = "ref" if is_ar else format_value(r.get("exact_match_rate"), "{:.0%}")
        rows.append([str(r["batch_size"]), r["label"], format_value(r["tokens_per_s"], "{:.1f}"),
                     format_value(r["per_request_tokens_per_s"], "{:.1f}"),
                     format_value(r.get("speedup_vs_ar"), "{:.2f}×"), format_value(r.get("speedup_vs_hf"), "{:.2f}×"),
                     format_value(r["acceptance_rate"], "{:.1%}"), format_value(r["mean_accepted_tokens"]), exact])
    return rows


def batched_markdown(results: Mapping[str, Any]) -> str:
    """Markdown report: a header (models, dtype, max_new_tokens, prompts per B, CPU model and flags,
    torch threads), the throughput table (``TABLE_COLUMNS``) and the definitions (``BATCH_NOTES``)."""
    ident, env = results.get("identity", {}), results.get("environment", {})
    flags = [f for f, on in (env.get("cpu_flags") or {}).items() if on]
    lines = [
        "# specdecode bench: batched throughput", "",
        f"Target `{ident.get('target')}`, draft `{ident.get('draft')}`, {ident.get('dtype')} on {ident.get('device')} "
        f"({env.get('cpu_model') or env.get('cuda_device') or '?'}; CPU flags: {', '.join(flags) or 'none known'}; "
        f"{env.get('torch_threads')} torch threads); max_new_tokens {ident.get('max_new_tokens')}, temperature "
        f"{ident.get('temperature')}, γ {ident.get('num_speculative_tokens')}; {results.get('num_prompts')} prompts "
        f"per B ({', '.join(results.get('categories', []))}), in groups of B prompts of one category.", "",
        "| " + " | ".join(TABLE_COLUMNS) + " |",
        "|" + "|".join(["---:", "---"] + ["---:"] * (len(TABLE_COLUMNS) - 2)) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results["records"])]
    lines += ["", "Definitions:", ""] + [f"- **{k}**: {v}" for k, v in results.get("notes", BATCH_NOTES).items()]
    return "\n".join(lines) + "\n"


def write_batched_results(out_dir: str | Path, generator: pipeline.SpeculativeGenerator, prompts: Sequence[Prompt],
                          settings: BenchSettings, records: list[dict], run_info: Mapping | None = None) -> dict:
    """Write ``BATCHED_JSON`` (records, settings, environment) and ``BATCHED_MD`` into ``out_dir``,
    each atomically; returns the JSON's content. These files are rewritten whole by every run."""
    results = {
        "identity": run_identity(generator, settings),
        "environment": environment(generator),
        "settings": settings.to_dict(),
        "batch_sizes": sorted({r["batch_size"] for r in records}),
        "categories": list(dict.fromkeys(p.category for p in prompts)),
        "num_prompts": len(prompts),
        "run_info": dict(run_info or {}),
        "notes": dict(BATCH_NOTES),
        "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "records": records,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / BATCHED_JSON, json.dumps(results, indent=1) + "\n")
    write_text_atomic(out / BATCHED_MD, batched_markdown(results))
    return results
