"""The public surface: layout, imports, exports, and documentation of every setting and flag."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import ampwatch
from ampwatch import _cli
from ampwatch._settings import AgentSettings
from ampwatch.server import Settings

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _configuration_hook():
    """docs/_hooks/configuration.py, the MkDocs hook that generates the configuration reference."""
    spec = importlib.util.spec_from_file_location("_docs_configuration", ROOT / "docs" / "_hooks" / "configuration.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generated() -> str:
    try:
        return _configuration_hook().render()
    except LookupError:  # a setting without a meaning: the configuration test below says which
        return ""


GENERATED = _generated()
# What the drift tests read: the README, every page of the documentation site, and the generated reference.
DOCS = README + "".join(p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))) + GENERATED


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_no_generic_top_level_module_is_importable(tmp_path: Path) -> None:
    for name in ("agent", "server", "web", "migrations", "tests"):
        done = _python(f"import {name}", tmp_path)
        assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr, name
    done = _python("import ampwatch.server, ampwatch.web, ampwatch.migrations; print('ok')", tmp_path)
    assert done.stdout.strip() == "ok", done.stderr


def test_importing_the_agent_loads_no_server_dependency_and_no_torch(tmp_path: Path) -> None:
    heavy = [
        "fastapi",
        "starlette",
        "uvicorn",
        "sqlalchemy",
        "alembic",
        "pydantic",
        "plotly",
        "psycopg",
        "jinja2",
        "torch",
    ]
    done = _python(f"import sys, ampwatch; print([m for m in {heavy!r} if m in sys.modules])", tmp_path)
    assert done.stdout.strip() == "[]", done.stderr


def test_the_agent_exports_exactly_its_all(tmp_path: Path) -> None:
    assert sorted(ampwatch.__all__) == ["Response", "Run", "StopRequested", "Transport", "__version__", "init"]
    done = _python("import ampwatch; print(sorted(n for n in vars(ampwatch) if not n.startswith('_')))", tmp_path)
    assert done.stdout.strip() == "['Response', 'Run', 'StopRequested', 'Transport', 'init']", done.stderr


def test_the_agent_distribution_depends_on_nothing_and_the_server_extra_has_the_stack() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == []
    server = " ".join(project["optional-dependencies"]["server"])
    for package in ("fastapi", "uvicorn", "sqlalchemy", "alembic", "plotly", "psycopg"):
        assert package in server
    assert project["scripts"] == {"ampwatch": "ampwatch._cli:main"}


def test_the_top_level_layout_is_the_documented_one() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    top = {path.split("/")[0] for path in tracked}
    assert top <= {
        "pyproject.toml",
        "README.md",
        "agent",
        "server",
        "web",
        "migrations",
        "tests",
        "bench",
        "docker-compose.yml",
        "Dockerfile",
        ".dockerignore",
        ".ci",
        ".gitignore",
        "docs",
        "mkdocs.yml",
        "CHANGELOG.md",
        ".pre-commit-config.yaml",
    }
    assert {"agent", "server", "web", "migrations", "tests", "pyproject.toml", "README.md", ".ci"} <= top


def test_every_setting_and_environment_variable_is_documented() -> None:
    for field in Settings.model_fields:
        assert f"AMPWATCH_{field.upper()}" in DOCS, field
    sources = "".join(p.read_text() for folder in ("agent", "server") for p in (ROOT / folder).rglob("*.py"))
    for name in set(re.findall(r"AMPWATCH_[A-Z_]+", sources)):
        assert name in DOCS, name


def test_every_cli_command_and_flag_is_documented() -> None:
    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    assert f"ampwatch {path}{name}".strip() in DOCS, f"command {path}{name}"
                    walk(sub, f"{path}{name} ")
            else:
                for flag in action.option_strings:
                    if flag not in ("-h", "--help"):
                        assert flag in DOCS, f"{path}{flag}"

    walk(_cli._parser(), "")


def test_ci_runs_the_readme_test_command() -> None:
    match = re.search(r"<!-- test-command -->\s*```(?:bash|sh)?\n(.+?)\n```", README, re.S)
    assert match, "README marks its test command"
    assert match.group(1).strip() in (ROOT / ".ci" / "run").read_text()


def test_the_configuration_page_is_generated_from_the_settings_objects() -> None:
    hook = _configuration_hook()
    assert hook.render() == GENERATED  # (raises LookupError naming a setting that has no meaning)
    assert hook.MARKER in (ROOT / "docs" / "configuration.md").read_text()
    assert (
        hook.on_page_markdown(f"# Configuration\n\n{hook.MARKER}\n", page=None) == f"# Configuration\n\n{GENERATED}\n"
    )
    assert hook.MARKER not in hook.on_page_markdown(hook.MARKER, page=None)
    for name, field in Settings.model_fields.items():
        default = "off" if field.default is False else f"`{field.default}`" if field.default not in (None, "") else "—"
        default = default.replace(".0`", "`")
        assert re.search(rf"^\| `AMPWATCH_{name.upper()}` \|[^|]*\| {re.escape(default)} \|", GENERATED, re.M), name
    for field in dataclasses.fields(AgentSettings):
        assert f"`AMPWATCH_{field.name.upper()}`" in GENERATED or f"| `{field.name}` |" in GENERATED, field.name
    for flag in ("--host", "--port", "--db", "--insecure"):
        assert f"| `{flag}` |" in GENERATED, flag


def test_the_configuration_hook_refuses_a_setting_without_a_meaning() -> None:
    hook = _configuration_hook()
    del hook.MEANINGS["AMPWATCH_PORT"]
    with pytest.raises(LookupError, match="AMPWATCH_PORT"):
        hook.render()


def test_the_readme_is_short_and_its_links_to_the_docs_resolve() -> None:
    assert len(README.splitlines()) <= 200, "the README is an introduction; the reference lives in docs/"
    links = re.findall(r"\]\(((?:docs/|CHANGELOG)[^)#]*)(?:#([^)]*))?\)", README)
    assert links, "the README points into the docs"
    for path, anchor in links:
        target = ROOT / path
        assert target.exists(), path
        if anchor and target.is_file():
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
            assert anchor in slugs, f"{path}#{anchor}"
