"""`specdecode generate` end to end on tiny models saved as folders."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from conftest import make_tiny_model, make_tiny_tokenizer
from helpers import run_generate, save_tiny_folders
from specdecode import GenerationConfig, SpeculativeDecoder


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    target = make_tiny_model("llama", num_layers=3)
    draft = make_tiny_model("llama", num_layers=1, seed=5)
    return (*save_tiny_folders(tmp_path_factory.mktemp("models"), make_tiny_tokenizer(), target, draft), target)


_run = run_generate


def test_generate_json_matches_autoregressive(tiny_folders, capsys):
    target_dir, draft_dir, target = tiny_folders
    code, out, err = _run(
        capsys, "--target", target_dir, "--draft", draft_dir, "--prompt", "w5 w9 w11", "--max-new-tokens", 12,
        "--dtype", "float32", "--device", "cpu", "-g", 3, "--json",
    )
    assert code == 0, err
    result = json.loads(out)  # stdout holds exactly one JSON object
    expected = SpeculativeDecoder(target, eos_token_ids=[2]).generate(
        torch.tensor([[5, 9, 11]]), GenerationConfig(max_new_tokens=12)
    )
    assert result["token_ids"] == expected.token_ids
    stats = result["stats"]
    assert stats["num_new_tokens"] == len(expected.token_ids)
    assert stats["num_drafted_tokens"] >= stats["num_accepted_tokens"] >= 0
    assert stats["mean_accepted_tokens_counts_bonus"] is True
    for key in ("acceptance_rate", "acceptance_by_position", "prefill_time_s", "decode_time_s", "tokens_per_s"):
        assert key in stats
    assert result["dtype"] == "float32"


def test_generate_streams_text_and_prints_stats(tiny_folders, capsys):
    target_dir, _, _ = tiny_folders
    code, out, err = _run(
        capsys, "--target", target_dir, "--method", "autoregressive", "--prompt", "w5 w9", "--max-new-tokens", 6,
        "--dtype", "float32",
    )
    assert code == 0, err
    assert "w" in out and "acceptance rate" in out and "decode tokens/s" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt", ""], "the prompt is empty"),
        (["--prompt", "w5", "--top-p", "1.5"], r"top_p must be in (0, 1], got 1.5"),
        (["--prompt", "w5", "--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--prompt", "w5", "--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1, got 0"),
        (["--prompt", "w5", "-g", "0"], "num_speculative_tokens (gamma) must be an integer >= 1, got 0"),
        (["--prompt", "w5", "--target", "nope-model"], "unknown model 'nope-model'"),
        (["--prompt", "w5", "--method", "prompt-lookup", "--draft-quantize-head", "int8"],
         "--draft-quantize-head applies to --method draft or cascade (the draft model), not 'prompt-lookup'"),
        (["--prompt", "w5", "--draft-quantize", "int8", "--draft-quantize-head", "int4"],
         "--draft-quantize-head int4 needs an int4 draft (--draft-quantize int4); the draft here is int8 "
         "(--draft-quantize int8)"),
        (["--prompt", "w5", "--method", "prompt-lookup", "--quantize-group-size", "64"],
         "--quantize-group-size 64 applies to int4 weights, but neither model is int4: the target is dense (--quantize "
         "none) and there is no draft model (--method prompt-lookup loads none); leave it out, or make one of them "
         "int4 (--quantize int4 or --draft-quantize int4)"),
        (["--prompt", "w5", "--draft-quantize", "none", "--quantize-group-size", "128"],
         "--quantize-group-size 128 applies to int4 weights, but neither model is int4: the target is dense "
         "(--quantize none) and the draft dense (--draft-quantize none); leave it out"),
        (["--prompt", "w5", "--quantize", "int8", "--quantize-group-size", "64"],
         "but neither model is int4: the target is int8 (--quantize int8) and the draft int8 (it follows --quantize "
         "int8: the int4 default applies with --quantize none only); leave it out"),
    ],
)
def test_bad_input_exits_nonzero_with_message(capsys, args, message):
    code, out, err = _run(capsys, *args)
    assert code == 2
    assert message in err
    assert out == ""


def test_a_seed_out_of_range_is_an_error_not_a_traceback(tiny_folders, capsys):
    """torch's manual_seed raised "Overflow when unpacking long long" at the first sampled token."""
    target_dir, _, _ = tiny_folders
    code, out, err = _run(capsys, "--target", target_dir, "--method", "autoregressive", "--prompt", "w5",
                          "--max-new-tokens", 2, "--dtype", "float32", "--temperature", 1, "--seed", 10**23)
    assert code == 2 and out == "" and "Traceback" not in err
    assert f"seed must be an integer in {-(2**63)}..{2**64 - 1} (-2**63 .. 2**64 - 1), got {10**23}" in err


