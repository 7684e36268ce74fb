"""Command line: ``specdecode generate ...``, ``specdecode bench ...`` (parsed in ``specdecode.bench``)
and ``specdecode search ...`` (the library part is ``specdecode.search``). The only modules that print."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from specdecode import bench
from specdecode.config import GenerationConfig
from specdecode.draft_control import LENGTH_SCHEDULES, DraftControl
from specdecode.errors import SpecDecodeError
from specdecode.pipeline import DEFAULT_DRAFT, DEFAULT_TARGET, METHODS

EXIT_BAD_INPUT = 2


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from one prompt, speculatively or not")
    p.add_argument("--target", default=DEFAULT_TARGET, help="offline model name, .gguf file, folder or hub id")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model (method 'draft')")
    p.add_argument("--method", default="draft", choices=METHODS)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the chat template (default: when the tokenizer has one)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--num-speculative-tokens", "-g", type=int, default=GenerationConfig.num_speculative_tokens,
                   help="gamma: tokens drafted per target forward")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats) only")
    g = p.add_argument_group("self-speculative and model-free drafting")
    skip = g.add_mutually_exclusive_group()
    skip.add_argument("--skip-layers", metavar="SPEC", default=None,
                      help="layer-skip: sublayers the draft skips, e.g. 'attn=2,15,18;mlp=2,15,18'")
    skip.add_argument("--skip-config", metavar="FILE", default=None,
                      help='layer-skip: JSON file {"skip_set": {"attn": [...], "mlp": [...]}, ...} or bare')
    g.add_argument("--exit-layer", type=int, metavar="N", default=None,
                   help="early-exit: the draft runs the first N decoder layers (1..L-1)")
    g.add_argument("--prompt-lookup-max-ngram", type=int, default=3, help="prompt-lookup: longest n-gram matched")
    g.add_argument("--prompt-lookup-min-ngram", type=int, default=1, help="prompt-lookup: shortest n-gram matched")
    c = p.add_argument_group("draft length control")
    c.add_argument("--adaptive-draft-exit", action="store_true",
                   help="Draft & Verify adaptive draft exit: stop drafting below a self-tuning confidence "
                        "threshold (blocks up to --max-draft-tokens instead of -g)")
    c.add_argument("--draft-exit-threshold", type=float, default=DraftControl.exit_threshold,
                   help="initial adaptive draft-exit threshold")
    c.add_argument("--max-draft-tokens", type=int, default=DraftControl.max_draft_tokens,
                   help="most tokens per block with --adaptive-draft-exit")
    c.add_argument("--draft-length-schedule", choices=LENGTH_SCHEDULES, default="constant",
                   help="constant: -g tokens per block; heuristic: +2 after a fully accepted block, -1 otherwise")
    c.add_argument("--confidence-gate", type=float, metavar="THRESHOLD", default=None,
                   help="make a plain target step whenever the target's probability of its last token is below this")


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def _print_stats(stats: dict, method: str, console) -> None:
    from rich.table import Table

    table = Table(title=f"specdecode {method}", show_header=False)
    rows = [
        ("prompt tokens", "num_prompt_tokens"),
        ("new tokens", "num_new_tokens"),
        ("target forwards (after prefill)", "num_target_forwards"),
        ("draft forwards", "num_draft_forwards"),
        ("drafted tokens", "num_drafted_tokens"),
        ("accepted tokens", "num_accepted_tokens"),
        ("acceptance rate (accepted / drafted)", "acceptance_rate"),
        ("mean accepted tokens per target forward (incl. bonus)", "mean_accepted_tokens"),
        ("acceptance by draft position", "acceptance_by_position"),
        ("final adaptive draft-exit threshold", "final_draft_threshold"),
        ("gated steps (target confidence below the gate)", "num_gated_steps"),
        ("prefill time (s)", "prefill_time_s"),
        ("decode time (s)", "decode_time_s"),
        ("tokens/s (incl. prefill)", "tokens_per_s"),
        ("decode tokens/s", "decode_tokens_per_s"),
    ]
    for label, key in rows:
        table.add_row(label, _fmt(stats.get(key)))
    console.print(table)


def _check_method_options(args) -> None:
    """Fail fast on method options that need no model to check."""
    from specdecode.errors import InvalidArgumentError
    from specdecode.layer_skip import SkipSet
    from specdecode.prompt_lookup import PromptLookupDrafter

    if args.skip_layers is not None:
        SkipSet.parse(args.skip_layers)
    if args.skip_config is not None:
        SkipSet.from_json(args.skip_config)
    if args.method == "layer-skip" and args.skip_layers is None and args.skip_config is None:
        raise InvalidArgumentError(
            "--method layer-skip needs a skip set: --skip-layers 'attn=2,15;mlp=3' or --skip-config FILE.json"
        )
    if args.method == "early-exit" and args.exit_layer is None:
        raise InvalidArgumentError("--method early-exit needs --exit-layer N (the draft runs layers 0..N-1)")
    if args.exit_layer is not None and args.exit_layer < 1:
        raise InvalidArgumentError(f"--exit-layer {args.exit_layer} is out of range: it must be in 1..L-1")
    if args.method == "prompt-lookup":
        PromptLookupDrafter(args.prompt_lookup_max_ngram, args.prompt_lookup_min_ngram)


def cmd_generate(args) -> int:
    import torch
    from transformers import TextStreamer

    from specdecode.pipeline import SpeculativeGenerator

    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        num_speculative_tokens=args.num_speculative_tokens,
        stop_strings=tuple(args.stop),
    )
    if not args.prompt.strip():
        raise SpecDecodeError("the prompt is empty: pass some text with --prompt")
    _check_method_options(args)  # before minutes of model loading
    control = DraftControl(
        adaptive_exit=args.adaptive_draft_exit,
        exit_threshold=args.draft_exit_threshold,
        max_draft_tokens=args.max_draft_tokens,
        length_schedule=args.draft_length_schedule,
        confidence_gate=args.confidence_gate,
    )
    options = dict(
        skip_layers=args.skip_layers,
        skip_config=args.skip_config,
        exit_layer=args.exit_layer,
        prompt_lookup_max_ngram=args.prompt_lookup_max_ngram,
        prompt_lookup_min_ngram=args.prompt_lookup_min_ngram,
        draft_control=control if control.active else None,
    )
    draft = args.draft if args.method == "draft" else None
    gen = SpeculativeGenerator.from_pretrained(args.target, draft, dtype=args.dtype, device=args.device)
    stream = gen.stream(args.prompt, config, method=args.method, chat=args.chat, **options)
    if args.json:
        for _ in stream:
            pass
        text = gen.tokenizer.decode(stream.token_ids, skip_special_tokens=True)
        out = {
            "text": text,
            "token_ids": stream.token_ids,
            "finish_reason": stream.finish_reason,
            "method": args.method,
            "target": args.target,
            "draft": draft,
            "skip_layers": args.skip_layers,
            "skip_config": args.skip_config,
            "exit_layer": args.exit_layer,
            "draft_control": dataclasses.asdict(control) if control.active else None,
            "dtype": str(gen.target.model.dtype).removeprefix("torch."),
            "device": str(gen.target.model.device),
            "stats": stream.stats.to_dict(),
        }
        sys.stdout.write(json.dumps(out) + "\n")
        return 0
    from rich.console import Console

    printer = TextStreamer(gen.tokenizer, skip_special_tokens=True)
    for ids in stream:
        printer.put(torch.tensor(ids))
    printer.end()
    _print_stats(stream.stats.to_dict(), args.method, Console(stderr=False))
    return 0


# Defaults of ``specdecode.search.SearchSettings`` (not imported here: optuna is an optional
# dependency that ``generate`` and ``bench`` must not need); tests/test_search.py checks they agree.
SEARCH_DEFAULTS = argparse.Namespace(
    calibration="humaneval", num_prompts=4, prompt_offset=0, max_new_tokens=64, trials=100,
    objective="modelled", sampler="tpe", min_skip_fraction=0.0, max_skip_fraction=1.0, max_gamma=12,
    remeasure=3, timing_repeats=5, heartbeat_interval_s=10,
)
SEARCH_OBJECTIVES = ("modelled", "measured")
SEARCH_SAMPLERS = ("tpe", "gp")


def _add_search(sub) -> None:
    d = SEARCH_DEFAULTS
    p = sub.add_parser(
        "search",
        help="search the layer-skip set with Optuna (Bayesian optimisation; resumable, distributed)",
        description="Search which attention/MLP sublayers the layer-skip drafter should skip. The study lives in "
                    "a database: rerunning the same command resumes it, and several workers started with the same "
                    "--storage and --study-name share it. Writes best.json (for generate --skip-config) and plots.",
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help="offline model name, .gguf file, folder or hub id")
    p.add_argument("--calibration", default=d.calibration, metavar="FILE|spec-bench[:CATEGORY]|humaneval",
                   help=f"calibration prompts (default {d.calibration})")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts,
                   help=f"calibration prompts used (default {d.num_prompts})")
    p.add_argument("--prompt-offset", type=int, default=d.prompt_offset,
                   help="skip this many calibration prompts first, e.g. to keep held-out prompts out (default 0)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="override the dataset's chat-template default")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help=f"tokens per greedy continuation / measured generation (default {d.max_new_tokens})")
    p.add_argument("--trials", type=int, default=d.trials,
                   help=f"finished trials the study should hold in total, over all runs and workers "
                        f"(default {d.trials})")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="stop starting trials after S seconds of optimisation (finished trials are kept)")
    p.add_argument("--storage", default=None, metavar="URL",
                   help="SQLAlchemy URL of the study database (default sqlite:///<folder of --out>/<study>.db)")
    p.add_argument("--study-name", default=None, help="default <model>-<dtype>-<objective>")
    p.add_argument("--objective", choices=SEARCH_OBJECTIVES, default=d.objective,
                   help="modelled: teacher-forced acceptance and measured sublayer costs (fast); measured: real "
                        f"decoding tokens/s (default {d.objective})")
    p.add_argument("--sampler", choices=SEARCH_SAMPLERS, default=d.sampler,
                   help=f"tpe: TPESampler; gp: GPSampler, needs scipy (default {d.sampler})")
    p.add_argument("--min-skip-fraction", type=float, default=d.min_skip_fraction, metavar="F",
                   help="fewest sublayers skipped, as a fraction of the 2L (default 0)")
    p.add_argument("--max-skip-fraction", type=float, default=d.max_skip_fraction, metavar="F",
                   help="most sublayers skipped, as a fraction of the 2L (default 1)")
    p.add_argument("--max-gamma", type=int, default=d.max_gamma,
                   help=f"largest gamma the modelled objective considers (default {d.max_gamma})")
    p.add_argument("--num-speculative-tokens", "-g", type=int, default=None,
                   help="gamma of measured decoding (default: 5 for --objective measured, each set's modelled "
                        "best gamma when re-measuring)")
    p.add_argument("--remeasure", type=int, default=d.remeasure, metavar="K",
                   help=f"after a modelled search, decode the K best distinct sets for real; best.json takes the "
                        f"best measured one (default {d.remeasure}; 0: the best modelled one)")
    p.add_argument("--timing-repeats", type=int, default=d.timing_repeats,
                   help=f"timed repeats of each cost measurement (default {d.timing_repeats})")
    p.add_argument("--heartbeat-interval", type=int, default=d.heartbeat_interval_s, metavar="S",
                   help=f"seconds between a running trial's heartbeats; a trial silent for 2x this is marked "
                        f"failed and re-queued (default {d.heartbeat_interval_s})")
    p.add_argument("--seed", type=int, default=None, help="sampler seed (default random; differ per worker)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="search-out/best.json", help="best.json path; plots go beside it")
    p.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True,
                   help="write the plots beside best.json (default on)")


def cmd_search(args) -> int:
    """``specdecode search``: validate, load, run the study, write best.json and plots."""
    from pathlib import Path

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from specdecode.models import load_model

    try:
        from specdecode import search
    except ImportError as e:
        raise SpecDecodeError(f"specdecode search needs optuna ({e}): pip install 'specdecode[search]'") from None

    settings = search.SearchSettings(
        trials=args.trials, objective=args.objective, sampler=args.sampler, timeout_s=args.timeout,
        calibration=args.calibration, num_prompts=args.num_prompts, prompt_offset=args.prompt_offset,
        chat=args.chat, max_new_tokens=args.max_new_tokens, max_gamma=args.max_gamma,
        num_speculative_tokens=args.num_speculative_tokens, min_skip_fraction=args.min_skip_fraction,
        max_skip_fraction=args.max_skip_fraction, remeasure=args.remeasure, seed=args.seed,
        timing_repeats=args.timing_repeats, heartbeat_interval_s=args.heartbeat_interval,
    )
    if not args.verbose:
        search.optuna.logging.set_verbosity(search.optuna.logging.WARNING)
    # Everything that needs no model first: a bad URL or file fails in a second, not after the load.
    storage = search.open_storage(args.storage, settings.heartbeat_interval_s) if args.storage else None
    prompts = search.load_calibration_prompts(
        settings.calibration, settings.num_prompts, offset=settings.prompt_offset, chat=settings.chat
    )
    err = Console(stderr=True)
    with err.status(f"loading {args.target}"):
        loaded = load_model(args.target, dtype=args.dtype, device=args.device)
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    study_name = args.study_name or search.default_study_name(args.target, dtype, settings.objective)
    out = Path(args.out)
    if storage is None:
        out.parent.mkdir(parents=True, exist_ok=True)
        storage = search.open_storage(search.default_storage_url(out, study_name), settings.heartbeat_interval_s)
    url = search.redact_url(str(storage.url))
    runner = search.SkipSetSearch(loaded, settings, storage, study_name, prompts)
    try:
        with err.status(f"study {study_name!r}: calibrating (once per study)"):
            runner.prepare()
        best = runner.best_value()
        bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("best {task.fields[best]}"), TimeElapsedColumn(), console=err)
        task = bar.add_task(f"{settings.objective} trials", total=settings.trials,
                            completed=min(runner.num_finished(), settings.trials),
                            best="-" if best is None else f"{best:.3f}x")

        def on_trial(done: int, total: int, best_value: float | None) -> None:
            bar.update(task, completed=min(done, total), best="-" if best_value is None else f"{best_value:.3f}x")

        with bar:
            runner.optimize(progress=on_trial)
        remeasured = []
        if settings.objective == "modelled" and settings.remeasure:
            with err.status(f"re-measuring the {settings.remeasure} best sets by real decoding"):
                remeasured = runner.remeasure()
        result = runner.write_outputs(out, remeasured, plots=args.plots)
    except KeyboardInterrupt:
        err.print(f"interrupted: the finished trials are kept in {url} (study {study_name!r}); "
                  "run the same command again to resume")
        return 130
    table = Table(title=f"specdecode search: {study_name} ({result['num_trials']} trials)")
    for col in ("", "skip set", "gamma", "modelled", "measured", "acceptance (real)"):
        table.add_column(col)
    rows = result["remeasured"] or [{"trial": result["trial"], "attn": result["attn"], "mlp": result["mlp"],
                                     "modelled": result["modelled"], "measured": result["measured"]}]
    for r in rows:
        m, mm = r["modelled"] or {}, r["measured"] or {}
        table.add_row(
            "best" if r["trial"] == result["trial"] else f"trial {r['trial']}",
            f"attn={','.join(map(str, r['attn']))};mlp={','.join(map(str, r['mlp']))}",
            str(mm.get("num_speculative_tokens") or m.get("best_gamma") or "-"),
            "-" if m.get("speedup") is None else f"{m['speedup']:.3f}x (alpha {m['alpha']:.3f})",
            "-" if mm.get("speedup") is None else f"{mm['speedup']:.3f}x",
            _fmt(mm.get("acceptance_rate")),
        )
    console = Console()
    console.print(table)
    console.print(f"best.json selected by {result['selected_by']}; written: {', '.join(result['files'])}")
    console.print(f"storage: {url}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description="Speculative decoding for Hugging Face models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (model loading) to stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    bench.add_parser(sub)
    _add_search(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return {"generate": cmd_generate, "bench": bench.run, "search": cmd_search}[args.command](args)
    except SpecDecodeError as e:
        print(f"specdecode: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
