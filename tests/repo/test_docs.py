"""The docs: every setting documented in a generated, current reference; links that resolve; a short README."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tokenmesh.config import env_name, settings

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
GENERATOR = ROOT / "scripts" / "gen_config_docs.py"
# Every page a reader reaches from the README, and the READMEs beside the code.
PAGES = [
    README,
    *sorted(DOCS.glob("*.md")),
    ROOT / "benchmarks" / "README.md",
    ROOT / "helm" / "tokenmesh" / "README.md",
    ROOT / "gateway" / "README.md",
]


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_docs", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def gen(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The generator, with TOKENMESH_* removed from the environment only for this test."""
    for name in [n for n in os.environ if n.startswith("TOKENMESH_")]:
        monkeypatch.delenv(name)
    return generator()


def configs(gen: ModuleType) -> list[tuple[str, Any]]:
    return [(name, cls) for name, _, _, cls in gen.services(gen.build_parser()) if cls is not None]


def test_every_setting_has_help_and_a_row_in_the_configuration_reference(gen: ModuleType) -> None:
    found = configs(gen)
    assert {"router", "worker", "prober", "gateway", "up"} <= {name for name, _ in found}
    reference = (DOCS / "configuration.md").read_text()
    missing = []
    for service, cls in found:
        for field in settings(cls):
            assert field.metadata.get("help"), f"{cls.__name__}.{field.name}: declare it with setting(default, help)"
            row = f"| `--{field.name.replace('_', '-')}` | `{env_name(service, field.name)}` |"
            if row not in reference:
                missing.append(row)
    assert not missing, "docs/configuration.md lacks (run `make docs`):\n" + "\n".join(missing)


def test_the_configuration_reference_is_what_the_generator_writes() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMESH_")}
    done = subprocess.run(
        [sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr


def test_the_check_fails_naming_the_file_and_the_fix_when_the_reference_is_stale(
    gen: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "configuration.md"
    monkeypatch.setattr(gen, "OUT", out)
    out.write_text(gen.render().replace("`TOKENMESH_ROUTER_PORT`", "`TOKENMESH_ROUTER_PORT_OLD`"))
    monkeypatch.setattr(sys, "argv", ["gen_config_docs.py", "--check"])
    assert gen.main() == 1
    err = capsys.readouterr().err
    assert "docs/configuration.md is stale" in err and "make docs" in err and "TOKENMESH_ROUTER_PORT_OLD" in err
    monkeypatch.setattr(sys, "argv", ["gen_config_docs.py"])
    assert gen.main() == 0
    monkeypatch.setattr(sys, "argv", ["gen_config_docs.py", "--check"])
    assert gen.main() == 0


def test_the_generated_reference_does_not_depend_on_the_environment(
    gen: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = gen.render()
    monkeypatch.setenv("TOKENMESH_ROUTER_PORT", "6000")
    monkeypatch.setenv("TOKENMESH_ADDR", "10.0.0.1:1")
    assert gen.render() == plain


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose(page.read_text()), flags=re.MULTILINE):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def prose(text: str) -> str:
    """Markdown without its fenced code blocks, where nothing is a link or a heading."""
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def links(page: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", prose(page.read_text()))
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_every_relative_link_in_the_docs_reaches_a_file_and_its_heading() -> None:
    broken = []
    for page in PAGES:
        for target in links(page):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading in {dest.name})")
    assert not broken, "\n".join(broken)


def test_every_repository_path_the_docs_name_exists() -> None:
    missing = []
    for page in PAGES:
        text = page.read_text()
        for path in re.findall(r"`((?:services|gateway|protos|helm|tests|benchmarks|docs|scripts)/[^`\s]*)`", text):
            if not re.search(r"[<>*{}]|\.\.\.", path) and not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "\n".join(missing)


def test_the_readme_is_short_and_links_every_docs_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 220, f"README.md has {len(lines)} lines; move the detail into docs/"
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in links(README)}
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"README.md links no docs/{', docs/'.join(unlinked)}"
    assert (ROOT / "benchmarks" / "README.md").resolve() in linked


def test_nothing_in_the_repository_links_outside_it_to_the_shared_folder() -> None:
    outside = "../" + "shared/"
    # The files git keeps (tracked, or new and not ignored): build output such as *.egg-info is not the repository.
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    found = []
    for name in listed:
        path = ROOT / name
        if path.suffix in {".md", ".py", ".yaml", ".yml", ".json", ".toml", ".txt", ".tpl", ""} and path.is_file():
            try:
                if outside in path.read_text():
                    found.append(name)
            except (UnicodeDecodeError, OSError):
                continue
    assert not found, f"links to {outside} (the design is docs/architecture.md): {', '.join(found)}"


def test_every_file_the_readme_names_exists() -> None:
    """A file name in the README is a path from the root, or the tail of one (a step names its folder once)."""
    files = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if ".venv" not in p.parts and p.is_file()]
    named = re.findall(r"`([\w./-]+\.(?:py|proto|md|yaml|toml|sh|json))`", README.read_text())
    assert len(named) >= 30, "the README's request path names the files it passes"
    missing = [n for n in named if not (ROOT / n).exists() and not any(f.endswith("/" + n) for f in files)]
    assert not missing, f"README.md names files that do not exist: {missing}"
