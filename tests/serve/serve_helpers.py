"""A real uvicorn server on a free loopback port, in a thread, over tiny float32 models."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import torch

from conftest import make_tiny_model, make_tiny_tokenizer
from helpers import perturbed_copy, save_tiny_folders

#: A word-level chat template for the tiny tokenizer (every word is in its vocabulary).
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('the first message must not be the "
    "assistant') }}{% endif %}{% for m in messages %}{% if m['role'] == 'system' %}w3 {% else %}w4 {% endif %}{{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}w5{% endif %}"
)


def tiny_chat_folders(root):
    """(target folder, draft folder): a tiny Llama target, a perturbed draft, a tokenizer with a chat template."""
    target = make_tiny_model("llama", num_layers=4, seed=2)
    draft = perturbed_copy(target, noise=0.1, seed=1)
    tok = make_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return save_tiny_folders(root, tok, target, draft)


class GatedStep:
    """Replaces ``decoder.step`` so a test decides when rounds run (``open``/``close``) and how
    long each takes (``delay_s``)."""

    def __init__(self, decoder, delay_s: float = 0.0) -> None:
        self.decoder, self.delay_s = decoder, delay_s
        self.gate = threading.Event()
        self.gate.set()
        self._step = decoder.step
        decoder.step = self

    def __call__(self):
        while not self.gate.wait(0.05):
            pass
        if self.delay_s:
            time.sleep(self.delay_s)
        return self._step()

    def close(self) -> None:
        self.gate.clear()

    def open(self) -> None:
        self.gate.set()


@contextlib.contextmanager
def running_server(generator, method: str = "draft", *, max_batch_size: int = 4, max_queue: int = 16,
                   max_length: int = 256, delay_s: float = 0.0, **settings):
    """Start ``specdecode.serve`` on 127.0.0.1:<free port>; yields (base_url, engine, gated step)."""
    from specdecode.serve.app import ServeSettings
    from specdecode.serve.command import build

    decoder = generator.batch_decoder(method, max_batch_size=max_batch_size, max_length=max_length)
    gate = GatedStep(decoder, delay_s)
    settings = ServeSettings(**{"model_name": "tiny", "method": method, "shutdown_timeout_s": 2.0, **settings})
    app, engine, _ = build(generator, decoder, max_queue=max_queue, settings=settings)
    with serving(app, engine, before_stop=gate.open) as url:
        yield url, engine, gate


@contextlib.contextmanager
def serving(app, engine, before_stop=lambda: None):
    """Run ``app`` (and its engine loop) with real uvicorn on 127.0.0.1:<free port>; yields the base URL.
    ``before_stop`` runs first on the way out (e.g. opening a test's step gate, so that shutdown can finish)."""
    from specdecode.serve.command import make_uvicorn_server

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = make_uvicorn_server(app, engine, host="127.0.0.1", port=port, shutdown_timeout_s=2.0,
                                 log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        with torch.inference_mode(False):
            yield f"http://127.0.0.1:{port}"
    finally:
        before_stop()
        server.should_exit = True
        thread.join(30)
        sock.close()


def openai_client(url: str):
    """The official openai client on ``url``, no retries."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def target_only(generator, prompt: str, chat: bool, **options):
    """Target-only decoding of one prompt with ``GenerationConfig`` ``options`` (20 new tokens unless
    ``max_new_tokens`` is given): the reference a server's answer is compared with."""
    from specdecode.config import GenerationConfig

    config = GenerationConfig(max_new_tokens=options.pop("max_new_tokens", 20), **options)
    return generator.generate(prompt, config, method="autoregressive", chat=chat)


def decoded(generator, ids: list[int]) -> str:
    """``ids`` as text, without special tokens (as the server answers)."""
    return generator.tokenizer.decode(ids, skip_special_tokens=True)


def command_completion(folders, cache_dir, prompt: str, *flags: str) -> tuple[str, object]:
    """The greedy 24-token completion of ``prompt`` over real HTTP (the openai client) by a server built as
    ``specdecode serve`` builds it from ``flags`` (``load_server``) on the tiny pair in ``folders``, and its engine."""
    from specdecode.cli import build_parser
    from specdecode.serve.command import load_server

    target, draft = folders
    args = build_parser().parse_args([
        "serve", "--target", str(target), "--draft", str(draft), "--dtype", "float32", "--device", "cpu",
        "--max-length", "256", "--max-batch-size", "2", "--served-model-name", "tiny", "--no-warmup",
        "--cache-dir", str(cache_dir), "--log-level", "warning", *flags,
    ])
    app, engine = load_server(args)
    with serving(app, engine) as url:
        r = openai_client(url).with_options(timeout=120).completions.create(model="tiny", prompt=prompt,
                                                                          max_tokens=24, temperature=0)
    return r.choices[0].text, engine


# Fixtures shared by the server test modules (imported by name there): the tiny chat model pair,
# a generator over it, and a real server on loopback, one of each per test module.


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return tiny_chat_folders(tmp_path_factory.mktemp("serve_models"))


@pytest.fixture(scope="module")
def generator(folders):
    from specdecode.pipeline import SpeculativeGenerator

    target, draft = folders
    return SpeculativeGenerator.from_pretrained(str(target), str(draft), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def server(generator):
    with running_server(generator) as running:  # 4 rows, 256 positions per row
        yield running
