"""Every tensor triton-ep makes names its device and its dtype (docs/design.md: callers may have set
``torch.set_default_device('cuda')`` and ``torch.set_default_dtype(torch.bfloat16)``, as DeepEP's own tests
do). A static check over the package's source, so that a factory call relying on the ambient defaults cannot
come back; the behaviour under those defaults is tested per mode (tests/modes/intranode/test_ambient.py,
tests/modes/internode/test_ambient_and_errors.py)."""
import ast
import pathlib

import triton_ep

#: torch functions that make a tensor whose device and dtype come from the ambient defaults unless named
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "range", "linspace", "logspace", "eye", "tensor",
             "as_tensor", "asarray", "rand", "randn", "randint", "randperm", "normal", "empty_strided",
             "scalar_tensor", "tril_indices", "triu_indices", "sparse_coo_tensor", "zeros_like", "ones_like",
             "empty_like", "full_like", "rand_like", "randn_like", "randint_like"}
#: factories that copy their source's device and dtype (a ``*_like`` call may still name them)
FROM_SOURCE = {n for n in FACTORIES if n.endswith("_like")}
#: always on the CPU, with no device argument: the dtype alone must be named
CPU_ONLY = {"frombuffer"}

PACKAGE = pathlib.Path(triton_ep.__file__).parent


def unnamed_factories(source: str, filename: str = "<source>") -> list:
    """``file:line: call`` for each ``torch.<factory>(...)`` in ``source`` that leaves its device or dtype to the
    ambient defaults, or pins memory without ``device="cpu"``; and each factory imported by name from torch
    (``from torch import zeros`` would hide its calls from this check)."""
    tree = ast.parse(source, filename)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "torch":
            bad += [f"{filename}:{node.lineno}: from torch import {a.name}" for a in node.names
                    if a.name in FACTORIES | CPU_ONLY]
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            continue
        name = node.func.attr
        kws = {k.arg: k.value for k in node.keywords}
        if name in CPU_ONLY:
            need = ["dtype"]
        elif name in FACTORIES and name not in FROM_SOURCE:
            need = ["dtype", "device"]
        else:
            need = []
        missing = [k for k in need if k not in kws]
        pinned = kws.get("pin_memory")
        if pinned is not None and not (isinstance(pinned, ast.Constant) and pinned.value is False):
            dev = kws.get("device")
            if not (isinstance(dev, ast.Constant) and dev.value == "cpu"):
                missing.append('device="cpu" (pinned memory is host memory)')
        if missing:
            bad.append(f"{filename}:{node.lineno}: torch.{name}(...) without {', '.join(missing)}: "
                       f"{(ast.get_source_segment(source, node) or '')[:100]}")
    return bad


def test_every_tensor_factory_in_the_package_names_device_and_dtype():
    bad = []
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 30, files          # the whole package, not an empty glob
    for path in files:
        bad += unnamed_factories(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not bad, "tensors made on the ambient default device or dtype:\n" + "\n".join(bad)


def test_the_check_finds_what_it_looks_for():
    """The checker itself: each kind of call that relies on an ambient default is found; named ones pass."""
    src = "\n".join([
        "import torch",
        "a = torch.zeros(3, dtype=torch.int32)",                              # no device
        "b = torch.arange(4, device=d)",                                      # no dtype
        "c = torch.tensor([1, 2])",                                           # neither
        "e = torch.zeros(2, dtype=torch.uint8, device=d, pin_memory=True)",   # pinned, device not 'cpu'
        "f = torch.frombuffer(buf)",                                          # no dtype
        "from torch import empty",
        "ok1 = torch.zeros(3, dtype=torch.int32, device='cpu', pin_memory=cuda)",
        "ok2 = torch.empty_like(x)",
        "ok3 = torch.frombuffer(buf, dtype=torch.uint8)",
        "ok4 = torch.full((2,), -1, dtype=torch.int64, device=x.device)",
    ])
    found = unnamed_factories(src)
    assert sorted(int(b.split(":")[1]) for b in found) == [2, 3, 4, 5, 6, 7], found
