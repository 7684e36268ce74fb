"""Tables and plots of a run: speedups, throughput, acceptance and agreement.

``summarize`` turns records into metrics per method and category (``NOTES`` defines
them), ``write_reports`` writes results.json, results.md (``markdown_report``) and the
three PNGs (``plot_speedups``, ``plot_acceptance``, ``plot_draft_sizes``; matplotlib is
imported when they run).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType
from typing import Any

from specdecode.files import write_png_atomic, write_text_atomic

# Target-only decoding, the speedup baselines: transformers' generate (eager and with a compiled
# static cache) and our autoregressive loop (with any compile option, see ``is_baseline``).
BASELINES = ("hf-generate", "hf-generate-static", "autoregressive")
REFERENCE_METHOD = "autoregressive"  # token agreement is measured against its output
LLAMA_CPP = "llama-cpp"  # llama.cpp on the target's GGUF file: a reference column, never a speedup baseline
LLAMA_CPP_LOOKUP = "llama-cpp-lookup"  # llama-cpp-python's own prompt-lookup speculation: a reference too
LLAMA_CPP_REFERENCES = (LLAMA_CPP, LLAMA_CPP_LOOKUP)  # never a baseline; run only when named
LLAMA_CPP_BACKEND = "llama-cpp"  # the run's target in llama.cpp (results' "backend"; ``SpeculativeGenerator.backend``)
OVERALL = "overall"
RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
SPEEDUP_PNG = "speedup_by_category.png"
ACCEPTANCE_PNG = "acceptance_by_position.png"
DRAFT_SIZES_PNG = "draft_sizes.png"
#: Depths whose acceptance the markdown table shows (results.json has every depth).
TABLE_DEPTHS = 4


def tokens_per_second(new_tokens: Sequence[int], seconds: Sequence[float]) -> float | None:
    """Aggregate throughput: total new tokens / total seconds (not the mean of per-prompt rates).

    Returns None when no time was spent.
    """
    total_s = math.fsum(seconds)
    return sum(new_tokens) / total_s if total_s > 0 else None


def is_baseline(method: str, baselines: Sequence[str] = BASELINES) -> bool:
    """Whether ``method`` may serve as speedup baseline: a name of ``baselines``, or one with
    options (``autoregressive:compile=1``: target-only decoding whatever its options; the
    transformers methods take none). Never a llama.cpp reference (``LLAMA_CPP_REFERENCES``)."""
    return method not in LLAMA_CPP_REFERENCES and (method in baselines or method.partition(":")[0] in baselines)


def speedups(
    tokens_per_s: Mapping[str, float | None], baselines: Sequence[str] = BASELINES
) -> tuple[dict[str, float | None], str | None]:
    """Speedup of each method over the fastest baseline present.

    Args:
        tokens_per_s: Method name -> aggregated tokens/s (None: not measured).
        baselines: The methods that may serve as baseline, with their option variants
            (``is_baseline``).

    Returns:
        (method -> tokens/s ÷ the fastest baseline's tokens/s, or None; the baseline's name,
        or None when no baseline was measured). ``LLAMA_CPP`` and ``LLAMA_CPP_LOOKUP`` are never a baseline, even if
        listed in ``baselines``: they run another engine on quantized weights.
    """
    measured = {m: v for m, v in tokens_per_s.items() if is_baseline(m, baselines) and v}
    if not measured:
        return {m: None for m in tokens_per_s}, None
    ref = max(measured, key=measured.__getitem__)
    return {m: (v / measured[ref] if v is not None else None) for m, v in tokens_per_s.items()}, ref


def first_divergence(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first position where ``tokens`` and ``reference`` differ (None: identical).

    When one is a prefix of the other, the shorter length.
    """
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


