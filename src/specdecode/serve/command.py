"""``specdecode serve``: load the models, build the batched engine, run uvicorn.

The arguments are defined here without importing FastAPI, so ``specdecode generate``
works without the ``serve`` extra; ``run`` imports it and says how to install it if missing.
"""

from __future__ import annotations

import argparse
import logging

from specdecode import method_registry
from specdecode.config import DEFAULT_NUM_SPECULATIVE_TOKENS
from specdecode.errors import InvalidArgumentError, SpecDecodeError

logger = logging.getLogger(__name__)

#: The methods with a batch mode (the method registry's): the server runs the batched engine.
SERVE_METHODS = method_registry.BATCH_METHODS


def add_arguments(p: argparse.ArgumentParser, *, default_target: str, default_draft: str) -> None:
    """The ``serve`` subcommand's options."""
    p.add_argument("--target", default=default_target, help="offline model name, .gguf file, folder or hub id")
    p.add_argument("--draft", default=default_draft, help="draft model (method 'draft')")
    p.add_argument("--method", default="draft", choices=SERVE_METHODS,
                   help="decoding method of every request (default draft)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --target)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--max-batch-size", type=int, default=8, help="rows decoded at once (default 8)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a free row; beyond it the server answers 429 (default 64)")
    p.add_argument("--max-length", type=int, default=2048,
                   help="cache positions per row: prompt + max_tokens + a draft block (default 2048)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt accepted, in tokens (default: what --max-length leaves room for)")
    p.add_argument("--max-tokens-limit", type=int, default=None,
                   help="largest max_tokens accepted (default: --max-length)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds running requests may take before they are cancelled (default 30)")
    p.add_argument("--num-speculative-tokens", "-g", type=int, default=DEFAULT_NUM_SPECULATIVE_TOKENS,
                   help="gamma for every row")
    p.add_argument("--adaptive-draft-exit", action="store_true", help="per-row adaptive draft exit")
    p.add_argument("--exit-rule", default="row", choices=("row", "batch"),
                   help="with --adaptive-draft-exit: a row stops at its own unsure token, or the batch at the last")
    p.add_argument("--max-verify-tokens", default="auto",
                   help="most tokens one verification forward takes ('auto': 12 on CPU, none elsewhere; 'none')")
    p.add_argument("--skip-layers", default=None, help="layer-skip: e.g. 'attn=2,15;mlp=2,15'")
    p.add_argument("--skip-config", default=None, help="layer-skip: a skip-set JSON file")
    p.add_argument("--exit-layer", type=int, default=None, help="early-exit: layers the draft runs")
    p.add_argument("--prompt-lookup-max-ngram", type=int, default=3)
    p.add_argument("--prompt-lookup-min-ngram", type=int, default=1)
    p.add_argument("--ngram-check", action=argparse.BooleanOptionalAction, default=True,
                   help="cascade: keep only the n-gram tokens the draft model would draft itself (default); "
                        "--no-ngram-check proposes the whole match")
    p.add_argument("--max-model-prompt-tokens", type=int, metavar="N", default=None,
                   help="cascade: a request whose prompt has more than N tokens gets n-gram matches alone, "
                        "without the draft model (default: no limit)")
    p.add_argument("--draft-vocab-size", type=int, metavar="K", default=None,
                   help="draft and cascade: the draft model proposes among the K most frequent tokens only "
                        "(FR-Spec; default: its whole vocabulary)")
    p.add_argument("--draft-context-window", type=int, metavar="W", default=None,
                   help="draft and cascade: prefill the draft model with each prompt's last W tokens only "
                        "(default: the whole prompt)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--cache-dir", default=None, help="where assembled and dense models are cached")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="the batched fast path: decode-time forwards compiled at a few (rows, width) buckets, "
                        "CUDA graphs on CUDA, compiled in the warm-up; default: on for CUDA, off for a CPU")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the start-up forwards at every width the engine uses (without them, a CPU "
                        "server's memory grows while new matmul shapes turn up)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def _check_draft_options(args) -> None:
    """--draft-vocab-size, --max-model-prompt-tokens and --draft-context-window: in range, and taken by
    --method (the method registry's), before any model is loaded.

    Raises:
        InvalidArgumentError: A value out of range, or an option the method does not take.
    """
    for keyword, low in (("draft_vocab_size", 0), ("max_model_prompt_tokens", 1), ("draft_context_window", 1)):
        value, flag = getattr(args, keyword), "--" + keyword.replace("_", "-")
        if value is not None and value < low:
            meaning = "0: the whole vocabulary" if keyword == "draft_vocab_size" else "tokens"
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
        metrics.finished.labels(delivery.finish_reason).inc()

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

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout_s + 10)
    return Server(config)


