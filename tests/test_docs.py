"""The README and docs/ cannot rot: the site builds, code blocks compile, commands and links exist.

- `mkdocs build --strict` builds docs/ (broken links and anchors inside docs/ fail it);
- README.md stays a front door (at most 300 lines);
- every ```python block of README.md and docs/*.md compiles (a fragment opts out with
  `<!-- not-python -->` on the line before its fence);
- in every ```sh / ```bash / ```console block, each `tfe-estimator <sub>` names a subcommand
  of the real command line with flags it accepts, and each `make <target>` a Makefile target;
- every relative link of README.md and docs/*.md points at a file that exists (and, into
  docs/, at a heading that exists).
"""
import contextlib
import io
import pathlib
import re
import subprocess
import sys
import textwrap
import unicodedata

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 300
OPT_OUT = "<!-- not-python -->"
SHELL_LANGUAGES = {"sh", "bash", "console", "shell"}

_FENCE = re.compile(r"^\s*```([\w-]*)\s*$")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _doc_files():
    return [README] + sorted((ROOT / "docs").glob("*.md"))


def _blocks(path):
    """(language, first line number, source, opted out) of each fenced block of `path`."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start, language = i, match.group(1).lower()
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        previous = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        blocks.append((language, start + 1, textwrap.dedent("\n".join(body)) + "\n", previous == OPT_OUT))
        i += 1
    return blocks


def _outside_code(path, keep_inline=False):
    """The lines of `path` outside fenced code blocks, with inline code removed unless `keep_inline`."""
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line if keep_inline else re.sub(r"`[^`]*`", "", line))
    return out


def _slug(text):
    """Python-Markdown's default `toc` slug of a heading (what mkdocs anchors are)."""
    text = re.sub(r"`([^`]*)`", r"\1", text)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(path):
    return {_slug(m.group(2)) for line in _outside_code(path, keep_inline=True)
            if (m := _HEADING.match(line))}


def _shell_commands(path):
    """(line number, command line) of every command in the shell blocks of `path`, continuations joined."""
    commands = []
    for language, start, source, _ in _blocks(path):
        if language not in SHELL_LANGUAGES:
            continue
        joined, first = "", None
        for offset, line in enumerate(source.splitlines()):
            line = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
            if language == "console":
                line = re.sub(r"^\s*\$\s?", "", line)
            first = start + 1 + offset if first is None else first
            if line.rstrip().endswith("\\"):
                joined += line.rstrip()[:-1] + " "
                continue
            joined += line
            if joined.strip():
                commands.append((first, joined.strip()))
            joined, first = "", None
    return commands


def _cli_help(subcommand):
    """The help text of `tfe-estimator <subcommand>`, or None if there is no such subcommand."""
    from tfe_estimator.tools import cli  # pylint: disable=import-outside-toplevel

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            args = cli.parse_args([subcommand, "--help"])
        except SystemExit as e:
            return out.getvalue() if e.code == 0 else None
        # A subcommand whose arguments its own module parses: ask that module for its help.
        try:
            cli._run(args)  # pylint: disable=protected-access
        except SystemExit as e:
            return out.getvalue() if e.code == 0 else None
    return out.getvalue()


def _make_targets():
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z0-9_-][A-Za-z0-9_.-]*)\s*:(?!=)", text, flags=re.M))
    for phony in re.findall(r"^\.PHONY\s*:(.*)$", text, flags=re.M):
        targets.update(phony.split())
    return targets


def test_mkdocs_builds_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, (
        "mkdocs build --strict failed (install it with the test extra: pip install -e '.[test]'):\n"
        + result.stdout + result.stderr)
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines, more than {MAX_README_LINES}: move the depth to docs/.")


def test_readme_names_no_test_files():
    named = [line for line in README.read_text().splitlines() if re.search(r"test_\w+\.py", line)]
    assert not named, f"README.md is for users; test files belong on docs/contributing.md: {named}"


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_compile(path):
    blocks = [b for b in _blocks(path) if b[0] in ("python", "py")]
    for _, line, source, opted_out in blocks:
        if opted_out:
            continue
        try:
            compile(source, f"{path.relative_to(ROOT)}:{line}", "exec")
        except SyntaxError as e:
            pytest.fail(f"{path.relative_to(ROOT)}, the python block at line {line} does not compile: {e}. "
                        f"Fix it, or mark a fragment with {OPT_OUT} on the line before its fence.")


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_blocks_name_real_commands(path):
    targets = _make_targets()
    helps = {}
    problems = []
    for line, command in _shell_commands(path):
        for match in re.finditer(r"(?:^|[\s;&|(])tfe-estimator\s+(\S+)(.*)", command):
            sub, rest = match.group(1), match.group(2)
            if sub not in helps:
                helps[sub] = _cli_help(sub)
            if helps[sub] is None:
                problems.append(f"line {line}: `tfe-estimator {sub}` is not a subcommand")
                continue
            own = rest.split(" -- ", 1)[0]  # after `--` comes the training command
            for flag in re.findall(r"(?:^|\s)(--[a-z][\w-]*)", own):
                if not re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", helps[sub]):
                    problems.append(f"line {line}: `tfe-estimator {sub}` has no flag {flag}")
        for match in re.finditer(r"(?:^|[\s;&|(])make((?:\s+\S+)*)", command):
            words = [w for w in match.group(1).split() if "=" not in w and not w.startswith("-")]
            if words and words[0] not in targets:
                problems.append(f"line {line}: `make {words[0]}` is not a Makefile target ({sorted(targets)})")
    assert not problems, f"{path.relative_to(ROOT)}: " + "; ".join(problems)


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    problems = []
    for line in _outside_code(path):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
                continue  # http:, https:, mailto:
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            if not resolved.exists():
                problems.append(f"{target!r} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                problems.append(f"{target!r} (no heading with the anchor #{anchor})")
    assert not problems, f"{path.relative_to(ROOT)} links to: " + ", ".join(problems)
