"""What ``specdecode serve`` refuses or defaults before anything loads when the target runs in llama.cpp
(``check_llama_cpp_backend``), and its default row count. The defaults it shares with ``generate`` (the draft
and its quantization, the draft control, γ, the prompt limit) are ``defaults.plan_command``'s.
"""

from __future__ import annotations

from specdecode import method_registry
from specdecode.defaults import LLAMA_CPP_COMMAND_METHOD
from specdecode.engine.runner_target import ONE_SEQUENCE
from specdecode.errors import InvalidArgumentError
from specdecode.models.llama_cpp_target import check_llama_cpp_target_options

#: Rows decoded at once when --max-batch-size is not given (a target in llama.cpp: 1, the only value it takes).
DEFAULT_MAX_BATCH_SIZE = 8


def check_llama_cpp_backend(args) -> None:
    """Give --method and --max-batch-size their defaults for --backend (``generate``'s method under
    llama-cpp, ``LLAMA_CPP_COMMAND_METHOD``; one row there), and refuse before loading what a target
    in llama.cpp cannot do, in the flags' words.

    Raises:
        InvalidArgumentError: With --backend llama-cpp: --max-batch-size other than 1 (one request at a
            time), a method it refuses (``method_registry.LLAMA_CPP_TARGET_REFUSALS``: layer-skip and
            early-exit; draft and cascade run with the draft in llama.cpp), --compile, or the torch loading flags
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
                                   "--method prompt-lookup, draft, cascade or autoregressive, or --backend torch")
    if args.compile:
        raise InvalidArgumentError("--compile compiles torch forwards, but with --backend llama-cpp the target runs "
                                   "in llama.cpp: leave --compile out")
    check_llama_cpp_target_options(dtype=args.dtype, device=args.device, quantize=args.quantize,
                                   draft_quantize=args.draft_quantize, draft_quantize_head=args.draft_quantize_head,
                                   quantize_group_size=args.quantize_group_size, draft_backend=None,
                                   prepack_linears=args.prepack_linears)
