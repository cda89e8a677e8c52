"""The ``tokenmesh`` command: run the mesh or one service, and talk to a router."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import uvloop

from tokenmesh.bench.command import BenchError
from tokenmesh.config import ConfigError, add_arguments, from_namespace, settings
from tokenmesh.errors import MeshError, from_rpc_error, label
from tokenmesh.logs import FORMATS as LOG_FORMATS
from tokenmesh.logs import configure as configure_logs
from tokenmesh.mesh import Mesh, MeshStartError, UpConfig

DEFAULT_ADDR = "127.0.0.1:50051"


def _add_addr(parser: argparse.ArgumentParser, several: bool = False) -> None:
    what = (
        "router addresses host:port, comma-separated (a stream that breaks resumes on another)"
        if several
        else "router address host:port"
    )
    parser.add_argument(
        "--addr",
        default=os.environ.get("TOKENMESH_ADDR", DEFAULT_ADDR),
        help=f"{what} (env TOKENMESH_ADDR; default {DEFAULT_ADDR})",
    )


def build_parser() -> argparse.ArgumentParser:  # long: an argparse table, a subcommand or flag per line
    """The full argument parser (also used to document the configuration)."""
    from tokenmesh.bench.command import add_arguments as add_bench_arguments
    from tokenmesh.prober import ProberConfig
    from tokenmesh.router import RouterConfig
    from tokenmesh.worker import WorkerConfig

    parser = argparse.ArgumentParser(
        prog="tokenmesh",
        description="Stream LLM tokens from Triton-backed workers through a gRPC router.",
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("TOKENMESH_LOG_LEVEL", "INFO"),
        help="DEBUG, INFO, WARNING or ERROR (env TOKENMESH_LOG_LEVEL; default INFO)",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=os.environ.get("TOKENMESH_LOG_FORMAT", "text"),
        help="text, or json: one object per line with request_id, trace_id and span_id where known "
        "(env TOKENMESH_LOG_FORMAT; default text)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser(
        "up", help="start the embedded mesh: N workers with Triton, a prober, a router and the HTTP gateway"
    )
    add_arguments(up, UpConfig, "up")
    up.add_argument(
        "--model",
        choices=("smollm2", "synthetic"),
        default="smollm2",
        help="the shipped model every worker serves (unless --model-repository): smollm2, SmolLM2 on "
        "llama.cpp (default); synthetic, placeholder tokens at 1,000 tokens/s per stream, for "
        "measuring the mesh itself",
    )
    up.add_argument(
        "--tls",
        action="store_true",
        help="mutual TLS on every hop, from a development CA made for this run in a temporary folder "
        "(tokenmesh certs; --tls-dir keeps it); prints the folder with ca.crt, client.crt and "
        "client.key for grpcurl",
    )
    _add_check_config(up, "TOKENMESH_UP_*")
    up.set_defaults(config_cls=UpConfig)

    gen = sub.add_parser("generate", help="stream a generation to stdout")
    gen.add_argument("prompt", help="the prompt (with --chat: the user message)")
    gen.add_argument("--chat", action="store_true", help="send as a chat message, rendered with the model's template")
    gen.add_argument("--system", default="", help="with --chat: a system message before the prompt")
    gen.add_argument("--max-tokens", type=int, default=None, help="most tokens to generate (default: router's, 256)")
    gen.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: model's)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    gen.add_argument("--model", default="", help="model name (default: the default model)")
    gen.add_argument("--request-id", default="", help="idempotency key (default: router assigns one)")
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds (default: none)")
    gen.add_argument("--verbose", "-v", action="store_true", help="print each chunk's seq and counts to stderr")
    gen.add_argument(
        "--no-batched",
        action="store_true",
        help="one Inference/Generate call, not a stream on the router's shared GenerateStream call",
    )
    _add_addr(gen, several=True)

    bench = sub.add_parser(
        "bench",
        help="measure TTFT, TPOT, ITL, throughput and interruptions of the mesh or of Triton directly",
        description="Drive the mesh (tokenmesh.client: Inference/GenerateStream, or Generate with --no-batched) "
        "or a Triton model directly, closed or open loop, "
        "and report the figures callers feel; --compare puts the mesh beside direct Triton. "
        "Definitions: TTFT = send to first text chunk; E2E = send to final chunk; "
        "TPOT = (E2E - TTFT)/(output tokens - 1); ITL = every gap between text chunks; "
        "throughput = output tokens of successful requests / (first send to last end); "
        "goodput = requests within every --slo bound / duration; interruption rate = requests that "
        "ended in an error or a seq gap / all; stream tokens/s = output tokens / E2E (its variance "
        "sigma^2 shows how evenly streams are served).",
    )
    add_bench_arguments(bench, os.environ.get("TOKENMESH_ADDR", DEFAULT_ADDR))

    certs = sub.add_parser(
        "certs",
        help="make a development CA and a certificate per service (mTLS)",
        description="Make ca.crt/ca.key and <role>.crt/<role>.key for router, worker, prober, "
        "gateway and client, each with its identity spiffe://tokenmesh/<role> as a "
        "URI SAN and the given host names as DNS or IP SANs. For development and "
        "tests; production takes certificates from its own CA (e.g. cert-manager).",
    )
    certs.add_argument("--out", required=True, help="folder to write them to (created if missing)")
    certs.add_argument(
        "--host",
        action="append",
        default=[],
        help="a DNS name or IP address the services are reached by (repeatable; default: localhost and 127.0.0.1)",
    )
    certs.add_argument("--days", type=int, default=90, help="validity of the service certificates (default 90)")

    status = sub.add_parser("status", help="show the router's routing table")
    _add_addr(status)
    models = sub.add_parser("models", help="list the models the mesh serves")
    _add_addr(models)

    for name, cls, what in (
        ("router", RouterConfig, "run a router (Inference, Router and Control services)"),
        ("worker", WorkerConfig, "run a worker with its own Triton, or over --triton-url"),
        ("prober", ProberConfig, "run the prober: watch workers, push weights to routers"),
    ):
        service = sub.add_parser(name, help=what, description=what)
        add_arguments(service, cls, name)
        _add_check_config(service, f"TOKENMESH_{name.upper()}_*")
        service.set_defaults(config_cls=cls)

    from tokenmesh_gateway import GatewayConfig

    what = (
        "run the HTTP gateway: OpenAI-compatible /v1/chat/completions, /v1/completions and /v1/responses, "
        "Anthropic's /v1/messages (SSE) over routers"
    )
    gateway = sub.add_parser("gateway", help=what, description=what)
    add_arguments(gateway, GatewayConfig, "gateway")
    _add_check_config(gateway, "TOKENMESH_GATEWAY_*")
    gateway.set_defaults(config_cls=GatewayConfig)
    return parser


def _add_check_config(parser: argparse.ArgumentParser, variables: str) -> None:
    parser.add_argument(
        "--check-config",
        action="store_true",
        help=f"validate the settings (flags and {variables} env), print them and exit: 0 when valid, "
        "2 with the reason when not; starts nothing (e.g. to test a chart's args)",
    )


def _print_config(config: Any) -> int:
    for field in settings(type(config)):
        value = getattr(config, field.name)
        print(f"{field.name} = {','.join(value) if isinstance(value, tuple) else value!r}")
    return 0


def _run_service(args: argparse.Namespace) -> int:
    service: Any
    if args.command == "gateway":
        from tokenmesh_gateway import Gateway

        service = Gateway
    else:
        from tokenmesh.prober import Prober
        from tokenmesh.router import Router
        from tokenmesh.worker import Worker

        service = {"router": Router, "worker": Worker, "prober": Prober}[args.command]
    config = from_namespace(args.config_cls, args)
    if args.check_config:
        return _print_config(config)

    async def serve() -> int:
        # Built inside the loop: grpc.aio servers and channels bind to the running loop.
        code: int = await service(config).run()
        return code

    # uvloop: less event-loop overhead per relayed message than asyncio's own loop.
    return uvloop.run(serve())


class _StopRequested(Exception):
    """SIGINT or SIGTERM arrived."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _StopRequested


