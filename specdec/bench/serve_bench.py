"""`specdec bench serve`: the serving benchmark. A ShareGPT-like workload against `specdec serve`,
speculation off vs on, at a sweep of concurrencies (and request rates), with latency percentiles.

    specdec bench serve +h                                          # (the bench CLI passes flags through)
    specdec bench serve --concurrency 1,4,16 --speculative-method ngram --out docs/benchmarks/serving
    python -m specdec.bench.serve_bench --concurrency 1,4 --num-prompts 8    # the same, standalone

Workload (as vLLM's benchmark_serving): the first human turn of ShareGPT conversations is the prompt
(chat template applied by the server), the first assistant turn's token count the output length
(capped; `ignore_eos` so every request produces exactly that many), greedy. A server subprocess per
setting is started; before a concurrency's first run each server is warmed up with that many requests at
once, on prompts no run sends (a first run at 4 met the batch shapes of 4 rows cold); then, for each
concurrency (a semaphore) and --request-rate
(Poisson arrivals; inf: all at once), the requests go in rounds of max(concurrency, 2) and the
settings take turns per round in ABBA order, so a drift in the machine's load falls on both. Per request: TTFT, TPOT = (e2e - TTFT) / (tokens - 1), ITL =
gaps between streamed chunks (a chunk may carry several tokens when drafts are accepted), e2e.
Prints p50/p90/p99 and throughput; writes NAME.json, NAME.md and NAME.png (TPOT p50 and throughput
vs concurrency) into --out. With --repeats N each concurrency runs N times on prompts of its own, and the
report adds the off / on TPOT p50 ratio of each run with its median and range (on a noisy 2-core machine
one run of 48 prompts at c = 16 ranged 0.88-0.96x on the same code).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specdec.bench.serve_report import plot, report_tables, summarize, tpot_ratios
from specdec.bench.serve_workload import mtbench_workload, sharegpt_workload
from specdec.cli._common import at_least, json_object
from specdec.config import KV_CACHE_DTYPES, ConfigError, check_method_name, split_method


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=at_least(0), default=None, help="server CPU threads (default, 0: all cores)")
    p.add_argument("--amx", action=argparse.BooleanOptionalAction, default=True,
                   help="bf16 on an AMX CPU: the servers' passes on AMX tiles (serve's default; --no-amx: vdpbf16ps)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="both servers' KV cache dtype (serve --kv-cache-dtype)")
    p.add_argument("--speculative-method", default="ngram",
                   help="the 'on' setting's method; METHOD+LOOKUP pairs a model drafter with a lookup (qdraft+ngram)")
    p.add_argument("--num-speculative-tokens", type=at_least(1), default=None, help="fix k (default: adaptive)")
    p.add_argument("--speculative-config", default=None,
                   help="JSON of further keys for the 'on' server, e.g. an EAGLE-2 tree: "
                        "'{\"eagle_topk\": 3, \"num_steps\": 3, \"num_draft_tokens\": 9}'")
    p.add_argument("--settings", default="off,on", help="which of off,on to run")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--request-rate", default="inf", help="requests/s, comma-separated; inf = all at once")
    p.add_argument("--num-prompts", type=at_least(1), default=None, help="per run (default: max(8, 2 x concurrency))")
    p.add_argument("--repeats", type=at_least(1), default=1,
                   help="runs of each concurrency, each on prompts of its own (a repeat on the same prompts would "
                        "find them in the prefix cache); the on/off TPOT ratio is reported per run, median and range")
    p.add_argument("--workload", choices=("sharegpt", "mtbench"), default="sharegpt",
                   help="sharegpt: ShareGPT first turns with their answers' lengths; mtbench: MT-bench first turns "
                        "(in no training set: the shipped EAGLE-3 head was trained on ShareGPT's), --max-output-tokens "
                        "each, in a seeded order, reused from the start once the 80 run out")
    p.add_argument("--max-prompt-tokens", type=at_least(1), default=256)
    p.add_argument("--max-output-tokens", type=at_least(1), default=64)
    p.add_argument("--max-num-seqs", type=at_least(1), default=16)
    p.add_argument("--max-num-batched-tokens", type=at_least(1), default=None,
                   help="both servers' prompt tokens per step (serve's flag; default: serve's, 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", default=None, help="drive a running server instead (one setting, named 'server')")
    p.add_argument("--out", type=Path, default=Path("bench-out/serving"))
    p.add_argument("--name", default="serving")


async def _one(client, url: str, prompt: str, max_tokens: int) -> dict:
    import httpx

    try:
        return await _stream_one(client, url, prompt, max_tokens)
    except httpx.HTTPError as e:  # the connection refused or dropped: this request failed
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}


async def _stream_one(client, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, tokens, spec = [], 0, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code} {(await r.aread()).decode()[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:  # the server ended the stream with an error object
                return {"error": f"in stream: {json.dumps(chunk['error'])[:200]}"}
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                spec = (chunk.get("metrics") or {}).get("speculative_decoding")
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
    e2e = time.perf_counter() - t0
    ttft = stamps[0] - t0 if stamps else e2e
    return {"ttft": ttft, "e2e": e2e, "tokens": tokens, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "tpot": (e2e - ttft) / (tokens - 1) if tokens > 1 else None, "spec": spec}


async def drive(url: str, work: list[tuple[str, int]], concurrency: int, rate: float, seed: int) -> tuple[list, float]:
    """Send the work (a semaphore of `concurrency`, Poisson arrivals at `rate`); per-request results, seconds."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)

    async def limited(client, prompt, n):
        async with sem:
            return await _one(client, url, prompt, n)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # (httpx caps a pool at 100)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for i, (prompt, n) in enumerate(work):
            tasks.append(asyncio.ensure_future(limited(client, prompt, n)))
            if rate != float("inf") and i + 1 < len(work):  # (after the last one: idle time, not the work's)
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


