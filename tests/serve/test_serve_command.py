"""`specdecode serve` as a user runs it: bad options fail before loading; SIGTERM ends it cleanly."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from serve_helpers import tiny_chat_folders
from specdecode.cli import main
from specdecode.serve.loadtest import wait_until_healthy, wait_until_listening


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max-queue", "-1"], "--max-queue must be >= 0"),
        (["--max-batch-size", "0"], "--max-batch-size must be >= 1"),
        (["--method", "early-exit"], "--exit-layer"),
        (["--method", "layer-skip"], "--skip-layers"),
        (["--method", "cascade", "--max-model-prompt-tokens", "-1"], "--max-model-prompt-tokens must be >= 0"),
        (["--method", "prompt-lookup", "--draft-quantize", "int4"], "not to 'prompt-lookup'"),
        (["--method", "prompt-lookup", "--adaptive-draft-exit"], "has none"),
        (["--draft-quantize", "none", "--draft-quantize-head", "int4"], "needs an int4 draft"),
        (["--draft-quantize", "none", "--quantize-group-size", "64"], "neither model is int4"),
        (["-g", "0"], "--num-speculative-tokens must be >= 1"),
        (["--method", "draft", "--max-model-prompt-tokens", "9"], "applies to the method 'cascade', not to 'draft'"),
        (["--draft-context-window", "0"], "--draft-context-window must be >= 1"),
        (["--draft-vocab-size", "-1"], "--draft-vocab-size must be >= 0"),
        (["--method", "early-exit", "--exit-layer", "1", "--draft-vocab-size", "8"], "not to 'early-exit'"),
        (["--method", "prompt-lookup", "--draft-context-window", "8"], "not to 'prompt-lookup'"),
        (["--max-verify-tokens", "many"], "'many'"),
        (["--port", "70000"], "0..65535"),
        (["--max-tokens-limit", "0", "--max-length", "64"], "max_tokens_limit must be an integer >= 1"),
        # --max-length too short for one prompt token, one new token and a draft block: refused before the
        # models load
        (["--device", "cpu", "--max-length", "14"],  # cascade's default adaptive exit: blocks of up to 12
         "--max-length 14 leaves no room for a request: a row keeps 13 positions for a draft block (--method "
         "cascade drafts up to 12 tokens a round, + 1), and a request needs at least one prompt token and one new "
         "token; allowed: --max-length >= 15"),
        (["--method", "autoregressive", "--max-length", "2"], "keeps 1 positions for a draft block (--method "
         "autoregressive drafts no token, + 1)"),
        (["--method", "autoregressive", "--max-length", "2"], "allowed: --max-length >= 3"),
        (["--method", "draft", "-g", "3", "--max-length", "5"], "allowed: --max-length >= 6"),
        (["--method", "prompt-lookup", "--max-length", "7"], "allowed: --max-length >= 8"),
        (["--method", "draft", "-g", "4", "--max-length", "100", "--max-prompt-tokens", "96"],
         "--max-prompt-tokens 96 does not fit --max-length 100: a prompt of 96 tokens, one new token and a draft "
         "block (5 positions) take 102; allowed: --max-prompt-tokens 1..94, or --max-length >= 102"),
        (["--max-length", "0"], "--max-length must be >= 1"),
        (["--method", "prompt-lookup", "--draft-exit-mode", "previous-round"],
         "--draft-exit-mode previous-round applies to the adaptive draft exit, which is off here"),
    ],
)
def test_bad_options_exit_2_before_loading_models(args, needle, capsys):
    code = main(["serve", "--target", "/nonexistent/model", *args])
    assert code == 2
    assert needle in capsys.readouterr().err


def test_sigterm_finishes_or_cancels_requests_and_exits_cleanly(tmp_path):
    target, draft = tiny_chat_folders(tmp_path)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:  # --port 0: the server binds a free port and names it in its log
        proc = subprocess.Popen(
            [sys.executable, "-m", "specdecode.cli", "serve", "--target", str(target), "--draft", str(draft),
             "--dtype", "float32", "--device", "cpu", "--port", "0", "--max-length", "512",
             "--shutdown-timeout", "1", "--log-level", "info", "--max-batch-size", "4"],
            stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
        )
    try:
        url = wait_until_listening(log_path, proc, 120)
        assert url is not None and re.fullmatch(r"http://127\.0\.0\.1:\d+", url), log_path.read_text()[-3000:]
        assert not url.endswith(":0")
        assert wait_until_healthy(url, proc, 120, poll_s=0.2), log_path.read_text()[-3000:]
        lines: list[str] = []
        errors: list[BaseException] = []

        def read_stream():
            body = {"prompt": "w5 w9 w11 w7", "max_tokens": 480, "stream": True, "temperature": 0.0}
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                    assert r.status_code == 200, r.read()
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            lines.append(line)
            except BaseException as e:  # noqa: BLE001 -- reported by the test below
                errors.append(e)

        reader = threading.Thread(target=read_stream)
        reader.start()
        while not lines and reader.is_alive():
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        reader.join(30)
        assert not reader.is_alive(), "the stream hung after SIGTERM"
        assert errors == []
        # uvicorn re-raises the signal after its graceful shutdown: the process ends as SIGTERM's
        assert proc.wait(30) in (0, -signal.SIGTERM)
        log = log_path.read_text()
        assert "Application shutdown complete" in log and "Traceback" not in log
        # Start-up names each phase with its duration, generate's defaults included (an int4 draft on a CPU
        # with AVX512, a dense one elsewhere: the server is a process of its own on this machine).
        import torch

        from specdecode.defaults import why_no_int4_draft

        int4 = why_no_int4_draft("cascade", "none", torch.device("cpu")) is None
        for phase in (r"loaded \S+ \(float32, cpu\) in [\d.]+ s", r"start-up: warm-up done in [\d.]+ s",
                      r"start-up: ready in [\d.]+ s \(loading [\d.]+ s",
                      r"method cascade, 4 rows, adaptive draft exit on"):
            assert re.search(phase, log), (phase, log[:3000])
        assert bool(re.search(r"quantized \S+ to int4 in [\d.]+ s", log)) == int4, log[:3000]
        # The stream ended properly: finished (a finish_reason) or cancelled with an error, then [DONE].
        assert lines[-1] == "data: [DONE]"
        assert '"finish_reason":"' in lines[-2] or "shutting down" in lines[-2]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.usefixtures("avx512_cpu")
@pytest.mark.parametrize(("flags", "device", "draft_quantize", "adaptive"), [
    ([], "cpu", "int4", True), ([], "cuda", None, True), (["--method", "draft"], "cpu", "int4", True),
    (["--quantize", "int8"], "cpu", None, False), (["-g", "3"], "cpu", "int4", False),
    (["--draft-quantize", "none"], "cpu", "none", True), (["--method", "prompt-lookup"], "cpu", None, False),
    (["--max-model-prompt-tokens", "0"], "cpu", "int4", True), (["--no-adaptive-draft-exit"], "cpu", "int4", False),
    (["--backend", "llama-cpp", "--method", "cascade"], "cpu", None, False),  # the draft in llama.cpp too
])
def test_serve_takes_generate_s_defaults_on_the_same_device(flags, device, draft_quantize, adaptive):
    """Both commands' flags resolve (``defaults.plan_command``) to the same plan, and that plan is generate's
    documented defaults: the int4 draft on an AVX512 CPU, the adaptive draft exit for draft and cascade with an
    unquantized target and no -g, the cascade's 512-token prompt limit with an int4 or llama.cpp draft or a
    float32 target on a CPU, the cost model over the default exit where the target computes in float32 on a CPU."""
    import torch

    from specdecode.cli import build_parser
    from specdecode.defaults import plan_command
    from specdecode.models.loading import resolve_dtype

    serve = build_parser().parse_args(["serve", *flags])
    gen = build_parser().parse_args(["generate", "--prompt", "w5", *flags])
    plan = plan_command(serve, torch.device(device))
    assert serve.method == gen.method
    assert plan == plan_command(gen, torch.device(device))
    assert plan.draft_quantize == draft_quantize
    assert (plan.draft_control is not None and plan.draft_control.adaptive_exit) == adaptive
    float32_cpu = device == "cpu" and resolve_dtype("auto", torch.device(device)) == torch.float32
    costly_prefill = draft_quantize == "int4" or "llama-cpp" in flags or float32_cpu
    limit = 512 if serve.method == "cascade" and costly_prefill and "--max-model-prompt-tokens" not in flags else None
    assert plan.max_model_prompt_tokens == limit
    assert plan.num_speculative_tokens == (3 if "-g" in flags else 5)
    if adaptive:  # the cost model over the default exit where the target computes in float32 on a CPU
        default_exit = "--adaptive-draft-exit" not in flags
        assert plan.draft_control.length_schedule == ("cost-model" if float32_cpu and default_exit else "constant")
    if not flags and device == "cpu":  # the case, stated outright
        assert (serve.method, plan.draft_quantize, plan.max_model_prompt_tokens) == ("cascade", "int4", 512)


def test_listening_url_names_the_bound_address():
    from specdecode.serve.command import listening_url

    assert listening_url(("127.0.0.1", 43127)) == "http://127.0.0.1:43127"
    assert listening_url(("::1", 8000, 0, 0)) == "http://[::1]:8000"


def test_a_bad_host_or_a_busy_port_exits_2_before_loading_models(capsys):
    """uvicorn reported both only after the models had loaded ("[Errno -2] Name or service not known",
    "address already in use"), naming neither flag."""
    code = main(["serve", "--target", "/nonexistent/model", "--host", "999.1.1.1"])
    assert code == 2 and "--host '999.1.1.1' is not an address of this machine" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["serve", "--target", "/nonexistent/model", "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2 and f"cannot listen on --host '127.0.0.1' --port {port}: Address already in use" in err, err


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_check_address_binds_as_asyncio_does():
    """It bound only the first getaddrinfo result without IPV6_V6ONLY, so an IPv6 --host was refused when
    an IPv4 listener held the port (uvicorn binds fine), and --host "" was refused."""
    from specdecode.errors import InvalidArgumentError
    from specdecode.serve.command import check_address

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(InvalidArgumentError, match=rf"cannot listen on --host '127.0.0.1' --port {port}: "):
            check_address("127.0.0.1", port)
        if _ipv6_loopback():
            check_address("::1", port)  # another family: asyncio binds it beside the IPv4 listener
    with socket.socket() as every_ipv4:
        every_ipv4.bind(("0.0.0.0", 0))
        every_ipv4.listen()
        port = every_ipv4.getsockname()[1]
        if _ipv6_loopback():
            check_address("::", port)  # IPV6_V6ONLY: "::" leaves 0.0.0.0 alone (once "Address already in use")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    check_address("", port)  # every interface, as uvicorn's --host ""


# --- --max-length and --max-batch-size against the loaded models ---------------------------------------------


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    return tiny_chat_folders(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def not_listening(monkeypatch):
    """``serve`` stops where it would listen (so a test sees whether it got that far); returns the list
    of servers it made."""
    from specdecode.serve import command

    made = []

    class NotListening:
        def run(self):
            pass

    def make(app, engine, **kw):
        made.append((app, engine))
        return NotListening()

    monkeypatch.setattr(command, "make_uvicorn_server", make)
    return made


def serve_args(tiny_folders, *flags) -> list[str]:
    target, draft = tiny_folders
    return ["serve", "--target", str(target), "--draft", str(draft), "--dtype", "float32", "--device", "cpu",
            "--port", "0", "--log-level", "warning", "--no-warmup", *map(str, flags)]


def test_a_max_length_past_the_target_s_context_is_refused_before_the_engine_is_built(
        tiny_folders, not_listening, capsys):
    """The tiny target has 512 positions (max_position_embeddings); cascade's rows keep 13 more for a draft
    block. --max-length 100000 once started a server whose rows could never use more than 525 positions,
    its caches sized for 100000."""
    code = main(serve_args(tiny_folders, "--max-length", 100000))
    err = capsys.readouterr().err
    assert code == 2 and not_listening == [], err
    assert ("--max-length 100000 is more than a row can use: the target's context length is 512 positions "
            "(max_position_embeddings) and a row keeps 13 more for a draft block; allowed: --max-length 15..525"
            ) in err, err
    assert main(serve_args(tiny_folders, "--max-length", 525)) == 0 and len(not_listening) == 1  # the bound


def test_the_default_max_length_is_what_the_target_s_context_leaves_room_for(tiny_folders):
    """2048 by default, or the context length and a draft block where they take fewer (512 + 13 here):
    the default once was 2048 whatever the model."""
    from specdecode.cli import build_parser
    from specdecode.serve.command import load_server

    _, engine = load_server(build_parser().parse_args(serve_args(tiny_folders)))
    assert engine.decoder.max_length == 525
    _, engine = load_server(build_parser().parse_args(serve_args(tiny_folders, "--method", "autoregressive")))
    assert engine.decoder.max_length == 513


def test_a_max_batch_size_whose_caches_do_not_fit_in_memory_is_refused_before_the_engine_is_built(
        tiny_folders, not_listening, capsys):
    """Rows of 256 positions take 256 KiB of keys and values here (target and draft), so 2,000,000 rows
    need about 488 GiB: the caches were only allocated at the warm-up (or, with --no-warmup, the first
    request), and failed there."""
    code = main(serve_args(tiny_folders, "--max-length", 256, "--max-batch-size", 2_000_000))
    err = capsys.readouterr().err
    assert code == 2 and not_listening == [], err
    assert re.search(r"--max-batch-size 2000000 does not fit in memory: at --max-length 256 a row's keys and "
                     r"values take 256\.0 KiB \(target 128\.0 KiB, draft 128\.0 KiB\), 2000000 rows 488\.3 GiB, "
                     r"more than the [\d.]+ GiB available on cpu; allowed: --max-batch-size 1\.\.\d+ at "
                     r"--max-length 256", err), err


def test_the_cache_memory_check_allows_exactly_the_rows_that_fit(tiny_folders):
    from specdecode.errors import InvalidArgumentError
    from specdecode.pipeline import SpeculativeGenerator
    from specdecode.serve.limits import check_cache_memory, kv_bytes_per_position

    target, draft = tiny_folders
    gen = SpeculativeGenerator.from_pretrained(str(target), str(draft), dtype="float32", device="cpu")
    # 4 layers x 2 key/value heads x 8 dimensions x (keys + values) x 4 bytes
    assert kv_bytes_per_position(gen.target.model) == kv_bytes_per_position(gen.draft.model) == 512
    row = 2 * 512 * 100  # target and draft, 100 positions
    check_cache_memory(gen, "cascade", max_batch_size=3, max_length=100, available_bytes=3 * row)
    with pytest.raises(InvalidArgumentError, match=r"--max-batch-size 4 does not fit in memory: .* allowed: "
                                                   r"--max-batch-size 1\.\.3 at --max-length 100"):
        check_cache_memory(gen, "cascade", max_batch_size=4, max_length=100, available_bytes=3 * row)
    check_cache_memory(gen, "prompt-lookup", max_batch_size=6, max_length=100, available_bytes=3 * row)
    with pytest.raises(InvalidArgumentError, match=r"not even one row fits: lower --max-length"):
        check_cache_memory(gen, "cascade", max_batch_size=1, max_length=100, available_bytes=row - 1)


@pytest.mark.parametrize("flags", [
    [], ["--method", "autoregressive"], ["--method", "draft"], ["--method", "draft", "-g", "3"],
    ["--method", "cascade", "--no-adaptive-draft-exit"], ["--method", "draft", "--draft-tree-depth", "3"],
    ["--method", "layer-skip", "--skip-layers", "attn=1;mlp=1"], ["--method", "early-exit", "--exit-layer", "2"],
    ["--method", "prompt-lookup"], ["--method", "prompt-lookup", "--prompt-lookup-branches", "3", "-g", "7"],
    ["--method", "token-recycling"], ["--method", "layer-skip", "--skip-layers", "attn=1", "--adaptive-draft-exit"],
])
def test_the_draft_block_known_before_loading_is_the_engine_s(tiny_folders, flags):
    """--max-length's bounds are checked with the longest draft block the flags give, before the models load;
    it must be the block of the engine built afterwards."""
    import torch

    from specdecode.cli import build_parser
    from specdecode.pipeline import SpeculativeGenerator
    from specdecode.defaults import plan_command
    from specdecode.serve.command import build_decoder, check_llama_cpp_backend
    from specdecode.serve.limits import longest_draft_block

    args = build_parser().parse_args(serve_args(tiny_folders, "--max-length", 256, *flags))
    check_llama_cpp_backend(args)
    plan = plan_command(args, torch.device("cpu"))
    target, draft = tiny_folders
    gen = SpeculativeGenerator.from_pretrained(str(target), str(draft) if plan.draft else None, dtype="float32",
                                               device="cpu")
    assert longest_draft_block(args, plan) == build_decoder(gen, args, plan).max_block


def test_dynamic_shapes_reach_the_engine_and_need_the_fast_path(tiny_folders):
    """``serve --dynamic-shapes`` gives the engine ``dynamic_shapes``; without the fast path (a CPU's default) it is
    refused by name rather than ignored."""
    import torch

    from specdecode.cli import build_parser
    from specdecode.errors import InvalidArgumentError
    from specdecode.pipeline import SpeculativeGenerator
    from specdecode.defaults import plan_command
    from specdecode.serve.command import build_decoder, check_llama_cpp_backend

    def engine(*flags):
        args = build_parser().parse_args(serve_args(tiny_folders, "--method", "draft", "--max-length", 256, *flags))
        check_llama_cpp_backend(args)
        return build_decoder(gen, args, plan_command(args, torch.device("cpu")))

    target, draft = tiny_folders
    # stock linears: where float32 CPU layers are prepacked by default (an AVX2-only CPU), the fast path refuses them
    gen = SpeculativeGenerator.from_pretrained(str(target), str(draft), dtype="float32", device="cpu",
                                               prepack_linears=False)
    made = engine("--compile", "--dynamic-shapes")
    assert made.cache.fast.dynamic_shapes and made.drafter.cache.fast.dynamic_shapes
    assert not engine("--compile").cache.fast.dynamic_shapes
    with pytest.raises(InvalidArgumentError, match=r"dynamic_shapes must be True or False, and True only where "
                                                   r"forwards compile \(compile=True, --compile; .*got True with "
                                                   r"compile=False, graphs=True"):
        engine("--dynamic-shapes")


# --- a draft model's context length, and --max-length checked before the models load ----------------------------


@pytest.fixture(scope="module")
def short_draft_folders(tmp_path_factory):
    """The tiny pair, its draft stating a context length of 300 positions (the target's: 512)."""
    import json

    target, draft = tiny_chat_folders(tmp_path_factory.mktemp("short_draft"))
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 300}))
    return target, draft