NOTES = MappingProxyType({
    "tokens_per_s": "new tokens / wall seconds (time.perf_counter around one whole generation), aggregated as total new tokens / total seconds over the category's prompts for each repeat; "
    "'tokens_per_s' is the median over repeats, 'tokens_per_s_min'/'_max' the spread. With the prompt cache "
    "(settings.prompt_cache, the default) every prompt but its last token is encoded once, untimed, and each "
    "method starts from a copy of that target cache, so the time covers the last prompt token, the draft "
    "model's own prompt encoding (method 'draft') and decoding; without it (and always when hf-assisted or "
    "hf-prompt-lookup is in the run, which cannot start from a cache) the whole prompt is timed",
    "speedup": "tokens_per_s / tokens_per_s of the fastest target-only baseline in the same category: hf-generate, "
    "hf-generate-static (transformers' static cache with a compiled forward) or autoregressive (any of its "
    "compile variants); never llama-cpp or llama-cpp-lookup, reference columns",
    "warmup_s": "wall seconds of each method's one warm-up generation (warmup_tokens tokens, before the timed "
    "runs) in this call; compilation (hf-generate-static, specdecode's fast path) happens there and never in "
    "tokens_per_s. None: the method had nothing left to run (resumed), so it was not warmed up",
    "vs_llama_cpp": "tokens_per_s / llama-cpp's tokens_per_s in the same category (when llama-cpp ran): llama.cpp "
    "(llama-cpp-python) runs the target's GGUF file target-only with its quantized kernels, the same prompt ids, "
    "EOS, max_new_tokens, greedy settings, thread count and timing; its weights differ from the de-quantized "
    "target's, so its tokens may differ too (with backend 'llama-cpp' our methods run that same file in llama.cpp, "
    "with the same threads and KV cache type); vs_llama_cpp_lookup: the same against llama-cpp-lookup",
    "agreement_vs_llama_cpp": "exact_match_rate_vs_llama_cpp: share of generations whose whole token sequence "
    "equals llama-cpp's (llama.cpp's own greedy decoding of the GGUF file) on the same prompt and repeat; "
    "mean_first_divergence_vs_llama_cpp: mean index of the first differing token among the others. With backend "
    "'llama-cpp' greedy outputs match where llama.cpp's kernels give a token the same logits in a k-token "
    "verification as in a single step (float32 weights); on quantized weights a k-token batch may round "
    "differently, and this rate says how often it changed the output",
    "acceptance_rate": "accepted draft tokens / drafted tokens; transformers methods: estimated from the target's "
    "forward input lengths (drafted) and new tokens - target forwards (accepted)",
    "mean_accepted_tokens": "tau: tokens per verifying target forward, the bonus/replacement token COUNTED "
    "(target-only decoding gives 1.0); specdecode excludes the prefill and its token, transformers methods "
    "count every forward (their first forward verifies candidates together with the prompt)",
    "target_forwards_per_token": "target forward passes (prefill included) / new tokens",
    "acceptance_by_position": "acceptance by depth: at depth d (a chain's d-th token, a tree's d-th level), "
    "blocks whose token at depth d was accepted / blocks that drafted depth d (accepted_by_position / "
    "drafted_by_position, summed over generations); the table shows depths 1..4",
    "mean_draft_size": "tokens (chains) or nodes (trees) drafted per verification, plain steps counting 0 "
    "(draft_size_histogram: entry n counts verifications of n; draft_sizes.png plots it); mean_draft_cap: the "
    "size the draft policy allowed per round (a cost model's choice), which a drafter may not fill (prompt "
    "lookup without a match drafts 0)",
    "agreement": "exact_match_rate: share of generations whose whole token sequence equals autoregressive's on "
    "the same prompt and repeat; mean_first_divergence: mean index of the first differing token among the "
    "others. In bfloat16 a k-token verification forward may round differently from a 1-token step, so greedy "
    "outputs can diverge late; in float32 they must match. Under sampling (temperature > 0) outputs differ by "
    "design and agreement says nothing about correctness",
    "peak_rss_mb": "peak resident set size of the whole process in MB (both models included), max over the "
    "category's generations; scope 'generation' when the kernel's peak mark was reset before each generation "
    "(Linux), else the process-lifetime peak",
})