def warm_up(urls: dict[str, str], work: list[tuple[str, int]], concurrency: int, seed: int) -> None:
    """Each server runs `work` at `concurrency` at once, unmeasured: the batch shapes of that many rows (their
    kernels' first calls, the cost model's first observations) are met before a measured run meets them."""
    for url in urls.values():
        results, _ = asyncio.run(drive(url, work, concurrency, float("inf"), seed))
        failed = [r["error"] for r in results if "error" in r]
        if failed:
            print(f"warning: {len(failed)} warm-up request(s) at concurrency {concurrency} failed: {failed[0]}",
                  file=sys.stderr)


def paired_runs(urls: dict[str, str], work: list[tuple[str, int]], concurrency: int, rate: float,
                seed: int) -> dict[str, dict]:
    """The work in rounds of max(concurrency, 2) requests; settings alternate per round in ABBA order, so
    a drift in the machine's load (other jobs) falls on every setting alike."""
    size = max(concurrency, 2)
    rounds = [work[i:i + size] for i in range(0, len(work), size)]
    got = {name: ([], 0.0) for name in urls}
    for i, chunk in enumerate(rounds):
        order = list(urls) if i % 4 in (0, 3) else list(reversed(urls))
        for name in order:
            results, seconds = asyncio.run(drive(urls[name], chunk, concurrency, rate, seed + i))
            got[name] = (got[name][0] + results, got[name][1] + seconds)
    return {name: summarize(results, seconds) for name, (results, seconds) in got.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_argv(args, speculative: bool, port: int) -> list[str]:
    """`specdec serve`'s arguments for one setting of the benchmark (both settings alike but speculation)."""
    argv = ["serve", args.model, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--port",
            str(port), "--max-num-seqs", str(args.max_num_seqs), "--max-queued-requests", "1024",
            "--no-grammar-warm-up"]  # no grammar here: its background compile would share the first run's cores
    if args.threads:
        argv += ["--threads", str(args.threads)]
    if args.max_num_batched_tokens:
        argv += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    argv += ["--amx" if args.amx else "--no-amx", "--kv-cache-dtype", args.kv_cache_dtype]
    if speculative:
        method, lookup = split_method(args.speculative_method)  # "qdraft+ngram": qdraft with an n-gram lookup
        argv += ["--speculative-method", method] + (["--speculative-lookup", lookup] if lookup else [])
        if args.num_speculative_tokens:
            argv += ["--num-speculative-tokens", str(args.num_speculative_tokens)]
        if args.speculative_config:
            argv += ["--speculative-config", args.speculative_config]
    return argv


def start_server(args, speculative: bool) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _free_port()
    argv = server_argv(args, speculative, port)
    code = "import sys; from specdec.cli import main; sys.exit(main())"
    # stderr into a file, read when the server fails: a pipe read only then filled up (64 KiB of logged
    # errors) and froze the server's engine thread in its logging call
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise ConfigError(f"the server exited: {log.read().decode(errors='replace')[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("the server did not start")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _numbers(text: str, kind, flag: str) -> list:
    """A comma list of positive numbers, or a ConfigError naming the flag."""
    try:
        values = [kind(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(v > 0 for v in values):
        raise ConfigError(f"{flag} wants comma-separated positive numbers, got {text!r}")
    return values


def check_args(args) -> tuple[list[int], list[float]]:
    """The concurrencies and request rates, the method and settings checked before a server starts (a bad
    one failed late, or never: concurrency 0 waited on nothing; counts parse with their floor, at_least);
    the output directory made."""
    concs = _numbers(args.concurrency, int, "--concurrency")
    rates = _numbers(args.request_rate, float, "--request-rate")
    for flag, values in (("--concurrency", concs), ("--request-rate", rates),
                         ("--settings", [s for s in args.settings.split(",") if s])):
        if len(set(values)) < len(values):  # one run's figures (and, for settings, a server) would replace another's
            raise ConfigError(f"{flag} names a value twice: {values}")
    if not args.url:
        check_method_name(args.speculative_method)
        bad = [s for s in args.settings.split(",") if s and s not in ("off", "on")]
        if bad or not args.settings.strip(","):
            raise ConfigError(f"--settings takes off and/or on, got {args.settings!r}")
    if args.speculative_config is not None:
        json_object(args.speculative_config, "--speculative-config")
    args.out.mkdir(parents=True, exist_ok=True)
    return concs, rates


def run_serve_bench(args) -> int:
    from specdec.model.loader import resolve_model
    from specdec.model.tokenizer import Tokenizer

    concs, rates = check_args(args)
    load_start = os.getloadavg()[0]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop the servers
    tok = Tokenizer(resolve_model(args.model, progress=False).directory)
    repeats = args.repeats
    n_max = sum(args.num_prompts or max(8, 2 * c) for c in concs) * len(rates) * repeats
    if args.workload == "mtbench":  # the warm-ups on second turns: the first ones are the runs' (80, cycled)
        work_all = mtbench_workload(n_max, args.max_output_tokens, args.seed)
        warm_work = mtbench_workload(max(concs), args.max_output_tokens, args.seed, turn=1)
    else:  # the warm-ups on the prompts after every run's
        work_all = sharegpt_workload(tok, n_max + max(concs), args.max_prompt_tokens, args.max_output_tokens, args.seed)
        work_all, warm_work = work_all[:n_max], work_all[n_max:]
    reused = n_max - len({prompt for prompt, _ in work_all})  # MT-bench has 80 first turns: cycled past them
    if reused:
        print(f"note: {reused} of the {n_max} requests reuse an earlier run's prompt (the {args.workload} workload "
              "holds fewer): those find it in the servers' prefix caches", file=sys.stderr)
    settings = ["server"] if args.url else [s for s in args.settings.split(",") if s]
    servers: dict[str, tuple] = {}
    rows = []
    try:
        for setting in settings:
            servers[setting] = (None, args.url) if args.url else start_server(args, speculative=setting == "on")
        urls = {name: url for name, (_, url) in servers.items()}
        offset = 0  # each run its own prompts: a replay would find them in both servers' prefix caches (and
        for c, rate, repeat in itertools.product(concs, rates, range(repeats)):  # suffix's trie): not cold
            if rate == rates[0] and repeat == 0:
                warm_up(urls, warm_work[:c], c, args.seed)
            size = args.num_prompts or max(8, 2 * c)
            work, offset = work_all[offset:offset + size], offset + size
            for setting, res in paired_runs(urls, work, c, rate, args.seed).items():
                row = {"setting": setting, "concurrency": c, "rate": "inf" if rate == float("inf") else rate,
                       "repeat": repeat, **res}
                rows.append(row)
                print(f"{setting:>6} c={c:<3} rate={row['rate']:<5} {res['output_tok_s']:7.1f} tok/s  "
                      f"TTFT p50 {res['ttft_ms']['p50']} ms  TPOT p50 {res['tpot_ms']['p50']} ms  "
                      f"e2e p50 {res['e2e_ms']['p50']} ms  failed {res['failed']}", flush=True)
                for error in res["errors"]:
                    print(f"       error: {error}", flush=True)
    finally:
        for proc, _ in servers.values():
            if proc is not None:
                stop_server(proc)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": _cpu_name(), "cores": os.cpu_count(),
            "threads": args.threads or os.cpu_count(), "dtype": args.dtype, "model": args.model,
            "method": args.speculative_method, "k": args.num_speculative_tokens or "adaptive",
            "speculative_config": json.loads(args.speculative_config) if args.speculative_config else None,
            "load_avg_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens or "serve's default",
            "workload": args.workload, "requests_reusing_a_prompt": reused}
    ratios = tpot_ratios(rows)
    (args.out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows, "tpot_ratios": ratios},
                                                           indent=1))
    report = report_tables(rows, ratios)
    if reused:
        report += (f"\n\n{reused} of the {n_max} measured requests reuse an earlier run's prompt: "
                   f"the {args.workload} workload holds fewer prompts than the runs ask for.")
    (args.out / f"{args.name}.md").write_text(report + "\n")
    print(report)
    try:
        plot(rows, args.out / f"{args.name}.png")
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m specdec.bench.serve_bench", description=__doc__.split("\n")[0])
    add_arguments(parser)
    sys.exit(run_serve_bench(parser.parse_args()))
