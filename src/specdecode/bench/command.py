"""The ``specdecode bench`` command: load the models, run ``run_bench``, print a summary.

A command-line module: it prints (a status line and progress bar on stderr, the summary
table on stdout, with rich). Its parser is ``specdecode.cli``'s ``_add_bench``, and
``specdecode.cli`` calls ``run``.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from specdecode import defaults, method_registry, pipeline
from specdecode.bench.hf_methods import HF_METHODS
from specdecode.bench.llamacpp import check_available
from specdecode.bench.methods import DRAFTER_OPTIONS, MethodSpec, available_methods, check_method_names
from specdecode.bench.records import RECORDS_FILE, SETTINGS_FILE, RecordStore
from specdecode.bench.report import (ACCEPTANCE_PNG, DRAFT_SIZES_PNG, LLAMA_CPP, LLAMA_CPP_LOOKUP,
                                     LLAMA_CPP_REFERENCES, OVERALL, REFERENCE_METHOD, RESULTS_JSON, RESULTS_MD,
                                     SPEEDUP_PNG, format_value)
from specdecode.bench.runner import run_bench
from specdecode.bench.settings import BenchSettings
from specdecode.config import parse_logit_bias
from specdecode.drafters.draft_tree import check_tree_flags
from specdecode.engine.banned_words import read_banned_words
from specdecode.errors import InvalidArgumentError
from specdecode.models.llama_cpp_target import check_llama_cpp_target_options
from specdecode.models.quantize import (  # noqa: F401  (the flag checks were defined here before)
    check_draft_quantize_head_flag,
    check_quantize_group_size_flag,
)


def _split_list(values: Sequence[str] | None, separator: str = ",") -> list[str] | None:
    if not values:
        return None
    return [v for item in values for v in re.split(separator, item) if v]


def _method_separator() -> str:
    """Commas followed by a method name: "layer-skip:skip_layers=mlp=5,7,num_speculative_tokens=1" stays whole."""
    names = "|".join(re.escape(m) for m in sorted(available_methods(), key=len, reverse=True))
    return rf",(?=(?:{names})(?:[:+,]|$))"


def _drafter_options(args) -> dict:
    options = dict(args.drafter_option)
    for opt in DRAFTER_OPTIONS:
        value = getattr(args, f"drafter_{opt.keyword}")
        if value is not None:
            options[opt.keyword] = value
    return options


def _draft_spec(args) -> str | None:
    if args.draft is None:
        return pipeline.DEFAULT_DRAFT if args.target == pipeline.DEFAULT_TARGET else None
    return None if args.draft.lower() in ("none", "") else args.draft


def _bench_draft_scheme(args) -> tuple[str, str]:
    """The draft's quantization in bench (--draft-quantize, else --quantize) and where it came from, in flag words."""
    given = args.draft_quantize is not None
    scheme = args.draft_quantize if given else args.quantize
    why = f"--draft-quantize {scheme}" if given else f"as --quantize {scheme}"
    if scheme == "none" and not given:
        why += "; unlike generate, bench quantizes the draft only when told"
    return scheme, why


def _check_draft_flags(args) -> None:
    """--draft-quantize and --draft-quantize-head need a draft model, and --draft-quantize-head
    one quantized to fit it (the draft's quantization here: --draft-quantize, else --quantize);
    --quantize-group-size other than 32 needs an int4 target or draft; --draft-tree-expand and
    --draft-tree-shape need --draft-tree-depth (else every draft-model method would be skipped as unavailable).

    Raises:
        InvalidArgumentError: One of them is given without a draft; --draft-quantize-head int4
            with a draft that is not int4, or any --draft-quantize-head with a dense draft;
            --quantize-group-size 64, 128 or 256 with neither model int4; a tree flag without the depth.
    """
    check_tree_flags(*(getattr(args, f"drafter_draft_tree_{name}", None) for name in ("depth", "expand", "shape")))
    for flag in ("draft_quantize", "draft_quantize_head"):
        if getattr(args, flag, None) is not None and _draft_spec(args) is None:
            raise InvalidArgumentError(
                f"--{flag.replace('_', '-')} needs a draft model (--draft); use --quantize for the target"
            )
    head = getattr(args, "draft_quantize_head", None)
    if head is not None:
        check_draft_quantize_head_flag(head, *_bench_draft_scheme(args))
    if _draft_spec(args) is None:
        draft, why = None, "--draft none" if args.draft is not None else "none by default with this --target"
    else:
        draft, why = _bench_draft_scheme(args)
    check_quantize_group_size_flag(getattr(args, "quantize_group_size", None), args.quantize, draft, why)


def _prepack(args, specs: Sequence[MethodSpec]) -> bool | None:
    """``prepack_linears`` for the run's models (``defaults.prepack_by_default``, which refuses
    --prepack-linears with a compiling method): the fast path is asked for by --compile or a method's
    ``compile=1`` (``specs``: the run's parsed methods), and ``hf-generate-static`` compiles the target too."""
    compiles = [f"--methods {spec.name}" for spec in specs if spec.compile or spec.base == "hf-generate-static"]
    return defaults.prepack_by_default(args.prepack_linears, "--compile" if args.compile else
                                       (compiles[0] if compiles else None))