def _agreement(records: list[dict]) -> None:
    """Annotate each record with ``exact_match`` and ``first_divergence`` vs. autoregressive's output, and
    ``exact_match_llama_cpp`` and ``first_divergence_llama_cpp`` vs. llama-cpp's (None where it did not run)."""
    for reference_method, suffix in ((REFERENCE_METHOD, ""), (LLAMA_CPP, "_llama_cpp")):
        reference = {(r["prompt_id"], r["repeat"]): r["token_ids"] for r in records
                     if r["method"] == reference_method}
        for r in records:
            ref = reference.get((r["prompt_id"], r["repeat"]))
            if ref is None or r["method"] == reference_method:
                r["exact_match" + suffix] = r["first_divergence" + suffix] = None
            else:
                r["first_divergence" + suffix] = first_divergence(r["token_ids"], ref)
                r["exact_match" + suffix] = r["first_divergence" + suffix] is None


def _sum_positions(records: Iterable[dict], key: str) -> list[int]:
    total: list[int] = []
    for r in records:
        values = r.get(key) or []
        if len(values) > len(total):
            total.extend([0] * (len(values) - len(total)))
        for i, v in enumerate(values):
            total[i] += v
    return total


def summarize(records: Sequence[dict]) -> dict:
    """Metrics per method, per category and overall (see ``NOTES``), speedups included.

    Args:
        records: Bench records (with ``exact_match``/``first_divergence`` set by the agreement pass).

    Returns:
        ``{"methods": {method: {category or "overall": metrics}}, "baselines": {category: baseline
        method used for its speedups, or None}}``.
    """
    methods = list(dict.fromkeys(r["method"] for r in records))
    categories = list(dict.fromkeys(r["category"] for r in records))
    summary: dict[str, dict[str, dict]] = {m: {} for m in methods}
    baselines: dict[str, str | None] = {}
    for cat in [*categories, OVERALL]:
        for m in methods:
            rs = [r for r in records if r["method"] == m and (cat == OVERALL or r["category"] == cat)]
            if rs:
                summary[m][cat] = _metrics(rs)
        tps = {m: summary[m][cat]["tokens_per_s"] for m in methods if cat in summary[m]}
        sp, baselines[cat] = speedups(tps)
        for m, v in sp.items():
            summary[m][cat]["speedup"] = v
            for reference, key in ((LLAMA_CPP, "vs_llama_cpp"), (LLAMA_CPP_LOOKUP, "vs_llama_cpp_lookup")):
                ref = tps.get(reference)
                summary[m][cat][key] = tps[m] / ref if ref and tps[m] is not None else None
    return {"methods": summary, "baselines": baselines}


