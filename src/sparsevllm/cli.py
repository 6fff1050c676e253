"""`sparsevllm` command line: generate, methods, serve, bench, calibrate, deltakv.

Every command checks what it can without a model before loading one; input errors end
with one line on stderr and exit status 2 (see cli_errors.py for every status).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from typing import NoReturn

from sparsevllm import __version__
from sparsevllm.cli_calibrate import add_calibrate_parser
from sparsevllm.cli_deltakv import add_deltakv_parser
from sparsevllm.cli_errors import (
    EXIT_INTERRUPTED,
    EXIT_PIPE_CLOSED,
    EXIT_STATUS_HELP,
    EXIT_USAGE,
    UsageError,
)
from sparsevllm.cli_generate import add_generate_parser
from sparsevllm.engine_args import add_engine_args, engine_config_from_args

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with its errors on one line (the usage is one `--help` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_methods(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "methods",
        help="List the sparse methods.",
        description="List the registered KV sparsity methods.",
    )
    p.add_argument("--json", action="store_true", help="Print JSON.")
    p.set_defaults(func=run_methods)


def run_methods(args: argparse.Namespace) -> int:
    from sparsevllm.sparse.registry import methods_table

    rows = methods_table()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    w = max(len("method"), *(len(r["name"]) for r in rows))  # e.g. expected_attention
    print(f"{'method':{w}s} {'family':22s} {'prefill policy':25s} knobs (defaults)")
    for r in rows:
        knobs = ", ".join(f"{k}={v}" for k, v in r["knobs"].items()) or "-"
        print(f"{r['name']:{w}s} {r['family']:22s} {r['prefill_policy']:25s} {knobs}")
        aliases = f" (aliases: {', '.join(r['aliases'])})" if r["aliases"] else ""
        print(f"{'':{w}s} {r['description']}{aliases}")
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from sparsevllm.server import defaults

    p = sub.add_parser(
        "serve",
        help="Run the OpenAI-compatible HTTP server.",
        description="Serve /v1/models, /v1/completions, /v1/chat/completions, /tokenize, "
        "/detokenize, /version, /health and /metrics (OpenAI-compatible; see docs/server.md). "
        "Example: sparsevllm serve ./my-model --port 8000 --sparse-method snapkv",
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="The model to serve, as vLLM takes it (the same as --model).",
    )
    srv = p.add_argument_group("server")
    srv.add_argument(
        "--host",
        default=defaults.DEFAULT_HOST,
        help=f"Address to bind (default: {defaults.DEFAULT_HOST}).",
    )
    srv.add_argument(
        "--port",
        type=int,
        default=defaults.DEFAULT_PORT,
        help=f"TCP port (default: {defaults.DEFAULT_PORT}).",
    )
    srv.add_argument(
        "--api-key",
        default=os.environ.get("SPARSEVLLM_API_KEY"),
        help="Require 'Authorization: Bearer KEY' on /v1 routes (default: $SPARSEVLLM_API_KEY; "
        "unset: no authentication).",
    )
    srv.add_argument(
        "--served-model-name",
        help="Model name clients send and responses carry (default: the --model path, or "
        "the bundled default model's name).",
    )
    srv.add_argument(
        "--max-queue-len",
        type=int,
        default=defaults.DEFAULT_MAX_QUEUE_LEN,
        help="Most requests waiting for the engine; beyond it requests get HTTP 429 "
        f"(default: {defaults.DEFAULT_MAX_QUEUE_LEN}).",
    )
    srv.add_argument(
        "--max-stored-responses",
        type=int,
        default=defaults.DEFAULT_MAX_STORED_RESPONSES,
        help="Most /v1/responses results kept in memory for GET /v1/responses/{id} and "
        "previous_response_id; the oldest are dropped first, 0 stores none "
        f"(default: {defaults.DEFAULT_MAX_STORED_RESPONSES}).",
    )
    srv.add_argument(
        "--reasoning-parser",
        choices=defaults.REASONING_PARSERS,
        default=None,
        help="Split the <think>...</think> text of replies into `reasoning_content` (chat "
        "completions) and reasoning items (responses): qwen3 (a reply may open a <think> "
        "block; Qwen3, QwQ) or deepseek_r1 (replies begin inside the block; DeepSeek-R1) "
        "(default: none, replies are all content).",
    )
    srv.add_argument(
        "--tool-call-parser",
        choices=defaults.TOOL_CALL_PARSERS,
        default=None,
        help="Parse the tool calls of chat and responses replies (tool_choice auto) in the "
        "model family's format: hermes (<tool_call>{...}</tool_call>: Hermes, Qwen2.5, Qwen3) or "
        "llama3_json (a JSON object reply: Llama 3.1-3.3) (default: none; requests with "
        "tools and tool_choice auto are refused, required and named choices still work).",
    )
    srv.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=defaults.DEFAULT_SHUTDOWN_GRACE_S,
        help="On SIGINT/SIGTERM, seconds running requests may take to finish before they are "
        f"aborted (default: {defaults.DEFAULT_SHUTDOWN_GRACE_S}).",
    )
    srv.add_argument(
        "--server-log-level",
        default="info",
        choices=defaults.LOG_LEVELS,
        help="Log level of uvicorn (access log included) and of the server (default: info).",
    )
    _add_replica_flags(p)
    add_engine_args(p)
    p.set_defaults(func=run_serve)


def _add_replica_flags(p: argparse.ArgumentParser) -> None:
    from sparsevllm.server.replicas.options import (
        DEFAULT_MAX_IMBALANCE,
        DEFAULT_REPLICA_CPUS,
    )

    rep = p.add_argument_group("replicas (Ray Serve; see docs/deployment.md)")
    rep.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="Engine replicas behind one router on Ray Serve (pip install 'sparsevllm[replicas]'); "
        "requests of a conversation (chain_id, previous_response_id, a held prompt prefix) go "
        "to the replica that holds its state (default: 1, the single server, without Ray).",
    )
    rep.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster to join (HOST:PORT of `ray start --head`, ray://HOST:PORT or auto); "
        "an unreachable address fails within seconds (default: start a local Ray instance).",
    )
    rep.add_argument(
        "--route-max-imbalance",
        type=int,
        default=DEFAULT_MAX_IMBALANCE,
        help="Requests in flight a replica holding a request's chain or prefix may have above "
        "the least loaded replica and still get it; beyond it the request goes to the least "
        f"loaded one (default: {DEFAULT_MAX_IMBALANCE}).",
    )
    rep.add_argument(
        "--replica-cpus",
        type=float,
        default=DEFAULT_REPLICA_CPUS,
        help="Ray CPUs each replica reserves (a CUDA replica also takes 1 GPU); --replicas "
        f"beyond the cluster's CPUs or GPUs is refused (default: {DEFAULT_REPLICA_CPUS:g}).",
    )


def run_serve(args: argparse.Namespace) -> int:
    if args.model_tag is not None:
        given = getattr(args, "model", None)
        if given is not None and given != args.model_tag:
            raise UsageError(f"the model is given twice: {args.model_tag!r} and --model {given!r}")
        args.model = args.model_tag
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue_len < 1:
        raise UsageError(f"--max-queue-len must be >= 1, got {args.max_queue_len}")
    if args.shutdown_grace_s < 0:
        raise UsageError(f"--shutdown-grace-s must be >= 0, got {args.shutdown_grace_s}")
    if args.max_stored_responses < 0:
        raise UsageError(f"--max-stored-responses must be >= 0, got {args.max_stored_responses}")
    if args.replicas < 1:
        raise UsageError(f"--replicas must be >= 1, got {args.replicas}")
    if args.replicas > 1 or args.ray_address is not None:
        return _run_replicated(args)
    config = engine_config_from_args(args)
    from sparsevllm.server.launcher import run_server

    return run_server(
        config,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_queue_len=args.max_queue_len,
        shutdown_grace_s=args.shutdown_grace_s,
        log_level=args.server_log_level,
        max_stored_responses=args.max_stored_responses,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
    )


def _run_replicated(args: argparse.Namespace) -> int:
    """`serve --replicas N` (or with --ray-address): engine replicas on Ray Serve."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise UsageError(
            "--replicas and --ray-address need Ray Serve: pip install 'sparsevllm[replicas]'"
        )
    config = engine_config_from_args(args)
    from sparsevllm.server.launcher import default_served_model_name
    from sparsevllm.server.replicas.launcher import run_replicated_server
    from sparsevllm.server.replicas.options import ReplicaOptions, RouteOptions, ServerOptions

    server = ServerOptions(
        served_model_name=args.served_model_name or default_served_model_name(config),
        api_key=args.api_key,
        max_queue_len=args.max_queue_len,
        max_stored_responses=args.max_stored_responses,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        host=args.host,
        port=args.port,
    )
    options = ReplicaOptions(
        engine=config,
        server=server,
        replicas=args.replicas,
        replica_cpus=args.replica_cpus,
        route=RouteOptions(max_imbalance=args.route_max_imbalance),
    )
    return run_replicated_server(options, args.ray_address)


