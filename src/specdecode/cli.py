"""Command line: argument parsing for ``specdecode generate|bench|search|serve``.

``generate`` streams ``SpeculativeGenerator`` output here; ``bench`` runs in
``specdecode.bench.command``, ``search`` in ``specdecode.search.command`` and ``serve``
in ``specdecode.serve.command``. These and the command modules are the only code that prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

from specdecode import bench
from specdecode.config import GenerationConfig
from specdecode.drafters.control import LENGTH_SCHEDULES, DraftControl
from specdecode.errors import InvalidArgumentError, SpecDecodeError
from specdecode.models.loading import resolve_device
from specdecode.models.quantize import QUANTIZE_HEADS, QUANTIZE_SCHEMES, check_quantize
from specdecode.pipeline import DEFAULT_DRAFT, DEFAULT_TARGET, METHODS

logger = logging.getLogger(__name__)

EXIT_BAD_INPUT = 2
# `generate` turns adaptive draft exit on by default for these methods (see _adaptive_by_default).
ADAPTIVE_BY_DEFAULT = ("draft", "cascade")


def _adaptive_by_default(args) -> bool:
    """Adaptive draft exit when --adaptive-draft-exit is not given: on for ``ADAPTIVE_BY_DEFAULT``
    with an unquantized target and no explicit -g. Measured (docs/benchmarks/2026-11-25-cascade-tuning.md):
    faster than a fixed γ = 5 with a bf16 target on HumanEval and Spec-Bench. With a quantized target
    it was slower than γ = 3 (2026-11-23: verifying 5-12 tokens costs two to four steps there), and an
    explicit -g asks for blocks of that length."""
    return args.method in ADAPTIVE_BY_DEFAULT and args.quantize == "none" and args.num_speculative_tokens is None


def _draft_quantize_by_default(args, device) -> str | None:
    """The draft's quantization when --draft-quantize is not given: "int4" for draft and cascade
    with an unquantized target on a CPU that has the int4 kernel, else None (= as --quantize).

    A quantized draft leaves the output unchanged (every token is verified by the target) and
    makes each draft step cheaper. Measured on a 2-core EPYC with AVX512-BF16 and AVX512-VNNI (no
    AMX), bf16 Qwen2.5-Coder 1.5B target, 0.5B draft, all with the int4 draft's LM head at int8:
    the draft's 1-token forward 93.7 ms (bf16) -> 35.2 ms (int4), c 0.42 -> 0.16 (2026-11-25);
    draft+adaptive 11.40 -> 18.53 tok/s on HumanEval and 7.35 -> 9.38 on Spec-Bench (2026-11-23,
    README "Quantized weights and llama.cpp"). Since 2026-11-25 an int4 draft's LM head is int4
    too (``from_pretrained``'s draft_quantize_head=None), which is faster still (README
    "Quantized weights on CPU"; --draft-quantize-head int8 keeps the int8 head measured above).
    The cost is quantizing the draft on the first start (cached next to an offline model's dense
    copy). int4 runs on CPU only (check_quantize refuses it elsewhere), and a quantized target is
    already followed by its draft. Only ``generate`` has this default: the Python API
    (``SpeculativeGenerator.from_pretrained``) and ``bench`` keep draft_quantize=None (as quantize),
    since benchmarks name their settings, and ``serve`` loads both models unquantized.

    Args:
        args: The parsed ``generate`` arguments.
        device: The resolved device (``resolve_device(args.device)``).
    """
    if args.draft_quantize is not None:
        return None
    return "int4" if _why_no_int4_default(args, device) is None else None


def _why_no_int4_default(args, device) -> str | None:
    """Why ``generate``'s int4 draft default does not apply (for error messages), or None when it
    applies. --draft-quantize is not consulted: given, there is no default to apply."""
    if args.method not in ("draft", "cascade"):
        return f"--method {args.method} has no draft model"
    if args.quantize != "none":
        return f"it follows --quantize {args.quantize}: the int4 default applies with --quantize none only"
    if device.type != "cpu":
        return f"the int4 default applies on CPU only, and the device is {device}"
    try:
        check_quantize("int4", device)  # a torch build without the int4 kernel (< 2.6) keeps a dense draft
    except InvalidArgumentError:
        import torch

        return f"the int4 default needs torch's int4 CPU kernel (torch >= 2.6), which torch {torch.__version__} lacks"
    return None


def _check_generate_draft_head(args, draft_quantize: str | None) -> None:
    """``generate``'s --draft-quantize-head against the draft's effective quantization
    (``draft_quantize``: --draft-quantize or the int4 default; None: as --quantize)."""
    if args.draft_quantize_head is None:
        return
    scheme = args.quantize if draft_quantize is None else draft_quantize
    if args.draft_quantize is not None:
        why = f"--draft-quantize {args.draft_quantize}"
    else:
        why = (_why_no_int4_default(args, resolve_device(args.device))
               or f"as --quantize {args.quantize}")
    from specdecode.bench.command import check_draft_quantize_head_flag  # the message bench gives too

    check_draft_quantize_head_flag(args.draft_quantize_head, scheme, why)


def _add_quantize_arguments(p: argparse.ArgumentParser, draft_default: str = "as --quantize") -> None:
    """--quantize, --draft-quantize and --draft-quantize-head (generate and bench; search has its own,
    target-only). ``draft_default`` describes --draft-quantize's default in the help."""
    p.add_argument("--quantize", default="none", choices=QUANTIZE_SCHEMES,
                   help="weight-only quantized linear layers on CPU for target and draft: a different model "
                   "from the unquantized one (default none)")
    p.add_argument("--draft-quantize", default=None, choices=QUANTIZE_SCHEMES,
                   help=f"quantization of the draft model alone (default: {draft_default}); a quantized draft "
                   "leaves the output unchanged")
    p.add_argument("--draft-quantize-head", default=None, choices=QUANTIZE_HEADS,
                   help="the LM head storage of a quantized draft (default: int4 for an int4 draft, measured "
                   "faster; int8 for an int8 one); int4 needs an int4 draft, and a dense draft refuses the flag; "
                   "int8 keeps an int4 draft's head as before")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from one prompt, speculatively or not")
    p.add_argument("--target", default=DEFAULT_TARGET, help="offline model name, .gguf file, folder or hub id")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model (methods 'draft' and 'cascade')")
    p.add_argument("--method", default="cascade", choices=METHODS,
                   help="default: cascade (n-gram match checked by the draft model, then the draft model)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the chat template (default: when the tokenizer has one)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    b = p.add_argument_group("banned words (matched on the text, any tokenization; rollback and mask)")
    b.add_argument("--banned-word", action="append", default=[], metavar="WORD",
                   help="a word or phrase the output must never contain (repeatable)")
    b.add_argument("--banned-words-file", metavar="FILE", default=None,
                   help="UTF-8 text file with one banned word or phrase per line (blank lines ignored)")
    b.add_argument("--banned-words-ignore-case", action="store_true", help="match banned words regardless of case")
    b.add_argument("--banned-words-whole-word", action="store_true",
                   help="match banned words only as whole words (a banned 'ass' does not block 'class')")
    p.add_argument("--num-speculative-tokens", "-g", type=int, default=None,
                   help=f"gamma: tokens drafted per target forward (default "
                        f"{GenerationConfig.num_speculative_tokens}); given, it turns the default adaptive "
                        "draft exit off")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    _add_quantize_arguments(p, draft_default="int4 on CPU for draft and cascade with --quantize none, for faster "
                            "drafting ('none' keeps the draft dense); else as --quantize")
    p.add_argument("--device", default="auto")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="the fast path: static KV cache and compiled forwards (compiled on first use); "
                   "default: the device's default")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats) only")
    g = p.add_argument_group("self-speculative and model-free drafting")
    skip = g.add_mutually_exclusive_group()
    skip.add_argument("--skip-layers", metavar="SPEC", default=None,
                      help="layer-skip: sublayers the draft skips, e.g. 'attn=2,15,18;mlp=2,15,18'")
    skip.add_argument("--skip-config", metavar="FILE", default=None,
                      help='layer-skip: JSON file {"skip_set": {"attn": [...], "mlp": [...]}, ...} or bare')
    g.add_argument("--exit-layer", type=int, metavar="N", default=None,
                   help="early-exit: the draft runs the first N decoder layers (1..L-1)")
    g.add_argument("--prompt-lookup-max-ngram", type=int, default=3,
                   help="prompt-lookup and cascade: longest n-gram matched")
    g.add_argument("--prompt-lookup-min-ngram", type=int, default=1,
                   help="prompt-lookup and cascade: shortest n-gram matched")
    g.add_argument("--ngram-check", action=argparse.BooleanOptionalAction, default=True,
                   help="cascade: keep only the n-gram tokens the draft model itself would draft (default); "
                        "--no-ngram-check proposes the whole match")
    p.add_argument("--draft-vocab-size", type=int, metavar="K", default=None,
                   help="draft and cascade: the draft model proposes only among the K most frequent tokens and "
                        "computes those LM-head rows alone (FR-Spec); 0 or unset: the full head")
    c = p.add_argument_group("draft length control")
    c.add_argument("--adaptive-draft-exit", action=argparse.BooleanOptionalAction, default=None,
                   help="Draft & Verify adaptive draft exit: stop drafting below a self-tuning confidence "
                        "threshold (blocks up to --max-draft-tokens instead of -g); default: on for "
                        f"{' and '.join(ADAPTIVE_BY_DEFAULT)} with an unquantized target and no -g, else off")
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
        ("banned-word rollbacks", "num_banned_word_rollbacks"),
        ("tokens discarded by banned-word rollbacks", "num_banned_word_discarded_tokens"),
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
    from specdecode.drafters.layer_skip import SkipSet
    from specdecode.drafters.prompt_lookup import PromptLookupDrafter

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
    if args.method in ("prompt-lookup", "cascade"):
        PromptLookupDrafter(args.prompt_lookup_max_ngram, args.prompt_lookup_min_ngram)
    if args.draft_vocab_size is not None and args.draft_vocab_size < 0:
        raise InvalidArgumentError(
            f"--draft-vocab-size {args.draft_vocab_size} is out of range: use K in S..V (S special tokens, V the "
            "vocabulary size) or 0 for the full head"
        )
    for flag in ("draft_quantize", "draft_quantize_head"):
        if getattr(args, flag) is not None and args.method not in ("draft", "cascade"):
            raise InvalidArgumentError(
                f"--{flag.replace('_', '-')} applies to --method draft or cascade (the draft model), not "
                f"{args.method!r}; use --quantize for the target"
            )
    if args.draft_vocab_size and args.method not in ("draft", "cascade"):
        raise InvalidArgumentError(
            f"--draft-vocab-size applies to --method draft or cascade (a draft model's head), not {args.method!r}"
        )


