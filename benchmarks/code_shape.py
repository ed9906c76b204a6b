"""The package's shape, counted from its code: parameters at the public doors (and those not deprecated), the
host-memory budget's `None` branches, `is None` branches and `isinstance` decisions, modules at the top level, the
largest modules and classes, import layers and arrows.

    python benchmarks/code_shape.py                  # this checkout
    python benchmarks/code_shape.py --json           # the same figures as one JSON object
    python benchmarks/code_shape.py --root /tmp/old  # another checkout (a `git worktree` of an older commit)

Run it before and after a restructuring and quote both tables (issue 80). Duplicate pairs come from the
`duplicates` command, run beside it.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent / "flaxstate"
DOORS = ("TrainLoop", "EvalLoop", "CheckpointFileWriter", "CheckpointFileReader", "plan", "global_batches", "launch")
BUDGET_NONE = re.compile(r"\b\w*budget\w* is (not )?None")
DEPRECATED = re.compile(r"^\s+(\w+): deprecated", re.MULTILINE)
"""A parameter that a door's docstring calls deprecated (`every_seconds: deprecated: ...`)."""
SAVE_DECISIONS = ("checkpoint/writers.py", "checkpoint/schedule.py", "checkpoint/policies.py", "planning.py")
"""The modules where a writer's and the plan's options are decided (issue 100, item 5)."""


def doors() -> tuple[dict[str, int], dict[str, int]]:
    """Each public entry point's parameters (keywords and positionals, `self` not counted), and those its
    docstring does not call deprecated."""
    import flaxstate as fs
    from flaxstate.launch import launch

    found = {name: getattr(fs, name) for name in DOORS if name != "launch"} | {"launch": launch}
    every, kept = {}, {}
    for name in DOORS:
        door = found[name].__init__ if isinstance(found[name], type) else found[name]
        parameters = list(inspect.signature(found[name]).parameters)
        deprecated = set(DEPRECATED.findall(inspect.getdoc(door) or ""))
        every[name], kept[name] = len(parameters), len([p for p in parameters if p not in deprecated])
    return every, kept


def none_branches(tree: ast.AST) -> int:
    """The tests of `if`, `elif`, `while` and conditional expressions that ask `is None` or `is not None`."""
    tests = [node.test for node in ast.walk(tree) if isinstance(node, ast.If | ast.IfExp | ast.While)]
    return sum(
        1
        for test in tests
        for node in ast.walk(test)
        if isinstance(node, ast.Compare)
        and any(isinstance(op, ast.Is | ast.IsNot) for op in node.ops)
        and any(isinstance(value, ast.Constant) and value.value is None for value in node.comparators)
    )


POLICY_CLASSES = {"EveryRecord", "EverySeconds", "Continuous", "AutoInterval", "POLICIES"}
"""The save policies' classes: an `isinstance` over them is a decision taken by the class, not by the policy."""


def isinstance_calls(tree: ast.AST, of: set[str] | None = None) -> int:
    """The `isinstance` calls; with `of`, those whose classes name one of these."""
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
    ]
    if of is None:
        return len(calls)
    named = [{name.id for name in ast.walk(call.args[1]) if isinstance(name, ast.Name)} for call in calls]
    return sum(bool(names & of) for names in named)


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """The package's modules that this one imports at its top level (not inside functions)."""
    tree = ast.parse(path.read_text())
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: set[str] = set()
    for item in tree.body:  # the top level only: `if TYPE_CHECKING:` and lazy imports draw no arrow at import time
        if isinstance(item, ast.Import):
            found |= {alias.name for alias in item.names if alias.name in known}
        elif isinstance(item, ast.ImportFrom):
            base = item.module or ""
            if item.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - item.level + 1] + ([base] if base else []))
            for alias in item.names:
                full = f"{base}.{alias.name}"
                if full in known:
                    found.add(full)
                elif base in known:
                    found.add(base)
    found.discard(this)
    return found


