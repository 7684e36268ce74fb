"""``specdecode soak``: start a server, drive it with concurrent streaming clients, report.

The soak test of the server: C clients (the official ``openai`` async client) each stream
chat completions back to back, greedy, with ``max_tokens`` drawn per request from a range,
for a bounded time and count. Meanwhile the server's resident memory is sampled. The
report gives errors and lost requests (started, never ended), RSS after warm-up and at the
end (with its slope), p50/p90/p99 of time to first token (TTFT) and of the gaps between
streamed chunks (inter-token latency as the client sees it; a speculative round delivers
several tokens in one chunk), time per output token, and total tok/s. Finally SIGTERM: the
server must end cleanly (uvicorn re-raises the signal after its graceful shutdown, so an
exit "by SIGTERM" after "Application shutdown complete" is clean).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdecode.errors import InvalidArgumentError, SpecDecodeError
from specdecode.files import write_text_atomic

logger = logging.getLogger(__name__)


def parse_token_range(text: str) -> tuple[int, int]:
    """``"LO:HI"`` (or ``"N"``) -> (lo, hi), 1 <= lo <= hi.

    Raises:
        InvalidArgumentError: On any other text.
    """
    parts = str(text).split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if not 1 <= lo <= hi:
        raise InvalidArgumentError(f"--max-tokens must be LO:HI with 1 <= LO <= HI (or one N >= 1), got {text!r}")
    return lo, hi


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation, or None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def rss_trend(samples: list[tuple[float, float]], warmup_s: float) -> dict:
    """RSS samples [(seconds since start, MB)] -> after-warm-up growth (MB, %) and slope (MB/min,
    least squares)."""
    after = [(t, m) for t, m in samples if t >= warmup_s] or samples[-1:]
    if not after:
        return {"rss_after_warmup_mb": None, "rss_end_mb": None, "rss_max_mb": None, "rss_growth_mb": None,
                "rss_growth_pct": None, "rss_slope_mb_per_min": None}
    start, end = after[0][1], after[-1][1]
    n = len(after)
    mean_t = sum(t for t, _ in after) / n
    mean_m = sum(m for _, m in after) / n
    var = sum((t - mean_t) ** 2 for t, _ in after)
    slope = sum((t - mean_t) * (m - mean_m) for t, m in after) / var * 60 if var > 0 else 0.0
    return {"rss_after_warmup_mb": start, "rss_end_mb": end, "rss_max_mb": max(m for _, m in samples),
            "rss_growth_mb": end - start, "rss_growth_pct": 100 * (end - start) / start if start else None,
            "rss_slope_mb_per_min": slope}


def cpu_flags() -> dict:
    """The CPU's model name and the flags that decide bf16 speed."""
    info = {"model": None, "flags": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        if line.startswith("model name") and info["model"] is None:
            info["model"] = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            info["flags"] = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in have]
            break
    return info


@dataclass
class SoakSettings:
    """What ``run_soak`` runs.

    Attributes:
        server_args: Arguments of ``specdecode serve`` (host and port are added).
        clients: Concurrent streaming clients (>= 1).
        duration_s: Seconds after which no new request starts (> 0).
        max_requests: Most requests started in all (>= 1).
        max_tokens: (lo, hi): each request's ``max_tokens`` is drawn uniformly from it.
        dataset: ``"spec-bench"`` or ``"humaneval"`` (prompts cycle in file order).
        seed: Seeds the ``max_tokens`` draws.
        warmup_s: Seconds at the start whose RSS samples do not count for "flat".
        rss_interval_s: Seconds between RSS samples.
        request_timeout_s: A request taking longer is counted as lost.
        startup_timeout_s: Seconds to wait for ``/health`` (loading real models takes minutes).
        out: Folder for soak.json, soak.md, metrics.txt and server.log.
        prompts: Prompt texts to use instead of ``dataset``'s.
    """

    server_args: list[str] = field(default_factory=list)
    clients: int = 8
    duration_s: float = 600.0
    max_requests: int = 100_000
    max_tokens: tuple[int, int] = (32, 128)
    dataset: str = "spec-bench"
    seed: int = 0
    warmup_s: float = 60.0
    rss_interval_s: float = 2.0
    request_timeout_s: float = 900.0
    startup_timeout_s: float = 900.0
    out: str = "soak"
    prompts: list[str] | None = None

    def __post_init__(self) -> None:
        if self.clients < 1 or self.max_requests < 1:
            raise InvalidArgumentError(f"clients and max_requests must be >= 1, got {self.clients}, {self.max_requests}")
        if not self.duration_s > 0 or not self.rss_interval_s > 0:
            raise InvalidArgumentError(f"duration_s and rss_interval_s must be > 0, got {self.duration_s}, "
                                       f"{self.rss_interval_s}")
        parse_token_range(f"{self.max_tokens[0]}:{self.max_tokens[1]}")


@dataclass
class _Record:
    started_s: float
    max_tokens: int
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    end_s: float | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    speculative: dict | None = None
    error: str | None = None


