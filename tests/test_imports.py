"""The package's imports point one way (docs/design.md, section 2, "Layers"). A static check over the source:
every import of a ``triton_ep`` module, at the top of a file or inside a function, is an edge from the importing
module to the imported one; each module belongs to one layer, and an edge may only go to the same layer, to one
the layer table allows, or to the base (``config``, ``errors``). No modules import each other in a loop.

Today's exceptions are listed in ``KNOWN_EDGES`` and ``KNOWN_CYCLES``: the lists only shrink. The test fails on a
new violation, and on a listed one that has gone (remove it from the list, so it cannot come back)."""
import ast
import pathlib
import sys

import triton_ep

PACKAGE = pathlib.Path(triton_ep.__file__).parent

#: layer of each module, by the first matching prefix of its dotted name below ``triton_ep`` ("" = the package)
LAYERS = [
    ("config", "base"), ("errors", "base"), ("_version", "base"), ("argtypes", "base"), ("triton_mode", "base"),
    ("", "api"), ("__main__", "api"), ("buffer", "api"), ("elastic", "api"), ("_deep_ep", "api"),
    ("deep_ep_hook", "api"), ("testing", "api"), ("metrics", "api"), ("tuned", "api"), ("tuner", "api"),
    ("reference", "oracle"),
    ("modes", "modes"),
    ("runtime", "runtime"),
    ("scheduler", "scheduler"), ("scheduler_cli", "scheduler"), ("proxy_process", "scheduler"),
    ("proxy_main", "scheduler"),
    ("transport", "transport"),
    ("kernels", "kernels"),
    ("protocol", "protocol"),
]

#: layer -> the layers it may import besides itself and the base
ALLOWED = {
    "api": {"modes", "runtime"},
    "modes": {"runtime", "kernels", "scheduler", "protocol"},
    "runtime": {"kernels", "transport", "protocol"},
    "scheduler": {"transport", "protocol"},
    "transport": {"protocol"},
    "kernels": {"protocol"},
    "protocol": set(),
    "oracle": set(),
    "base": set(),
}

#: today's edges against the table: (importer, imported) by dotted name below ``triton_ep``. Only shrinks.
KNOWN_EDGES: set = set()

#: today's import loops, each as the set of its modules. Only shrinks.
KNOWN_CYCLES: set = set()


def module_name(path: pathlib.Path) -> str:
    """Dotted name below ``triton_ep`` of a source file ("" for the package's ``__init__.py``)."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def is_module(name: str) -> bool:
    """Whether ``name`` (below ``triton_ep``) is a module or package of the source tree."""
    p = PACKAGE.joinpath(*name.split(".")) if name else PACKAGE
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def imports_of(path: pathlib.Path) -> set:
    """The ``triton_ep`` modules a file imports anywhere (top level, functions, ``TYPE_CHECKING`` blocks): a
    ``from X import y`` names ``X.y`` where that is a module, else ``X``."""
    me = module_name(path)
    pkg = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    pkg = [p for p in pkg if p]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name[len("triton_ep."):] if a.name != "triton_ep" else "" for a in node.names
                      if a.name == "triton_ep" or a.name.startswith("triton_ep.")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            elif node.module == "triton_ep" or (node.module or "").startswith("triton_ep."):
                base = node.module.split(".")[1:]
            else:
                continue
            for a in node.names:
                sub = ".".join(base + [a.name])
                found.add(sub if is_module(sub) else ".".join(base))
    found.discard(me)
    return found


def layer_of(name: str) -> str:
    for prefix, layer in LAYERS:
        if name == prefix or (prefix and name.startswith(prefix + ".")):
            return layer
    raise AssertionError(f"triton_ep.{name} has no layer: add it to LAYERS (and to docs/design.md)")


def graph() -> dict:
    return {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def cycles(g: dict) -> set:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.add(frozenset(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer_and_every_import_resolves():
    for mod, deps in graph().items():
        layer_of(mod)
        for d in deps:
            assert is_module(d), f"triton_ep.{mod} imports triton_ep.{d}, which is no module of the package"


def test_imports_follow_the_layers():
    bad = set()
    for mod, deps in graph().items():
        src = layer_of(mod)
        for d in deps:
            dst = layer_of(d)
            if dst not in (src, "base") and dst not in ALLOWED[src]:
                bad.add((mod, d))
    new = sorted(bad - KNOWN_EDGES)
    gone = sorted(KNOWN_EDGES - bad)
    assert not new, ("imports against the layers (docs/design.md, section 2): "
                     + ", ".join(f"triton_ep.{a} ({layer_of(a)}) -> triton_ep.{b} ({layer_of(b)})" for a, b in new))
    assert not gone, f"these known violations are gone: remove them from KNOWN_EDGES: {gone}"


def test_no_import_cycles():
    found = cycles(graph())
    new = found - KNOWN_CYCLES
    gone = KNOWN_CYCLES - found
    assert not new, f"modules that import each other in a loop: {[sorted(c) for c in new]}"
    assert not gone, f"these known cycles are gone: remove them from KNOWN_CYCLES: {[sorted(c) for c in gone]}"


def test_the_check_sees_imports_inside_functions(tmp_path, monkeypatch):
    """The reader follows relative imports inside functions (a loop hidden in a function is still a loop)."""
    pkg = tmp_path / "triton_ep"
    (pkg / "modes").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "modes" / "__init__.py").write_text("")
    (pkg / "modes" / "a.py").write_text("def f():\n    from . import b\n    from ..runtime import x\n")
    (pkg / "modes" / "b.py").write_text("from .a import f\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    g = {module_name(p): imports_of(p) for p in sorted(pkg.rglob("*.py"))}
    assert g["modes.a"] == {"modes.b", "runtime"}
    assert cycles(g) == {frozenset({"modes.a", "modes.b"})}
