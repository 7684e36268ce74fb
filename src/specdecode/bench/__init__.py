"""``specdecode bench``: time every decoding method on the same prompts, in one process.

The target (and draft) are loaded once; every method runs with the same weights,
dtype, prompts (encoded once) and generation settings. Every prompt plus
``max_new_tokens`` must fit the target's context length, checked before anything
runs. After a warm-up (one short generation per method, timed and reported as
``warmup_s``: compilation happens there), each method runs on every prompt, ``repeats``
times, interleaved prompt by prompt so that slow drifts of the machine (heat,
other load) hit every method alike.

Methods:

* ``hf-generate``: transformers ``model.generate`` on the target alone (greedy, or
  sampling at the same temperature with top-k/top-p off), EOS from the target's
  generation config, ``min_new_tokens`` unset.
* ``hf-generate-static``: the same with transformers' ``StaticCache`` and the decode
  forward compiled (``cache_implementation="static"`` and a ``CompileConfig``, on every
  device; compiled in the warm-up), also a baseline.
* ``hf-assisted``: ``generate(assistant_model=draft)``; the draft's
  ``num_assistant_tokens``/``num_assistant_tokens_schedule``/
  ``assistant_confidence_threshold`` are set to transformers' defaults (recorded
  in results.json).
* ``hf-prompt-lookup``: ``generate(prompt_lookup_num_tokens=10)``.
* every method in ``specdecode.pipeline.METHODS`` (read at run time, so new
  methods appear here without code), run through ``SpeculativeGenerator.decoder``,
  with the fast path as ``BenchSettings.compile`` or the method's ``compile=0|1`` says.
* ``llama-cpp``: llama.cpp (``pip install 'specdecode[llamacpp]'``) on the target's
  GGUF file, target only, with the same prompt ids, threads and greedy settings; a
  reference column next to ours (``vs_llama_cpp``), never a speedup baseline, and run
  only when named (by default with the target in llama.cpp, below).
* ``llama-cpp-lookup``: the same with llama-cpp-python's own prompt-lookup speculation
  (``LlamaPromptLookupDecoding``, ``num_pred_tokens=2``): a reference column too, run only when named.

With the target in llama.cpp (``SpeculativeGenerator.from_pretrained(backend="llama-cpp")``,
``specdecode bench --backend llama-cpp``) specdecode's methods decode on its GGUF file, whole prompts
timed (no prompt cache), next to ``llama-cpp``/``llama-cpp-lookup`` on the same file, threads and KV
cache type, which then run by default; transformers' methods and those needing torch layers are
refused (skipped when unnamed).
The report then adds each method's agreement with ``llama-cpp``'s greedy tokens and its tok/s ÷
the references', per category; the backend is in the identity and results.

Speedups are relative to the *fastest* target-only baseline (``hf-generate``,
``hf-generate-static``, ``autoregressive`` and its compile variants; ``BASELINES``)
in the same category (``speedups``), with tokens/s aggregated as total new
tokens / total seconds (``tokens_per_second``), so neither a slow baseline nor a
few short outputs can flatter a method.

Every finished (method, prompt, repeat) is appended to ``OUT/records.jsonl`` at
once (flushed and fsynced). Running the same command again skips finished
records; the reports are recomputed from all records of the run's plan. The
run's settings live in ``OUT/settings.json``; resuming with different ones is refused.

Modules:

* ``methods``: what a method is (``MethodSpec``, ``DRAFTER_OPTIONS``,
  ``METHOD_MODIFIERS``, ``available_methods``) and how it runs (``build_decoder``,
  ``resolve_methods`` and the runners);
* ``hf_methods``: transformers' ``generate`` variants (``HFMethod``, ``HF_METHODS``) and
  their runner;
* ``settings``: ``BenchSettings``, how every method generates;
* ``runner``: ``run_bench``, the run itself;
* ``llamacpp``: the ``llama-cpp`` and ``llama-cpp-lookup`` reference methods (``LlamaCppRunner``,
  ``LlamaCppLookupRunner``, ``gguf_file``);
* ``records``: the results folder (``RecordStore``, ``run_identity``, ``environment``);
* ``report``: ``summarize``, ``speedups``, ``markdown_report`` and the plots;
* ``datasets``: the prompt sets (Spec-Bench, HumanEval, JSONL), shared with ``specdecode search``;
* ``batched``: ``--batch-size`` throughput mode (``run_batched_bench``): batched engine,
  transformers ``generate`` on left-padded batches, batch-1 references; its own table;
* ``command``: ``run``, the ``specdecode bench`` command (the only module here that prints).
"""

