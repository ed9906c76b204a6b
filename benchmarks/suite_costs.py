"""What each test file costs a run of the suite, from pytest's JUnit XML: its tests, their seconds (setup, call
and teardown together, as JUnit counts them), and its costliest test.

    python -m pytest -m processes --junitxml=/tmp/run.xml      # any run of the suite
    python benchmarks/suite_costs.py /tmp/run.xml [--top 25]   # its files, costliest first

Issue 95, item 5: which test costs what, and why it cannot go lower (tests/README.md).
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ElementTree


def costs(path: str) -> dict[str, list[tuple[float, str]]]:
    """Each test file's tests, as (seconds, name), from a JUnit XML report."""
    files: dict[str, list[tuple[float, str]]] = collections.defaultdict(list)
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        files[module].append((float(case.get("time", 0.0)), case.get("name", "")))
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", nargs="+", help="JUnit XML reports (pytest --junitxml); several: their median")
    parser.add_argument("--top", type=int, default=25, help="the costliest files to list")
    args = parser.parse_args()
    runs = [costs(path) for path in args.report]
    names = sorted(set().union(*runs))
    totals = {name: sorted(sum(seconds for seconds, _ in run.get(name, [])) for run in runs) for name in names}
    median = {name: values[len(values) // 2] for name, values in totals.items()}
    whole = sum(median.values())
    print(f"{len(names)} files, {sum(len(runs[0].get(name, [])) for name in names)} tests, {whole:.0f} s of tests")
    print("| file | tests | seconds | share | costliest test (seconds) |")
    print("|---|---:|---:|---:|---|")
    for name in sorted(names, key=lambda name: -median[name])[: args.top]:
        tests = runs[0].get(name, [])
        seconds, test = max(tests) if tests else (0.0, "")
        share = median[name] / whole
        print(f"| `{name}` | {len(tests)} | {median[name]:.0f} | {share:.0%} | `{test}` ({seconds:.0f}) |")


if __name__ == "__main__":
    main()