def _up_config(args: argparse.Namespace) -> UpConfig:
    """The UpConfig of the flags and TOKENMESH_UP_* variables, with --model's repository."""
    from tokenmesh.worker.triton import SHIPPED_REPOSITORIES

    config = from_namespace(UpConfig, args)
    if args.model != "smollm2":
        if config.model_repository:
            raise ConfigError("give --model or --model-repository, not both")
        config = dataclasses.replace(config, model_repository=str(SHIPPED_REPOSITORIES[args.model]))
    return config


def _up_banner(mesh: Mesh) -> str:
    """Where each service of a started mesh listens (and, with mTLS, how to call it)."""
    assert mesh.router is not None and mesh.prober is not None
    lines = [f"router   {mesh.router.address}   (tokenmesh.v1.Inference, Router, Control)"]
    lines += [
        f"worker   {w.address}   triton {w.info.get('triton_url')}   pid {w.info.get('pid')}   "
        f"CPUs {w.info.get('cpus')}"
        for w in mesh.workers
    ]
    lines.append(f"prober   {mesh.prober.address}")
    if mesh.gateway is not None:
        lines.append(
            f"gateway  {mesh.gateway.info.get('url')}   (OpenAI-compatible HTTP: /v1/chat/completions, "
            "/v1/completions, /v1/responses, /v1/models; Anthropic's /v1/messages)"
        )
    lines += [f"metrics  {name:9} {url}" for name, url in mesh.metrics_urls.items()]
    if mesh.config.tls_dir:
        folder = Path(mesh.config.tls_dir)
        lines.append(
            f"mTLS     certificates in {folder}: CA {folder / 'ca.crt'}, client certificate "
            f"{folder / 'client.crt'}, its key {folder / 'client.key'}; try\n    grpcurl -cacert "
            f"{folder / 'ca.crt'} -cert {folder / 'client.crt'} -key {folder / 'client.key'} -d "
            '\'{"prompt": "The capital of France is", "max_tokens": 8}\' '
            f"{mesh.router.address} tokenmesh.v1.Inference/Generate"
        )
    return "tokenmesh is up:\n  " + "\n  ".join(lines) + "\nCtrl-C stops everything."


