"""``specdecode serve``: load the models, build the batched engine, run uvicorn.

The arguments are defined here without importing FastAPI, so ``specdecode generate`` works without the ``serve``
extra; ``run`` imports it and says how to install it if missing. The server's defaults are ``generate``'s on the
same device (``pipeline``'s command defaults): method ``cascade`` with adaptive draft exit, an int4 draft on a
CPU, and the cascade's prompt limit for the draft model. Start-up logs each phase (loading, quantizing, warm-up)
with its duration at ``--log-level info``, and last ``start-up: listening on http://HOST:PORT``, the address
bound (with ``--port 0``, the free port the system picked).

``--backend llama-cpp`` runs the target's GGUF file in llama.cpp (as ``generate --backend llama-cpp``, with its
default method, ``defaults.LLAMA_CPP_COMMAND_METHOD``, and prompt lookup's draft length from the measured
forward costs): one request at a time, since llama.cpp's multi-sequence batches are not built, so the engine
has one row and further requests wait in the queue (``--max-queue``). What that backend cannot do is refused
before loading (``plan.check_llama_cpp_backend``).
"""

from __future__ import annotations

import argparse
import logging
import time

from specdecode import defaults, method_registry
from specdecode.config import DEFAULT_NUM_SPECULATIVE_TOKENS
from specdecode.defaults import LLAMA_CPP_COMMAND_METHOD, CommandPlan, plan_command
from specdecode.drafters.draft_tree import MAX_TREE_DEPTH, TREE_SHAPES, check_tree_flags
from specdecode.errors import InvalidArgumentError, SpecDecodeError
from specdecode.method_registry import who_takes
from specdecode.models.llama_cpp_target import TARGET_BACKENDS
from specdecode.models.loading import resolve_device
from specdecode.models.quantize import INT4_GROUP_SIZES, QUANTIZE_HEADS, QUANTIZE_SCHEMES
from specdecode.pipeline import COMMAND_METHOD, MAX_MODEL_PROMPT_TOKENS
from specdecode.serve.limits import (
    DEFAULT_MAX_LENGTH,
    check_cache_memory,
    check_max_length,
    describe_limit,
    fit_max_length,
    loaded_context_limits,
    longest_draft_block,
    stored_context_limits,
    tightest_limit,
)
from specdecode.serve.plan import DEFAULT_MAX_BATCH_SIZE, check_llama_cpp_backend

logger = logging.getLogger(__name__)

#: The methods with a batch mode (the method registry's): the server runs the batched engine.
SERVE_METHODS = method_registry.BATCH_METHODS


