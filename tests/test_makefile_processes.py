"""The Makefile's docs command on machines with and without a browser, its steps run by a stand-in Python that

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands.
records what it was asked (the site's build and checks themselves are `make docs`'s, run by CI).
"""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[1]


def make_docs(tmp_path, *settings):
    """`make docs` with `BIN` a folder whose `python` logs its arguments and succeeds: its exit status, its
    output, and the commands it ran."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "ran.txt"
    (bin_dir / "python").write_text(f'#!/bin/sh\necho "$CHROMIUM|$*" >> {log}\n')
    (bin_dir / "python").chmod(0o755)
    done = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "docs", f"BIN={bin_dir}", *settings],
        env={key: value for key, value in os.environ.items() if key != "CHROMIUM"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout + done.stderr, log.read_text().splitlines() if log.exists() else []


def test_without_a_browser_make_docs_builds_checks_the_rest_and_says_the_browser_checks_were_not_run(tmp_path):
    # It exited 2 after building the site and running its notebooks, the browser checks unable to start.
    status, output, ran = make_docs(tmp_path, "CHROMIUM=")
    assert status == 0, output
    assert "the browser checks were not run: no Chromium" in output
    assert any("-m sphinx" in line for line in ran) and ran[-1].endswith("-m not browser docs/tests"), ran


def test_ci_s_required_browser_fails_without_one_and_a_browser_runs_every_check(tmp_path):
    status, output, _ = make_docs(tmp_path, "CHROMIUM=", "DOCS_BROWSER=required")
    assert status != 0 and "no Chromium for the browser checks (DOCS_BROWSER=required)" in output, output
    status, output, ran = make_docs(tmp_path, "CHROMIUM=/opt/chromium/chrome", "DOCS_BROWSER=required")
    assert status == 0, output
    assert ran[-1] == "/opt/chromium/chrome|-m pytest -q -p no:cacheprovider docs/tests", ran
