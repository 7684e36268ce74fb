"""``specdecode serve --backend llama-cpp``: the target's GGUF file in llama.cpp, one request at a time.

The flags a target in llama.cpp cannot take are refused before anything loads, and the defaults are
``generate --backend llama-cpp``'s. The last tests start the server as the command does
(``serve.command.load_server`` on parsed flags; only the tokenizer is the tiny one, since it
cannot be read back from the tiny float32 GGUF file) and drive it with real uvicorn on loopback
and the ``openai`` client: a completion equals llama.cpp's own greedy decoding of the file, and
of two concurrent requests one runs while the other waits in the queue, and both succeed.
"""

from __future__ import annotations

import threading

import openai
import pytest
import torch

from conftest import make_tiny_model, make_tiny_tokenizer
from runner_target_helpers import PROMPT
from serve_helpers import serving
from specdecode.cli import build_parser, main
from specdecode.engine.cost_model import MEASURED_WIDTHS

TEXT_A = " ".join(f"w{t}" for t in PROMPT[1:])  # the tiny tokenizer's words: ids PROMPT[1:], no BOS
TEXT_B = "w30 w31 w32 w30 w31 w8 w30 w31"


@pytest.mark.parametrize(("flags", "needle"), [
    (["--max-batch-size", "4"], "--max-batch-size 4: with --backend llama-cpp the server decodes one request at a "
                                "time (llama.cpp's target runs one sequence at a time"),
    (["--method", "layer-skip", "--skip-layers", "attn=1"],
     "--method layer-skip does not run with --backend llama-cpp: it drafts with the target's own torch layers"),
    (["--method", "early-exit", "--exit-layer", "1"], "--method early-exit does not run with --backend llama-cpp"),
    (["--compile"], "--compile compiles torch forwards, but with --backend llama-cpp"),
    (["--quantize", "int8"], "quantize='int8' quantize torch weights, but backend='llama-cpp'"),
    (["--dtype", "bfloat16"], "dtype='bfloat16': backend='llama-cpp' runs the GGUF file's own weight types"),
    (["--method", "draft", "--draft-vocab-size", "64"], "--draft-vocab-size 64 truncates a torch draft's LM head; a "
                                                        "llama.cpp draft (--draft-backend llama-cpp, or beside "
                                                        "--backend llama-cpp) computes every logit"),
])
def test_what_llama_cpp_cannot_do_exits_2_before_loading(flags, needle, capsys):
    code = main(["serve", "--backend", "llama-cpp", "--target", "/nonexistent/model.gguf", *flags])
    assert code == 2
    assert needle in capsys.readouterr().err


def test_defaults_are_generate_s_under_llama_cpp():
    from specdecode import generate_command
    from specdecode.serve.command import check_llama_cpp_backend

    args = build_parser().parse_args(["serve", "--backend", "llama-cpp"])
    check_llama_cpp_backend(args)
    assert (args.method, args.max_batch_size) == (generate_command.LLAMA_CPP_COMMAND_METHOD, 1) == ("prompt-lookup", 1)
    args = build_parser().parse_args(["serve", "--backend", "llama-cpp", "--method", "autoregressive",
                                      "--max-batch-size", "1"])
    check_llama_cpp_backend(args)
    assert (args.method, args.max_batch_size) == ("autoregressive", 1)
    args = build_parser().parse_args(["serve"])  # the torch target keeps its defaults
    check_llama_cpp_backend(args)
    assert (args.method, args.max_batch_size) == ("cascade", 8)


def test_help_says_one_request_at_a_time(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "ONE REQUEST AT A TIME" in out and "further requests wait in the queue (--max-queue)" in out


# ---------------------------------------------------------------------------------------------
# the server on a tiny float32 GGUF file in llama.cpp


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install 'specdecode[llamacpp]')")
    from tiny_gguf import write_tiny_gguf

    model = make_tiny_model("qwen2", num_layers=2, seed=4)
    return write_tiny_gguf(model, make_tiny_tokenizer(), tmp_path_factory.mktemp("gguf") / "qwen2.gguf")


def llama_cpp_own_greedy(path, prompt: list[int], n: int, eos: int) -> list[int]:
    """llama.cpp's own greedy decoding (``Llama.generate``) with the server's model settings (llama.cpp's
    default f16 KV cache, torch's thread count), up to and with the first EOS."""
    import llama_cpp

    threads = torch.get_num_threads()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=threads, n_threads_batch=threads, verbose=False)
    out: list[int] = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        out.append(int(token))
        if len(out) == n or token == eos:
            break
    llm.close()
    return out