def _check_backend(args, methods: Sequence[str] | None) -> None:
    """--backend llama-cpp: the flags and named methods that cannot run with the target in llama.cpp, refused
    before anything loads (the same refusals as the pipeline's, in the flags' words).

    Raises:
        InvalidArgumentError: --batch-size (one sequence at a time), --compile, --prompt-cache, the torch
            loading flags (``check_llama_cpp_target_options``), or a named transformers method or method that
            the llama.cpp target refuses (``method_registry.LLAMA_CPP_TARGET_REFUSALS``).
    """
    if getattr(args, "backend", "torch") != "llama-cpp":
        return
    if getattr(args, "batch_size", None) is not None:
        raise InvalidArgumentError(
            f"--batch-size {args.batch_size} decodes several rows at once, but with --backend llama-cpp the target "
            "runs one sequence at a time (llama.cpp's multi-sequence batches are not built): leave --batch-size out"
        )
    for flag, value in (("--compile", args.compile), ("--prompt-cache", args.prompt_cache)):
        if value:
            what = "compiles torch forwards" if flag == "--compile" else "copies a torch target's KV cache"
            raise InvalidArgumentError(f"{flag} {what}, but with --backend llama-cpp the target runs in llama.cpp: "
                                       f"leave {flag} out")
    check_llama_cpp_target_options(dtype=args.dtype, device=args.device, quantize=args.quantize,
                                   draft_quantize=args.draft_quantize, draft_quantize_head=args.draft_quantize_head,
                                   quantize_group_size=args.quantize_group_size, draft_backend=None,
                                   prepack_linears=args.prepack_linears)
    for name in methods or ():
        base = name.partition("+")[0].partition(":")[0]
        why = ("it runs transformers' generate on the target's torch model, and the target in llama.cpp has none"
               if base in HF_METHODS else method_registry.LLAMA_CPP_TARGET_REFUSALS.get(base))
        if why is not None:
            raise InvalidArgumentError(
                f"method {name!r} does not run with --backend llama-cpp: {why}; leave it out (llama.cpp's own "
                f"decoding: {', '.join(LLAMA_CPP_REFERENCES)}), or use --backend torch"
            )