def _up(args: argparse.Namespace) -> int:
    config = _up_config(args)
    if args.check_config:
        return _print_config(config)
    scratch = tempfile.TemporaryDirectory(prefix="tokenmesh-tls-") if args.tls and not config.tls_dir else None
    if scratch is not None or config.tls_dir:
        from tokenmesh.certs import make_dev_certs

        folder = Path(config.tls_dir or scratch.name)  # type: ignore[union-attr]
        if not (folder / "ca.crt").exists():
            make_dev_certs(folder, hosts=_cert_hosts(config.host))
        config = dataclasses.replace(config, tls_dir=str(folder))
    mesh = Mesh(config)
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    engine = {"smollm2": "SmolLM2", "synthetic": "the synthetic model"}[args.model]
    if args.model == "smollm2" and config.model_repository:
        engine = f"the models of {config.model_repository}"
    print(
        f"starting {config.workers} workers (Triton + {engine}, {mesh.threads_per_worker} threads each, "
        f"pinned to {os.cpu_count()} CPUs shared out)...",
        file=sys.stderr,
    )
    try:
        mesh.start()
        print(_up_banner(mesh), flush=True)
        reason = mesh.supervise(lambda line: print(line, file=sys.stderr))
        print(f"{reason}; stopping", file=sys.stderr)
        return 1
    except MeshStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if "gateway" in exc.services:  # its own message names the gateway's flag, not up's
            print(
                f"tokenmesh up: the gateway could not start on port {config.gateway_port}: choose another with "
                "--gateway-port (0 picks a free one), or --gateway-port off for none",
                file=sys.stderr,
            )
        return 1
    except _StopRequested:
        return 0
    finally:
        # Stopping is not interrupted by a second Ctrl-C (it ends in SIGKILL anyway).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("stopping...", file=sys.stderr)
        mesh.stop()
        if scratch is not None:
            scratch.cleanup()


def _cert_hosts(host: str) -> list[str]:
    """The SANs of `up --tls` certificates: loopback, plus the address the services listen on."""
    hosts = ["localhost", "127.0.0.1"]
    if host not in hosts and host not in ("0.0.0.0", "::"):  # noqa: S104 - a listen address, not a bind here
        hosts.append(host)
    return hosts


def _certs(args: argparse.Namespace) -> int:
    from tokenmesh.certs import ROLES, make_dev_certs

    folder = make_dev_certs(Path(args.out), hosts=args.host or ["localhost", "127.0.0.1"], days=args.days)
    print(f"wrote {folder}/ca.crt (and ca.key) and, for {', '.join(ROLES)}, <role>.crt and <role>.key")
    return 0