class StepPermits:
    """Replaces ``decoder.step``: each round waits for a permit (``allow``), so a test knows where the
    engine stands; ``open`` lets every later round through."""

    def __init__(self, decoder) -> None:
        self.permits = threading.Semaphore(0)
        self.opened = threading.Event()
        self._step = decoder.step
        decoder.step = self

    def __call__(self):
        while not self.opened.is_set() and not self.permits.acquire(timeout=0.05):
            pass
        return self._step()

    def allow(self, n: int = 1) -> None:
        self.permits.release(n)

    def open(self) -> None:
        self.opened.set()


@pytest.fixture(scope="module")
def llama_server(tiny_gguf, tmp_path_factory):
    from specdecode.models import llama_cpp_target
    from specdecode.serve.command import load_server

    tok = make_tiny_tokenizer()
    patch = pytest.MonkeyPatch()
    patch.setattr(llama_cpp_target, "_target_tokenizer", lambda spec, path, cache_dir: tok)
    args = build_parser().parse_args([
        "serve", "--backend", "llama-cpp", "--target", str(tiny_gguf), "--max-length", "256",
        "--served-model-name", "tiny", "--cache-dir", str(tmp_path_factory.mktemp("cache")), "--log-level", "warning",
    ])
    try:
        app, engine = load_server(args)
    finally:
        patch.undo()
    permits = StepPermits(engine.decoder)
    permits.open()
    with serving(app, engine, before_stop=permits.open) as url:
        yield url, engine, permits, tok


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def expected(tiny_gguf, tok, text: str, n: int) -> tuple[list[int], str]:
    """llama.cpp's own greedy tokens after ``text`` (ids) and their text."""
    ids = llama_cpp_own_greedy(tiny_gguf, tok(text, add_special_tokens=False)["input_ids"], n, tok.eos_token_id)
    return ids, tok.decode(ids, skip_special_tokens=True)


def test_server_runs_the_llama_cpp_target_one_row_with_prompt_lookup_from_measured_costs(llama_server):
    _, engine, _, _ = llama_server
    decoder = engine.decoder
    assert decoder.max_batch_size == 1
    assert type(decoder.target).__name__ == "LlamaCppTargetRunner"
    assert type(decoder.drafter).__name__ == "PromptLookupDrafter"
    assert type(decoder.draft_control).__name__ == "SpeculationCostPolicy"  # as generate --backend llama-cpp drafts
    assert list(decoder.target.forward_costs) == list(MEASURED_WIDTHS)


def test_completion_equals_llama_cpp_s_own_greedy_output(llama_server, tiny_gguf):
    url, _, _, tok = llama_server
    n = 24
    r = client(url).completions.create(model="tiny", prompt=TEXT_A, max_tokens=n, temperature=0)
    ids, text = expected(tiny_gguf, tok, TEXT_A, n)
    assert r.choices[0].text == text and len(set(ids)) > 3
    assert r.usage.completion_tokens == len(ids)
    assert r.model_extra["speculative"]["method"] == "prompt-lookup"


def test_two_concurrent_requests_one_waits_in_the_queue_and_both_succeed(llama_server, tiny_gguf):
    url, engine, permits, tok = llama_server
    n = 20
    permits.opened.clear()  # from now on each round needs a permit
    answers: dict[str, object] = {}

    def ask(name: str, text: str) -> None:
        try:
            answers[name] = client(url).completions.create(model="tiny", prompt=text, max_tokens=n, temperature=0)
        except Exception as e:  # noqa: BLE001 -- reported by the assertions below
            answers[name] = e

    threads = [threading.Thread(target=ask, args=(name, text)) for name, text in (("a", TEXT_A), ("b", TEXT_B))]
    try:
        for t in threads:
            t.start()
        assert wait_for(lambda: engine.outstanding == 2)  # both accepted: no 429, nothing failed
        permits.allow(1)  # one round: a row is admitted and decodes, the other request stays queued
        assert wait_for(lambda: engine.running == 1 and engine.waiting == 1)
        assert engine.decoder.num_running == 1 and not answers
    finally:
        permits.open()
        for t in threads:
            t.join(60)
    for name, text in (("a", TEXT_A), ("b", TEXT_B)):
        answer = answers[name]
        assert not isinstance(answer, Exception), answer
        ids, expected_text = expected(tiny_gguf, tok, text, n)
        assert (answer.choices[0].text, answer.usage.completion_tokens) == (expected_text, len(ids)), name
    assert engine.outstanding == 0


