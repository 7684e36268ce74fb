#!/usr/bin/env bash
# Issue 28's open GPU figures in two device calls (three if time is left), prepared here, run there.
#
# Models: random weights of the real Qwen2.5-Coder 1.5B/0.5B shapes (`gpu_engine.py --random-weights echo`):
# copying the real GGUF files takes about 30 calls, more than a session's 15 minutes of device time allow.
# Forward costs, round costs and overheads hold; acceptance rates, tau and speculative speedups do not
# (2026-11-27-gpu-h200.md says why).
#
#   bash docs/benchmarks/gpu_calls.sh prep    # here, once: .gpu/ (configs, tokenizer) and .whl/ (transformers)
#   then, with the device tool, each with carry=[".gpu", ".whl"]:
#   run(command="bash docs/benchmarks/gpu_calls.sh 1", timeout_s=500)  # cold machine: forwards, single, rounds,
#       # syncs, batched autoregressive at B = 32, profile (a script budget of 420 s; a compile started just
#       # before it can run about 40 s past it)
#   run(command="BUDGET=<budget_left_s - 90> bash docs/benchmarks/gpu_calls.sh 2", timeout_s=<budget_left_s - 40>)
#       # warm: batched B = 8, 32, cut to what is left of the 15 minutes (a cold start takes 1-2 of them)
#   run(command="bash docs/benchmarks/gpu_calls.sh 3", timeout_s=300)  # dynamic shapes: only if 5 minutes are
#       # left, else in a later session
#   then give_back. Each call's log comes back as $OUT/callN.log. BUDGET=<seconds> sets a call's script budget
#   (gpu_engine.py's --budget-s): from status's budget_left_s, less about 90 s. GPU_ENGINE_ARGS adds options
#   (here, to try a call on the CPU: OUT=/tmp/o GPU_ENGINE_ARGS="--device cpu --no-compile --max-new-tokens 4").
#
# What each call answers: the "Next time" section of 2026-11-27-gpu-h200.md.
set -o pipefail
cd "$(dirname "$0")/../.." || exit 1
models=(--random-weights echo --target .gpu/qwen2.5-coder-1.5b-shape --draft .gpu/qwen2.5-coder-0.5b-shape)

case "${1:-}" in
prep)
    dense=${SPECDECODE_CACHE:-$HOME/.cache/specdecode}/dense
    for name in 1.5b 0.5b; do
        [ -f "$dense/qwen2.5-coder-$name-instruct-bfloat16/config.json" ] || {
            echo "no dense copy of qwen2.5-coder-$name-instruct in $dense: load the packaged models once (bf16)," \
                 "e.g. specdecode generate 'hi' --max-new-tokens 1" >&2; exit 1; }
    done
    mkdir -p .gpu/qwen2.5-coder-1.5b-shape .gpu/qwen2.5-coder-0.5b-shape .whl
    cp "$dense"/qwen2.5-coder-1.5b-instruct-bfloat16/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} \
        .gpu/qwen2.5-coder-1.5b-shape/ || exit 1
    cp "$dense"/qwen2.5-coder-0.5b-instruct-bfloat16/{config.json,generation_config.json} .gpu/qwen2.5-coder-0.5b-shape/ \
        || exit 1
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 -d .whl transformers==5.23.0 || exit 1
    for path in /.gpu/ /.whl/; do
        grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude
    done
    du -sh .gpu .whl
    exit 0 ;;
1 | 2 | 3) ;;
*)
    echo "usage: $0 prep | 1 | 2 | 3" >&2
    exit 64 ;;
esac

: "${OUT:?OUT names the folder whose files come back (the device tool sets it)}"
mkdir -p "$OUT" || exit 1
# On the GPU machine: transformers 5.23 (the machine has 5.17) and src/ (gpu_engine.py puts it on sys.path).
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ ! -d /tmp/site/transformers ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
# engine N ARGS...: gpu_engine.py with ARGS, then $GPU_ENGINE_ARGS (extra options), logged to $OUT/callN.log
engine() {
    local n=$1
    shift
    # shellcheck disable=SC2086  # GPU_ENGINE_ARGS: options split on spaces
    python3 docs/benchmarks/gpu_engine.py "${models[@]}" "$@" ${GPU_ENGINE_ARGS:-} 2>&1 | tee "$OUT/call$n.log"
}

case "$1" in
1)
    engine 1 --sections forwards,single,rounds,syncs,batched,profile \
        --methods autoregressive,autoregressive-serial,draft,prompt-lookup,autoregressive-captured,draft-captured,prompt-lookup-captured,hf-generate-static,autoregressive-after-hf,draft-after-hf \
        --prompts 2 --batch-sizes 32 --batch-groups 1 --batch-methods autoregressive --row-buckets batch \
        --budget-s "${BUDGET:-420}" --profile-dir /tmp/traces
    rc=$?
    # the profiles' Chrome traces, if they fit what a call brings back
    tar czf /tmp/traces.tgz -C /tmp traces 2>/dev/null && [ "$(stat -c %s /tmp/traces.tgz)" -lt 15000000 ] \
        && cp /tmp/traces.tgz "$OUT/"
    exit "$rc" ;;
2)
    engine 2 --sections batched --batch-sizes 8,32 --batch-groups 1 --batch-methods autoregressive,prompt-lookup,draft \
        --row-buckets batch --budget-s "${BUDGET:-220}" ;;
3)
    engine 3 --sections batched --batch-sizes 8 --batch-groups 1 --batch-methods prompt-lookup --dynamic-shapes \
        --budget-s "${BUDGET:-220}" ;;
esac
