"""The ``tokenmesh`` command and ``python -m tokenmesh``: process-wide gRPC settings, then the CLI.

gRPC reads ``GRPC_EXPERIMENTS`` once, when it is first imported, so the
default is set here, before anything imports grpc. A value in the
environment wins; ``GRPC_EXPERIMENTS=`` (empty) keeps gRPC's own defaults.
"""

import os
import sys
from collections.abc import MutableMapping

GRPC_EXPERIMENTS = "-event_engine_client"
"""Client channels on gRPC's poll-based I/O, not its EventEngine.

grpc.aio delivers each message from an EventEngine thread to the completion
queue, then from its poller thread to the event loop: two thread hand-offs
per message. Without ``event_engine_client`` the poller thread reads the
socket itself. Measured on 2 cores (benchmarks/README.md, "gRPC settings"):
the gateway spends 29 instead of 37 us CPU per token at 5k tokens/s
(benchmarks/gateway.py), the router 14.0 instead of 17.2 and a bare
grpc.aio relay 15.8 instead of 21.3 at 24k tokens/s
(benchmarks/router_cost.py; ``GRPC_EXPERIMENTS=`` for gRPC's defaults).
tests/unit/test_grpc_settings.py fails when an installed
grpcio no longer knows the experiment.
"""


def set_grpc_defaults(environ: MutableMapping[str, str]) -> None:
    """The gRPC settings above, in a process environment, where it sets none of its own."""
    environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)


def main() -> int:
    """Set the gRPC defaults, then run the CLI."""
    set_grpc_defaults(os.environ)
    from tokenmesh.cli import main as cli_main  # after the line above: the CLI imports grpc

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
