"""`specdec serve`: the OpenAI-compatible server with continuous batching and batched speculation.

    specdec serve smollm2-135m --port 8000
    specdec serve smollm2-135m --speculative-method ngram --max-num-seqs 16 --api-key "$KEY"
    open http://127.0.0.1:8000/  (a chat page that colours the tokens the drafter got accepted)
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import threading

from specdec.cli._common import add_model_args, add_spec_args, at_least, spec_config_from_args
from specdec.config import ConfigError, check_method_name


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, speculation)")
    add_model_args(p)
    add_spec_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $SPECDEC_API_KEY, else none)")
    g.add_argument("--served-model-name", default=None, help="the model id clients use (default: MODEL)")
    g.add_argument("--max-queued-requests", type=at_least(1), default=64, help="waiting sequences before 429")
    g.add_argument("--max-body-bytes", type=at_least(1), default=1 << 20)
    g.add_argument("--max-header-bytes", type=at_least(1), default=16 << 10)
    g.add_argument("--shutdown-timeout", type=at_least(0), default=30, help="seconds SIGTERM waits for in-flight requests")
    g.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug", "trace"))
    g.add_argument("--grammar-warm-up", action=argparse.BooleanOptionalAction, default=True,
                   help="compile response_format json_object's grammar in the background at start, at the lowest "
                        "CPU priority (~5 s of one core; its first request then does not wait for it)")
    e = p.add_argument_group("engine")
    e.add_argument("--max-num-seqs", type=at_least(1), default=16, help="sequences in the running batch")
    e.add_argument("--max-num-batched-tokens", type=at_least(1), default=256, help="prefill tokens per step (padded)")
    e.add_argument("--block-size", type=at_least(1), default=16)
    e.add_argument("--num-kv-blocks", type=int, default=None)
    e.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    e.add_argument("--request-speculative-methods", default="ngram,suffix",
                   metavar="M1,M2", help="the speculative methods a request's `speculative` field may pick besides "
                   "the server's own and off, built at start (default: ngram,suffix; 'none': no other; "
                   "e.g. qdraft+ngram)")
    p.set_defaults(func=run)


def method_list(text: str) -> tuple[str, ...]:
    """--request-speculative-methods: 'ngram,suffix' -> ('ngram', 'suffix'); 'none' or '' -> (); a
    ConfigError for a name that is no method."""
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    if names == ("none",):
        return ()
    for name in names:
        check_method_name(name)
    return names


def build_server(args, engine_on_caller: bool = False):
    """The uvicorn server and the app state. The engine's thread starts with the app, or, with
    engine_on_caller, the caller runs the engine loop itself (state.engine.run_here(), as run() does)."""
    import uvicorn

    from specdec.engine.async_engine import AsyncEngine
    from specdec.engine.engine import Engine, EngineConfig
    from specdec.llm import LLM
    from specdec.serve.api_server import ServerState, build_app
    from specdec.serve.metrics import ServerMetrics

    if not 0 <= args.port <= 65535:  # checked before the model loads, not by the socket after it
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    request_methods = method_list(args.request_speculative_methods)
    llm = LLM(args.model, speculative_config=spec_config_from_args(args), dtype=args.dtype,
              max_model_len=args.max_model_len, num_threads=args.threads, enforce_eager=True,  # the engine's passes
              enable_prefix_caching=False,  # (the engine has its own: --no-prefix-caching turns that off)
              amx=args.amx is not False,  # batches of rows: the tiles pay here (quant/bf16.py use_amx_tiles)
              kv_cache_dtype=args.kv_cache_dtype)
    engine = Engine(llm, EngineConfig(args.max_num_seqs, args.max_num_batched_tokens, args.block_size,
                                      args.num_kv_blocks, args.kv_cache_memory_gb, not args.no_prefix_caching,
                                      request_methods=request_methods))
    name = args.served_model_name or args.model
    metrics = ServerMetrics(name)
    # the engine loop runs on the main thread (run()), uvicorn on another: see specdec/engine/async_engine.py
    state = ServerState(AsyncEngine(engine, on_stats=metrics.on_stats, own_thread=not engine_on_caller), name, args.api_key or None,
                        args.max_queued_requests, args.max_body_bytes, args.max_header_bytes, metrics=metrics)
    if args.grammar_warm_up:  # json_object's grammar, compiled in the background (its first use waited ~5 s)
        state.grammars.warm_up()
    config = uvicorn.Config(build_app(state), host=args.host, port=args.port, log_level=args.log_level, http="h11",
                            h11_max_incomplete_event_size=args.max_header_bytes,
                            timeout_graceful_shutdown=args.shutdown_timeout, lifespan="on")

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM/SIGINT: refuse new work (503), finish what runs
            state.draining = True
            super().handle_exit(sig, frame)

    return Server(config), state


def freeze_heap() -> int:
    """Collect once, then move every object alive after start-up (torch's and the model's modules, the
    tokenizer's tables, ...: ~300k objects) to the GC's permanent generation, as vLLM's engine does. A full
    collection then scans only what requests allocate: one of the start-up heap took ~160 ms on a 2-vCPU
    Zen 4, a stall of every stream. Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def kv_cache_summary(engine) -> str:
    """One line on the engine's KV cache: blocks, tokens, dtype and memory (vLLM prints its block count)."""
    pool, blocks = engine.pool, engine.blocks
    per_block = engine.drafter_bytes_per_block(blocks.block_size)
    drafters = f", drafters' {blocks.num_blocks * per_block / 2**20:.0f} MiB" if per_block else ""
    return (f"KV cache: {blocks.num_blocks} blocks of {blocks.block_size} tokens "
            f"({blocks.num_blocks * blocks.block_size} tokens, {str(pool.k.dtype).replace('torch.', '')}, "
            f"{(pool.k.nbytes + pool.v.nbytes) / 2**20:.0f} MiB{drafters})")


def run(args) -> int:
    server, state = build_server(args, engine_on_caller=True)
    freeze_heap()
    logging.basicConfig(level=args.log_level.upper())
    print(f"specdec: serving {args.served_model_name or args.model} on http://{args.host}:{args.port}", flush=True)
    print(f"specdec: {kv_cache_summary(state.engine.engine)}", flush=True)
    # uvicorn serves from a second thread, so the signals reach this one: hand them to it (graceful
    # shutdown: new requests get 503, running ones finish, then the app's shutdown stops the engine)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)
    http = threading.Thread(target=server.run, name="specdec-http", daemon=True)
    http.start()
    state.engine.run_here(while_true=http.is_alive)
    http.join()
    return 0 if server.started else 1  # not started: uvicorn said why (e.g. the port is taken)
