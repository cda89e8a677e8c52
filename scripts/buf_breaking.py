"""Run `buf breaking` on protos/ against the contract this change started from (run by `make lint`).

The base: on a branch, the merge base with main (origin/main when the clone has it, else the local main), so a
branch is judged on what it changes, not on what main gained since. On main itself (CI's fresh clone), HEAD~1: the
first parent, so a merge commit is judged on everything it brought in. The working tree is compared, uncommitted
edits included.

buf cannot read the base from git itself (`--against .git#...`): its worker.proto imports google/rpc/status.proto,
which buf.yaml resolves from the venv (not in git, and buf.build is not reachable offline). So the base's protos/
is exported into a temporary folder that gets this buf.yaml and a link to this venv, and buf compares against that.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUF = ROOT / "node_modules" / ".bin" / "buf"


def git(root: Path, *args: str) -> str:
    """Run git in the repository at root; its stdout, stripped ("" when it fails)."""
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


def base_commit(root: Path = ROOT) -> tuple[str, str]:
    """The commit to compare against and why it was chosen; ("", reason) when there is none."""
    head = git(root, "rev-parse", "--verify", "-q", "HEAD")
    if not head:
        return "", "no commit yet"
    for main in ("origin/main", "main"):
        tip = git(root, "rev-parse", "--verify", "-q", f"{main}^{{commit}}")
        if tip and tip != head:
            merge_base = git(root, "merge-base", "HEAD", main)
            if merge_base and merge_base != head:
                return merge_base, f"merge base of HEAD and {main}"
            if merge_base:
                break  # HEAD is an ancestor of main: judge HEAD's own commit, as on main.
    parent = git(root, "rev-parse", "--verify", "-q", "HEAD~1")
    if not parent:
        return "", "HEAD has no parent (first commit, or a shallow clone)"
    return parent, "HEAD~1"


def export_protos(commit: str, dest: Path) -> bool:
    """Write commit's protos/ under dest; False when that commit has none."""
    paths = git(ROOT, "ls-tree", "-r", "--name-only", commit, "--", "protos").splitlines()
    for path in paths:
        blob = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{path}"], capture_output=True, check=True)
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).write_bytes(blob.stdout)
    return bool(paths)


def main() -> int:
    """Compare the working tree's protos/ with the base's; buf's exit status."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", help="a commit to compare against instead of the one chosen above")
    args = parser.parse_args()
    if not BUF.exists():
        print("buf_breaking: node_modules/.bin/buf is missing: run `make test-deps` (npm ci)", file=sys.stderr)  # noqa: T201
        return 1
    commit, why = (args.against, "--against") if args.against else base_commit()
    if not commit:
        print(f"buf breaking: skipped, nothing to compare against ({why})")  # noqa: T201
        return 0
    with tempfile.TemporaryDirectory(prefix="buf-base-") as tmp:
        base = Path(tmp)
        if not export_protos(commit, base):
            print(f"buf breaking: skipped, {commit[:12]} ({why}) has no protos/")  # noqa: T201
            return 0
        # The base is built with today's buf.yaml (its own may predate buf), and the same venv for google/rpc.
        shutil.copy(ROOT / "buf.yaml", base / "buf.yaml")
        (base / ".venv").symlink_to(ROOT / ".venv", target_is_directory=True)
        print(f"buf breaking: protos/ against {commit[:12]} ({why})")  # noqa: T201
        done = subprocess.run([str(BUF), "breaking", ".", "--against", str(base)], cwd=ROOT, check=False)
        return done.returncode


if __name__ == "__main__":
    sys.exit(main())
