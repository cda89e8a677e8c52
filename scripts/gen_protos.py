"""Regenerate the Python code for protos/ into services/tokenmesh/v1/ (import path tokenmesh.v1).

``--check`` regenerates into a temporary folder and fails when the committed
code differs, so generated code is never stale or edited by hand.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

import google.rpc.status_pb2
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO_DIR = PROTO_ROOT / "tokenmesh" / "v1"
OUT_DIR = ROOT / "services" / "tokenmesh" / "v1"
INIT = '"""Generated from protos/tokenmesh/v1 by scripts/gen_protos.py. Do not edit."""\n'


def generate(dest: Path) -> None:
    """Write *_pb2.py, *_pb2_grpc.py and *_pb2.pyi for every proto into dest."""
    include = Path(protoc.__file__).parent / "_proto"
    # google/rpc/status.proto (a Link end's status) ships with googleapis-common-protos, beside its generated code.
    googleapis = Path(google.rpc.status_pb2.__file__).parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_DIR.glob("*.proto"))
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"-I{googleapis}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--pyi_out={tmp}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        dest.mkdir(parents=True, exist_ok=True)
        for old in dest.glob("*_pb2*"):
            old.unlink()
        for new in sorted((Path(tmp) / "tokenmesh" / "v1").iterdir()):
            shutil.copy(new, dest / new.name)
        (dest / "__init__.py").write_text(INIT)


def main() -> int:
    """Regenerate, or with --check compare against the committed code."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail when services/tokenmesh/v1 is stale")
    args = parser.parse_args()
    if not args.check:
        generate(OUT_DIR)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        cmp = filecmp.dircmp(tmp, OUT_DIR, ignore=["__pycache__"])
        stale = cmp.diff_files + cmp.left_only + cmp.right_only
        if stale:
            print(f"services/tokenmesh/v1 is stale ({', '.join(sorted(stale))}): run `make proto`", file=sys.stderr)  # noqa: T201
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