def run(args) -> int:
    """``specdecode bench``: load the models once, run ``run_bench``, print a summary. Returns the exit code."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)
    from rich.table import Table

    from specdecode.bench.datasets import load_prompts

    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        num_speculative_tokens=args.num_speculative_tokens,
        repeats=args.repeats,
        seed=args.seed,
        warmup_tokens=args.warmup_tokens,
        drafter_options=_drafter_options(args),
        prompt_cache=args.prompt_cache,
        banned_words=tuple(read_banned_words(args.banned_words_file)) if args.banned_words_file else (),
        banned_words_ignore_case=args.banned_words_ignore_case,
        banned_words_whole_word=args.banned_words_whole_word,
        compile=args.compile,
        repetition_penalty=args.repetition_penalty,  # [processors]
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        min_p=args.min_p,
        logit_bias=parse_logit_bias(args.logit_bias),
    )
    methods = _split_list(args.methods, _method_separator())
    _check_backend(args, methods)
    if getattr(args, "batch_size", None) is not None:
        return _run_batched(args, settings, methods)
    if methods is not None:
        methods = check_method_names(methods)
    _check_draft_flags(args)
    llama_methods = [m for m in methods or () if m in LLAMA_CPP_REFERENCES]
    if llama_methods:  # their extra and the target's GGUF file, before loading
        settings = dataclasses.replace(settings, gguf_file=str(check_available(args.target, method=llama_methods[0])))
    prompts = load_prompts(
        args.dataset,
        categories=_split_list(args.categories),
        limit_per_category=args.limit_per_category,
        limit=args.limit,
        chat=args.chat,
    )
    err = Console(stderr=True)
    with err.status(f"loading {args.target}" + (f" and {_draft_spec(args)}" if _draft_spec(args) else "")):
        generator = pipeline.SpeculativeGenerator.from_pretrained(
            args.target, _draft_spec(args), dtype=args.dtype, device=args.device, quantize=args.quantize,
            draft_quantize=args.draft_quantize, draft_quantize_head=args.draft_quantize_head,
            quantize_group_size=args.quantize_group_size, backend=getattr(args, "backend", "torch"),
            prepack_linears=_prepack(args, [MethodSpec.parse(m) for m in methods or ()]),
        )
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn())
    # A whole-run average for the ETA (rich's default averages the last 30 s only).
    bar = Progress(*columns, console=err, speed_estimate_period=7 * 24 * 3600.0)
    task = bar.add_task("bench", total=None)

    def on_progress(done: int, total: int, description: str) -> None:
        bar.update(task, completed=done, total=total, description=description)

    info = {"dataset": args.dataset, "command_line": shlex.join(sys.argv), "chat": args.chat}
    try:
        with bar:
            results = run_bench(generator, prompts, methods, settings, args.out, progress=on_progress,
                                run_info=info)
    except KeyboardInterrupt:
        kept = len(RecordStore(args.out).load()) if Path(args.out, SETTINGS_FILE).is_file() else 0
        err.print(f"interrupted: {kept} finished record(s) kept in {Path(args.out) / RECORDS_FILE}; "
                  "run the same command again to resume")
        return 130
    on_llama = results.get("backend") == "llama-cpp"
    table = Table(title=f"specdecode bench: {len(prompts)} prompts, {args.dataset}"
                  + (", target in llama.cpp (--backend llama-cpp)" if on_llama else ""))
    llama = LLAMA_CPP in results["summary"]  # a reference column: our tok/s next to llama.cpp's
    lookup = LLAMA_CPP_LOOKUP in results["summary"]
    agree = llama and on_llama  # greedy tokens against llama.cpp's own, the same file
    for col in ("method", "tok/s", "speedup", *(["vs llama.cpp"] if llama else []),
                *(["vs llama-cpp-lookup"] if lookup else []), "acceptance", "τ", "exact match vs AR",
                *(["exact match vs llama.cpp"] if agree else []), "warm-up s"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for method, by_cat in results["summary"].items():
        o = by_cat[OVERALL]
        table.add_row(method, format_value(o["tokens_per_s"]), format_value(o["speedup"], "{:.2f}×"),
                      *([format_value(o.get("vs_llama_cpp"), "{:.2f}×")] if llama else []),
                      *([format_value(o.get("vs_llama_cpp_lookup"), "{:.2f}×")] if lookup else []),
                      format_value(o["acceptance_rate"], "{:.1%}"), format_value(o["mean_accepted_tokens"]),
                      "ref" if method == REFERENCE_METHOD else format_value(o["exact_match_rate"], "{:.0%}"),
                      *(["ref" if method == LLAMA_CPP else format_value(o.get("exact_match_rate_vs_llama_cpp"),
                                                                         "{:.0%}")] if agree else []),
                      format_value(results["methods"].get(method, {}).get("warmup_s"), "{:.1f}"))
    out = Console()
    out.print(table)
    out.print(f"results in {Path(args.out).resolve()}: {RESULTS_MD}, {RESULTS_JSON}, {SPEEDUP_PNG}, {ACCEPTANCE_PNG}, "
              f"{DRAFT_SIZES_PNG}")
    return 0


def _run_batched(args, settings: BenchSettings, methods: list[str] | None) -> int:
    """``specdecode bench --batch-size ...``: the throughput table of ``run_batched_bench``, printed and
    written to --out (batched_results.json, batched_results.md). Returns the exit code."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from specdecode.bench.batched import (BATCHED_JSON, BATCHED_MD, TABLE_COLUMNS, BatchMethod, parse_batch_sizes,
                                          run_batched_bench, table_rows, write_batched_results)
    from specdecode.bench.datasets import load_prompts

    sizes = parse_batch_sizes(args.batch_size)  # every check that needs no model, before loading one
    for name in methods or ():
        BatchMethod.parse(name)
    if args.repeats != 1 or settings.banned_words or args.prompt_cache:
        raise InvalidArgumentError("--batch-size runs each group once, whole prompts, no banned words: leave "
                                   "--repeats, --prompt-cache and --banned-words-file out")
    _check_draft_flags(args)
    prompts = load_prompts(args.dataset, categories=_split_list(args.categories),
                           limit_per_category=args.limit_per_category, limit=args.limit, chat=args.chat)
    err = Console(stderr=True)
    with err.status(f"loading {args.target}" + (f" and {_draft_spec(args)}" if _draft_spec(args) else "")):
        generator = pipeline.SpeculativeGenerator.from_pretrained(
            args.target, _draft_spec(args), dtype=args.dtype, device=args.device, quantize=args.quantize,
            draft_quantize=args.draft_quantize, draft_quantize_head=args.draft_quantize_head,
            quantize_group_size=args.quantize_group_size,
            prepack_linears=_prepack(args, [BatchMethod.parse(m).spec for m in methods or ()]),
        )
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=err)
    task = bar.add_task("bench", total=None)

    def on_progress(done: int, total: int, description: str) -> None:
        bar.update(task, completed=done, total=total, description=description)

    try:
        with bar:
            records = run_batched_bench(generator, prompts, methods, sizes, settings, progress=on_progress)
    except KeyboardInterrupt:
        err.print("interrupted: batch mode keeps no partial results")
        return 130
    info = {"dataset": args.dataset, "command_line": shlex.join(sys.argv), "chat": args.chat}
    write_batched_results(args.out, generator, prompts, settings, records, info)
    table = Table(title=f"specdecode bench --batch-size: {len(prompts)} prompts per B, {args.dataset}")
    for col in TABLE_COLUMNS:
        table.add_column(col, justify="left" if col == "method" else "right")
    for row in table_rows(records):
        table.add_row(*row)
    out = Console()
    out.print(table)
    out.print(f"results in {Path(args.out).resolve()}: {BATCHED_MD}, {BATCHED_JSON}")
    return 0