def _metrics(rs: list[dict]) -> dict:
    by_repeat: dict[int, list[dict]] = {}
    for r in rs:
        by_repeat.setdefault(r["repeat"], []).append(r)
    rates = [
        v for v in (tokens_per_second([r["new_tokens"] for r in g], [r["seconds"] for r in g])
                    for g in by_repeat.values()) if v is not None
    ]
    drafted = sum(r["drafted"] or 0 for r in rs)
    compared = [r for r in rs if r.get("exact_match") is not None]
    diverged = [r["first_divergence"] for r in compared if not r["exact_match"]]
    vs_llama = [r for r in rs if r.get("exact_match_llama_cpp") is not None]
    diverged_llama = [r["first_divergence_llama_cpp"] for r in vs_llama if not r["exact_match_llama_cpp"]]
    new_tokens = sum(r["new_tokens"] for r in rs)
    peaks = [r["peak_rss_mb"] for r in rs if r.get("peak_rss_mb") is not None]
    drafted_pos = _sum_positions(rs, "drafted_by_position")
    accepted_pos = _sum_positions(rs, "accepted_by_position")
    sizes = _sum_positions(rs, "rounds_by_draft_size")
    caps = _sum_positions(rs, "rounds_by_draft_cap")
    return {
        "prompts": len({r["prompt_id"] for r in rs}),
        "generations": len(rs),
        "new_tokens": new_tokens,
        "seconds": math.fsum(r["seconds"] for r in rs),
        "tokens_per_s": statistics.median(rates) if rates else None,
        "tokens_per_s_min": min(rates) if rates else None,
        "tokens_per_s_max": max(rates) if rates else None,
        "speedup": None,
        "acceptance_rate": _ratio(sum(r["accepted"] or 0 for r in rs), drafted) if drafted else None,
        "mean_accepted_tokens": _ratio(sum(r["verify_tokens"] for r in rs), sum(r["verify_forwards"] for r in rs)),
        "target_forwards_per_token": _ratio(sum(r["target_forwards"] for r in rs), new_tokens),
        "exact_match_rate": len([r for r in compared if r["exact_match"]]) / len(compared) if compared else None,
        "mean_first_divergence": statistics.fmean(diverged) if diverged else None,
        "compared": len(compared),
        "exact_match_rate_vs_llama_cpp": (len([r for r in vs_llama if r["exact_match_llama_cpp"]]) / len(vs_llama)
                                          if vs_llama else None),
        "mean_first_divergence_vs_llama_cpp": statistics.fmean(diverged_llama) if diverged_llama else None,
        "compared_vs_llama_cpp": len(vs_llama),
        "peak_rss_mb": max(peaks) if peaks else None,
        "banned_word_rollbacks": sum(r.get("banned_word_rollbacks") or 0 for r in rs),
        "banned_word_discarded_tokens": sum(r.get("banned_word_discarded_tokens") or 0 for r in rs),
        "drafted_by_position": drafted_pos,
        "accepted_by_position": accepted_pos,
        "acceptance_by_position": [a / d if d else None for a, d in zip(accepted_pos, drafted_pos)],
        "draft_size_histogram": sizes,
        "mean_draft_size": _histogram_mean(sizes),
        "draft_cap_histogram": caps,
        "mean_draft_cap": _histogram_mean(caps),
    }


def _histogram_mean(histogram: Sequence[int]) -> float | None:
    """The mean value a histogram counts (entry n: how many times n), or None when it counts nothing."""
    total = sum(histogram)
    return sum(n * c for n, c in enumerate(histogram)) / total if total else None


def _depths_text(rates: Sequence[float | None] | None) -> str:
    """Acceptance at depths 1..``TABLE_DEPTHS``, as "0.81/0.64/0.50/0.41" ("–" where none was drafted)."""
    rates = list(rates or [])[:TABLE_DEPTHS]
    return "/".join(format_value(r) for r in rates) if rates else "–"


