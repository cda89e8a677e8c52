"""buf on the wire contract: lint passes and still refuses what STANDARD refuses, breaking refuses a wire break,
and scripts/buf_breaking.py picks the right base on a branch, on main and in a clone with no history."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUF = ROOT / "node_modules" / ".bin" / "buf"
INFERENCE = Path("protos") / "tokenmesh" / "v1" / "inference.proto"


def buf(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    if not BUF.exists():
        pytest.fail("node_modules/.bin/buf missing: `make test-deps` runs npm ci")
    return subprocess.run([str(BUF), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def workspace(tmp: Path) -> Path:
    """A copy of protos/ and buf.yaml in tmp, with this venv (buf.yaml reads google/rpc from it)."""
    shutil.copytree(ROOT / "protos", tmp / "protos")
    shutil.copy(ROOT / "buf.yaml", tmp / "buf.yaml")
    (tmp / ".venv").symlink_to(ROOT / ".venv", target_is_directory=True)
    return tmp


def edit(root: Path, old: str, new: str) -> None:
    path = root / INFERENCE
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_buf_lint_passes_on_the_protos() -> None:
    done = buf("lint")
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_buf_lint_takes_new_rpcs_in_v1_style_and_refuses_what_standard_refuses(tmp_path: Path) -> None:
    root = workspace(tmp_path)
    # Named as the Link RPC's messages are (what they carry, not <Method>Request): accepted.
    edit(
        root,
        "  rpc ListModels(ListModelsRequest) returns (ListModelsResponse);\n",
        "  rpc ListModels(ListModelsRequest) returns (ListModelsResponse);\n"
        "  rpc GenerateBatch(stream BatchCommands) returns (stream BatchEvents);\n",
    )
    with (root / INFERENCE).open("a") as proto:
        proto.write("\nmessage BatchCommands {\n  repeated GenerateRequest starts = 1;\n}\n")
        proto.write("\nmessage BatchEvents {\n  repeated GenerateChunk chunks = 1;\n}\n")
    assert buf("lint", cwd=root).returncode == 0
    # A rule STANDARD keeps still holds.
    with (root / INFERENCE).open("a") as proto:
        proto.write("\nenum Mode {\n  MODE_FAST = 0;\n}\n")
    done = buf("lint", "--error-format", "config-ignore-yaml", cwd=root)
    assert done.returncode == 100
    assert "ENUM_ZERO_VALUE_SUFFIX" in done.stdout


def test_buf_breaking_refuses_a_changed_field_and_takes_an_added_one(tmp_path: Path) -> None:
    root = workspace(tmp_path)
    edit(root, "  uint64 after_seq = 2;\n", "  uint64 after_seq = 2;\n  bool follow = 3;\n")
    assert buf("breaking", str(root), "--against", str(ROOT)).returncode == 0
    edit(root, "  uint64 after_seq = 2;", "  uint32 after_seq = 2;")
    done = buf("breaking", str(root), "--against", str(ROOT))
    assert done.returncode == 100
    assert 'Field "2" with name "after_seq" on message "ResumeRequest" changed type' in done.stdout


def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("buf_breaking", ROOT / "scripts" / "buf_breaking.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def git(root: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True, env=env)
    return done.stdout.strip()


def commit(root: Path, name: str) -> str:
    (root / name).write_text(name)
    git(root, "add", name)
    git(root, "commit", "-q", "-m", name)
    return git(root, "rev-parse", "HEAD")


def test_the_base_is_the_merge_base_on_a_branch_and_the_parent_on_main(tmp_path: Path) -> None:
    base_commit = script().base_commit
    origin = tmp_path / "origin"
    origin.mkdir()
    git(origin, "init", "-q", "-b", "main")
    assert base_commit(origin) == ("", "no commit yet")
    first = commit(origin, "a")
    assert base_commit(origin)[0] == ""  # one commit: nothing before it
    second = commit(origin, "b")

    # CI: a fresh clone of main judges main's last commit (a merge: everything it brought in).
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(origin), str(clone))
    assert base_commit(clone) == (first, "HEAD~1")

    # A branch is judged from where it left main, also after main moved on.
    git(clone, "switch", "-q", "-c", "feature")
    commit(clone, "c")
    commit(clone, "d")
    commit(origin, "e")
    git(clone, "fetch", "-q")
    assert base_commit(clone) == (second, "merge base of HEAD and origin/main")

    # A shallow clone has no parent to compare with: the script says so and skips.
    shallow = tmp_path / "shallow"
    git(tmp_path, "clone", "-q", "--depth", "1", f"file://{origin}", str(shallow))
    assert base_commit(shallow) == ("", "HEAD has no parent (first commit, or a shallow clone)")
