"""The library's defaults: the default models, the methods and draft backends, and the defaults the
commands (``specdecode generate`` and ``specdecode serve``) share, each with the measurement behind it.

``specdecode.pipeline`` re-exports the names the commands and tools take from it.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

import torch

from specdecode import method_registry
from specdecode.config import DEFAULT_NUM_SPECULATIVE_TOKENS
from specdecode.drafters.control import LENGTH_SCHEDULES, DraftControl
from specdecode.engine.protocol import DRAFT_EXIT_MODES
from specdecode.errors import InvalidArgumentError
from specdecode.models import LoadedModel
from specdecode.models.loading import resolve_dtype
from specdecode.models.llama_cpp_target import LlamaCppTargetRunner
from specdecode.models.quantize import check_draft_quantize_head_flag, check_quantize, check_quantize_group_size_flag

logger = logging.getLogger(__name__)

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
#: Every method (each has a batch mode): the method registry's (``specdecode.method_registry``).
METHODS = method_registry.METHODS
BATCH_METHODS = method_registry.BATCH_METHODS
#: Prompt lookup's datastore under "auto" with a llama.cpp target (``method_registry``'s, where it is resolved).
LLAMA_CPP_PROMPT_LOOKUP_DATASTORE = method_registry.LLAMA_CPP_PROMPT_LOOKUP_DATASTORE
#: What runs a draft model's forwards: transformers (and specdecode's quantized layers), or
#: llama.cpp on the draft's GGUF file (``specdecode.models.llama_cpp``).
DRAFT_BACKENDS = ("torch", "llama-cpp")
#: ``max_verify_tokens`` of batched decoding on a CPU: Qwen2.5-Coder 1.5B in bf16 on a 2-core
#: AVX512-BF16 EPYC verified up to 12 tokens in about one step (160-170 ms) and 16 in 287 ms
#: (``docs/benchmarks/batched_forward_cost.py``), so B rows draft at most 12 // B - 1 tokens.
#: "auto" raises it to the longest block + 1 where that is more (``auto_verify_tokens``).
BATCH_VERIFY_TOKENS_CPU = 12


# --- the commands' defaults (``specdecode generate`` and ``specdecode serve`` share them) -------------
#: The method the commands run when none is named (the Python API's default stays "draft").
COMMAND_METHOD = "cascade"
#: The commands' method with the target in llama.cpp (``--backend llama-cpp``) when none is named ("draft"
#: and "cascade" run there too, with the draft in llama.cpp; which is the default waits for their measurement).
LLAMA_CPP_COMMAND_METHOD = "prompt-lookup"
#: Methods whose adaptive draft exit the commands turn on by default (``adaptive_exit_by_default``).
ADAPTIVE_BY_DEFAULT = ("draft", "cascade")
#: The commands' cascade with an int4 (or llama.cpp) draft skips the draft model for prompts longer
#: than this: on 6 held-out Spec-Bench prompts of 705-1154 tokens prompt lookup beat the cascade on all
#: 6, since the int4 draft's prefill costs ~3.4 s per 700 tokens; on the 9 evaluation prompts over 512
#: tokens the limit was faster on 7 (docs/benchmarks/2026-11-25-cascade-long-prompts.md).
MAX_MODEL_PROMPT_TOKENS = 512


def adaptive_exit_by_default(method: str, quantize: str, num_speculative_tokens: int | None) -> bool:
    """The commands' adaptive draft exit when none is asked for: on for ``ADAPTIVE_BY_DEFAULT`` with
    an unquantized target and no explicit γ. Measured (docs/benchmarks/2026-11-25-cascade-tuning.md):
    faster than a fixed γ = 5 with a bf16 target on HumanEval and Spec-Bench; with a quantized target
    slower than γ = 3 (2026-11-23), and an explicit γ asks for blocks of that length."""
    return method in ADAPTIVE_BY_DEFAULT and quantize == "none" and num_speculative_tokens is None


def target_float32_on_cpu(dtype: str | torch.dtype, device: torch.device, backend: str = "torch") -> bool:
    """Whether a torch target (``backend``) computes in ``dtype`` ("auto" resolved, ``resolve_dtype``) = float32
    on a CPU ``device``: the case the commands' float32 defaults (``length_schedule_by_default``,
    ``prompt_limit_by_default``) are for.

    Raises:
        InvalidArgumentError: As ``resolve_dtype`` (an unknown dtype, float16 on a CPU).
    """
    return backend == "torch" and device.type == "cpu" and resolve_dtype(dtype, device) == torch.float32


def length_schedule_by_default(adaptive_exit: bool, float32_cpu: bool) -> str:
    """The commands' draft length schedule when none is named: "cost-model" over the default adaptive draft
    exit (``adaptive_exit``: the exit sets each draft's length, the cost model chooses between drafting and
    a plain step by their measured tokens per second, ``engine.speculation_cost``) where the target
    computes in float32 on a CPU (``float32_cpu``, ``target_float32_on_cpu``: one without native bf16,
    where the "auto" dtype is float32); else
    "constant" (the exit alone, as measured with bf16 and on CUDA).

    Measured on a 2-core EPYC with AVX2 only, float32 Qwen2.5-Coder 1.5B target and dense 0.5B draft: with
    the stock linears a verification costs 2-3 plain steps whatever its width (0.50 s at 1 token, 1.10 s at
    2, 1.36 s at 13), and the exit alone ran 0.58-0.64x plain decoding on Spec-Bench's writing and roleplay
    prompts (docs/benchmarks/2026-11-26-cost-model-arms-avx2.md). With the linears on oneDNN (the default
    there since, ``models.prepacked_linear``) a verification costs 1.5-2 steps and still: on 13 Spec-Bench
    prompts the default ran 0.97x ``autoregressive``, the exit alone 0.90x (0.75-0.76x on writing and
    roleplay); on HumanEval 0-4 the exit alone was faster, 1.17x against 1.07x
    (docs/benchmarks/2026-11-26-prepacked-linears-avx2.md). With native bf16 the exit alone stays: on a
    2-core Xeon with AMX (bf16 int4-draft cascade, 128 tokens) it ran 2.70x ``autoregressive`` on HumanEval
    0-9 and 1.85x on 26 Spec-Bench prompts (every category 1.13x or more), the cost model over it 2.43x and
    1.58x (docs/benchmarks/2026-11-27-xeon-amx.md)."""
    return "cost-model" if adaptive_exit and float32_cpu else "constant"


#: torch's CPU capabilities (``torch.backends.cpu.get_cpu_capability()``) on which the int4 draft default
#: applies. Its int4 (and int8) weight-only kernels are vectorized for AVX512; measured on a 2-core EPYC
#: with AVX2 only (capability "AVX2"), float32 compute, the Qwen2.5-Coder 0.5B draft's forward over 200
#: tokens of context took 200 / 424 ms at 1 / 8 tokens dense, 273 / 2,056 ms int8 and 649 / 4,309 ms int4
#: (``docs/benchmarks/forward_cost.py``, 2026-11-26; the int4 draft was 3.2x slower than the dense one),
#: against 93.7 ms bf16 -> 35.2 ms int4 at 1 token with AVX512-BF16 (``draft_quantize_by_default``).
INT4_DRAFT_CPU_CAPABILITIES = ("AVX512",)


def cpu_capability() -> str | None:
    """torch's CPU capability level ("AVX512", "AVX2", "DEFAULT", ...), or None where this torch cannot
    say (``torch.backends.cpu.get_cpu_capability``, feature-detected)."""
    get = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    return get() if get is not None else None


def why_no_int4_draft(method: str, quantize: str, device: torch.device) -> str | None:
    """Why the commands' int4 draft default does not apply to ``method`` (for messages), or None when it
    applies: a method with a draft model, an unquantized target, a CPU whose capability makes torch's
    int4 kernel fast (``INT4_DRAFT_CPU_CAPABILITIES``), a torch with that kernel."""
    if not method_registry.REGISTRY[method].needs_draft_model:
        return f"--method {method} has no draft model"
    if quantize != "none":
        return f"it follows --quantize {quantize}: the int4 default applies with --quantize none only"
    if device.type != "cpu":
        return f"the int4 default applies on CPU only, and the device is {device}"
    capability = cpu_capability()
    if capability not in INT4_DRAFT_CPU_CAPABILITIES:
        named = "unknown to this torch" if capability is None else capability
        return (f"torch's int4 CPU kernel is fast with AVX512 only, and this CPU's capability is {named}: on "
                "AVX2 the int4 draft measured 3.2x slower than the dense one (others, ARM included, not measured)")
    try:
        check_quantize("int4", device)  # a torch build without the int4 kernel (< 2.6) keeps a dense draft
    except InvalidArgumentError:
        return f"the int4 default needs torch's int4 CPU kernel (torch >= 2.6), which torch {torch.__version__} lacks"
    return None


def draft_quantize_by_default(method: str, quantize: str, device: torch.device, *, draft_quantize: str | None = None,
                              draft_backend: str | None = None) -> str | None:
    """The commands' draft quantization when ``draft_quantize`` is not given: "int4" where
    ``why_no_int4_draft`` finds no reason against it, else None (= as ``quantize``). A llama.cpp
    draft keeps its GGUF quantization (None).

    A quantized draft leaves the output unchanged (the target verifies every token) and makes each
    draft step cheaper. Measured on a 2-core EPYC with AVX512-BF16 and AVX512-VNNI (no AMX), bf16
    Qwen2.5-Coder 1.5B target, 0.5B draft: the draft's 1-token forward 93.7 ms (bf16) -> 35.2 ms
    (int4), c 0.42 -> 0.16 (2026-11-25); draft+adaptive 11.40 -> 18.53 tok/s on HumanEval and 7.35 ->
    9.38 on Spec-Bench (2026-11-23, README "Quantized weights and llama.cpp"). The cost is quantizing
    the draft on the first start (cached next to an offline model's dense copy). The Python API
    (``SpeculativeGenerator.from_pretrained``) and ``bench`` keep draft_quantize=None: they name
    their settings.
    """
    if draft_quantize is not None or draft_backend == "llama-cpp":
        return None
    return "int4" if why_no_int4_draft(method, quantize, device) is None else None


def prompt_limit_by_default(method: str, draft_scheme: str, draft_backend: str | None = None, *,
                            float32_cpu: bool = False) -> int | None:
    """The cascade's prompt limit (``max_model_prompt_tokens``) when none is given:
    ``MAX_MODEL_PROMPT_TOKENS`` for the cascade with an int4 draft (``draft_scheme``: the draft's
    quantization) or a llama.cpp draft, or with a target in float32 on a CPU (``float32_cpu``, whatever the
    draft's quantization and draft control: the prefill costs the same), else None.
    The int4 draft's prefill costs about twice a bf16 one per token on CPU; the llama.cpp draft's about
    the same as the int4 one's (700 tokens: 3.1 s against 3.4 s, 2-core EPYC with avx512_bf16), and on
    the 6 held-out long prompts the limit made its cascade faster too
    (docs/benchmarks/2026-11-25-llama-cpp-draft.md). A float32 draft on a CPU without native bf16 (2-core
    EPYC, AVX2 only) prefills slowest of all: on Spec-Bench's summarization and rag prompts (709 and 671
    tokens) the default cascade ran 0.82x ``autoregressive``, 0.97x with the limit
    (docs/benchmarks/2026-11-26-cost-model-arms-avx2.md). With a dense bf16 draft, or on CUDA, it was
    not measured."""
    costly_prefill = draft_scheme == "int4" or draft_backend == "llama-cpp" or float32_cpu
    return MAX_MODEL_PROMPT_TOKENS if method == "cascade" and costly_prefill else None


def add_draft_control_flags(parser, *, server: bool = False) -> None:
    """generate's and serve's draft length control, a group on ``parser`` (``plan_command`` reads it into a
    ``DraftControl``; serve's applies to every row, each with its own state): --adaptive-draft-exit,
    --draft-exit-threshold, --max-draft-tokens, --draft-exit-mode (``check_exit_mode_flag``),
    --draft-length-schedule and --confidence-gate."""
    c = parser.add_argument_group("draft length control" + (" (per row)" if server else ""))
    c.add_argument("--adaptive-draft-exit", action=argparse.BooleanOptionalAction, default=None,
                   help="Draft & Verify adaptive draft exit: stop drafting below a self-tuning confidence "
                        "threshold (blocks up to --max-draft-tokens instead of -g); default"
                        f"{', as specdecode generate' if server else ''}: on for {' and '.join(ADAPTIVE_BY_DEFAULT)} "
                        "with an unquantized target and no -g, else off; by default on a CPU with a float32 target "
                        "under the cost model (drafting or a plain step by measured tokens per second), given "
                        "explicitly alone")
    c.add_argument("--draft-exit-threshold", type=float, default=DraftControl.exit_threshold,
                   help="initial adaptive draft-exit threshold")
    c.add_argument("--max-draft-tokens", type=int, default=DraftControl.max_draft_tokens,
                   help="most tokens per block with --adaptive-draft-exit")
    c.add_argument("--draft-exit-mode", choices=DRAFT_EXIT_MODES, default=DraftControl.exit_mode,
                   help=DRAFT_EXIT_MODE_HELP)
    c.add_argument("--draft-length-schedule", choices=LENGTH_SCHEDULES, default=None,
                   help="default: cost-model over the default adaptive exit where the target computes in float32 on "
                        "a CPU, else constant. constant: -g tokens per block; heuristic: +2 after a fully accepted "
                        "block, -1 otherwise; cost-model: each round the size (up to -g tokens, or tree nodes) with "
                        "the most expected tokens per second from the target's measured forward costs and acceptance "
                        "by depth (0: a plain step); with --adaptive-draft-exit, drafting (the exit sets the length) "
                        "or a plain step by their measured tokens per second; not with --confidence-gate")
    c.add_argument("--confidence-gate", type=float, metavar="THRESHOLD", default=None,
                   help="make a plain target step whenever the target's probability of its last token is below this")


DRAFT_EXIT_MODE_HELP = ("with --adaptive-draft-exit, how the exit reads the draft's confidence: per-step (default: "
                        "after each draft token, stopping at the first unsure one), masked (nothing read between "
                        "draft steps: the whole cap drafted, cut after the first unsure token on the device, read "
                        "with the round's one read), previous-round (nothing read between draft steps: each block "
                        "as long as the previous round's up to its first unsure token, kept whole)")


def add_banned_word_flags(parser, *, server: bool = False) -> None:
    """generate's and serve's banned words (``GenerationConfig.banned_words``), a group on ``parser``;
    ``banned_words_from_flags`` reads them. ``server``: the help speaks of every answer and of requests'
    ``bad_words``."""
    also = " (also to requests' bad_words)" if server else ""
    group = parser.add_argument_group("banned words (matched on the text, any tokenization; rollback and mask)")
    group.add_argument("--banned-word", action="append", default=[], metavar="WORD",
                       help="a word or phrase no answer may contain (repeatable; a request's bad_words add to them)"
                       if server else "a word or phrase the output must never contain (repeatable)")
    group.add_argument("--banned-words-file", metavar="FILE", default=None,
                       help="UTF-8 text file with one banned word or phrase per line (blank lines ignored)")
    group.add_argument("--banned-words-ignore-case", action="store_true",
                       help=f"match banned words regardless of case{also}")
    group.add_argument("--banned-words-whole-word", action="store_true",
                       help=f"match banned words only as whole words (a banned 'ass' does not block 'class'){also}")


def banned_words_from_flags(args) -> tuple[str, ...]:
    """The words of --banned-word and --banned-words-file, in order (``add_banned_word_flags``).

    Raises:
        InvalidArgumentError: The file cannot be read, is not UTF-8 or holds no word; a word is blank
            (``config.check_banned_words``).
    """
    from specdecode.config import check_banned_words
    from specdecode.engine.banned_words import read_banned_words

    words = list(args.banned_word)
    if args.banned_words_file is not None:
        words += read_banned_words(args.banned_words_file)
    return check_banned_words(words, allow_empty=True)


@dataclass(frozen=True)
class CommandPlan:
    """What ``generate`` and ``serve`` load and run once the commands' defaults are applied to their flags
    (``plan_command``).

    Attributes:
        draft: The draft model to load, or None (the method has none).
        draft_quantize: The draft's quantization (None: as --quantize, or a llama.cpp draft's own).
        draft_quantize_note: "<scheme>: <why>" for the start-up log; "" without a torch draft.
        draft_control: The draft control (adaptive exit, length schedule, gate), or None when inactive.
        num_speculative_tokens: γ (``config.DEFAULT_NUM_SPECULATIVE_TOKENS`` when not given).
        max_model_prompt_tokens: The cascade's prompt limit for the draft model, or None.
    """

    draft: str | None
    draft_quantize: str | None
    draft_quantize_note: str
    draft_control: DraftControl | None
    num_speculative_tokens: int
    max_model_prompt_tokens: int | None


def plan_command(args, device: torch.device) -> CommandPlan:
    """The commands' defaults applied to ``generate``'s or ``serve``'s flags (``args``) on ``device``, and the
    flags that depend on them checked, before anything loads. One place for both commands, so a server runs
    what ``generate`` runs (``add_draft_control_flags`` defines their draft control flags). --draft-backend, which
    ``serve`` lacks, counts as not given there; a draft beside a llama.cpp target (--backend llama-cpp) runs in
    llama.cpp too, whatever --draft-backend says (``generate`` refuses another value before this).

    * the draft: --draft for a method with a draft model, else None;
    * its quantization: --draft-quantize, else ``draft_quantize_by_default``;
    * the adaptive draft exit: --adaptive-draft-exit / --no-adaptive-draft-exit, else
      ``adaptive_exit_by_default``, off with a draft tree (its rows draft without an exit policy), under
      --backend llama-cpp (the draft length comes from measured costs, ``engine.runner_target``), with
      --draft-length-schedule cost-model, and for a method whose drafts carry no probabilities;
    * the length schedule: --draft-length-schedule, else ``length_schedule_by_default``;
    * the cascade's prompt limit: --max-model-prompt-tokens (0: none), else ``prompt_limit_by_default``.

    Raises:
        InvalidArgumentError: In the flags' words: --draft-quantize or --draft-quantize-head for a method
            without a draft model, or with a llama.cpp draft, and --draft-vocab-size with one; --draft-quantize-head or
            --quantize-group-size that does not fit the draft's quantization; --adaptive-draft-exit for a
            method without draft probabilities; --draft-exit-mode other than per-step with the exit off.
            ``DraftControl``'s range errors, named by its fields (max_draft_tokens, confidence gate threshold).
    """
    method = method_registry.REGISTRY[args.method]
    draft_backend = getattr(args, "draft_backend", None)
    if args.backend == "llama-cpp" and method.needs_draft_model:
        draft_backend = "llama-cpp"  # the only draft beside a llama.cpp target (``ModelPair.from_pretrained``)
    llama_draft = draft_backend == "llama-cpp"
    if llama_draft and getattr(args, "draft_vocab_size", None):
        raise InvalidArgumentError(f"--draft-vocab-size {args.draft_vocab_size} truncates a torch draft's LM head; a "
                                   "llama.cpp draft (--draft-backend llama-cpp, or beside --backend llama-cpp) "
                                   "computes every logit: leave it out")
    for flag in ("draft_quantize", "draft_quantize_head"):
        if getattr(args, flag) is None:
            continue
        if not method.needs_draft_model:
            raise InvalidArgumentError(f"--{flag.replace('_', '-')} applies to {method_registry.who_takes(flag)}, "
                                       f"not to {args.method!r}; use --quantize for the target")
        if llama_draft:
            raise InvalidArgumentError(f"--{flag.replace('_', '-')} quantizes a torch draft; --draft-backend "
                                       "llama-cpp runs the draft's GGUF file with its own quantization: leave it out")
    draft = args.draft if method.needs_draft_model else None
    draft_quantize = args.draft_quantize
    if draft_quantize is None and draft is not None:
        draft_quantize = draft_quantize_by_default(args.method, args.quantize, device, draft_backend=draft_backend)
    # the quantization flags against the draft's (a llama.cpp draft: --quantize-group-size is the target's alone)
    torch_draft = draft is not None and not llama_draft
    scheme = (args.quantize if draft_quantize is None else draft_quantize) if torch_draft else None
    if llama_draft:
        why = "--draft-backend llama-cpp keeps the GGUF file's quantization"
    elif draft is None:
        why = f"--method {args.method} loads none"
    elif args.draft_quantize is not None:
        why = f"--draft-quantize {args.draft_quantize}"
    elif draft_quantize is not None:
        why = "generate's default on CPU"
    else:
        why = why_no_int4_draft(args.method, args.quantize, device) or f"as --quantize {args.quantize}"
    if torch_draft and args.draft_quantize_head is not None:
        check_draft_quantize_head_flag(args.draft_quantize_head, scheme, why)
    check_quantize_group_size_flag(args.quantize_group_size, args.quantize, scheme, why)
    schedule, gate = args.draft_length_schedule, args.confidence_gate
    if args.adaptive_draft_exit is None:
        adaptive = (adaptive_exit_by_default(args.method, args.quantize, args.num_speculative_tokens)
                    and method.adaptive_exit and args.draft_tree_depth is None and args.backend != "llama-cpp"
                    and schedule != "cost-model")
    elif args.adaptive_draft_exit and not method.adaptive_exit:
        raise InvalidArgumentError(f"--adaptive-draft-exit needs a method whose drafts carry probabilities; "
                                   f"{args.method!r} has none")
    else:
        adaptive = args.adaptive_draft_exit
    check_exit_mode_flag(args.draft_exit_mode, adaptive)
    float32_cpu = target_float32_on_cpu(args.dtype, device, args.backend)
    if schedule is None:  # the cost model over the default exit where the target computes in float32 on a CPU
        default_exit = args.adaptive_draft_exit is None and adaptive and gate is None
        schedule = length_schedule_by_default(default_exit, float32_cpu)
    control = DraftControl(adaptive_exit=adaptive, exit_threshold=args.draft_exit_threshold,
                           max_draft_tokens=args.max_draft_tokens, length_schedule=schedule, confidence_gate=gate,
                           exit_mode=args.draft_exit_mode)
    limit = args.max_model_prompt_tokens
    if limit is None and draft is not None:
        limit = prompt_limit_by_default(args.method, args.quantize if draft_quantize is None else draft_quantize,
                                        draft_backend, float32_cpu=float32_cpu)
    return CommandPlan(
        draft=draft,
        draft_quantize=draft_quantize,
        draft_quantize_note=f"{scheme}: {why}" if scheme is not None else "",
        draft_control=control if control.active else None,
        num_speculative_tokens=(DEFAULT_NUM_SPECULATIVE_TOKENS if args.num_speculative_tokens is None
                                else args.num_speculative_tokens),
        max_model_prompt_tokens=limit or None,
    )


def check_exit_mode_flag(mode: str, adaptive: bool) -> None:
    """generate's and serve's ``--draft-exit-mode``: anything but the default needs the adaptive draft exit on.

    Raises:
        InvalidArgumentError: ``mode`` other than "per-step" while the exit is off, naming both flags.
    """
    if mode != DraftControl.exit_mode and not adaptive:
        raise InvalidArgumentError(f"--draft-exit-mode {mode} applies to the adaptive draft exit, which is off here: "
                                   "add --adaptive-draft-exit (with a method whose drafts carry probabilities)")


#: The commands' help for --prepack-linears / --no-prepack-linears (``prepack_by_default``).
PREPACK_HELP = ("float32 linear layers on oneDNN's CPU kernel (weights prepacked once at load): faster plain steps "
                "and far cheaper verification where a model computes in float32 on a CPU (one without native bf16); "
                "default: on for float32 unquantized models on an x86 CPU with AVX2 (where it was measured)")
#: --compile's effect on it (generate, bench and serve; search compiles nothing).
PREPACK_COMPILE_HELP = ", off with --compile, which cannot compile them"


def prepack_by_default(prepack_linears: bool | None, compiled_by: str | None) -> bool | None:
    """The commands' ``prepack_linears`` (``models.load_model``): as asked (``--prepack-linears`` /
    ``--no-prepack-linears``), else None (float32 unquantized models on an x86 CPU get oneDNN's kernel,
    ``models.prepacked_linear``) unless something will compile the target (``compiled_by``: the flag that
    asks for it, e.g. "--compile", or None), which cannot compile those layers: then False. Measured on a
    2-core EPYC with AVX2 only, float32 Qwen2.5-Coder 1.5B: a plain step 609 -> 446 ms, a 5-token
    verification 1,772 -> 776 ms (docs/benchmarks/2026-11-26-prepacked-linears-avx2.md).

    Raises:
        InvalidArgumentError: --prepack-linears together with ``compiled_by``, before anything is loaded.
    """
    if prepack_linears and compiled_by:
        raise InvalidArgumentError(
            f"--prepack-linears and {compiled_by}: the fast path cannot compile prepacked (oneDNN) linear layers; "
            "leave one out (with --compile the default keeps the stock layers)")
    if prepack_linears is None and compiled_by:
        logger.info("float32 linears stay nn.Linear for the whole run: %s compiles, and the fast path cannot "
                    "compile prepacked (oneDNN) layers", compiled_by)
        return False
    return prepack_linears


def auto_verify_tokens(device: torch.device, num_speculative_tokens: int, control: DraftControl | None) -> int | None:
    """``max_verify_tokens="auto"``: None off CPU; on a CPU ``BATCH_VERIFY_TOKENS_CPU`` or, where more,
    the longest block + 1, so a lone row drafts the blocks ``generate`` drafts (with 12, a server
    request's adaptive blocks stopped at 11: one more verification). Longer blocks than 12 raise
    the budget for every row count."""
    if device.type != "cpu":
        return None
    block = control.controller(num_speculative_tokens).max_tokens if control is not None and control.active \
        else num_speculative_tokens
    return max(BATCH_VERIFY_TOKENS_CPU, block + 1)


def eos_token_ids(loaded: LoadedModel) -> set[int]:
    """End-of-sequence ids from the generation config (int or list), else the tokenizer's; a llama.cpp
    target: the tokenizer's and its GGUF file's end-of-sequence and end-of-turn ids."""
    gguf = loaded.model.end_of_sequence_ids() if isinstance(loaded.model, LlamaCppTargetRunner) else None
    eos = loaded.tokenizer.eos_token_id if gguf is not None else loaded.model.generation_config.eos_token_id
    if eos is None:
        eos = loaded.tokenizer.eos_token_id
    if eos is None:
        return gguf or set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])} | (gguf or set())
