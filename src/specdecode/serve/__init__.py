"""An OpenAI-compatible HTTP server on the batched speculative engine (``specdecode serve``).

Layers: ``engine_loop`` (one thread owns the models and steps the batched decoder),
``text`` (token ids -> streamed text, stop sequences cut), ``schemas`` (pydantic request
bodies), ``openai_format`` (response and error shapes), ``metrics`` (Prometheus),
``app`` (FastAPI routes), ``limits`` (context and memory limits), ``plan`` (a llama.cpp target's
defaults and refusals, before loading; the rest of generate's defaults: ``defaults.plan_command``),
``command`` (the CLI, uvicorn), ``loadtest`` (``specdecode soak``). Needs the ``serve`` extra
(FastAPI, uvicorn, sse-starlette, prometheus-client, pydantic); importing this package
alone does not import them.
"""