class _Given(argparse.Action):
    """Stores the value and records that the flag was given (``<dest>_given``): --method's default depends on
    --backend, as ``generate``'s."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def add_arguments(p: argparse.ArgumentParser, *, default_target: str, default_draft: str) -> None:
    """The ``serve`` subcommand's options."""
    p.add_argument("--target", default=default_target, help="offline model name, .gguf file, folder or hub id")
    p.add_argument("--draft", default=default_draft, help="draft model (methods 'draft' and 'cascade')")
    p.add_argument("--method", default=COMMAND_METHOD, choices=SERVE_METHODS, action=_Given,
                   help=f"decoding method of every request (default {COMMAND_METHOD}, as specdecode generate; with "
                        f"--backend llama-cpp: {LLAMA_CPP_COMMAND_METHOD}, as generate --backend llama-cpp)")
    p.add_argument("--backend", default="torch", choices=TARGET_BACKENDS,
                   help="what runs the target: torch (default) or llama-cpp (its GGUF file in llama.cpp, no torch "
                        "weights; methods autoregressive, prompt-lookup, draft and cascade, the draft model in "
                        "llama.cpp too). With llama-cpp the server decodes ONE REQUEST AT A TIME (llama.cpp's "
                        "multi-sequence batches are not built): --max-batch-size is 1 and further requests wait in "
                        "the queue (--max-queue); needs pip install "
                        "'specdecode[llamacpp]'")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --target)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000,
                   help="port to listen on (default 8000; 0: a free port the system picks, named in the start-up "
                        "log line 'start-up: listening on http://HOST:PORT')")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help=f"rows decoded at once (default {DEFAULT_MAX_BATCH_SIZE}; with --backend llama-cpp 1, the only "
                        "value it takes: one request at a time); at most the rows whose KV caches (--max-length "
                        "positions each, target and draft model) fit in the memory free once the models loaded")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a free row; beyond it the server answers 429 (default 64)")
    p.add_argument("--max-length", type=int, default=None,
                   help=f"cache positions per row: prompt + max_tokens + a draft block (default {DEFAULT_MAX_LENGTH}, "
                        "or the shorter context length of the target and a draft model + a draft block where that is "
                        "less; at most that)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt accepted, in tokens (default: what --max-length leaves room for beside one "
                        "new token and a draft block)")
    p.add_argument("--max-tokens-limit", type=int, default=None,
                   help="largest max_tokens accepted (default: --max-length)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds running requests may take before they are cancelled (default 30)")
    defaults.add_banned_word_flags(p, server=True)  # with each request's bad_words
    p.add_argument("--num-speculative-tokens", "-g", type=int, default=None,
                   help=f"gamma for every row (default {DEFAULT_NUM_SPECULATIVE_TOKENS}); given, it turns the "
                        "default adaptive draft exit off")
    p.add_argument("--exit-rule", default="row", choices=("row", "batch"),
                   help="with --adaptive-draft-exit: a row stops at its own unsure token, or the batch at the last")
    defaults.add_draft_control_flags(p, server=True)
    p.add_argument("--max-verify-tokens", default="auto",
                   help="most tokens one verification forward takes ('auto': on CPU 12, or the longest draft "
                        "block + 1 where more, so one request drafts as specdecode generate; none elsewhere; "
                        "'none')")
    p.add_argument("--skip-layers", default=None, help="layer-skip: e.g. 'attn=2,15;mlp=2,15'")
    p.add_argument("--skip-config", default=None, help="layer-skip: a skip-set JSON file")
    p.add_argument("--exit-layer", type=int, default=None, help="early-exit: layers the draft runs")
    p.add_argument("--prompt-lookup-max-ngram", type=int, default=3)
    p.add_argument("--prompt-lookup-min-ngram", type=int, default=1)
    p.add_argument("--prompt-lookup-datastore", metavar="CORPUS", default="auto",
                   help="prompt-lookup: also draft from an n-gram index of CORPUS ('python-stdlib', a folder or file "
                        "of text, or 'none'; default 'auto': python-stdlib with --backend llama-cpp, else none)")
    p.add_argument("--prompt-lookup-branches", type=int, default=1, metavar="N",
                   help="prompt-lookup: N matches drafted per round as a token tree, verified in one forward "
                        "(default 1: the most recent match, a linear draft)")
    p.add_argument("--draft-tree-depth", type=int, metavar="D", default=None,
                   help="draft and cascade: each row drafts a chain of D tokens (greedy, or drawn when sampling) "
                        "and verifies a token tree of -g "
                        "nodes (the chain and its steps' runners-up of highest joint draft probability, EAGLE-2's "
                        "reranking), as specdecode generate; turns the default adaptive draft exit off")
    p.add_argument("--draft-tree-expand", type=int, metavar="M", default=None,
                   help="draft, with --draft-tree-depth: EAGLE-2's dynamic tree, the M best nodes of each depth "
                        "expanded by one draft tree forward (greedy rows; a round with a sampling row grows the chain's "
                        "trees)")
    p.add_argument("--draft-tree-shape", choices=TREE_SHAPES, default=None,
                   help="draft and cascade, with --draft-tree-depth: per-round or previous-round shapes, as specdecode "
                        "generate; default: previous-round on CUDA, else per-round")
    p.add_argument("--ngram-check", action=argparse.BooleanOptionalAction, default=True,
                   help="cascade: keep only the n-gram tokens the draft model would draft itself (default); "
                        "--no-ngram-check proposes the whole match")
    p.add_argument("--max-model-prompt-tokens", type=int, metavar="N", default=None,
                   help="cascade: a request whose prompt has more than N tokens gets n-gram matches alone, "
                        f"without the draft model; 0: no limit (default, as specdecode generate: "
                        f"{MAX_MODEL_PROMPT_TOKENS} with an int4 draft, else no limit)")
    p.add_argument("--draft-vocab-size", type=int, metavar="K", default=None,
                   help="draft and cascade: the draft model proposes among the K most frequent tokens only "
                        "(FR-Spec; default: its whole vocabulary)")
    p.add_argument("--draft-context-window", type=int, metavar="W", default=None,
                   help="draft and cascade: prefill the draft model with each prompt's last W tokens only "
                        "(default: the whole prompt)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--quantize", default="none", choices=QUANTIZE_SCHEMES,
                   help="weight-only quantized linear layers on CPU for target and draft: a different model "
                        "from the unquantized one (default none)")
    p.add_argument("--draft-quantize", default=None, choices=QUANTIZE_SCHEMES,
                   help="quantization of the draft model alone (default, as specdecode generate: int4 on a CPU with AVX512 for "
                        "draft and cascade with --quantize none; else as --quantize); output unchanged")
    p.add_argument("--draft-quantize-head", default=None, choices=QUANTIZE_HEADS,
                   help="the LM head storage of a quantized draft (default: int4 for an int4 draft, int8 for int8)")
    p.add_argument("--quantize-group-size", type=int, default=None, choices=INT4_GROUP_SIZES, metavar="G",
                   help=f"inputs per scale and zero of int4 weights: {', '.join(map(str, INT4_GROUP_SIZES))} "
                        "(default 32)")
    p.add_argument("--prepack-linears", action=argparse.BooleanOptionalAction, default=None,
                   help=defaults.PREPACK_HELP + defaults.PREPACK_COMPILE_HELP)
    p.add_argument("--device", default="auto")
    p.add_argument("--cache-dir", default=None, help="where assembled and dense models are cached")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="the batched fast path: decode-time forwards compiled at a few (rows, width) buckets, "
                        "CUDA graphs on CUDA, compiled in the warm-up; default: on for CUDA, off for a CPU")
    p.add_argument("--dynamic-shapes", action="store_true",
                   help="with --compile (the CUDA default), compile each model's buckets as at most four functions "
                        "(rows and widths above 1 symbolic; token trees up to four more; a CUDA graph still per "
                        "bucket): a shorter warm-up; not yet measured on a GPU")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the start-up forwards at every width the engine uses (without them, a CPU "
                        "server's memory grows while new matmul shapes turn up)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def describe_control(control) -> str:
    """The draft length control of every row, for the start-up log: the adaptive draft exit on or off, and the
    length schedule and confidence gate where they are not the default."""
    if control is None:
        return "adaptive draft exit off"
    parts = [f"adaptive draft exit {'on' if control.adaptive_exit else 'off'}"]
    if control.length_schedule != "constant":
        parts.append(f"length schedule {control.length_schedule}")
    if control.confidence_gate is not None:
        parts.append(f"confidence gate {control.confidence_gate}")
    return ", ".join(parts)


def _check_draft_options(args) -> None:
    """--draft-vocab-size, --max-model-prompt-tokens, --draft-context-window, --draft-tree-depth,
    --draft-tree-expand and --prompt-lookup-branches: in range, and taken by --method (the method
    registry's), before any model is loaded.

    Raises:
        InvalidArgumentError: A value out of range, or an option the method does not take.
    """
    if args.prompt_lookup_branches < 1:
        raise InvalidArgumentError(f"--prompt-lookup-branches must be >= 1 (matches per round), got "
                                   f"{args.prompt_lookup_branches}")
    if method_registry.refused_option(args.method, {"prompt_lookup_datastore": args.prompt_lookup_datastore}):
        raise InvalidArgumentError(f"--prompt-lookup-datastore applies to {who_takes('prompt_lookup_datastore')}, "
                                   f"not to {args.method!r}")
    method_registry.check_datastore_option(args.prompt_lookup_datastore, args.prompt_lookup_branches)
    if args.prompt_lookup_branches > 1 and args.method != "prompt-lookup":
        raise InvalidArgumentError(f"--prompt-lookup-branches applies to {who_takes('prompt_lookup_branches')}, "
                                   f"not to {args.method!r}")
    check_tree_flags(args.draft_tree_depth, args.draft_tree_expand, args.draft_tree_shape)
    if args.draft_tree_depth is not None and args.adaptive_draft_exit:
        raise InvalidArgumentError("--draft-tree-depth with --adaptive-draft-exit: a row with an exit policy drafts a linear chain, "
                                   "never a tree; leave one of them out")
    for keyword, low, high in (("draft_vocab_size", 0, None), ("max_model_prompt_tokens", 0, None),
                               ("draft_context_window", 1, None), ("draft_tree_depth", 1, MAX_TREE_DEPTH),
                               ("draft_tree_expand", 1, MAX_TREE_DEPTH)):
        value, flag = getattr(args, keyword), "--" + keyword.replace("_", "-")
        if value is not None and high is not None and value > high:
            raise InvalidArgumentError(f"{flag} must be in {low}..{high}, got {value}")
        if value is not None and value < low:
            meaning = {"draft_vocab_size": "0: the whole vocabulary",
                       "max_model_prompt_tokens": "tokens; 0: no limit"}.get(keyword, "tokens")
            raise InvalidArgumentError(f"{flag} must be >= {low} ({meaning}), got {value}")
        if method_registry.refused_option(args.method, {keyword: value}):
            users = method_registry.who_takes(keyword)
            raise InvalidArgumentError(f"{flag} applies to {users}, not to {args.method!r}")


def _max_verify_tokens(text: str):
    if text in ("auto", "none"):
        return None if text == "none" else "auto"
    try:
        value = int(text)
    except ValueError:
        raise InvalidArgumentError(f"--max-verify-tokens must be 'auto', 'none' or an integer >= 1, got {text!r}")
    return value


def build(generator, decoder, *, max_queue: int, settings):
    """(ASGI app, engine loop, metrics) for a loaded generator and its batched decoder."""
    from specdecode.serve.app import create_app
    from specdecode.serve.engine_loop import EngineLoop
    from specdecode.serve.metrics import ServerMetrics

    metrics = ServerMetrics()

    def on_step(dec, seconds: float) -> None:
        metrics.step.observe(seconds)
        metrics.observe_engine(dec.stats, dec.num_running, engine.waiting)

    def on_finish(handle, delivery) -> None:
        metrics.observe_finish(delivery.finish_reason)

    engine = EngineLoop(decoder, max_queue=max_queue, on_step=on_step, on_finish=on_finish)
    return create_app(generator, engine, settings, metrics), engine, metrics


def make_uvicorn_server(app, engine, *, host: str, port: int, shutdown_timeout_s: float, log_level: str = "info"):
    """A ``uvicorn.Server`` whose SIGTERM/SIGINT also starts the engine's shutdown: requests
    running then get ``shutdown_timeout_s`` seconds to finish, then are cancelled."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            engine.begin_shutdown(shutdown_timeout_s)
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            for server in getattr(self, "servers", []):  # none when the app's start-up failed
                for sock in server.sockets:
                    logger.info("start-up: listening on %s", listening_url(sock.getsockname()))

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout_s + 10)
    return Server(config)


def listening_url(address) -> str:
    """``http://HOST:PORT`` of a bound socket's ``getsockname()`` (IPv6 hosts in brackets): the port the
    system picked for ``--port 0``."""
    host, port = address[0], address[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run(args) -> int:
    """``specdecode serve``: blocks until SIGTERM or SIGINT. After the graceful shutdown uvicorn
    re-raises the signal, so the process ends as killed by it (status 143 for SIGTERM in a
    shell), as every uvicorn application does.

    Raises:
        SpecDecodeError: Bad options (before loading models), a missing ``serve`` extra, or
            the loading errors of ``SpeculativeGenerator.from_pretrained``; a --max-length past what the
            target's or a draft model's context length and a draft block use (``fit_max_length``: before
            loading where the models' files state their context lengths, ``stored_context_limits``, else
            once they loaded); once the models loaded, before the engine is built, a --max-batch-size whose
            KV caches do not fit in memory (``check_cache_memory``).
    """
    app, engine = load_server(args)
    server = make_uvicorn_server(app, engine, host=args.host, port=args.port,
                                 shutdown_timeout_s=args.shutdown_timeout, log_level=args.log_level)
    server.run()
    return 0


def load_server(args):
    """Everything ``run`` does before it listens: check the flags, load the models, build and warm up the
    engine. Returns (ASGI app, ``EngineLoop``), not started (uvicorn's lifespan starts the engine thread).

    Raises:
        SpecDecodeError: As ``run``.
    """
    try:
        import fastapi  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise SpecDecodeError(f"specdecode serve needs the 'serve' extra ({e.name} is missing): "
                              "pip install 'specdecode[serve]'") from e
    from specdecode.pipeline import SpeculativeGenerator

    if not 0 <= args.port <= 65535:
        raise InvalidArgumentError(f"--port must be in 0..65535, got {args.port}")
    check_llama_cpp_backend(args)  # --method and --max-batch-size take their defaults here
    if args.method == "layer-skip" and args.skip_layers is None and args.skip_config is None:
        raise InvalidArgumentError("--method layer-skip needs --skip-layers SPEC or --skip-config FILE")
    if args.method == "early-exit" and args.exit_layer is None:
        raise InvalidArgumentError("--method early-exit needs --exit-layer N")
    for name in ("max_batch_size", "max_length", "num_speculative_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise InvalidArgumentError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    _check_draft_options(args)
    if args.max_queue < 0:
        raise InvalidArgumentError(f"--max-queue must be >= 0, got {args.max_queue}")
    verify = _max_verify_tokens(args.max_verify_tokens)
    backend = getattr(args, "backend", "torch")
    plan = plan_command(args, resolve_device("cpu" if backend == "llama-cpp" else args.device))
    block = longest_draft_block(args, plan)
    # What needs no model: the rows' room for a request, within the models' context lengths where their files
    # state them (read without loading the weights: an over-long --max-length fails before minutes of loading)
    stored = stored_context_limits(args.target, plan.draft, cache_dir=args.cache_dir, backend=backend)
    max_length = fit_max_length(args.max_length, block, stored)
    check_max_length(max_length, block, args.method, args.max_prompt_tokens)
    words = serve_settings(args, max_length, block).banned_words  # the limits' ranges, the words' file, read once
    check_address(args.host, args.port)  # the flags' last check: the models take minutes to load
    _configure_logging(args.log_level)
    started = time.perf_counter()
    logger.info("start-up: loading target %s%s%s", args.target, " in llama.cpp" if backend == "llama-cpp" else "",
                f" and draft {plan.draft} ({plan.draft_quantize_note or 'in llama.cpp'})" if plan.draft else "")
    gen = SpeculativeGenerator.from_pretrained(
        args.target, plan.draft, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir,
        quantize=args.quantize, draft_quantize=plan.draft_quantize, draft_quantize_head=args.draft_quantize_head,
        quantize_group_size=args.quantize_group_size, backend=backend,
        prepack_linears=defaults.prepack_by_default(args.prepack_linears, "--compile" if args.compile else None),
    )
    loaded_s = time.perf_counter() - started
    logger.info("start-up: models loaded%s in %.1f s", " and quantized" if gen.target.quantize != "none" or (
        gen.draft is not None and gen.draft.quantize != "none") else "", loaded_s)
    # What needs the models, before the engine is built and its caches allocated
    limits = loaded_context_limits(gen, args.method, target_name=args.target, draft_name=plan.draft)
    max_length = fit_max_length(args.max_length, block, limits)
    if max_length != DEFAULT_MAX_LENGTH and args.max_length is None:
        logger.info("start-up: --max-length %d (%s, and a %d-position draft block; default %d)", max_length,
                    describe_limit(tightest_limit(limits), limits), block + 1, DEFAULT_MAX_LENGTH)
    check_max_length(max_length, block, args.method, args.max_prompt_tokens)
    check_cache_memory(gen, args.method, max_batch_size=args.max_batch_size, max_length=max_length, block=block,
                       compile=args.compile)
    t0 = time.perf_counter()
    control = plan.draft_control  # under a llama.cpp target None unless flags ask: batch_decoder measures its costs
    measured = gen.backend == "llama-cpp" and control is None and args.method != "autoregressive"
    decoder = build_decoder(gen, args, plan, max_length=max_length, max_verify_tokens=verify)
    settings = serve_settings(args, decoder.max_length, decoder.max_block, words)
    logger.info("start-up: batched engine built in %.1f s: method %s, %d rows%s, %s, max_model_prompt_tokens %s",
                time.perf_counter() - t0, args.method, args.max_batch_size,
                " (the target in llama.cpp: one request at a time, the others wait in the queue)"
                if gen.backend == "llama-cpp" else "",
                "draft length from measured costs" if measured else describe_control(control),
                plan.max_model_prompt_tokens)
    app, engine, _ = build(gen, decoder, max_queue=args.max_queue, settings=settings)  # checks the rows' room
    warm_s = 0.0
    if not args.no_warmup:
        logger.info("start-up: warm-up (every forward width the engine uses; --no-warmup skips it)")
        warm_s = decoder.warm_up()
        logger.info("start-up: warm-up done in %.1f s", warm_s)
    logger.info("start-up: ready in %.1f s (loading %.1f s, warm-up %.1f s); serving %s (%s)",
                time.perf_counter() - started, loaded_s, warm_s, settings.model_name, args.method)
    return app, engine


def build_decoder(gen, args, plan: CommandPlan, *, max_length: int | None = None, max_verify_tokens="auto"):
    """The server's batched engine over ``gen`` from its flags and ``defaults.plan_command``'s plan (its caches are
    allocated at the first forward); ``max_length``: as ``fit_max_length`` gives (None: --max-length or
    ``DEFAULT_MAX_LENGTH``).

    Raises:
        InvalidArgumentError: ``SpeculativeGenerator.batch_decoder``'s.
    """
    if max_length is None:
        max_length = DEFAULT_MAX_LENGTH if args.max_length is None else args.max_length
    return gen.batch_decoder(
        args.method, max_batch_size=args.max_batch_size, max_length=max_length,
        num_speculative_tokens=plan.num_speculative_tokens, draft_control=plan.draft_control,
        exit_rule=args.exit_rule, max_verify_tokens=max_verify_tokens, skip_layers=args.skip_layers,
        skip_config=args.skip_config, exit_layer=args.exit_layer, prompt_lookup_max_ngram=args.prompt_lookup_max_ngram,
        prompt_lookup_min_ngram=args.prompt_lookup_min_ngram, compile=args.compile, dynamic_shapes=args.dynamic_shapes,
        ngram_check=args.ngram_check, max_model_prompt_tokens=plan.max_model_prompt_tokens,
        draft_context_window=args.draft_context_window, draft_vocab_size=args.draft_vocab_size,
        prompt_lookup_branches=args.prompt_lookup_branches, draft_tree_depth=args.draft_tree_depth,
        draft_tree_expand=args.draft_tree_expand, draft_tree_shape=args.draft_tree_shape,
        prompt_lookup_datastore=args.prompt_lookup_datastore,
    )


def serve_settings(args, max_length: int, block: int, banned_words: tuple[str, ...] | None = None):
    """The HTTP layer's ``ServeSettings`` from the flags, for rows of ``max_length`` positions that keep
    ``block`` + 1 for a draft block: by default a prompt may take what is left beside one new token, and
    ``max_tokens`` up to ``max_length``. ``banned_words``: the words of the banned-word flags as read before
    (None: read them now).

    Raises:
        InvalidArgumentError: A limit below 1 (``ServeSettings``); a --banned-words-file that cannot be read or
            holds no word, a blank --banned-word (``defaults.banned_words_from_flags``).
    """
    from specdecode.serve.app import ServeSettings

    return ServeSettings(
        model_name=args.served_model_name or args.target, method=args.method, api_key=args.api_key,
        max_prompt_tokens=max(max_length - block - 2, 1) if args.max_prompt_tokens is None else args.max_prompt_tokens,
        max_tokens_limit=max_length if args.max_tokens_limit is None else args.max_tokens_limit,
        max_body_bytes=args.max_body_bytes, shutdown_timeout_s=args.shutdown_timeout,
        banned_words=defaults.banned_words_from_flags(args) if banned_words is None else banned_words,
        banned_words_ignore_case=args.banned_words_ignore_case,
        banned_words_whole_word=args.banned_words_whole_word,
    )


def check_address(host: str, port: int) -> None:
    """Bind ``host:port`` as asyncio's ``create_server`` (uvicorn's) would and release it, so that a --host
    that is no address of this machine or a --port in use fails before the models load (uvicorn would log
    "[Errno -2] Name or service not known" or "address already in use" after it, naming neither flag).

    As asyncio: host "" means every interface; every address ``getaddrinfo`` gives (AF_INET and AF_INET6,
    AI_PASSIVE) is bound, an IPv6 socket with IPV6_V6ONLY (so "::" does not clash with a listener on
    0.0.0.0), every socket with SO_REUSEADDR on POSIX; a family the system cannot open is skipped.

    Raises:
        InvalidArgumentError: Naming --host or --port and the system's reason.
    """
    import os
    import socket

    try:
        infos = socket.getaddrinfo(host or None, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise InvalidArgumentError(f"--host {host!r} is not an address of this machine: {e}") from e
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            if family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # a family this system cannot open (asyncio skips it too)
                continue
            sockets.append(sock)
            if os.name == "posix":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPV6_V6ONLY"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                where = "" if address[0] == host else f" (address {address[0]})"
                raise InvalidArgumentError(
                    f"cannot listen on --host {host!r} --port {port}{where}: {e.strerror or e}"
                ) from e
    finally:
        for sock in sockets:
            sock.close()


def _configure_logging(level: str) -> None:
    """Show specdecode's start-up log at ``level`` (the CLI's root handler prints it; without one, as
    when ``run`` is called from Python, a handler to stderr is added)."""
    package = logging.getLogger("specdecode")
    package.setLevel(level.upper())
    if not logging.getLogger().handlers and not package.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        package.addHandler(handler)