@pytest.fixture
def no_loading(monkeypatch):
    """Loading models fails the test's command (a check it expects first did not come first); returns the
    list of loads tried."""
    from specdecode.errors import SpecDecodeError
    from specdecode.pipeline import SpeculativeGenerator

    tried = []

    def refuse(cls, *args, **kwargs):
        tried.append(args)
        raise SpecDecodeError("this test loads no model")

    monkeypatch.setattr(SpeculativeGenerator, "from_pretrained", classmethod(refuse))
    return tried


def draft_refusal(draft, value: int) -> str:
    return (f"--max-length {value} is more than a row can use: the draft model {str(draft)!r} has a context length "
            "of 300 positions (max_position_embeddings), fewer than the target's 512 and a row keeps 13 more for a "
            "draft block; allowed: --max-length 15..313")


def test_a_max_length_past_a_shorter_draft_context_is_refused_naming_the_draft_before_loading(
        short_draft_folders, no_loading, capsys):
    """The draft model sees every position of a row but the draft block: --max-length 400 gave it 387 positions,
    past its 300. Only the target's context length was checked."""
    code = main(serve_args(short_draft_folders, "--max-length", 400))
    assert code == 2 and no_loading == []
    assert draft_refusal(short_draft_folders[1], 400) in capsys.readouterr().err


