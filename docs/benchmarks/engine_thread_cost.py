"""Where a server request loses time against `specdecode generate`, on the real default pair (CPU).

Runs greedy 128-token generations of one chat prompt, alternating: generate's single-sequence decoder
(`SpeculativeGenerator.decoder`), the batched engine at one row stepped in the main thread, and the same
engine stepped in a worker thread, without and with the main thread's OpenMP pool released first
(``release_openmp_pool``, which the server's engine loop calls before it starts its thread). Defaults of both commands:
`cascade`, adaptive draft exit, an int4 draft, the 512-token prompt limit; the engine with 8 rows of 2,048
positions, warmed up.

Usage (run it alone: `flock /tmp/specdecode-bench.lock` on shared machines):

    PYTHONPATH=src python docs/benchmarks/engine_thread_cost.py [REPEATS]
"""
import sys
import threading
import time

from specdecode.config import GenerationConfig
from specdecode.drafters.control import DraftControl
from specdecode.pipeline import SpeculativeGenerator
from specdecode.serve.openmp import release_openmp_pool

PROMPT = "Write a Python function that checks whether a number is prime."


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    gen = SpeculativeGenerator.from_pretrained(draft_quantize="int4")
    ids = gen.encode(PROMPT, chat=True)
    config = GenerationConfig(max_new_tokens=128)
    control = DraftControl(adaptive_exit=True)
    single = gen.decoder("cascade", draft_control=control, max_model_prompt_tokens=512)
    batched = gen.batch_decoder("cascade", max_batch_size=8, max_length=2048, draft_control=control,
                                max_model_prompt_tokens=512)
    batched.warm_up()
    single.generate(ids, GenerationConfig(max_new_tokens=16))

    def timed(label: str, fn) -> None:
        t = time.perf_counter()
        tokens = fn()
        print(f"{label}: {len(tokens) / (time.perf_counter() - t):.2f} tok/s", flush=True)

    def engine() -> list[int]:
        return batched.generate([ids[0].tolist()], config)[0].token_ids

    for _ in range(repeats):
        timed("single-sequence decoder (generate)", lambda: single.generate(ids, config).token_ids)
        timed("batched engine, main thread", engine)
        worker = threading.Thread(target=timed, args=("batched engine, worker thread, two OpenMP pools", engine))
        worker.start()
        worker.join()
        release_openmp_pool()  # the main thread's next op starts a new pool
        worker = threading.Thread(target=timed, args=("batched engine, worker thread, main's pool released (serve)",
                                                      engine))
        worker.start()
        worker.join()


if __name__ == "__main__":
    main()
