"""Only tokenmesh.links holds peer connections: no other module opens a channel or makes a stub."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = (ROOT / "services", ROOT / "gateway")
GENERATED = ROOT / "services" / "tokenmesh" / "v1"

OWNERS = {
    "services/tokenmesh/links.py": "makes every stub, on the channels it owns",
    "services/tokenmesh/tls.py": "opens every channel to a mesh peer (Tls.channel, open_channel), for Links' factories",
}
"""Modules whose job it is."""

EXCEPTIONS = {
    ("services/tokenmesh/cli.py", "insecure_channel"): "`tokenmesh status` and `models`: one call per command, on a "
    "channel closed by `async with` when the command returns",
    ("services/tokenmesh/cli.py", "RouterStub"): "`tokenmesh status`: the same one-shot call",
    ("services/tokenmesh/cli.py", "InferenceStub"): "`tokenmesh models`: the same one-shot call",
    ("services/tokenmesh/bench/targets.py", "insecure_channel"): "`tokenmesh bench` reads one router's table once, "
    "at its start (the client has no such call)",
    ("services/tokenmesh/bench/targets.py", "secure_channel"): "the same, with --tls",
    ("services/tokenmesh/bench/targets.py", "RouterStub"): "the same one-shot GetRoutingTable",
    ("services/tokenmesh/worker/triton/_backend.py", "insecure_channel"): "Triton is not a mesh peer: the backend owns "
    "its one channel to its own Triton server",
    ("services/tokenmesh/worker/triton/_backend.py", "secure_channel"): "the same, to a Triton behind TLS",
    ("services/tokenmesh/worker/triton/_backend.py", "GRPCInferenceServiceStub"): "the same: Triton's stub",
}
"""(module, what it makes) pairs allowed elsewhere, each with why."""


def _made(source: str) -> list[tuple[str, int]]:
    """What the code makes: (channel function or stub class, line) for each call that opens or makes one."""
    made = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in ("insecure_channel", "secure_channel") or name.endswith("Stub"):
            made.append((name, node.lineno))
        elif name == "channel" and isinstance(func, ast.Attribute) and "tls" in ast.unparse(func.value).lower():
            made.append(("Tls.channel", node.lineno))
    return sorted(made, key=lambda m: m[1])


def _scan() -> dict[tuple[str, str], list[int]]:
    found: dict[tuple[str, str], list[int]] = {}
    for source in SOURCES:
        for path in sorted(source.rglob("*.py")):
            if GENERATED in path.parents:
                continue
            module = path.relative_to(ROOT).as_posix()
            if module in OWNERS:
                continue
            for name, line in _made(path.read_text()):
                found.setdefault((module, name), []).append(line)
    return found


def test_no_module_but_links_and_tls_opens_a_channel_or_makes_a_stub() -> None:
    found = _scan()
    unexpected = [
        f"{module}:{line} makes {name}"
        for (module, name), lines in sorted(found.items())
        if (module, name) not in EXCEPTIONS
        for line in lines
    ]
    assert not unexpected, (
        "peer connections belong to tokenmesh.links (Links.open, Link.stub); "
        "or add a justified exception: " + "; ".join(unexpected)
    )


def test_every_exception_is_still_needed() -> None:
    found = _scan()
    stale = [f"{module} no longer makes {name}" for module, name in EXCEPTIONS if (module, name) not in found]
    assert not stale, "remove from EXCEPTIONS: " + "; ".join(stale)


def test_the_scan_sees_each_way_of_making_one() -> None:
    sample = "grpc.aio.insecure_channel(a)\nself.tls.channel(a)\nx_pb2_grpc.WorkerStub(c)\nWorkerStub(c)\n"
    assert _made(sample) == [("insecure_channel", 1), ("Tls.channel", 2), ("WorkerStub", 3), ("WorkerStub", 4)]
    assert _made("link.stub(x_pb2_grpc.WorkerStub)\nstub: x_pb2_grpc.WorkerStub\n") == []  # taken from a link
