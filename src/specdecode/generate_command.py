"""``specdecode generate``: its arguments, the defaults it picks, and the command itself.

``generate`` streams ``SpeculativeGenerator`` output to the terminal (or prints one JSON
object); with ``specdecode.cli`` and the other command modules it is the only code that
prints. Its defaults differ from the Python API's on purpose (the API and ``bench`` ask for
everything by name): the cascade method, adaptive draft exit, an int4 draft on CPU, and a
prompt limit for the draft model, each measured (``pipeline``'s command defaults, shared with ``serve``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from specdecode import defaults, method_registry
from specdecode.config import DEFAULT_NUM_SPECULATIVE_TOKENS, GenerationConfig, check_unicode, parse_logit_bias
from specdecode.drafters.draft_tree import MAX_TREE_DEPTH, TREE_SHAPES, check_tree_flags
from specdecode.errors import InvalidArgumentError, SpecDecodeError
from specdecode.models.llama_cpp_target import TARGET_BACKENDS, check_llama_cpp_target_options
from specdecode.models.loading import resolve_device
from specdecode.models.quantize import (
    INT4_GROUP_SIZES,
    QUANTIZE_HEADS,
    QUANTIZE_SCHEMES,
)
from specdecode.pipeline import (
    COMMAND_METHOD,
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    DRAFT_BACKENDS,
    MAX_MODEL_PROMPT_TOKENS,
    METHODS,
)

logger = logging.getLogger(__name__)

#: ``generate``'s method under --backend llama-cpp when --method is not given (``serve``'s too).
LLAMA_CPP_COMMAND_METHOD = defaults.LLAMA_CPP_COMMAND_METHOD


def add_quantize_arguments(p: argparse.ArgumentParser, draft_default: str = "as --quantize") -> None:
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
    p.add_argument("--quantize-group-size", type=int, default=None, choices=INT4_GROUP_SIZES, metavar="G",
                   help="inputs per scale and zero of the int4 weights of target and draft, whichever is int4: "
                   f"{', '.join(map(str, INT4_GROUP_SIZES))} (default 32); 64 stores 4.5 bits a weight, not 5")
    add_prepack_argument(p)


def add_prepack_argument(p: argparse.ArgumentParser) -> None:
    """--prepack-linears / --no-prepack-linears (generate and bench; serve's own parser adds the same flag with
    ``defaults.PREPACK_HELP``; ``defaults.prepack_by_default``)."""
    p.add_argument("--prepack-linears", action=argparse.BooleanOptionalAction, default=None,
                   help=defaults.PREPACK_HELP + defaults.PREPACK_COMPILE_HELP)


def add_processor_arguments(p: argparse.ArgumentParser, *, per_request: bool = True) -> None:
    """The processor flags (``GenerationConfig``'s fields; ``engine.processors``); with
    ``per_request`` also --stop-token-id and the logprobs flags (``generate``'s, not ``bench``'s)."""
    g = p.add_argument_group("logits processors (exact under speculation)" + (" and logprobs" if per_request else ""))
    g.add_argument("--repetition-penalty", type=float, default=1.0, metavar="P",
                   help="divide (multiply when negative) the logits of tokens already in the prompt or output by P "
                        "(0.01..100; 1 = off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="OpenAI's: subtract F per earlier occurrence in the output ([-2, 2]; 0 = off)")
    g.add_argument("--presence-penalty", type=float, default=0.0, metavar="F",
                   help="OpenAI's: subtract F once a token occurs in the output ([-2, 2]; 0 = off)")
    g.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="sampling keeps tokens with at least P times the top token's probability ([0, 1]; 0 = off)")
    g.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS ([-100, 100]) to token ID's logit (repeatable)")
    if not per_request:
        return
    g.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                   help="a token id that ends the generation like EOS (repeatable)")
    g.add_argument("--logprobs", action="store_true", help="report each token's log-probability")
    g.add_argument("--top-logprobs", type=int, default=0, metavar="N",
                   help="with --logprobs, also the N (0..20) most likely tokens at each position")


def processor_options(args) -> dict:
    """``GenerationConfig`` keywords from ``add_processor_arguments``'s flags.

    Raises:
        InvalidArgumentError: A ``--logit-bias`` that is not ID=BIAS (the values are checked by the config).
    """
    return dict(
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        min_p=args.min_p,
        logit_bias=parse_logit_bias(args.logit_bias),
        stop_token_ids=tuple(args.stop_token_id),
        logprobs=args.logprobs,
        top_logprobs=args.top_logprobs,
    )


class _Given(argparse.Action):
    """Stores the value and records that the flag was given (``<dest>_given``): --method's default depends
    on --backend."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from one prompt, speculatively or not")
    p.add_argument("--target", default=DEFAULT_TARGET, help="offline model name, .gguf file, folder or hub id")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model (methods 'draft' and 'cascade')")
    p.add_argument("--method", default=COMMAND_METHOD, choices=METHODS, action=_Given,
                   help="default: cascade (n-gram match checked by the draft model, then the draft model); with "
                        f"--backend llama-cpp: {LLAMA_CPP_COMMAND_METHOD}")
    p.add_argument("--backend", default="torch", choices=TARGET_BACKENDS,
                   help="what runs the target: torch (default) or llama-cpp (its GGUF file in llama.cpp, no torch "
                        "weights; methods autoregressive, prompt-lookup, draft and cascade, the draft model in "
                        "llama.cpp too (--draft: an offline model or .gguf file); the draft length per round comes "
                        "from the measured forward costs; needs pip install 'specdecode[llamacpp]')")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the chat template (default: when the tokenizer has one)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_processor_arguments(p)
    defaults.add_banned_word_flags(p)
    p.add_argument("--num-speculative-tokens", "-g", type=int, default=None,
                   help=f"gamma: tokens drafted per target forward (default "
                        f"{DEFAULT_NUM_SPECULATIVE_TOKENS}); given, it turns the default adaptive "
                        "draft exit off")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    add_quantize_arguments(p, draft_default="int4 on a CPU with AVX512 for draft and cascade with --quantize none, for faster "
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
    g.add_argument("--prompt-lookup-branches", type=int, default=1,
                   help="prompt-lookup: matches drafted per round as a token tree, verified in one forward "
                        "(default 1: the most recent match, a linear draft)")
    g.add_argument("--prompt-lookup-datastore", metavar="CORPUS", default="auto",
                   help="prompt-lookup: also draft from an n-gram index of CORPUS where the text has no match of "
                        "2 tokens or more: 'python-stdlib' (this Python's standard library sources), a folder or "
                        "file of text, or 'none'; tokenized once, cached (default 'auto': python-stdlib with "
                        "--backend llama-cpp, else none)")
    g.add_argument("--ngram-check", action=argparse.BooleanOptionalAction, default=True,
                   help="cascade: keep only the n-gram tokens the draft model itself would draft (default); "
                        "--no-ngram-check proposes the whole match")
    p.add_argument("--draft-vocab-size", type=int, metavar="K", default=None,
                   help="draft and cascade: the draft model proposes only among the K most frequent tokens and "
                        "computes those LM-head rows alone (FR-Spec); 0 or unset: the full head")
    p.add_argument("--max-model-prompt-tokens", type=int, metavar="N", default=None,
                   help="cascade: prompts of more than N tokens skip the draft model (no draft prefill) and get "
                        f"n-gram matches alone, as prompt-lookup; 0: no limit (default: {MAX_MODEL_PROMPT_TOKENS} "
                        "with an int4 or llama.cpp draft, measured, else no limit)")
    p.add_argument("--draft-backend", choices=DRAFT_BACKENDS, default=None,
                   help="draft and cascade: what runs the draft model: torch (default; quantized by --draft-quantize) "
                        "or llama-cpp (its GGUF file in llama.cpp, faster on a CPU, measured; needs pip install "
                        "'specdecode[llamacpp]')")
    p.add_argument("--draft-context-window", type=int, metavar="W", default=None,
                   help="draft and cascade: prefill the draft model with the prompt's last W tokens only (a "
                        "cheaper draft prefill on long prompts; output unchanged, acceptance may drop); unset: "
                        "the whole prompt")
    p.add_argument("--draft-tree-depth", type=int, metavar="D", default=None,
                   help="draft and cascade: each row drafts a chain of D tokens (greedy, or drawn when sampling) "
                        "and verifies a token tree of "
                        "-g nodes (the chain and its steps' runners-up of highest joint draft probability, "
                        "EAGLE-2's reranking; no extra draft forward), e.g. -g 16 --draft-tree-depth 5; turns the "
                        "default adaptive draft exit off; unset: linear drafts")
    p.add_argument("--draft-tree-expand", type=int, metavar="M", default=None,
                   help="draft, with --draft-tree-depth: EAGLE-2's dynamic tree, the M best nodes of each depth "
                        "expanded by one draft tree forward (D - 1 of them) instead of the chain's runners-up; "
                        "greedy rows (a round with a sampling row grows the chain's trees)")
    p.add_argument("--draft-tree-shape", choices=TREE_SHAPES, default=None,
                   help="draft and cascade, with --draft-tree-depth: per-round shapes each tree from its round's own "
                        "draft values (one host read more a round), previous-round from the row's earlier rounds "
                        "(nothing read before the verification); default: previous-round on CUDA, else per-round; "
                        "not used by --draft-tree-expand's rounds")
    defaults.add_draft_control_flags(p)


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
        ("gated steps (plain steps the draft policy chose)", "num_gated_steps"),
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
    if "prompt_lookup_max_ngram" in method_registry.REGISTRY[args.method].options:
        PromptLookupDrafter(args.prompt_lookup_max_ngram, args.prompt_lookup_min_ngram, args.prompt_lookup_branches)
    if args.method == "prompt-lookup":
        method_registry.check_datastore_option(args.prompt_lookup_datastore, args.prompt_lookup_branches)
    if args.draft_vocab_size is not None and args.draft_vocab_size < 0:
        raise InvalidArgumentError(
            f"--draft-vocab-size {args.draft_vocab_size} is out of range: use K in S..V (S special tokens, V the "
            "vocabulary size) or 0 for the full head"
        )
    if args.max_model_prompt_tokens is not None and args.max_model_prompt_tokens < 0:
        raise InvalidArgumentError(
            f"--max-model-prompt-tokens {args.max_model_prompt_tokens} is out of range: use N >= 1 (tokens), or "
            "0 for no limit"
        )
    if args.draft_context_window is not None and args.draft_context_window < 1:
        raise InvalidArgumentError(
            f"--draft-context-window {args.draft_context_window} is out of range: use W >= 1 (tokens), or leave "
            "it out for the whole prompt"
        )
    if args.draft_tree_depth is not None and not 1 <= args.draft_tree_depth <= MAX_TREE_DEPTH:
        raise InvalidArgumentError(
            f"--draft-tree-depth {args.draft_tree_depth} is out of range: use D in 1..{MAX_TREE_DEPTH} (the draft "
            "model's chain steps per round; -g counts the tree's nodes), or leave it out for linear drafts"
        )
    if args.draft_tree_expand is not None and not 1 <= args.draft_tree_expand <= MAX_TREE_DEPTH:
        raise InvalidArgumentError(
            f"--draft-tree-expand {args.draft_tree_expand} is out of range: use M in 1..{MAX_TREE_DEPTH} (nodes "
            "expanded per depth), or leave it out"
        )
    check_tree_flags(args.draft_tree_depth, args.draft_tree_expand, args.draft_tree_shape)
    if args.draft_tree_depth is not None and getattr(args, "adaptive_draft_exit", None):
        raise InvalidArgumentError("--draft-tree-depth with --adaptive-draft-exit: a row with an exit policy drafts a linear chain, "
                                   "never a tree; leave one of them out")
    if args.draft_backend == "llama-cpp" and args.draft_vocab_size:
        raise InvalidArgumentError(
            f"--draft-vocab-size {args.draft_vocab_size} truncates a torch draft's LM head; --draft-backend llama-cpp "
            "computes every logit: leave it out"
        )
    # Flags that only some methods use (the method registry's): any other method refuses them rather than
    # ignoring them (--draft-vocab-size 0, the full head, counts as not given).
    refused = method_registry.refused_option(
        args.method, {o.keyword: getattr(args, o.keyword) for o in method_registry.METHOD_ONLY_OPTIONS})
    if refused is not None:
        option = next(o for o in method_registry.METHOD_ONLY_OPTIONS if o.keyword == refused[0])
        raise InvalidArgumentError(
            f"--{option.keyword.replace('_', '-')} applies to --method "
            f"{' or '.join(method_registry.methods_taking(option.keyword))} ({option.acts_on}), not "
            f"{args.method!r}{option.hint}"
        )


def run_generate(args) -> int:
    import torch
    from transformers import TextStreamer

    from specdecode.pipeline import SpeculativeGenerator

    banned = defaults.banned_words_from_flags(args)
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        num_speculative_tokens=(DEFAULT_NUM_SPECULATIVE_TOKENS if args.num_speculative_tokens is None
                                else args.num_speculative_tokens),
        stop_strings=tuple(args.stop),
        banned_words=banned,
        banned_words_ignore_case=args.banned_words_ignore_case,
        banned_words_whole_word=args.banned_words_whole_word,
        **processor_options(args),
    )
    if not args.prompt.strip():
        raise SpecDecodeError("the prompt is empty: pass some text with --prompt")
    check_unicode(args.prompt, "--prompt")  # before the model loads (the tokenizer refused it after)
    llama = args.backend == "llama-cpp"
    if llama and not getattr(args, "method_given", False):
        args.method = LLAMA_CPP_COMMAND_METHOD
    if llama:  # what the llama.cpp target cannot run, refused before loading
        why = method_registry.LLAMA_CPP_TARGET_REFUSALS.get(args.method)
        if why is not None:
            raise InvalidArgumentError(f"--method {args.method} does not run with --backend llama-cpp: {why}; use "
                                       "--method prompt-lookup, draft, cascade or autoregressive, or --backend torch")
        check_llama_cpp_target_options(dtype=args.dtype, device=args.device, quantize=args.quantize,
                                       draft_quantize=args.draft_quantize, draft_quantize_head=args.draft_quantize_head,
                                       quantize_group_size=args.quantize_group_size, draft_backend=args.draft_backend,
                                       prepack_linears=args.prepack_linears)
        if method_registry.REGISTRY[args.method].needs_draft_model:
            args.draft_backend = "llama-cpp"  # the only draft beside a llama.cpp target
    _check_method_options(args)  # before minutes of model loading
    plan = defaults.plan_command(args, resolve_device(args.device))  # checks the flags it resolves, before loading
    if plan.draft_quantize is not None and args.draft_quantize is None:
        logger.info("quantizing the draft to %s by default on CPU (output unchanged, faster drafting; the "
                    "first start quantizes it); --draft-quantize none keeps it dense", plan.draft_quantize)
    options = dict(
        skip_layers=args.skip_layers,
        skip_config=args.skip_config,
        exit_layer=args.exit_layer,
        prompt_lookup_max_ngram=args.prompt_lookup_max_ngram,
        prompt_lookup_min_ngram=args.prompt_lookup_min_ngram,
        prompt_lookup_branches=args.prompt_lookup_branches,
        ngram_check=args.ngram_check,
        prompt_lookup_datastore=args.prompt_lookup_datastore,
        draft_control=plan.draft_control,
        compile=args.compile,  # None: the pipeline's device default
    )
    if args.draft_vocab_size:
        options["draft_vocab_size"] = args.draft_vocab_size
    if args.draft_context_window is not None:
        options["draft_context_window"] = args.draft_context_window
    if args.draft_tree_depth is not None:
        options["draft_tree_depth"] = args.draft_tree_depth
    if args.draft_tree_expand is not None:
        options["draft_tree_expand"] = args.draft_tree_expand
    if args.draft_tree_shape is not None:
        options["draft_tree_shape"] = args.draft_tree_shape
    if args.draft_backend is not None:
        options["draft_backend"] = args.draft_backend
    draft, draft_quantize, limit = plan.draft, plan.draft_quantize, plan.max_model_prompt_tokens
    if limit is not None:
        options["max_model_prompt_tokens"] = limit
    gen = SpeculativeGenerator.from_pretrained(args.target, draft, dtype=args.dtype, device=args.device,
                                              quantize=args.quantize, draft_quantize=draft_quantize,
                                              draft_quantize_head=args.draft_quantize_head,
                                              quantize_group_size=args.quantize_group_size,
                                              draft_backend=args.draft_backend, backend=args.backend,
                                              prepack_linears=defaults.prepack_by_default(
                                                  args.prepack_linears, "--compile" if args.compile else None))
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
            "backend": args.backend,
            "target": args.target,
            "draft": draft,
            "draft_backend": (args.draft_backend or "torch") if draft is not None else None,
            "skip_layers": args.skip_layers,
            "skip_config": args.skip_config,
            "exit_layer": args.exit_layer,
            "draft_vocab_size": args.draft_vocab_size or None,
            "draft_context_window": args.draft_context_window,
            "draft_tree_depth": args.draft_tree_depth,
            "draft_tree_expand": args.draft_tree_expand,
            "draft_tree_shape": args.draft_tree_shape,
            "max_model_prompt_tokens": limit,
            "draft_control": dataclasses.asdict(plan.draft_control) if plan.draft_control is not None else None,
            "ngram_check": args.ngram_check if "ngram_check" in method_registry.REGISTRY[args.method].options else None,
            "compile": args.compile,
            "quantize": gen.target.quantize,
            "draft_quantize": gen.draft.quantize if gen.draft is not None else None,
            "draft_quantize_head": gen.draft.quantize_head if gen.draft is not None else None,
            "prepack_linears": {"target": gen.target.prepacked,
                                "draft": gen.draft.prepacked if gen.draft is not None else None},
            "quantize_group_size": next((m.quantize_group_size for m in (gen.target, gen.draft)
                                         if m is not None and m.quantize_group_size is not None), None),
            "dtype": str(gen.target.model.dtype).removeprefix("torch."),
            "device": str(gen.target.model.device),
            "stats": stream.stats.to_dict(),
        }
        if config.logprobs:
            out["logprobs"] = [dataclasses.asdict(lp) for lp in stream.logprobs]
        sys.stdout.write(json.dumps(out) + "\n")
        return 0
    from rich.console import Console

    printer = TextStreamer(gen.tokenizer, skip_special_tokens=True)
    for ids in stream:
        printer.put(torch.tensor(ids))
    printer.end()
    if config.logprobs:
        console = Console(stderr=False)
        for lp in stream.logprobs:
            top = "  ".join(f"{gen.tokenizer.decode([t])!r} {v:.4f}" for t, v in lp.top)
            console.print(f"{lp.token_id:>8} {gen.tokenizer.decode([lp.token_id])!r:>16} {lp.logprob:.4f}  {top}",
                          markup=False, highlight=False)
    _print_stats(stream.stats.to_dict(), args.method, Console(stderr=False))
    return 0
