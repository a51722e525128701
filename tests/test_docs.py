"""The documentation matches the code: api.md is generated, every variable and error is documented,
and relative links resolve. Fast: no communicator is made."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import ahcomm

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
VAR = re.compile(r"\bAHCOMM_[A-Z][A-Z0-9_]*[A-Z0-9]\b")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _code_vars() -> set[str]:
    """The variables the package's code names, leaving out ``_config.KNOWN_VARS``'s own list
    (else every name put there would count as read, and the checks against it could not fail)."""
    found: set[str] = set()
    for path in (ROOT / "ahcomm").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if path.name == "_config.py":
            start = text.index("KNOWN_VARS = frozenset({")
            text = text[:start] + text[text.index("})", start):]
        found |= set(VAR.findall(text))
    return found


# The variables only the project's own tools read: benchmarks/latency.py's event loop, and
# tests/test_sim.py's big runs. Named here, not gathered from tests/ (those mention misspelt names
# on purpose, to test the warning about them).
TOOL_VARS = {"AHCOMM_BENCH_LOOP", "AHCOMM_SIM_SCALE"}


def _tool_vars() -> set[str]:
    """``TOOL_VARS``, each checked to be read by a test or a benchmark script."""
    found: set[str] = set()
    for folder in ("tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name != "test_docs.py":  # which names TOOL_VARS itself
                found |= set(VAR.findall(path.read_text(encoding="utf-8")))
    assert TOOL_VARS <= found, sorted(TOOL_VARS - found)
    return TOOL_VARS


def _readme_env_table() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"^## Environment\n(.*?)(?=^## )", text, re.S | re.M)
    assert match, "README.md has no '## Environment' section"
    return match.group(1)


def test_api_md_is_up_to_date() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_api_docs.py"), "--check"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr or proc.stdout


def test_code_reads_some_variables() -> None:
    assert {"AHCOMM_RANK", "AHCOMM_BUFFSIZE", "AHCOMM_JOB_SECRET"} <= _code_vars()


def test_every_variable_is_in_environment_md() -> None:
    doc = (DOCS / "environment.md").read_text(encoding="utf-8")
    missing = sorted(v for v in _code_vars() if f"`{v}`" not in doc)
    assert not missing, f"docs/environment.md does not document {missing}"


def test_environment_md_lists_only_variables_the_code_reads() -> None:
    doc = (DOCS / "environment.md").read_text(encoding="utf-8")
    extra = sorted(set(VAR.findall(doc)) - _code_vars() - _tool_vars())
    assert not extra, f"docs/environment.md documents variables ahcomm never reads: {extra}"


def test_every_variable_is_in_readme_environment_table() -> None:
    table = _readme_env_table()
    missing = sorted(v for v in _code_vars() if v not in table)
    assert not missing, f"README.md's environment table does not list {missing}"


def test_every_exception_is_in_troubleshooting_md() -> None:
    doc = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    exceptions = [n for n in ahcomm.__all__
                  if isinstance(getattr(ahcomm, n), type) and issubclass(getattr(ahcomm, n), BaseException)]
    assert "CollectiveTimeout" in exceptions
    missing = [n for n in exceptions if n not in doc]
    assert not missing, f"docs/troubleshooting.md does not mention {missing}"


def _markdown_files() -> list[Path]:
    return [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # links inside code blocks are not links
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # http:, mailto:, in-page anchors
        file_part = target.split("#", 1)[0]
        if not (path.parent / file_part).exists():
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)} links to missing files: {broken}"


def test_the_known_variables_are_the_ones_read() -> None:
    """``_config.KNOWN_VARS`` (a variable outside it draws a warning at init) lists every variable
    the package reads, and besides them only its own tools' ones."""
    from ahcomm._config import KNOWN_VARS

    assert _code_vars() <= KNOWN_VARS, sorted(_code_vars() - KNOWN_VARS)
    assert KNOWN_VARS <= _code_vars() | _tool_vars(), sorted(KNOWN_VARS - _code_vars() - _tool_vars())