async def _one(client, model: str, prompt: str, max_tokens: int, rec: _Record, timeout_s: float) -> None:
    async def run():
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True})
        last = None
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].delta.content:
                if rec.ttft_s is None:
                    rec.ttft_s = now - rec.started_s
                else:
                    rec.gaps_s.append(now - last)
                last = now
            if chunk.choices and chunk.choices[0].finish_reason:
                rec.finish_reason = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                rec.completion_tokens = chunk.usage.completion_tokens
                rec.speculative = (chunk.model_extra or {}).get("speculative")
        if rec.finish_reason is None or rec.speculative is None:
            raise RuntimeError("the stream ended without a finish_reason or without its usage chunk")

    try:
        await asyncio.wait_for(run(), timeout_s)
        rec.end_s = time.perf_counter()
    except TimeoutError:
        pass  # lost: neither completed nor errored in time
    except Exception as e:  # noqa: BLE001 -- every failure is counted and reported
        rec.error = f"{type(e).__name__}: {e}"[:300]
        rec.end_s = time.perf_counter()


async def _load(settings: SoakSettings, url: str, api_key: str, model: str, prompts: list[str], pid: int) -> dict:
    import openai
    import psutil

    rng = random.Random(settings.seed)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0,
                                timeout=settings.request_timeout_s + 60)
    records: list[_Record] = []
    proc = psutil.Process(pid)
    rss: list[tuple[float, float]] = []
    t0 = time.perf_counter()
    done = asyncio.Event()

    async def sample():
        while not done.is_set():
            try:
                total = proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
            except psutil.Error:
                break
            rss.append((time.perf_counter() - t0, total / 2**20))
            try:
                await asyncio.wait_for(done.wait(), settings.rss_interval_s)
            except TimeoutError:
                pass

    async def worker():
        while time.perf_counter() - t0 < settings.duration_s and len(records) < settings.max_requests:
            n = rng.randint(*settings.max_tokens)
            rec = _Record(time.perf_counter(), n)
            records.append(rec)
            await _one(client, model, prompts[(len(records) - 1) % len(prompts)], n, rec, settings.request_timeout_s)

    sampler = asyncio.create_task(sample())
    await asyncio.gather(*(worker() for _ in range(settings.clients)))
    wall = time.perf_counter() - t0
    done.set()
    await sampler
    await client.close()
    return {"records": records, "rss": rss, "wall_s": wall}


def summarize(records: list, rss: list[tuple[float, float]], wall_s: float, warmup_s: float) -> dict:
    """The soak's numbers (see the module docstring) from its request records and RSS samples."""
    ok = [r for r in records if r.end_s is not None and r.error is None]
    errors = Counter(r.error for r in records if r.error is not None)
    lost = sum(1 for r in records if r.end_s is None)
    tokens = sum(r.completion_tokens for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]
    tpot = [(r.end_s - r.started_s - r.ttft_s) / (r.completion_tokens - 1)
            for r in ok if r.ttft_s is not None and r.completion_tokens > 1]
    per_request = [r.completion_tokens / (r.end_s - r.started_s) for r in ok if r.end_s > r.started_s]
    drafted = sum((r.speculative or {}).get("num_drafted_tokens") or 0 for r in ok)
    accepted = sum((r.speculative or {}).get("num_accepted_tokens") or 0 for r in ok)
    taus = [(r.speculative or {}).get("mean_accepted_tokens") for r in ok]
    taus = [t for t in taus if t is not None]
    out = {
        "requests_started": len(records), "requests_completed": len(ok), "requests_errored": sum(errors.values()),
        "requests_lost": lost, "errors": [{"error": e, "count": n} for e, n in errors.most_common(20)],
        "finish_reasons": dict(Counter(r.finish_reason for r in ok)),
        "completion_tokens": tokens, "load_wall_s": wall_s, "total_tokens_per_s": tokens / wall_s if wall_s else None,
        "per_request_tokens_per_s_p50": percentile(per_request, 50),
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_tokens": sum(taus) / len(taus) if taus else None,
    }
    for name, values in (("ttft_s", ttft), ("chunk_gap_s", gaps), ("time_per_output_token_s", tpot)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = percentile(values, q)
    out.update(rss_trend(rss, warmup_s))
    return out


def _markdown(result: dict) -> str:
    s = result["summary"]

    def f(v, nd=3):
        return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))

    rows = [("requests started / completed / errored / lost",
             f"{s['requests_started']} / {s['requests_completed']} / {s['requests_errored']} / {s['requests_lost']}"),
            ("completion tokens", f(s["completion_tokens"])), ("total tok/s", f(s["total_tokens_per_s"], 2)),
            ("per-request tok/s p50", f(s["per_request_tokens_per_s_p50"], 2)),
            ("TTFT p50 / p99 (s)", f"{f(s['ttft_s_p50'], 2)} / {f(s['ttft_s_p99'], 2)}"),
            ("chunk gap p50 / p99 (s)", f"{f(s['chunk_gap_s_p50'])} / {f(s['chunk_gap_s_p99'])}"),
            ("time per output token p50 / p99 (s)",
             f"{f(s['time_per_output_token_s_p50'])} / {f(s['time_per_output_token_s_p99'])}"),
            ("acceptance rate / τ", f"{f(s['acceptance_rate'])} / {f(s['mean_accepted_tokens'], 2)}"),
            ("RSS after warm-up / end / max (MB)",
             f"{f(s['rss_after_warmup_mb'], 0)} / {f(s['rss_end_mb'], 0)} / {f(s['rss_max_mb'], 0)}"),
            ("RSS slope after warm-up (MB/min)", f(s["rss_slope_mb_per_min"], 2)),
            ("shutdown", f"{result['shutdown']['seconds']:.1f} s, clean={result['shutdown']['clean']}")]
    head = f"Soak: `specdecode serve {' '.join(result['settings']['server_args'])}`, {result['cpu']}\n\n"
    return head + "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)