def test_the_draft_s_context_length_is_checked_once_loaded_where_its_files_said_nothing(
        short_draft_folders, not_listening, capsys, monkeypatch):
    from specdecode.serve import command

    monkeypatch.setattr(command, "stored_context_limits", lambda *args, **kwargs: [])  # nothing read before loading
    code = main(serve_args(short_draft_folders, "--max-length", 400))
    assert code == 2 and not_listening == []
    assert draft_refusal(short_draft_folders[1], 400) in capsys.readouterr().err
    assert main(serve_args(short_draft_folders, "--max-length", 313)) == 0 and len(not_listening) == 1  # the bound
    # a method without a draft model is bound by the target alone
    assert main(serve_args(short_draft_folders, "--method", "prompt-lookup", "--max-length", 400)) == 0


def test_the_default_max_length_respects_a_shorter_draft_context(short_draft_folders):
    from specdecode.cli import build_parser
    from specdecode.serve.command import load_server

    _, engine = load_server(build_parser().parse_args(serve_args(short_draft_folders)))
    assert engine.decoder.max_length == 313  # 300 + 13; was 525, the target's 512 + 13
    _, engine = load_server(build_parser().parse_args(serve_args(short_draft_folders, "--method", "autoregressive")))
    assert engine.decoder.max_length == 513


def test_a_max_length_past_the_target_s_context_is_refused_before_the_models_load(tiny_folders, no_loading, capsys):
    """The target folder's config states its context length: --max-length 100000 is refused in milliseconds,
    not after loading the models (minutes for the offline models' first start)."""
    code = main(serve_args(tiny_folders, "--max-length", 100000))
    assert code == 2 and no_loading == []
    assert ("--max-length 100000 is more than a row can use: the target's context length is 512 positions "
            "(max_position_embeddings)") in capsys.readouterr().err