from specdecode.bench.batched import (
    BATCHED_JSON,
    BATCHED_MD,
    BatchMethod,
    batch_methods,
    batched_markdown,
    parse_batch_sizes,
    run_batched_bench,
    write_batched_results,
)
from specdecode.bench.command import run
from specdecode.bench.hf_methods import HF_METHODS, HFMethod
from specdecode.bench.llamacpp import LlamaCppLookupRunner, LlamaCppRunner, gguf_file
from specdecode.bench.methods import (
    DEFAULT_GATE_THRESHOLD,
    DRAFTER_OPTIONS,
    METHOD_MODIFIERS,
    DrafterOption,
    MethodSpec,
    PromptPrefix,
    available_methods,
    build_decoder,
    check_method_names,
    resolve_methods,
)
from specdecode.bench.records import (
    CPU_FLAGS_OF_INTEREST,
    RECORDS_FILE,
    SETTINGS_FILE,
    RecordStore,
    environment,
    record_key,
    run_identity,
)
from specdecode.bench.report import (
    ACCEPTANCE_PNG,
    DRAFT_SIZES_PNG,
    BASELINES,
    LLAMA_CPP,
    LLAMA_CPP_LOOKUP,
    NOTES,
    OVERALL,
    REFERENCE_METHOD,
    RESULTS_JSON,
    RESULTS_MD,
    SPEEDUP_PNG,
    first_divergence,
    is_baseline,
    markdown_report,
    plot_acceptance,
    plot_draft_sizes,
    plot_speedups,
    speedups,
    summarize,
    tokens_per_second,
    write_reports,
)
from specdecode.bench.runner import ProgressCallback, prompt_seed, run_bench
from specdecode.bench.settings import BenchSettings

__all__ = [
    "ACCEPTANCE_PNG",
    "DRAFT_SIZES_PNG",
    "BASELINES",
    "BATCHED_JSON",
    "BATCHED_MD",
    "CPU_FLAGS_OF_INTEREST",
    "DEFAULT_GATE_THRESHOLD",
    "DRAFTER_OPTIONS",
    "HF_METHODS",
    "LLAMA_CPP",
    "LLAMA_CPP_LOOKUP",
    "METHOD_MODIFIERS",
    "NOTES",
    "OVERALL",
    "RECORDS_FILE",
    "REFERENCE_METHOD",
    "RESULTS_JSON",
    "RESULTS_MD",
    "SETTINGS_FILE",
    "SPEEDUP_PNG",
    "BatchMethod",
    "BenchSettings",
    "DrafterOption",
    "HFMethod",
    "LlamaCppLookupRunner",
    "LlamaCppRunner",
    "MethodSpec",
    "ProgressCallback",
    "PromptPrefix",
    "RecordStore",
    "available_methods",
    "batch_methods",
    "batched_markdown",
    "build_decoder",
    "check_method_names",
    "environment",
    "first_divergence",
    "gguf_file",
    "is_baseline",
    "markdown_report",
    "plot_acceptance",
    "plot_draft_sizes",
    "plot_speedups",
    "prompt_seed",
    "parse_batch_sizes",
    "record_key",
    "resolve_methods",
    "run",
    "run_batched_bench",
    "run_bench",
    "run_identity",
    "speedups",
    "summarize",
    "tokens_per_second",
    "write_batched_results",
    "write_reports",
]