def wait_until_healthy(url: str, proc: subprocess.Popen, timeout_s: float, poll_s: float = 0.5) -> bool:
    """Poll ``url``/health until it answers 200 (True), or until ``proc`` exits or ``timeout_s``
    seconds pass (False)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(poll_s)


# What ``specdecode serve`` logs once it listens (``serve.command.make_uvicorn_server``).
_LISTENING = re.compile(r"start-up: listening on (http://\S+)")


def wait_until_listening(log_path: str | Path, proc: subprocess.Popen, timeout_s: float,
                         poll_s: float = 0.2) -> str | None:
    """The base URL that a ``specdecode serve`` process writing its log to ``log_path`` names
    in its ``start-up: listening on http://HOST:PORT`` line (the port it bound, so ``--port 0``
    works without a race for a free port), once that line is there; None if ``proc`` exits or
    ``timeout_s`` seconds pass first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = _LISTENING.search(Path(log_path).read_text(errors="replace"))
        except FileNotFoundError:
            found = None
        if found:
            return found.group(1)
        if proc.poll() is not None or time.monotonic() > deadline:
            return None
        time.sleep(poll_s)


def run_soak(settings: SoakSettings) -> dict:
    """Start the server, run the load, stop it with SIGTERM; returns (and writes) the report.

    Raises:
        SpecDecodeError: If the openai client (the ``dev`` extra) is not installed.
        RuntimeError: If the server does not become healthy within ``startup_timeout_s``
            (the message holds the end of its log).
    """
    try:
        import httpx
        import openai  # noqa: F401 -- the clients
        import psutil  # noqa: F401 -- the server's RSS
    except ImportError as e:
        raise SpecDecodeError(f"specdecode soak needs the openai client ({e.name} is missing): "
                              "pip install 'specdecode[serve,dev]'") from e
    from specdecode.bench.datasets import load_prompts

    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = settings.prompts or [p.text for p in load_prompts(settings.dataset)]
    api_key = "soak-" + os.urandom(8).hex()
    log_path = out / "server.log"
    # --port 0: the server binds a free port itself and names it in its log (info: the port and the
    # shutdown check are read from the log).
    cmd = [sys.executable, "-m", "specdecode.cli", "serve", *settings.server_args, "--host", "127.0.0.1",
           "--port", "0", "--api-key", api_key, "--log-level", "info"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    headers = {"Authorization": f"Bearer {api_key}"}
    try:
        started = time.monotonic()
        url = wait_until_listening(log_path, proc, settings.startup_timeout_s)
        left_s = settings.startup_timeout_s - (time.monotonic() - started)
        if url is None or not wait_until_healthy(url, proc, max(left_s, 1.0)):
            raise RuntimeError(f"the server did not start (exit {proc.poll()}); its log ends:\n"
                               f"{log_path.read_text()[-2000:]}")
        model = httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]
        logger.info("server up on %s (pid %d); %d clients for %.0f s", url, proc.pid, settings.clients,
                    settings.duration_s)
        load = asyncio.run(_load(settings, url, api_key, model, prompts, proc.pid))
        metrics_text = httpx.get(f"{url}/metrics", headers=headers).text
        write_text_atomic(out / "metrics.txt", metrics_text)
        t = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        shutdown_s = time.perf_counter() - t
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log_text = log_path.read_text()
    clean = code in (0, -signal.SIGTERM) and "Application shutdown complete" in log_text and "Traceback" not in log_text
    result = {
        "settings": {**asdict(settings), "max_tokens": list(settings.max_tokens)},
        "cpu": cpu_flags(),
        "summary": summarize(load["records"], load["rss"], load["wall_s"], settings.warmup_s),
        "rss_samples_mb": [[round(t, 1), round(m, 1)] for t, m in load["rss"]],
        "shutdown": {"exit_code": code, "seconds": shutdown_s, "clean": clean},
    }
    write_text_atomic(out / "soak.json", json.dumps(result, indent=1) + "\n")
    write_text_atomic(out / "soak.md", _markdown(result))
    return result


def passed(result: dict) -> bool:
    """Zero errors, zero lost requests, a clean shutdown."""
    s = result["summary"]
    return s["requests_errored"] == 0 and s["requests_lost"] == 0 and result["shutdown"]["clean"]