def write_reports(out_dir: str | Path, records: list[dict], info: Mapping[str, Any]) -> dict:
    """Write results.json, results.md and the PNGs from ``records``; returns results.json's content."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = [dict(r) for r in records]
    _agreement(records)
    summary = summarize(records)
    results = {
        **info,
        "baseline": "per category, the fastest (highest median tokens/s) of " + ", ".join(BASELINES)
        + " and their option variants (autoregressive:compile=0|1)",
        "baselines_used": summary["baselines"],
        "summary": summary["methods"],
        "notes": dict(NOTES),
        "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "records": records,
    }
    write_text_atomic(out / RESULTS_JSON, json.dumps(results, indent=1) + "\n")
    write_text_atomic(out / RESULTS_MD, markdown_report(results))
    categories = [c for c in info.get("categories", []) if any(c in s for s in summary["methods"].values())]
    plot_speedups(summary["methods"], categories, out / SPEEDUP_PNG)
    plot_acceptance(summary["methods"], out / ACCEPTANCE_PNG)
    plot_draft_sizes(summary["methods"], out / DRAFT_SIZES_PNG)
    return results


def format_value(v, fmt: str = "{:.2f}", none: str = "–") -> str:
    return none if v is None else fmt.format(v)


def _quantized(ident: Mapping[str, Any]) -> str:
    q, dq = ident.get("quantize", "none"), ident.get("draft_quantize", "none")
    text = "" if q == "none" else f" with {q} weight-only quantized linear layers"
    if ident.get("quantize_head") == "int4":
        text += " (int4 LM head)"
    dhead = " and LM head" if ident.get("draft_quantize_head") == "int4" else ""
    if dq != q or (dhead and ident.get("quantize_head") != "int4"):
        text += f" (draft: {dq} weights{dhead})"
    if ident.get("prepacked_linears"):
        text += f", linear layers on oneDNN's kernel ({' and '.join(ident['prepacked_linears'])}; prepacked)"
    return text


def _target_text(results: Mapping[str, Any]) -> str:
    """How the target ran: its dtype and torch quantization, or with backend 'llama-cpp' its GGUF file in llama.cpp."""
    ident = results.get("identity", {})
    if results.get("backend") != LLAMA_CPP_BACKEND:
        return f"{ident.get('dtype')}{_quantized(ident)}"
    about = results.get("environment", {}).get("llama_cpp_target", {})
    return (f"backend llama-cpp: the target's GGUF file `{about.get('gguf_file')}` in llama.cpp "
            f"({about.get('n_threads')} threads, {about.get('kv_cache_type')} KV cache)")


def _agreement_text(method: str, o: Mapping[str, Any]) -> str:
    """The 'Exact match vs llama.cpp' cell: the rate, with the mean first divergence where some differ."""
    if method == LLAMA_CPP:
        return "ref"
    text = format_value(o.get("exact_match_rate_vs_llama_cpp"), "{:.0%}")
    if o.get("mean_first_divergence_vs_llama_cpp") is not None:
        text += f" (1st diff @{o['mean_first_divergence_vs_llama_cpp']:.0f})"
    return text


def _by_category_vs_llama_cpp(summary: Mapping[str, Mapping[str, dict]], cats: Sequence[str]) -> list[str]:
    """Tok/s ÷ llama-cpp's and ÷ llama-cpp-lookup's per category and overall, with the agreement with llama-cpp's
    tokens (issue 30's criteria are per category); no lines when neither reference ran."""
    lines: list[str] = []
    for reference, key in ((LLAMA_CPP, "vs_llama_cpp"), (LLAMA_CPP_LOOKUP, "vs_llama_cpp_lookup")):
        if not summary.get(reference, {}).get(OVERALL):
            continue
        agreement = reference == LLAMA_CPP
        head = ["Method", *cats, OVERALL, *(["Exact match vs llama.cpp"] if agreement else [])]
        lines += ["", f"Tok/s ÷ `{reference}`'s tok/s, by category:", "", "| " + " | ".join(head) + " |",
                  "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
        for method, by_cat in summary.items():
            cells = [format_value(by_cat.get(c, {}).get(key), "{:.2f}×") for c in [*cats, OVERALL]]
            if agreement:
                cells.append(_agreement_text(method, by_cat.get(OVERALL, {})))
            lines.append("| " + " | ".join([f"`{method}`", *cells]) + " |")
    return lines


def markdown_report(results: Mapping[str, Any]) -> str:
    """A Spec-Bench-style leaderboard: methods × (category speedups, overall tokens/s, speedup, α, τ, agreement)."""
    summary = results["summary"]
    cats = [c for c in results.get("categories", []) if any(c in s for s in summary.values())]
    ident, env = results.get("identity", {}), results.get("environment", {})
    head = ["Method", *[f"{c} speedup" for c in cats], "Overall tok/s (min–max)", "Overall speedup",
            "Acceptance α", "α by depth 1/2/3/4", "Draft size (cap)", "τ (incl. bonus)", "Fwd/token", "Exact match vs AR", "Peak RSS MB", "Warm-up s"]
    described = results.get("methods", {})
    llama = summary.get(LLAMA_CPP, {}).get(OVERALL)
    lookup = summary.get(LLAMA_CPP_LOOKUP, {}).get(OVERALL)
    on_llama = results.get("backend") == LLAMA_CPP_BACKEND  # our methods' target runs in llama.cpp
    if lookup:
        head.insert(head.index("Overall speedup") + 1, "vs llama-cpp-lookup")
    if llama:
        head.insert(head.index("Overall speedup") + 1, "vs llama.cpp")
    if llama and on_llama:
        head.insert(head.index("Exact match vs AR") + 1, "Exact match vs llama.cpp")
    lines = [
        "# specdecode bench",
        "",
        f"Target `{ident.get('target')}`, draft `{ident.get('draft')}`, {_target_text(results)} on "
        f"{ident.get('device')} ({env.get('cpu_model') or env.get('cuda_device') or '?'}, "
        f"{env.get('torch_threads')} torch threads); max_new_tokens {ident.get('max_new_tokens')}, "
        f"temperature {ident.get('temperature')}, γ {ident.get('num_speculative_tokens')}"
        f"{'' if 'compile' not in ident else ', compile ' + str(ident['compile']).lower()}; "
        f"{results.get('num_prompts')} prompts × {results.get('settings', {}).get('repeats')} repeat(s).",
        "",
        "Speedup: against the fastest target-only baseline (hf-generate, hf-generate-static, autoregressive) in "
        f"each category (baseline used: {', '.join(f'{c}: {b}' for c, b in results.get('baselines_used', {}).items())})"
        ". Tokens/s = total new tokens / total seconds, median over repeats. Warm-up s: the method's warm-up "
        "generation, where compilation happens (never in tok/s).",
        "",
    ]
    if llama:
        threads = results.get("methods", {}).get(LLAMA_CPP, {}).get("n_threads")
        lines += [
            f"`{LLAMA_CPP}` is a reference column, not a speedup baseline: llama.cpp runs the target's GGUF file "
            f"target-only ({threads} threads) at {format_value(llama.get('tokens_per_s'))} tok/s overall; "
            "vs llama.cpp = a method's overall tok/s ÷ llama-cpp's.",
            "",
        ]
    if lookup:
        about = results.get("methods", {}).get(LLAMA_CPP_LOOKUP, {})
        lines += [
            f"`{LLAMA_CPP_LOOKUP}` is a reference column too, not a speedup baseline: llama-cpp-python's own "
            f"prompt-lookup speculation (LlamaPromptLookupDecoding, num_pred_tokens {about.get('num_pred_tokens')}, "
            f"max_ngram_size {about.get('max_ngram_size')}, {about.get('n_threads')} threads) on the same GGUF file "
            f"at {format_value(lookup.get('tokens_per_s'))} tok/s overall.",
            "",
        ]
    lines += [
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|",
    ]
    for method, by_cat in summary.items():
        o = by_cat.get(OVERALL, {})
        agree = "ref" if method == REFERENCE_METHOD else format_value(o.get("exact_match_rate"), "{:.0%}")
        if o.get("mean_first_divergence") is not None:
            agree += f" (1st diff @{o['mean_first_divergence']:.0f})"
        row = [
            f"`{method}`",
            *[format_value(by_cat.get(c, {}).get("speedup"), "{:.2f}×") for c in cats],
            f"{format_value(o.get('tokens_per_s'))} "
            f"({format_value(o.get('tokens_per_s_min'))}–{format_value(o.get('tokens_per_s_max'))})",
            format_value(o.get("speedup"), "{:.2f}×"),
            *([format_value(o.get("vs_llama_cpp"), "{:.2f}×")] if llama else []),
            *([format_value(o.get("vs_llama_cpp_lookup"), "{:.2f}×")] if lookup else []),
            format_value(o.get("acceptance_rate"), "{:.1%}"),
            _depths_text(o.get("acceptance_by_position")),
            f"{format_value(o.get('mean_draft_size'))} ({format_value(o.get('mean_draft_cap'))})",
            format_value(o.get("mean_accepted_tokens")),
            format_value(o.get("target_forwards_per_token")),
            agree,
            *([_agreement_text(method, o)] if llama and on_llama else []),
            format_value(o.get("peak_rss_mb"), "{:.0f}"),
            format_value(described.get(method, {}).get("warmup_s"), "{:.1f}"),
        ]
        lines.append("| " + " | ".join(row) + " |")
    lines += _by_category_vs_llama_cpp(summary, cats)
    skipped = results.get("skipped_methods") or {}
    if skipped:
        lines += ["", "Skipped: " + "; ".join(f"`{m}` ({why})" for m, why in skipped.items())]
    hf = {m: d for m, d in results.get("methods", {}).items() if d.get("assistant_generation_config")}
    for m, d in hf.items():
        lines += ["", f"`{m}` assistant settings (transformers defaults): "
                  + ", ".join(f"{k}={v}" for k, v in d["assistant_generation_config"].items())]
    lines += ["", "Definitions:", ""] + [f"- **{k}**: {v}" for k, v in results.get("notes", {}).items()]
    return "\n".join(lines) + "\n"


def plot_speedups(summary: Mapping[str, Mapping[str, dict]], categories: Sequence[str], path: Path) -> None:
    """Grouped bars: speedup of every method per category and overall (1.0 = baseline)."""
    from matplotlib.figure import Figure

    groups = [*categories, OVERALL]
    methods = list(summary)
    fig = Figure(figsize=(min(24.0, max(6.0, 0.25 * len(groups) * len(methods) + 2.0)), 4.5))
    ax = fig.subplots()
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(groups))]
        ys = [(summary[m].get(c) or {}).get("speedup") or 0.0 for c in groups]
        ax.bar(xs, ys, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right")
    ax.set_ylabel("speedup vs faster baseline (×)")
    ax.set_title("Speedup by category")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    write_png_atomic(fig, path)


def plot_acceptance(summary: Mapping[str, Mapping[str, dict]], path: Path) -> None:
    """Acceptance rate by draft position (accepted ÷ drafted at position i) of every drafting method."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 4.0))
    ax = fig.subplots()
    plotted = False
    for m, by_cat in summary.items():
        rates = (by_cat.get(OVERALL) or {}).get("acceptance_by_position") or []
        if any(r is not None for r in rates):
            xs = [i + 1 for i, r in enumerate(rates) if r is not None]
            ax.plot(xs, [r for r in rates if r is not None], marker="o", label=m)
            plotted = True
    if plotted:
        ax.legend(fontsize="small")
        ax.xaxis.get_major_locator().set_params(integer=True)
    else:
        ax.text(0.5, 0.5, "no method recorded drafted tokens by position", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position")
    write_png_atomic(fig, path)


def plot_draft_sizes(summary: Mapping[str, Mapping[str, dict]], path: Path) -> None:
    """Grouped bars: the share of verifications that checked a draft of each size (0: a plain step), per
    drafting method (``draft_size_histogram``, overall)."""
    from matplotlib.figure import Figure

    histograms = {m: (by_cat.get(OVERALL) or {}).get("draft_size_histogram") or [] for m, by_cat in summary.items()}
    histograms = {m: h for m, h in histograms.items() if sum(h[1:]) > 0}  # methods that drafted
    fig = Figure(figsize=(7.0, 4.0))
    ax = fig.subplots()
    if histograms:
        largest = max(len(h) for h in histograms.values())
        width = 0.8 / len(histograms)
        for j, (m, h) in enumerate(histograms.items()):
            total = sum(h)
            xs = [n + (j - (len(histograms) - 1) / 2) * width for n in range(len(h))]
            ax.bar(xs, [c / total for c in h], width, label=m)
        ax.set_xticks(range(largest))
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no method drafted", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("draft size per verification (tokens of a chain, nodes of a tree; 0 = a plain step)")
    ax.set_ylabel("share of verifications")
    ax.set_title("Draft sizes chosen")
    write_png_atomic(fig, path)
