"""The docs stay true: every command they mark runnable still runs, and every repository path
they name still exists.

Runnable commands are the ```console blocks of README.md, docs/*.md and the folder READMEs:
each line starting with "$ " is a command (a line ending in "\\" continues it), run with bash
from the repository root, the build's bin/ first on PATH and its python/ on PYTHONPATH; it must
exit 0 within TIMEOUT_S. Lines after a command up to the next "$ " are output it must print
(each, stripped, a substring of one of its stdout lines). ```bash blocks are for reading only
(they need a GPU, a checkpoint or root). A path is an inline `code` span without spaces whose
first component is a top-level entry of the repository (or, for a folder README, an entry of
that folder, whose own files it may name bare); braces expand ({h,cc}), globs must match, and
spans with placeholders (<name>, DIR, ...) are not paths."""

import glob
import itertools
import os
import re
import subprocess

import pytest

from conftest import BUILD, REPO

TIMEOUT_S = 60
FOLDER_READMES = ["server/service", "server/model", "client/src", "kernels"]


def doc_files():
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return docs + [REPO / d / "README.md" for d in FOLDER_READMES]


def rel(path):
    return str(path.relative_to(REPO))


def fences(text):
    """(language, first line number, body lines) of each fenced block."""
    out, lang, start, body = [], None, 0, []
    for n, line in enumerate(text.splitlines(), 1):
        m = re.match(r"^\s*```(\S*)\s*$", line)
        if m and lang is None:
            lang, start, body = m.group(1), n + 1, []
        elif m:
            out.append((lang, start, body))
            lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"a fence opened at line {start - 1} is never closed"
    return out


def console_commands(body):
    """[(command, [expected output lines])] of one console block."""
    cmds = []
    lines = iter(body)
    for line in lines:
        line = line.strip()  # a block inside a list item is indented
        if line.startswith("$ "):
            cmd = line[2:]
            while cmd.endswith("\\"):
                cmd = cmd[:-1] + " " + next(lines).strip()
            cmds.append((cmd, []))
        elif line.strip():
            assert cmds, f"output before any command: {line!r}"
            cmds[-1][1].append(line)
    return cmds


def all_commands():
    for doc in doc_files():
        for lang, start, body in fences(doc.read_text()):
            if lang == "console":
                for cmd, expected in console_commands(body):
                    yield pytest.param(cmd, expected, id=f"{rel(doc)}:{start}:{cmd[:40]}")


def test_the_docs_have_runnable_commands():
    # The convention is in use: a docs tree whose console blocks all vanished checks nothing.
    assert len(list(all_commands())) >= 5


@pytest.mark.parametrize("cmd,expected", all_commands())
def test_a_documented_command_runs(cmd, expected):
    bin_dir = BUILD / "bin"
    if not (bin_dir / "draftfeed-target").exists():
        pytest.skip(f"no build at {BUILD} (DRAFTFEED_BUILD_DIR)")
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BUILD / "python"),
                                                      env.get("PYTHONPATH")]))
    r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, f"{cmd}\nexit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
    lines = [line.strip() for line in r.stdout.splitlines()]
    for want in expected:
        assert any(want in line for line in lines), f"{cmd}: no line has {want!r}\n{r.stdout}"


SOURCE_FILE = re.compile(r"^[\w.*-]+\.(h|cc|cu|cuh|py|txt)$")
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|\bDIR\b|\bBUILD\b|\bPREFIX\b|\bNAME\b|\bFILE\b")


def inline_code(text):
    """Inline code spans outside fenced blocks."""
    outside = re.sub(r"^\s*```.*?^\s*```[^\n]*$", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", outside)


def expand_braces(path):
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return list(itertools.chain.from_iterable(
        expand_braces(path[:m.start()] + alt + path[m.end():]) for alt in m.group(1).split(",")))


def named_paths(doc):
    """(span, [candidate bases]) for each span of `doc` that names a repository path."""
    top = {p.name for p in REPO.iterdir() if not p.name.startswith(("build", "dist", ".git"))}
    here = doc.parent
    folder_readme = doc.name == "README.md" and here != REPO
    for span in inline_code(doc.read_text()):
        span = span.rstrip(".,;:")
        if " " in span or "://" in span or span.startswith("/") or PLACEHOLDER.search(span):
            continue
        if "/" not in span:
            # A folder README's own files, named bare (`stream_reactor.cc`).
            if folder_readme and SOURCE_FILE.match(span):
                yield span, here
            continue
        first = span.split("/", 1)[0]
        if first in top:
            yield span, REPO
        elif here != REPO and (here / first).exists():
            yield span, here


def test_every_path_the_docs_name_exists():
    missing, checked = [], 0
    for doc in doc_files():
        assert doc.exists(), rel(doc)
        for span, base in named_paths(doc):
            checked += 1
            for path in expand_braces(span):
                if not glob.glob(str(base / path)):
                    missing.append(f"{rel(doc)}: `{span}` ({rel(base / path)})")
    assert checked >= 100, checked  # the check sees the docs' paths at all
    assert not missing, "\n".join(missing)


def test_readme_stays_short_and_links_resolve():
    readme = (REPO / "README.md").read_text()
    assert readme.count("\n") <= 250
    for doc in doc_files():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{rel(doc)}: link to {target}"