def run(args) -> int:
    """``specdecode serve``: blocks until SIGTERM or SIGINT. After the graceful shutdown uvicorn
    re-raises the signal, so the process ends as killed by it (status 143 for SIGTERM in a
    shell), as every uvicorn application does.

    Raises:
        SpecDecodeError: Bad options (before loading models), a missing ``serve`` extra, or
            the loading errors of ``SpeculativeGenerator.from_pretrained``.
    """
    try:
        import fastapi  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise SpecDecodeError(f"specdecode serve needs the 'serve' extra ({e.name} is missing): "
                              "pip install 'specdecode[serve]'") from e
    from specdecode.drafters.control import DraftControl
    from specdecode.pipeline import SpeculativeGenerator
    from specdecode.serve.app import ServeSettings

    if not 0 <= args.port <= 65535:
        raise InvalidArgumentError(f"--port must be in 0..65535, got {args.port}")
    if args.method == "layer-skip" and args.skip_layers is None and args.skip_config is None:
        raise InvalidArgumentError("--method layer-skip needs --skip-layers SPEC or --skip-config FILE")
    if args.method == "early-exit" and args.exit_layer is None:
        raise InvalidArgumentError("--method early-exit needs --exit-layer N")
    for name in ("max_batch_size", "max_length", "num_speculative_tokens"):
        if getattr(args, name) < 1:
            raise InvalidArgumentError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    _check_draft_options(args)
    if args.max_queue < 0:
        raise InvalidArgumentError(f"--max-queue must be >= 0, got {args.max_queue}")
    verify = _max_verify_tokens(args.max_verify_tokens)
    control = DraftControl(adaptive_exit=True) if args.adaptive_draft_exit else None
    limit = args.max_length if args.max_tokens_limit is None else args.max_tokens_limit
    settings = ServeSettings(
        model_name=args.served_model_name or args.target, method=args.method, api_key=args.api_key,
        max_prompt_tokens=args.max_length if args.max_prompt_tokens is None else args.max_prompt_tokens, max_tokens_limit=limit,
        max_body_bytes=args.max_body_bytes, shutdown_timeout_s=args.shutdown_timeout,
    )
    draft = args.draft if method_registry.REGISTRY[args.method].needs_draft_model else None
    gen = SpeculativeGenerator.from_pretrained(args.target, draft,
                                               dtype=args.dtype, device=args.device, cache_dir=args.cache_dir)
    decoder = gen.batch_decoder(
        args.method, max_batch_size=args.max_batch_size, max_length=args.max_length,
        num_speculative_tokens=args.num_speculative_tokens, draft_control=control, exit_rule=args.exit_rule,
        max_verify_tokens=verify, skip_layers=args.skip_layers, skip_config=args.skip_config,
        exit_layer=args.exit_layer, prompt_lookup_max_ngram=args.prompt_lookup_max_ngram,
        prompt_lookup_min_ngram=args.prompt_lookup_min_ngram, compile=args.compile,
        ngram_check=args.ngram_check, max_model_prompt_tokens=args.max_model_prompt_tokens,
        draft_context_window=args.draft_context_window, draft_vocab_size=args.draft_vocab_size,
    )
    if not args.no_warmup:
        decoder.warm_up()
    app, engine, _ = build(gen, decoder, max_queue=args.max_queue, settings=settings)
    server = make_uvicorn_server(app, engine, host=args.host, port=args.port,
                                 shutdown_timeout_s=args.shutdown_timeout, log_level=args.log_level)
    logger.info("serving %s (%s) on http://%s:%d", settings.model_name, args.method, args.host, args.port)
    server.run()
    return 0