def test_a_prompt_that_is_not_utf8_is_an_error_not_a_traceback(capsys):
    """An undecodable argv byte reaches Python as a lone surrogate ("\\udcff"), which the tokenizer
    refused with a TypeError traceback; it is refused naming --prompt before any model loads (the
    target does not exist: loading it would fail with another message)."""
    code, out, err = _run(capsys, "--target", "/nonexistent/model", "--method", "autoregressive", "--prompt",
                          "w5 \udcff", "--max-new-tokens", 2, "--dtype", "float32")
    assert code == 2 and out == "" and "Traceback" not in err
    assert "--prompt is not valid Unicode: character 3 is a lone surrogate '\\udcff'" in err, err


@pytest.mark.parametrize("flags, method, adaptive, ngram_check", [
    ([], "cascade", True, True),  # the defaults: the cascade, n-gram check and adaptive draft exit on
    (["--no-adaptive-draft-exit"], "cascade", False, True),
    (["--no-ngram-check"], "cascade", True, False),
    (["-g", "3"], "cascade", False, True),  # an explicit gamma asks for fixed blocks
    (["--quantize", "int8"], "cascade", False, True),  # quantized target: verifying > 4 tokens costs 2+ steps
    (["--draft-quantize", "int4"], "cascade", True, True),  # an int4 draft (and int4 LM head): the same tokens
    (["--method", "draft"], "draft", True, None),
    (["--method", "draft", "--no-adaptive-draft-exit"], "draft", False, None),
    (["--method", "prompt-lookup"], "prompt-lookup", False, None),  # no draft probabilities: off by default
])
def test_generate_defaults_to_the_cascade_with_adaptive_exit(tiny_folders, capsys, flags, method, adaptive,
                                                             ngram_check):
    target_dir, draft_dir, target = tiny_folders
    code, out, err = _run(capsys, "--target", target_dir, "--draft", draft_dir, "--prompt", "w5 w9 w11 w5 w9",
                          "--max-new-tokens", 10, "--dtype", "float32", "--json", *flags)
    assert code == 0, err
    result = json.loads(out)
    assert result["method"] == method
    control = result["draft_control"]
    assert bool(control and control["adaptive_exit"]) is adaptive
    assert result["ngram_check"] is ngram_check
    if "--quantize" not in flags:  # a quantized target is another model
        reference = SpeculativeDecoder(target, eos_token_ids=[2]).generate(
            torch.tensor([[5, 9, 11, 5, 9]]), GenerationConfig(max_new_tokens=10)
        )
        assert result["token_ids"] == reference.token_ids


@pytest.mark.parametrize("flag, expected", [([], None), (["--no-compile"], False), (["--compile"], True)])
def test_generate_passes_compile_to_the_pipeline(tiny_folders, capsys, monkeypatch, flag, expected):
    """--compile/--no-compile reach SpeculativeGenerator.decoder as compile= (unset: None, the device default).

    The decoder is built eager whatever was asked: this tests the flag, not the fast path.
    """
    from specdecode.pipeline import SpeculativeGenerator

    asked = []
    original = SpeculativeGenerator.decoder

    def decoder(self, method="draft", **options):
        asked.append(options.pop("compile", "missing"))
        return original(self, method, **options, compile=False)

    monkeypatch.setattr(SpeculativeGenerator, "decoder", decoder)
    target_dir, _, target = tiny_folders
    code, out, err = _run(capsys, "--target", target_dir, "--method", "autoregressive", "--prompt", "w5 w9 w11",
                          "--max-new-tokens", 5, "--dtype", "float32", "--json", *flag)
    assert code == 0, err
    assert asked == [expected]
    result = json.loads(out)
    assert result["compile"] is expected
    reference = SpeculativeDecoder(target, eos_token_ids=[2]).generate(
        torch.tensor([[5, 9, 11]]), GenerationConfig(max_new_tokens=5)
    )
    assert result["token_ids"] == reference.token_ids


