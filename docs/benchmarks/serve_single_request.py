"""Single-request tok/s of `specdecode serve` against `specdecode generate`, both with their defaults.

Starts `specdecode serve --port <free> [SERVE_ARGS]` from this tree, waits for /health, then alternates
ROUNDS times: one greedy chat request of MAX_TOKENS (default 128) tokens to the server (tok/s =
completion tokens / the request's wall seconds, measured by the client: tokenization, prefill,
decoding and HTTP included),
then one `specdecode generate --json` run on the same prompt (tok/s: its `stats.tokens_per_s`, prefill
and decoding, loading excluded). Alternating lets both see the same machine load. Prints one JSON line
per round (with each side's target verifications), whether the two texts are equal, and the server's
peak resident memory (VmHWM, Linux).

Usage, from the project root (run it alone: `flock /tmp/specdecode-bench.lock` on shared machines):

    python docs/benchmarks/serve_single_request.py [ROUNDS [MAX_TOKENS]] [-- SERVE_ARGS...]
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

PROMPT = "Write a Python function that checks whether a number is prime."
MAX_TOKENS = 128


def main() -> None:
    args = sys.argv[1:]
    extra = args[args.index("--") + 1:] if "--" in args else []
    positional = args[: args.index("--")] if "--" in args else args
    rounds = int(positional[0]) if positional else 3
    max_tokens = int(positional[1]) if len(positional) > 1 else MAX_TOKENS
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src, "PYTHONUNBUFFERED": "1"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "specdecode.cli", "serve", "--port", str(port), *extra],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                sys.exit(f"the server exited with status {server.returncode}")
            time.sleep(0.5)
        print(f"server ready after {time.perf_counter() - t0:.1f} s", flush=True)
        for _ in range(rounds):
            body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, "temperature": 0}
            t = time.perf_counter()
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=900).json()
            seconds = time.perf_counter() - t
            done = subprocess.run([sys.executable, "-m", "specdecode.cli", "generate", "--prompt", PROMPT,
                                   "--max-new-tokens", str(max_tokens), "--json"],
                                  env=env, capture_output=True, text=True, check=True)
            gen = json.loads(done.stdout)
            n = r["usage"]["completion_tokens"]
            print(json.dumps({
                "serve_tok_s": round(n / seconds, 2), "serve_tokens": n,
                "serve_tau": r["speculative"].get("mean_accepted_tokens"),
                "serve_verifications": r["speculative"].get("num_target_forwards"),
                "generate_tok_s": round(gen["stats"]["tokens_per_s"], 2), "generate_tokens": gen["stats"]["num_new_tokens"],
                "generate_tau": gen["stats"]["mean_accepted_tokens"],
                "generate_verifications": gen["stats"].get("num_target_forwards"),
                "same_text": gen["text"] == r["choices"][0]["message"]["content"],
            }), flush=True)
        with open(f"/proc/{server.pid}/status") as f:
            print([line for line in f.read().splitlines() if line.startswith(("VmHWM", "VmRSS"))], flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


if __name__ == "__main__":
    main()