def layers(graph: dict[str, set[str]]) -> int:
    """The longest chain of imports, each import cycle counted as one module (Kosaraju's components)."""
    order: list[str] = []
    seen: set[str] = set()

    def visit(node: str) -> None:
        seen.add(node)
        for other in graph[node]:
            if other not in seen:
                visit(other)
        order.append(node)

    for node in graph:
        if node not in seen:
            visit(node)
    reverse: dict[str, set[str]] = {node: set() for node in graph}
    for node, edges in graph.items():
        for other in edges:
            reverse[other].add(node)
    component: dict[str, int] = {}
    for number, root in enumerate(reversed(order)):
        todo = [root] if root not in component else []
        while todo:
            node = todo.pop()
            if node not in component:
                component[node] = number
                todo += [other for other in reverse[node] if other not in component]
    dag: dict[int, set[int]] = {}
    for node, edges in graph.items():
        dag.setdefault(component[node], set()).update(component[o] for o in edges if component[o] != component[node])
    depth: dict[int, int] = {}

    def longest(node: int) -> int:
        if node not in depth:
            depth[node] = 1 + max((longest(other) for other in dag.get(node, ())), default=0)
        return depth[node]

    return max(longest(node) for node in dag)


def classes(path: pathlib.Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    return [
        (node.end_lineno - node.lineno + 1, f"{module_name(path)}.{node.name}")
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    ]


def measure() -> dict[str, object]:
    files = sorted(ROOT.rglob("*.py"))
    known = {module_name(path) for path in files}
    graph = {module_name(path): imports(path, known) for path in files}
    sizes = sorted(((len(path.read_text().splitlines()), module_name(path)) for path in files), reverse=True)
    every_class = sorted((entry for path in files for entry in classes(path)), reverse=True)
    budget = sum(len(BUDGET_NONE.findall(path.read_text())) for path in files)
    budget_lines = sum(path.read_text().count("host_memory_budget") for path in files)
    budget_modules = sum("host_memory_budget" in path.read_text() for path in files)
    top = [path.name for path in ROOT.glob("*.py") if path.name not in ("__init__.py", "__main__.py")]
    door, kept = doors()
    trees = {path.relative_to(ROOT).as_posix(): ast.parse(path.read_text()) for path in files}
    deciding = {name: tree for name, tree in trees.items() if name in SAVE_DECISIONS}
    return {
        "doors": door,
        "door_parameters": sum(door.values()),
        "doors_not_deprecated": kept,
        "door_parameters_not_deprecated": sum(kept.values()),
        "is_none_branches": sum(none_branches(tree) for tree in trees.values()),
        "is_none_branches_save_decisions": sum(none_branches(tree) for tree in deciding.values()),
        "isinstance_calls": sum(isinstance_calls(tree) for tree in trees.values()),
        "isinstance_calls_save_decisions": sum(isinstance_calls(tree) for tree in deciding.values()),
        "isinstance_of_save_policies": sum(isinstance_calls(tree, POLICY_CLASSES) for tree in trees.values()),
        "classes_over_250_lines": sum(size > 250 for size, _ in every_class),
        "budget_is_none": budget,
        "host_memory_budget_mentions": budget_lines,
        "host_memory_budget_modules": budget_modules,
        "top_level_modules": len(top),
        "modules": len(files),
        "lines": sum(size for size, _ in sizes),
        "largest_modules": sizes[:5],
        "largest_classes": every_class[:5],
        "import_arrows": sum(len(edges) for edges in graph.values()),
        "import_layers": layers(graph),
    }


def main() -> None:
    global ROOT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--root", type=pathlib.Path, help="a checkout to measure (default: this one)")
    args = parser.parse_args()
    if args.root is not None:
        ROOT = args.root.resolve() / "flaxstate"
        sys.path.insert(0, str(ROOT.parent))  # its flaxstate, not this one's, for the doors' signatures
    figures = measure()
    if args.json:
        print(json.dumps(figures, indent=1))
        return
    print("door                  parameters  not deprecated")
    for name, count in figures["doors"].items():  # type: ignore[union-attr]
        print(f"{name:<22}{count:>10}{figures['doors_not_deprecated'][name]:>16}")  # type: ignore[index]
    print(f"{'(all seven)':<22}{figures['door_parameters']:>10}{figures['door_parameters_not_deprecated']:>16}")
    for key in (
        "is_none_branches",
        "is_none_branches_save_decisions",
        "isinstance_calls",
        "isinstance_calls_save_decisions",
        "isinstance_of_save_policies",
        "classes_over_250_lines",
        "budget_is_none",
        "host_memory_budget_mentions",
        "host_memory_budget_modules",
        "top_level_modules",
        "modules",
        "lines",
        "import_arrows",
        "import_layers",
    ):
        print(f"{key:<30}{figures[key]:>8}")
    print("largest modules:", ", ".join(f"{name} {size}" for size, name in figures["largest_modules"]))  # type: ignore[union-attr]
    print("largest classes:", ", ".join(f"{name} {size}" for size, name in figures["largest_classes"]))  # type: ignore[union-attr]


if __name__ == "__main__":
    main()