@pytest.mark.usefixtures("avx512_cpu")
@pytest.mark.parametrize("flags, quantize, draft_quantize, head", [
    ([], "none", "int4", "int4"),  # the default on CPU: an int4 draft (int4 LM head), the target's output unchanged
    (["--method", "draft"], "none", "int4", "int4"),
    (["--draft-quantize", "int4"], "none", "int4", "int4"),
    (["--draft-quantize", "none"], "none", "none", None),  # an explicit none keeps the draft dense
    (["--draft-quantize", "int8"], "none", "int8", "int8"),  # an int8 draft's head is int8
    (["--quantize", "int8"], "int8", "int8", "int8"),  # a quantized target: the draft follows it
    (["--method", "prompt-lookup"], "none", None, None),  # no draft model, and no --draft-quantize error
    (["--method", "autoregressive"], "none", None, None),
])
def test_generate_quantizes_the_draft_to_int4_by_default_on_cpu(tiny_folders, capsys, caplog, flags, quantize,
                                                               draft_quantize, head):
    target_dir, draft_dir, target = tiny_folders
    caplog.set_level(logging.INFO, logger="specdecode.generate_command")
    code, out, err = _run(capsys, "--target", target_dir, "--draft", draft_dir, "--prompt", "w5 w9 w11 w5 w9",
                          "--max-new-tokens", 10, "--dtype", "float32", "--device", "cpu", "--json", *flags)
    assert code == 0, err
    result = json.loads(out)
    assert (result["quantize"], result["draft_quantize"]) == (quantize, draft_quantize)
    assert result["draft_quantize_head"] == head
    assert result["quantize_group_size"] == (32 if "int4" in (quantize, draft_quantize) else None)
    assert ("--draft-quantize none keeps it dense" in caplog.text) is (flags in ([], ["--method", "draft"]))
    if quantize == "none":  # a quantized draft leaves the target's output unchanged
        reference = SpeculativeDecoder(target, eos_token_ids=[2]).generate(
            torch.tensor([[5, 9, 11, 5, 9]]), GenerationConfig(max_new_tokens=10)
        )
        assert result["token_ids"] == reference.token_ids


@pytest.mark.usefixtures("avx512_cpu")
def test_generate_draft_quantize_head_int8_keeps_the_default_int4_drafts_head_int8(tiny_folders, capsys):
    target_dir, draft_dir, target = tiny_folders
    code, out, err = _run(capsys, "--target", target_dir, "--draft", draft_dir, "--prompt", "w5 w9 w11 w5 w9",
                          "--max-new-tokens", 10, "--dtype", "float32", "--device", "cpu", "--json",
                          "--draft-quantize-head", "int8")
    assert code == 0, err
    result = json.loads(out)
    assert (result["quantize"], result["draft_quantize"], result["draft_quantize_head"]) == ("none", "int4", "int8")
    reference = SpeculativeDecoder(target, eos_token_ids=[2]).generate(
        torch.tensor([[5, 9, 11, 5, 9]]), GenerationConfig(max_new_tokens=10)
    )
    assert result["token_ids"] == reference.token_ids


_INT4_HEAD = "--draft-quantize-head int4 needs an int4 draft (--draft-quantize int4); the draft here is "
_DENSE = ": it has no quantized LM head, so the flag would be ignored; leave it out or quantize the draft " \
         "(--draft-quantize int8 or int4)"


