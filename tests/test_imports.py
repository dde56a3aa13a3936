"""The package's modules import each other without a circle, read statically (every import
statement, function-local ones included, so no circle hides behind a deferred import), and
choosing the cute backend leaves the CuTe DSL alone until a kernel runs."""
import ast
import os
import pathlib
import subprocess
import sys

import ringfa4

ROOT = pathlib.Path(ringfa4.__file__).parent


def _modules():
    """{module name: path} of every ringfa4 module."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(name, path, modules):
    """The ringfa4 modules that module ``name`` names in its import statements."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from a import b` names module a.b when b is one, else module a.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        edges.update(t for t in targets if t in modules and t != name)
    return edges


def _cycle(graph):
    """One import circle of graph as a list of modules, or None."""
    state = {}
    stack = []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_walker_sees_imports_of_every_form():
    modules = _modules()
    graph = {name: _imported(name, path, modules) for name, path in modules.items()}
    assert "ringfa4.api" in graph["ringfa4"]  # from ringfa4.api import ...
    assert "ringfa4.backends" in graph["ringfa4.api"]  # from ringfa4 import backends
    assert "ringfa4.backends.cute.compile" in graph["ringfa4.backends.cute.launch"]  # in a function
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_ringfa4_modules_import_each_other_without_a_circle():
    modules = _modules()
    graph = {name: _imported(name, path, modules) for name, path in modules.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_kernel_modules_do_not_import_the_host_side():
    """ringfa4.kernels holds device code; only its command line (__main__, a program that no
    module imports) reaches the compile cache in ringfa4.backends.cute."""
    modules = _modules()
    for name, path in modules.items():
        if name.startswith("ringfa4.kernels") and name != "ringfa4.kernels.__main__":
            host = [m for m in _imported(name, path, modules) if not m.startswith("ringfa4.kernels")]
            assert not host, f"{name} imports {host}"


def test_choosing_the_cute_backend_loads_no_cutlass_and_pins_no_arch():
    """Another backend on another GPU (upstream FA4 on Blackwell) must keep the DSL's own arch:
    the cute backend pins sm_90a only when its first kernel runs."""
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    code = ("import os, sys, torch, ringfa4, ringfa4.backends as b; "
            "m = b.get('cute'); m.unsupported_reason(*[torch.zeros(1, 8, 2, 64)] * 3, False, True); "
            "print('cutlass' in sys.modules, 'ringfa4.kernels' in sys.modules, "
            "'CUTE_DSL_ARCH' in os.environ)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "False", "False"]