def cmd_generate(args) -> int:
    import torch
    from transformers import TextStreamer

    from specdecode.engine.banned_words import read_banned_words
    from specdecode.pipeline import SpeculativeGenerator

    banned = list(args.banned_word)
    if args.banned_words_file is not None:
        banned += read_banned_words(args.banned_words_file)
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        num_speculative_tokens=(GenerationConfig.num_speculative_tokens if args.num_speculative_tokens is None
                                else args.num_speculative_tokens),
        stop_strings=tuple(args.stop),
        banned_words=tuple(banned),
        banned_words_ignore_case=args.banned_words_ignore_case,
        banned_words_whole_word=args.banned_words_whole_word,
    )
    if not args.prompt.strip():
        raise SpecDecodeError("the prompt is empty: pass some text with --prompt")
    _check_method_options(args)  # before minutes of model loading
    control = DraftControl(
        adaptive_exit=_adaptive_by_default(args) if args.adaptive_draft_exit is None else args.adaptive_draft_exit,
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
        ngram_check=args.ngram_check,
        draft_control=control if control.active else None,
        compile=args.compile,  # None: the pipeline's device default
    )
    if args.draft_vocab_size:
        options["draft_vocab_size"] = args.draft_vocab_size
    draft = args.draft if args.method in ("draft", "cascade") else None
    draft_quantize = args.draft_quantize
    if draft_quantize is None and draft is not None:
        draft_quantize = _draft_quantize_by_default(args, resolve_device(args.device))
        if draft_quantize is not None:
            logger.info("quantizing the draft to %s by default on CPU (output unchanged, faster drafting; the "
                        "first start quantizes it); --draft-quantize none keeps it dense", draft_quantize)
    if draft is not None:
        _check_generate_draft_head(args, draft_quantize)  # in the flags' words, before loading
    gen = SpeculativeGenerator.from_pretrained(args.target, draft, dtype=args.dtype, device=args.device,
                                              quantize=args.quantize, draft_quantize=draft_quantize,
                                              draft_quantize_head=args.draft_quantize_head)
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
            "draft_vocab_size": args.draft_vocab_size or None,
            "draft_control": dataclasses.asdict(control) if control.active else None,
            "ngram_check": args.ngram_check if args.method == "cascade" else None,
            "compile": args.compile,
            "quantize": gen.target.quantize,
            "draft_quantize": gen.draft.quantize if gen.draft is not None else None,
            "draft_quantize_head": gen.draft.quantize_head if gen.draft is not None else None,
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
    p.add_argument("--quantize", default="none", choices=QUANTIZE_SCHEMES,
                   help="weight-only quantized linear layers on CPU: a different model from the unquantized "
                   "one, searched in its own study (default none)")
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
                   help="methods to run (default: all whose requirements are met, except llama-cpp, a "
                   "reference column that runs only when named: pip install 'specdecode[llamacpp]'): "
                   + ", ".join(bench.available_methods())
                   + ". A specdecode method may carry options and draft-control modifiers: "
                   "NAME[:KEY=VALUE,...][+MODIFIER[=VALUE]...], e.g. early-exit:exit_layer=8+adaptive; "
                   "every specdecode method, autoregressive included, takes compile=0|1 (the fast path); "
                   "modifiers: " + "; ".join(f"{k}: {v}" for k, v in bench.METHOD_MODIFIERS.items()))
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--num-speculative-tokens", "-g", type=int, default=GenerationConfig.num_speculative_tokens,
                   help="gamma of specdecode's speculative methods")
    p.add_argument("--seed", type=int, default=0, help="base seed of sampling (temperature > 0)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    _add_quantize_arguments(p)
    p.add_argument("--device", default="auto")
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
    _add_generate(sub)
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
        return {"generate": cmd_generate, "bench": _run_bench, "search": _run_search, "serve": _run_serve, "soak": _run_soak}[args.command](args)
    except SpecDecodeError as e:
        print(f"specdecode: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
