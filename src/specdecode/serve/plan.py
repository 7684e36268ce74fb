"""What ``specdecode serve`` loads and runs, from its flags: ``generate``'s defaults applied on the device
(``resolve_defaults``, a ``ServePlan``), and what a target in llama.cpp refuses (``check_llama_cpp_backend``),
both checked before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode import defaults, method_registry
from specdecode.config import DEFAULT_NUM_SPECULATIVE_TOKENS
from specdecode.defaults import LLAMA_CPP_COMMAND_METHOD
from specdecode.drafters.control import DraftControl
from specdecode.engine.runner_target import ONE_SEQUENCE
from specdecode.errors import InvalidArgumentError
from specdecode.method_registry import who_takes
from specdecode.models.llama_cpp_target import check_llama_cpp_target_options
from specdecode.models.quantize import check_draft_quantize_head_flag, check_quantize_group_size_flag
from specdecode.pipeline import (
    adaptive_exit_by_default,
    draft_quantize_by_default,
    length_schedule_by_default,
    prompt_limit_by_default,
    target_float32_on_cpu,
    why_no_int4_draft,
)

#: Rows decoded at once when --max-batch-size is not given (a target in llama.cpp: 1, the only value it takes).
DEFAULT_MAX_BATCH_SIZE = 8


def check_llama_cpp_backend(args) -> None:
    """Give --method and --max-batch-size their defaults for --backend (``generate``'s method under
    llama-cpp, ``LLAMA_CPP_COMMAND_METHOD``; one row there), and refuse before loading what a target
    in llama.cpp cannot do, in the flags' words.

    Raises:
        InvalidArgumentError: With --backend llama-cpp: --max-batch-size other than 1 (one request at a
            time), a method it refuses (``method_registry.LLAMA_CPP_TARGET_REFUSALS``: layer-skip,
            early-exit, and for now draft and cascade), --compile, or the torch loading flags
            (``check_llama_cpp_target_options``: --quantize, --draft-quantize, --draft-quantize-head,
            --quantize-group-size, a --dtype other than auto/float32, a --device other than the CPU).
    """
    llama = getattr(args, "backend", "torch") == "llama-cpp"
    if getattr(args, "max_batch_size", None) is None:
        args.max_batch_size = 1 if llama else DEFAULT_MAX_BATCH_SIZE
    if not llama:
        return
    if not getattr(args, "method_given", False):
        args.method = LLAMA_CPP_COMMAND_METHOD
    if args.max_batch_size != 1:
        raise InvalidArgumentError(
            f"--max-batch-size {args.max_batch_size}: with --backend llama-cpp the server decodes one request at a "
            f"time ({ONE_SEQUENCE}); leave --max-batch-size out (or 1): further requests wait in the queue "
            "(--max-queue)"
        )
    why = method_registry.LLAMA_CPP_TARGET_REFUSALS.get(args.method)
    if why is not None:
        raise InvalidArgumentError(f"--method {args.method} does not run with --backend llama-cpp: {why}; use "
                                   "--method prompt-lookup or autoregressive, or --backend torch")
    if args.compile:
        raise InvalidArgumentError("--compile compiles torch forwards, but with --backend llama-cpp the target runs "
                                   "in llama.cpp: leave --compile out")
    check_llama_cpp_target_options(dtype=args.dtype, device=args.device, quantize=args.quantize,
                                   draft_quantize=args.draft_quantize, draft_quantize_head=args.draft_quantize_head,
                                   quantize_group_size=args.quantize_group_size, draft_backend=None,
                                   prepack_linears=args.prepack_linears)


@dataclass(frozen=True)
class ServePlan:
    """What ``serve`` loads and runs once ``generate``'s defaults are applied to its flags.

    Attributes:
        draft: The draft model to load, or None (the method has none).
        draft_quantize: The draft's quantization (None: as --quantize).
        draft_quantize_note: Where the draft's quantization came from, for the start-up log.
        draft_control: Adaptive draft exit, or None.
        num_speculative_tokens: γ.
        max_model_prompt_tokens: The cascade's prompt limit for the draft model, or None.
    """

    draft: str | None
    draft_quantize: str | None
    draft_quantize_note: str
    draft_control: DraftControl | None
    num_speculative_tokens: int
    max_model_prompt_tokens: int | None


def resolve_defaults(args, device) -> ServePlan:
    """Apply ``specdecode generate``'s defaults (``pipeline``'s command defaults) to ``serve``'s flags
    on ``device``, and check the quantization flags against the result before anything loads.

    Raises:
        InvalidArgumentError: --draft-quantize, --draft-quantize-head or --quantize-group-size that
            does not fit the method or the draft's quantization (in the flags' words).
    """
    needs_draft = method_registry.REGISTRY[args.method].needs_draft_model
    if not needs_draft:
        for flag in ("draft_quantize", "draft_quantize_head"):
            if getattr(args, flag) is not None:
                raise InvalidArgumentError(f"--{flag.replace('_', '-')} applies to {who_takes(flag)}, "
                                           f"not to {args.method!r}; use --quantize for the target")
    draft_quantize = args.draft_quantize
    if draft_quantize is None and needs_draft:
        draft_quantize = draft_quantize_by_default(args.method, args.quantize, device)
    scheme = (args.quantize if draft_quantize is None else draft_quantize) if needs_draft else None
    if args.draft_quantize is not None:
        why = f"--draft-quantize {args.draft_quantize}"
    elif draft_quantize is not None:
        why = "generate's default on CPU"
    else:
        why = why_no_int4_draft(args.method, args.quantize, device) or f"as --quantize {args.quantize}"
    if needs_draft and args.draft_quantize_head is not None:
        check_draft_quantize_head_flag(args.draft_quantize_head, scheme, why)
    check_quantize_group_size_flag(args.quantize_group_size, args.quantize, scheme, why)
    # A draft tree is drafted by rows without an exit policy: as generate, --draft-tree-depth turns the
    # default adaptive draft exit off.
    adaptive = (adaptive_exit_by_default(args.method, args.quantize, args.num_speculative_tokens)
                and getattr(args, "draft_tree_depth", None) is None
                if args.adaptive_draft_exit is None else args.adaptive_draft_exit)
    if adaptive and not method_registry.REGISTRY[args.method].adaptive_exit:
        if args.adaptive_draft_exit:
            raise InvalidArgumentError(f"--adaptive-draft-exit needs a method whose drafts carry probabilities; "
                                       f"{args.method!r} has none")
        adaptive = False
    defaults.check_exit_mode_flag(args.draft_exit_mode, adaptive)
    float32_cpu = target_float32_on_cpu(args.dtype, device, getattr(args, "backend", "torch"))
    limit = args.max_model_prompt_tokens
    if limit is None:
        limit = prompt_limit_by_default(args.method, scheme, float32_cpu=float32_cpu) if needs_draft else None
    return ServePlan(
        draft=args.draft if needs_draft else None,
        draft_quantize=draft_quantize,
        draft_quantize_note=f"{scheme}: {why}" if scheme is not None else "",
        # as generate: over the default exit, the cost model where the target computes in float32 on a CPU
        draft_control=DraftControl(adaptive_exit=True, length_schedule=length_schedule_by_default(
            args.adaptive_draft_exit is None, float32_cpu), exit_mode=args.draft_exit_mode) if adaptive else None,
        num_speculative_tokens=(DEFAULT_NUM_SPECULATIVE_TOKENS if args.num_speculative_tokens is None
                                else args.num_speculative_tokens),
        max_model_prompt_tokens=limit or None,
    )