@pytest.mark.usefixtures("avx512_cpu")
@pytest.mark.parametrize("flags, device, kernel, message", [
    (["--quantize", "int8", "--draft-quantize-head", "int4"], "cpu", True,
     _INT4_HEAD + "int8 (it follows --quantize int8: the int4 default applies with --quantize none only)"),
    (["--draft-quantize-head", "int4"], "cuda", True,
     _INT4_HEAD + "dense (none: the int4 default applies on CPU only, and the device is cuda)"),
    (["--draft-quantize-head", "int4"], "cpu", False,
     _INT4_HEAD + "dense (none: the int4 default needs torch's int4 CPU kernel (torch >= 2.6), which torch "
     f"{torch.__version__} lacks)"),
    (["--draft-quantize", "none", "--draft-quantize-head", "int8"], "cpu", True,
     "--draft-quantize-head int8 applies to a quantized draft, but the draft here is dense (none: --draft-quantize "
     "none)" + _DENSE),
    (["--method", "draft", "--draft-quantize-head", "int8"], "cuda", True,
     "--draft-quantize-head int8 applies to a quantized draft, but the draft here is dense (none: the int4 default "
     "applies on CPU only, and the device is cuda)" + _DENSE),
])
def test_generate_refuses_a_draft_quantize_head_the_draft_does_not_have(monkeypatch, capsys, flags, device, kernel,
                                                                        message):
    """In the flags' words and before anything loads: an int4 head needs an int4 draft, and a dense
    draft would ignore any head, saying why generate's int4 default did not apply."""
    from specdecode import defaults, generate_command
    from specdecode.errors import InvalidArgumentError, SpecDecodeError
    from specdecode.pipeline import SpeculativeGenerator

    def from_pretrained(*args, **kwargs):
        raise SpecDecodeError("loaded")

    def no_kernel(scheme, device=None):
        raise InvalidArgumentError("no int4 kernel")

    monkeypatch.setattr(SpeculativeGenerator, "from_pretrained", from_pretrained)
    monkeypatch.setattr(generate_command, "resolve_device", lambda name: torch.device(device))
    if not kernel:
        monkeypatch.setattr(defaults, "check_quantize", no_kernel)
    code, out, err = _run(capsys, "--prompt", "w5", *flags)
    assert code == 2 and out == ""
    assert message in err
    assert "loaded" not in err


@pytest.mark.parametrize("flags, message", [
    (["--method", "prompt-lookup", "--adaptive-draft-exit"],
     "--adaptive-draft-exit needs a method whose drafts carry probabilities; 'prompt-lookup' has none"),
    (["--method", "autoregressive", "--adaptive-draft-exit"],
     "--adaptive-draft-exit needs a method whose drafts carry probabilities; 'autoregressive' has none"),
])
def test_generate_refuses_the_adaptive_exit_for_a_method_without_draft_probabilities(monkeypatch, capsys, flags,
                                                                                       message):
    """As serve does (``defaults.plan_command``), in the flags' words and before anything loads (prompt lookup's
    was refused by the engine after loading, autoregressive's ignored)."""
    from specdecode.errors import SpecDecodeError
    from specdecode.pipeline import SpeculativeGenerator

    def from_pretrained(*args, **kwargs):
        raise SpecDecodeError("loaded")

    monkeypatch.setattr(SpeculativeGenerator, "from_pretrained", from_pretrained)
    code, out, err = _run(capsys, "--prompt", "w5", *flags)
    assert code == 2 and out == ""
    assert message in err
    assert "loaded" not in err


@pytest.mark.usefixtures("avx512_cpu")
@pytest.mark.parametrize("flags, device, expected", [
    ([], "cpu", "int4"),
    (["--method", "draft"], "cpu", "int4"),
    ([], "cuda", None),  # int4 runs on CPU only: the draft follows --quantize (none)
    (["--draft-quantize", "none"], "cpu", "none"),  # given: the rule is not consulted
    (["--quantize", "int4"], "cpu", None),
    (["--method", "prompt-lookup"], "cpu", None),
    (["--method", "early-exit", "--exit-layer", "1"], "cpu", None),
])
def test_draft_quantize_by_default_rule(flags, device, expected):
    from specdecode.cli import build_parser
    from specdecode.defaults import plan_command
    from specdecode.generate_command import _check_method_options

    args = build_parser().parse_args(["generate", "--prompt", "w5", *flags])
    _check_method_options(args)
    assert plan_command(args, torch.device(device)).draft_quantize == expected  # the default trips no flag check


def test_draft_quantize_default_needs_the_int4_kernel(monkeypatch):
    """A torch build without the int4 CPU kernel keeps a dense draft rather than failing."""
    from specdecode import cli, defaults
    from specdecode.errors import InvalidArgumentError

    def refuse(scheme, device=None):
        raise InvalidArgumentError("no int4 kernel")

    monkeypatch.setattr(defaults, "check_quantize", refuse)
    args = cli.build_parser().parse_args(["generate", "--prompt", "w5"])
    assert defaults.plan_command(args, torch.device("cpu")).draft_quantize is None