def build_parser(with_bench: bool = True) -> argparse.ArgumentParser:
    """The whole parser; without `with_bench`, `bench` has no sub-commands (their modules
    import torch, seconds that `--help` or a usage error of another command need not pay)."""
    parser = ArgumentParser(
        prog="sparsevllm",
        description="Sparse-vLLM: a sparse-first LLM inference engine.",
        epilog=EXIT_STATUS_HELP,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=LOG_LEVELS,
        help="Logging level (default: WARNING).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub, add_engine_args)
    _add_methods(sub)
    _add_serve(sub)
    _add_bench(sub, with_bench)
    add_calibrate_parser(sub)
    add_deltakv_parser(sub)
    return parser


def _add_bench(sub: argparse._SubParsersAction, with_kinds: bool) -> None:
    p = sub.add_parser(
        "bench",
        help="Benchmarks: throughput, multiturn, quality, fidelity, moe, replicas.",
        description="Benchmarks that write JSON reports (see docs/benchmarks/).",
    )
    kinds = p.add_subparsers(dest="bench", required=True)
    if not with_kinds:
        return
    from sparsevllm.bench import fidelity_cli, moe, multiturn, replicas, throughput_cli
    from sparsevllm.bench.quality import cli as quality

    throughput_cli.add_parser(kinds, add_engine_args)
    multiturn.add_parser(kinds, add_engine_args)
    quality.add_parser(kinds)
    fidelity_cli.add_parser(kinds)
    moe.add_parser(kinds)
    replicas.add_parser(kinds)


def main(argv: list[str] | None = None) -> int:
    try:
        argv = sys.argv[1:] if argv is None else argv
        if argv[:2] == ["calibrate", "duoattention"]:  # beside `calibrate REPORT...`
            from sparsevllm.bench import duo_calibrate

            args = duo_calibrate.build_parser(ArgumentParser).parse_args(argv[2:])
            return int(args.func(args))
        args = build_parser(with_bench="bench" in argv).parse_args(argv)
        args.command_line = shlex.join(["sparsevllm", *argv])  # what logs record
        logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
        return args.func(args)
    except (UsageError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # Python would report the closed pipe again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE_CLOSED


if __name__ == "__main__":
    sys.exit(main())
