"""Command line: ``specdecode generate ...`` and ``specdecode bench ...`` (parsed in ``specdecode.bench``).
The only modules that print."""

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description="Speculative decoding for Hugging Face models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (model loading) to stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return {"generate": cmd_generate, "bench": bench.run}[args.command](args)
    except SpecDecodeError as e:
        print(f"specdecode: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
