"""Command line: argument parsing for ``specdecode generate|bench|search|serve``.

``generate`` runs in ``specdecode.generate_command``, ``bench`` in
``specdecode.bench.command``, ``search`` in ``specdecode.search.command`` and ``serve``
in ``specdecode.serve.command``. These and the command modules are the only code that prints.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from specdecode import bench
from specdecode.config import DEFAULT_NUM_SPECULATIVE_TOKENS, GenerationConfig
from specdecode.defaults import PREPACK_HELP
from specdecode.errors import SpecDecodeError
from specdecode.generate_command import (
    add_generate_parser,
    add_processor_arguments,
    add_quantize_arguments,
    run_generate,
)
from specdecode.models.llama_cpp_target import TARGET_BACKENDS
from specdecode.models.quantize import QUANTIZE_SCHEMES
from specdecode.pipeline import DEFAULT_DRAFT, DEFAULT_TARGET

EXIT_BAD_INPUT = 2

# Defaults of ``specdecode.search.SearchSettings`` (not imported here: optuna is an optional
# dependency that ``generate`` and ``bench`` must not need); tests/search/test_search_command.py checks they agree.
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
                   help=f"gamma of measured decoding (default: {DEFAULT_NUM_SPECULATIVE_TOKENS} for --objective measured, each set's modelled "
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
    p.add_argument("--quantize", default="none", choices=QUANTIZE_SCHEMES,
                   help="weight-only quantized linear layers on CPU: a different model from the unquantized "
                   "one, searched in its own study (default none)")
    p.add_argument("--prepack-linears", action=argparse.BooleanOptionalAction, default=None,
                   help=PREPACK_HELP + "; a prepacked model is searched in its own study (its sublayers cost "
                   "differently)")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="search-out/best.json", help="best.json path; plots go beside it")
    p.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True,
                   help="write the plots beside best.json (default on)")


def _run_search(args) -> int:
    """Hand ``specdecode search`` to ``specdecode.search.command`` (optuna is an optional extra)."""
    try:
        from specdecode.search import command as search_command
    except ImportError as e:
        raise SpecDecodeError(f"specdecode search needs optuna ({e}): pip install 'specdecode[search]'") from None
    return search_command.run(args)


def _run_bench(args) -> int:
    from specdecode.bench import command as bench_command

    return bench_command.run(args)


# ---------------------------------------------------------------------------------------------
# bench


def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def _add_bench(sub) -> argparse.ArgumentParser:
    """Register ``specdecode bench`` (run by ``specdecode.bench.command``)."""
    p = sub.add_parser(
        "bench",
        help="time every decoding method on Spec-Bench, HumanEval or a JSONL file",
        description="Benchmark decoding methods in one process on the same models, dtype and prompts. "
        "Results go to --out; rerunning the same command resumes an interrupted run.",
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help="offline model name, .gguf file, folder or hub id")
    p.add_argument("--draft", default=None,
                   help=f"draft model; default {DEFAULT_DRAFT} when --target is the default, "
                   "else none; 'none' for no draft")
    p.add_argument("--dataset", default="spec-bench",
                   help="spec-bench, humaneval, or a .jsonl file with a 'prompt' or 'turns' field per line")
    p.add_argument("--categories", nargs="+", default=None, help="categories to keep (space or comma separated)")
    p.add_argument("--limit-per-category", type=int, default=None, help="first N prompts of each category")
    p.add_argument("--limit", type=int, default=None, help="first N prompts overall (after the category limit)")
    p.add_argument("--methods", nargs="+", default=None,
                   help="methods to run (default: all whose requirements are met, except llama-cpp and "
                   "llama-cpp-lookup, reference columns that run only when named, or by default with --backend "
                   "llama-cpp: pip install 'specdecode[llamacpp]'): "
                   + ", ".join(bench.available_methods())
                   + ". A specdecode method may carry options and draft-control modifiers: "
                   "NAME[:KEY=VALUE,...][+MODIFIER[=VALUE]...], e.g. early-exit:exit_layer=8+adaptive; "
                   "every specdecode method, autoregressive included, takes compile=0|1 (the fast path); "
                   "modifiers: " + "; ".join(f"{k}: {v}" for k, v in bench.METHOD_MODIFIERS.items()))
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--num-speculative-tokens", "-g", type=int, default=DEFAULT_NUM_SPECULATIVE_TOKENS,
                   help="gamma of specdecode's speculative methods")
    p.add_argument("--seed", type=int, default=0, help="base seed of sampling (temperature > 0)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    add_quantize_arguments(p)
    p.add_argument("--device", default="auto")
    p.add_argument("--backend", default="torch", choices=TARGET_BACKENDS,
                   help="what runs the target of specdecode's methods: torch (default) or llama-cpp (its GGUF file "
                   "in llama.cpp, as specdecode generate --backend llama-cpp; the references llama-cpp and "
                   "llama-cpp-lookup, llama.cpp's own decoding of the same file, then run by default: the report "
                   "gives each method's tok/s ÷ theirs and its agreement with llama-cpp's greedy tokens; "
                   "transformers' methods, layer-skip and early-exit are refused, or skipped when --methods is "
                   "not given)")
    p.add_argument("--repeats", type=int, default=1, help="runs per (method, prompt); tok/s is their median")
    p.add_argument("--warmup-tokens", type=int, default=8,
                   help="length of each method's warm-up generation (timed and reported as warm-up seconds: "
                   "compilation happens there)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="the fast path (static KV cache, compiled forwards) on or off for every specdecode method "
                   "whose name sets no compile option (NAME:compile=0|1); default: the device's default")
    p.add_argument("--prompt-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="encode each prompt (but its last token) once, untimed, and start every method from a "
                   "copy of that cache; default: on unless hf-assisted or hf-prompt-lookup is in the run "
                   "(they cannot start from a cache); --no-prompt-cache times whole prompts")
    p.add_argument("--out", default="bench-out", help="results folder (resumable)")
    p.add_argument("--batch-size", default=None, metavar="B[,B...]",
                   help="throughput mode: decode each category's prompts B at a time with the batched engine, "
                   "for each B of this comma list (e.g. 1,2,4,8); methods: " + ", ".join(bench.batch_methods())
                   + ", as NAME[:KEY=VALUE,...][+MODIFIER], plus exit_rule=row|batch (with +adaptive) and "
                   "decoder=single (the single-sequence decoder at B=1); writes batched_results.json/.md to --out")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="chat template on/off (default: on for spec-bench and JSONL when the tokenizer has one, "
                   "off for humaneval, whose stubs are completed raw)")
    for opt in bench.DRAFTER_OPTIONS:
        p.add_argument(opt.flag, dest=f"drafter_{opt.keyword}", type=opt.type, default=None, help=opt.help,
                       metavar=opt.keyword.upper())
    p.add_argument("--banned-words-file", metavar="FILE", default=None,
                   help="ban these words (one per line) in every specdecode method; transformers' methods "
                   "are left out")
    p.add_argument("--banned-words-ignore-case", action="store_true", help="match banned words regardless of case")
    p.add_argument("--banned-words-whole-word", action="store_true", help="match banned words as whole words only")
    add_processor_arguments(p, per_request=False)  # [processors]
    p.add_argument("--drafter-option", action="append", type=_parse_option, default=[], metavar="KEY=VALUE",
                   help="any other keyword for the pipeline's decoder/make_drafter (VALUE parsed as JSON if it can be)")
    return p


def _add_serve(sub) -> None:
    from specdecode.serve.command import add_arguments

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, SSE) on the batched engine")
    add_arguments(p, default_target=DEFAULT_TARGET, default_draft=DEFAULT_DRAFT)


def _run_serve(args) -> int:
    from specdecode.serve.command import run

    return run(args)


def _add_soak(sub) -> None:
    p = sub.add_parser("soak", help="load-test `specdecode serve`: concurrent streaming clients, latency, memory",
                       description="Starts `specdecode serve SERVER_ARGS` on a free loopback port, runs the load, "
                       "then stops it with SIGTERM. Exit status 0 only with zero errors, zero lost requests "
                       "and a clean shutdown.")
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (default 8)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds during which requests start (default 600)")
    p.add_argument("--max-requests", type=int, default=100_000, help="most requests started in all")
    p.add_argument("--max-tokens", default="32:128", help="LO:HI, each request's max_tokens drawn from it")
    p.add_argument("--dataset", default="spec-bench", choices=("spec-bench", "humaneval"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=float, default=60.0, help="seconds of RSS not counted for 'flat' (default 60)")
    p.add_argument("--request-timeout", type=float, default=900.0, help="a request longer than this is lost")
    p.add_argument("--out", default="soak", help="folder for soak.json, soak.md, metrics.txt, server.log")
    p.add_argument("server_args", nargs=argparse.REMAINDER,
                   help="after --: the arguments of `specdecode serve` (e.g. -- --method draft --dtype bfloat16)")


def _run_soak(args) -> int:
    from specdecode.serve.loadtest import SoakSettings, parse_token_range, passed, run_soak

    server_args = args.server_args[1:] if args.server_args[:1] == ["--"] else args.server_args
    settings = SoakSettings(
        server_args=server_args, clients=args.clients, duration_s=args.duration, max_requests=args.max_requests,
        max_tokens=parse_token_range(args.max_tokens), dataset=args.dataset, seed=args.seed,
        warmup_s=args.warmup, request_timeout_s=args.request_timeout, out=args.out,
    )
    result = run_soak(settings)
    print((Path(args.out) / "soak.md").read_text())
    return 0 if passed(result) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description="Speculative decoding for Hugging Face models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (model loading) to stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    _add_bench(sub)
    _add_search(sub)
    _add_serve(sub)
    _add_soak(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return {"generate": run_generate, "bench": _run_bench, "search": _run_search, "serve": _run_serve, "soak": _run_soak}[args.command](args)
    except SpecDecodeError as e:
        print(f"specdecode: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