@pytest.mark.usefixtures("avx512_cpu")
def test_generate_on_cuda_keeps_the_draft_as_the_target(monkeypatch, capsys):
    """The resolved device reaches the rule: on CUDA (faked, no GPU needed) from_pretrained gets
    draft_quantize=None, so int4, which CUDA refuses, is never picked."""
    from specdecode import generate_command as cli
    from specdecode.errors import SpecDecodeError
    from specdecode.pipeline import SpeculativeGenerator

    asked = []

    def from_pretrained(target, draft, **kwargs):
        asked.append((draft, kwargs["draft_quantize"]))
        raise SpecDecodeError("stopped before loading")

    monkeypatch.setattr(cli, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(SpeculativeGenerator, "from_pretrained", from_pretrained)
    code, _, err = _run(capsys, "--prompt", "w5")
    assert code == 2 and "stopped before loading" in err
    assert asked == [(cli.DEFAULT_DRAFT, None)]
    monkeypatch.setattr(cli, "resolve_device", lambda device: torch.device("cpu"))
    _run(capsys, "--prompt", "w5")
    assert asked[-1] == (cli.DEFAULT_DRAFT, "int4")  # the same call on CPU picks int4


@pytest.mark.usefixtures("avx512_cpu")
@pytest.mark.parametrize("flags, draft_quantize", [
    ([], "int4"),  # generate's default int4 draft (the target dense) takes the group size
    (["--method", "draft", "--quantize", "int4", "-g", "3"], "int4"),  # both int4: both take it
    (["--method", "prompt-lookup", "--quantize", "int4"], None),  # the int4 target alone
])
def test_generate_quantize_group_size_reaches_every_int4_model(tiny_folders, capsys, monkeypatch, flags,
                                                              draft_quantize):
    from specdecode.pipeline import SpeculativeGenerator

    loaded = []
    original = SpeculativeGenerator.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        loaded.append(original(cls, *args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(SpeculativeGenerator, "from_pretrained", classmethod(from_pretrained))
    target_dir, draft_dir, target = tiny_folders
    code, out, err = _run(capsys, "--target", target_dir, "--draft", draft_dir, "--prompt", "w5 w9 w11 w5 w9",
                          "--max-new-tokens", 10, "--dtype", "float32", "--device", "cpu", "--json",
                          "--quantize-group-size", 64, *flags)
    assert code == 0, err
    result = json.loads(out)
    assert (result["quantize_group_size"], result["draft_quantize"]) == (64, draft_quantize)
    gen = loaded.pop()
    int4 = [m for m in (gen.target, gen.draft) if m is not None and m.quantize == "int4"]
    assert int4 and all(m.quantize_group_size == 64 for m in int4)
    # the tiny models' 64-input down_proj is int4 in groups of 64 (their 32-wide layers stay int8)
    assert all(m.model.model.layers[0].mlp.down_proj.group_size == 64 for m in int4)
    if "--quantize" not in flags:  # an int4 draft leaves the target's output unchanged
        reference = SpeculativeDecoder(target, eos_token_ids=[2]).generate(
            torch.tensor([[5, 9, 11, 5, 9]]), GenerationConfig(max_new_tokens=10)
        )
        assert result["token_ids"] == reference.token_ids


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_an_unknown_quantize_group_size_is_refused_by_the_parser(capsys, command):
    from specdecode.cli import main

    with pytest.raises(SystemExit) as exited:
        main([command, *(["--prompt", "w5"] if command == "generate" else []), "--quantize-group-size", "48"])
    assert exited.value.code == 2
    assert "argument --quantize-group-size: invalid choice: 48 (choose from 32, 64, 128, 256)" in capsys.readouterr().err


@pytest.mark.usefixtures("avx512_cpu")
@pytest.mark.parametrize("flags, limit, window", [
    ([], 512, None),  # the cascade with generate's int4 draft: the measured default
    (["--draft-quantize", "none"], 512, None),  # a dense draft computing in float32 on a CPU: the limit too
    (["--draft-quantize", "none", "--dtype", "bfloat16"], None, None),  # a dense bf16 draft: no default limit
    (["--max-model-prompt-tokens", "0"], None, None),
    (["--max-model-prompt-tokens", "3"], 3, None),  # the 5-token prompt is over it: no draft forward
    (["--draft-context-window", "2"], 512, 2),
])
def test_generate_prompt_limit_and_context_window(tiny_folders, capsys, flags, limit, window):
    target_dir, draft_dir, target = tiny_folders
    code, out, err = _run(capsys, "--target", target_dir, "--draft", draft_dir, "--prompt", "w5 w9 w11 w5 w9",
                          "--max-new-tokens", 10, "--dtype", "float32", "--device", "cpu", "--json", *flags)
    assert code == 0, err
    result = json.loads(out)
    assert (result["max_model_prompt_tokens"], result["draft_context_window"]) == (limit, window)
    assert (result["stats"]["num_draft_forwards"] == 0) is (limit == 3)
    if "bfloat16" in flags:  # another dtype: equal to its own target-only decoding elsewhere in the suite
        return
    reference = SpeculativeDecoder(target, eos_token_ids=[2]).generate(
        torch.tensor([[5, 9, 11, 5, 9]]), GenerationConfig(max_new_tokens=10)
    )
    assert result["token_ids"] == reference.token_ids


@pytest.mark.parametrize("flags, message", [
    (["--max-model-prompt-tokens", "-1"], "--max-model-prompt-tokens -1 is out of range: use N >= 1 (tokens), or 0 "
                                          "for no limit"),
    (["--method", "draft", "--max-model-prompt-tokens", "64"], "--max-model-prompt-tokens applies to --method "
                                                               "cascade (its draft model), not 'draft'"),
    (["--draft-context-window", "0"], "--draft-context-window 0 is out of range: use W >= 1 (tokens)"),
    (["--method", "prompt-lookup", "--draft-context-window", "4"], "--draft-context-window applies to --method "
                                                                   "draft or cascade (a draft model), not "
                                                                   "'prompt-lookup'"),
    (["--draft-tree-depth", "0"], "--draft-tree-depth 0 is out of range: use D in 1..64"),
    (["--method", "prompt-lookup", "--draft-tree-depth", "4"], "--draft-tree-depth applies to --method draft or "
                                                               "cascade (the draft model's token tree), not "
                                                               "'prompt-lookup'"),
    (["--draft-tree-depth", "3", "--draft-tree-expand", "0"], "--draft-tree-expand 0 is out of range: use M in 1..64"),
    (["--draft-tree-expand", "2"], "--draft-tree-expand 2 expands a draft tree: give --draft-tree-depth D too"),
    (["--draft-tree-shape", "previous-round"],
     "--draft-tree-shape previous-round shapes a draft tree: give --draft-tree-depth D too"),
    (["--method", "draft", "--draft-tree-depth", "3", "--adaptive-draft-exit"], "drafts a linear chain, never a tree"),
    (["--method", "cascade", "--draft-tree-depth", "3", "--draft-tree-expand", "2"],
     "--draft-tree-expand applies to --method draft (the draft model's token tree), not 'cascade'"),
    (["--method", "draft", "--prompt-lookup-datastore", "none"],
     "--prompt-lookup-datastore applies to --method prompt-lookup (prompt lookup's datastore), not 'draft'"),
    (["--method", "prompt-lookup", "--prompt-lookup-datastore", "/no/such/corpus"],
     "datastore '/no/such/corpus' is neither 'python-stdlib', a folder nor a file"),
    (["--method", "prompt-lookup", "--prompt-lookup-datastore", "python-stdlib", "--prompt-lookup-branches", "2"],
     "with --prompt-lookup-branches 2 use 'auto' or 'none'"),
    (["--method", "draft", "--no-adaptive-draft-exit", "--draft-exit-mode", "masked"],
     "--draft-exit-mode masked applies to the adaptive draft exit, which is off here: add --adaptive-draft-exit"),
])
def test_generate_refuses_bad_long_prompt_flags(capsys, flags, message):
    code, out, err = _run(capsys, "--prompt", "w5", *flags)
    assert code == 2 and out == ""
    assert message in err


def test_draft_quantize_default_is_dense_where_torch_s_int4_kernel_is_slow(monkeypatch):
    """Below AVX512 (measured on AVX2: the int4 draft 3.2x slower than the dense one) the commands keep a
    dense draft, and say why."""
    from specdecode import cli, defaults

    args = cli.build_parser().parse_args(["generate", "--prompt", "w5"])
    for capability in ("AVX2", "DEFAULT", None):
        monkeypatch.setattr(defaults, "cpu_capability", lambda: capability)
        assert defaults.plan_command(args, torch.device("cpu")).draft_quantize is None
        why = defaults.why_no_int4_draft("cascade", "none", torch.device("cpu"))
        assert f"this CPU's capability is {capability or 'unknown to this torch'}" in why
    monkeypatch.setattr(defaults, "cpu_capability", lambda: "AVX512")
    assert defaults.plan_command(args, torch.device("cpu")).draft_quantize == "int4"


def test_cpu_capability_is_torch_s():
    from specdecode.defaults import cpu_capability

    assert cpu_capability() == torch.backends.cpu.get_cpu_capability()