def wait_for(predicate, timeout_s: float = 30.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_readme_s_server_section_says_one_request_at_a_time():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme.split("### OpenAI-compatible server")[1].split("\n### ")[0]
    assert "serve --backend llama-cpp" in section
    assert "`--backend llama-cpp` serves one request at a time." in section
    assert "further requests wait in the queue (`--max-queue`" in section


@pytest.mark.parametrize("flags", [[], ["-g", "9"], ["--method", "autoregressive"]])
def test_the_draft_block_known_before_loading_is_the_engine_s(tiny_gguf, tmp_path, flags, monkeypatch):
    """--max-length's bounds are checked before loading with the longest draft block the flags give: under
    llama.cpp, prompt lookup's γ capped at the widest forward whose cost is measured (8 tokens: blocks of 7)."""
    from specdecode.models import llama_cpp_target
    from specdecode.defaults import plan_command
    from specdecode.serve.command import check_llama_cpp_backend, load_server
    from specdecode.serve.limits import longest_draft_block

    monkeypatch.setattr(llama_cpp_target, "_target_tokenizer", lambda spec, path, cache_dir: make_tiny_tokenizer())
    argv = ["serve", "--backend", "llama-cpp", "--target", str(tiny_gguf), "--max-length", "64", "--no-warmup",
            "--cache-dir", str(tmp_path), "--log-level", "warning", *flags]
    _, engine = load_server(build_parser().parse_args(argv))
    args = build_parser().parse_args(argv)
    check_llama_cpp_backend(args)
    block = longest_draft_block(args, plan_command(args, torch.device("cpu")))
    assert block == engine.decoder.max_block == {(): 5, ("-g", "9"): 7}.get(tuple(flags), 0)


def test_a_max_length_past_the_gguf_target_s_context_is_refused_before_loading(tiny_gguf, tmp_path, monkeypatch,
                                                                                 capsys):
    """The GGUF file's metadata states the target's training context (llama.cpp's n_ctx_train, 512 here): an
    over-long --max-length is refused before llama.cpp loads the file (it was refused only after)."""
    from specdecode.errors import SpecDecodeError
    from specdecode.models.context_length import stored_context_length
    from specdecode.models.llama_cpp import LlamaCppModel
    from specdecode.pipeline import SpeculativeGenerator

    model = LlamaCppModel(tiny_gguf, role="target model")
    try:
        assert stored_context_length(str(tiny_gguf), backend="llama-cpp").positions == model.n_ctx_train == 512
    finally:
        model.close()
    tried = []

    def refuse(cls, *args, **kwargs):
        tried.append(args)
        raise SpecDecodeError("this test loads no model")

    monkeypatch.setattr(SpeculativeGenerator, "from_pretrained", classmethod(refuse))
    code = main(["serve", "--backend", "llama-cpp", "--target", str(tiny_gguf), "--max-length", "100000",
                 "--cache-dir", str(tmp_path), "--port", "0"])
    assert code == 2 and tried == []
    assert ("--max-length 100000 is more than a row can use: the target's context length is 512 positions (the GGUF "
            "file's qwen2.context_length) and a row keeps 6 more for a draft block; allowed: --max-length 8..518"
            ) in capsys.readouterr().err


@pytest.mark.usefixtures("avx512_cpu")
def test_a_draft_beside_the_llama_cpp_target_runs_in_llama_cpp_too(tiny_gguf, tmp_path, monkeypatch):
    """``serve --backend llama-cpp --method draft``: the draft runs in llama.cpp, as with ``generate`` (the plan once
    gave it generate's int4 torch-draft default on an AVX512 CPU, which loading refused), and the completion is
    llama.cpp's own greedy output."""
    from specdecode.models import llama_cpp_target
    from specdecode.serve.command import load_server

    tok = make_tiny_tokenizer()
    monkeypatch.setattr(llama_cpp_target, "_target_tokenizer", lambda spec, path, cache_dir: tok)
    args = build_parser().parse_args([
        "serve", "--backend", "llama-cpp", "--target", str(tiny_gguf), "--draft", str(tiny_gguf), "--method", "draft",
        "--max-length", "256", "--served-model-name", "tiny", "--no-warmup", "--cache-dir", str(tmp_path),
        "--log-level", "warning",
    ])
    app, engine = load_server(args)
    drafter = engine.decoder.drafter
    assert type(drafter).__name__ == "DraftModelDrafter" and drafter.model is None  # no torch draft: llama.cpp's
    assert type(drafter._sequence_runner).__name__.startswith("LlamaCpp")  # a llama.cpp runner
    with serving(app, engine) as url:
        r = client(url).completions.create(model="tiny", prompt=TEXT_A, max_tokens=16, temperature=0)
    ids, text = expected(tiny_gguf, tok, TEXT_A, 16)
    assert r.choices[0].text == text
    assert r.model_extra["speculative"]["method"] == "draft"