async def _generate(args: argparse.Namespace) -> int:
    from tokenmesh.v1 import inference_pb2

    request = inference_pb2.GenerateRequest(model=args.model, request_id=args.request_id)
    if args.chat:
        if args.system:
            request.messages.add(role="system", content=args.system)
        request.messages.add(role="user", content=args.prompt)
    else:
        request.prompt = args.prompt
    if args.max_tokens is not None:
        request.max_tokens = args.max_tokens
    if args.temperature is not None:
        request.temperature = args.temperature
    if args.seed is not None:
        request.seed = args.seed
    from tokenmesh.client import Client

    try:
        client = Client(args.addr, batched=not args.no_batched)
    except ValueError as exc:
        raise ConfigError(f"--addr: {exc}") from None
    async with client:
        async for chunk in client.generate(request, timeout=args.timeout):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            if args.verbose:
                print(f"\n[seq {chunk.seq} tokens {chunk.token_count}]", file=sys.stderr)
            if chunk.finish_reason:
                reason = inference_pb2.FinishReason.Name(chunk.finish_reason)
                cached = chunk.usage.cached_prompt_tokens
                print(
                    f"\n[{reason}; prompt {chunk.usage.prompt_tokens} tokens"
                    f"{f' ({cached} cached)' if cached else ''}, "
                    f"completion {chunk.usage.completion_tokens} tokens; request_id {chunk.request_id}]",
                    file=sys.stderr,
                )
    return 0


async def _status(args: argparse.Namespace) -> int:
    from tokenmesh.v1 import router_pb2, router_pb2_grpc

    async with grpc.aio.insecure_channel(args.addr) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        table = await stub.GetRoutingTable(router_pb2.GetRoutingTableRequest(), timeout=5)
    arrived = table.received_at.ToDatetime().isoformat() + "Z" if table.version else "-"
    print(f"weight table version {table.version or 'none (even split over healthy workers)'}, arrived {arrived}")
    print(f"{'ADDRESS':22} {'WEIGHT':>6} {'STATE':14} {'IN_FLIGHT':>9} {'SERVED':>7}  {'FOUND BY':24} REASON")
    for w in table.workers:
        state = label(w.state, router_pb2.WorkerState).upper()
        print(
            f"{w.address:22} {w.weight:6.2f} {state:14} {w.in_flight:9d} {w.served_total:7d}  {w.found_by:24} "
            f"{w.reason}"
        )
    return 0


async def _models(args: argparse.Namespace) -> int:
    from tokenmesh.v1 import inference_pb2, inference_pb2_grpc

    async with grpc.aio.insecure_channel(args.addr) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        response = await stub.ListModels(inference_pb2.ListModelsRequest(), timeout=5)
    for m in response.models:
        loaded = ", loaded on demand" if m.not_loaded else ""
        default = " (default)" if m.is_default else f" (LoRA adapter of {m.base}{loaded})" if m.base else ""
        print(f"{m.name}{default}  context {m.max_context} tokens  on {m.workers} worker(s)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tokenmesh`` console command."""
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
    except ConfigError as exc:
        print(f"tokenmesh: error: {exc}", file=sys.stderr)
        return 2
    configure_logs(str(args.log_level), args.log_format)
    # The services `up` starts log the same way.
    os.environ["TOKENMESH_LOG_LEVEL"], os.environ["TOKENMESH_LOG_FORMAT"] = str(args.log_level), args.log_format
    try:
        if args.command == "up":
            return _up(args)
        if args.command == "certs":
            return _certs(args)
        if args.command in ("router", "worker", "prober", "gateway"):
            try:
                return _run_service(args)
            except OSError as exc:  # e.g. the port is taken: say so, without a traceback
                print(f"tokenmesh {args.command}: error: {exc}", file=sys.stderr)
                return 1
        if args.command == "bench":
            from tokenmesh.bench.command import run as bench

            return asyncio.run(bench(args))
        handler = {"generate": _generate, "status": _status, "models": _models}[args.command]
        try:
            return asyncio.run(handler(args))
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc  # the one client-side translation
    except (ConfigError, BenchError) as exc:
        print(f"tokenmesh {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except MeshError as exc:
        print(f"tokenmesh {args.command}: {exc.grpc_code.name}: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
