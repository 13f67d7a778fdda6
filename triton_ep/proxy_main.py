"""Entry of the RDMA proxy process (``TRITON_EP_PROXY=process``), run by path by
:class:`triton_ep.proxy_process.ProcessScheduler`: ``python .../triton_ep/proxy_main.py FD PARENT_PID``.

It imports neither torch nor Triton, so it does not go through ``triton_ep/__init__.py`` (which imports both):
``triton_ep`` is registered as a bare namespace over the package's folder, so ``import triton_ep.x`` loads only
``x`` and the modules it names. The protocol's one table (:mod:`triton_ep.protocol.signal_header`) writes its
words as ``tl.constexpr`` and its formulas under ``triton.jit``; this process gets a stand-in ``triton`` that
holds only those two (a constexpr is an int; a formula keeps its ``.host``), and ``torch`` is blocked (an import
of it fails), so a module that starts needing either fails loudly here instead of slowing the start-up.
Run by path, never with ``-m triton_ep...`` (that runs the package's ``__init__`` first); the folder of this
file (the package's) is dropped from ``sys.path`` (its modules' names would shadow others). It sits beside
:mod:`triton_ep.proxy_process`, in the scheduler's layer (docs/design.md, section 2).
"""
import os
import signal
import sys
import types


class constexpr(int):  # noqa: N801  (named as Triton's)
    """Stand-in for ``triton.language.constexpr`` in the proxy process: an int with Triton's ``.value``."""

    @property
    def value(self) -> int:
        """The int itself (as ``tl.constexpr(...).value``)."""
        return int(self)


class _Jit:
    """Stand-in for a ``triton.jit`` function: host code only calls its ``.host`` (set by ``formula``)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.fn.__name__} is a Triton kernel function: the proxy process has no Triton")


def install_stand_ins(pkg_dir: str) -> None:
    """Register the bare ``triton_ep`` namespace over ``pkg_dir``, the stand-in ``triton`` and a blocked
    ``torch`` in ``sys.modules``."""
    pkg = types.ModuleType("triton_ep", "triton-ep (the RDMA proxy process's bare namespace: no __init__)")
    pkg.__path__ = [pkg_dir]
    pkg.__file__ = os.path.join(pkg_dir, "__init__.py")
    sys.modules["triton_ep"] = pkg
    tl = types.ModuleType("triton.language", "stand-in: constexpr only (the RDMA proxy process)")
    tl.constexpr = constexpr
    tr = types.ModuleType("triton", "stand-in: jit and language.constexpr only (the RDMA proxy process)")
    tr.jit, tr.language = _Jit, tl
    sys.modules["triton"], sys.modules["triton.language"] = tr, tl
    sys.modules["torch"] = None     # (import torch raises ImportError)


def main() -> int:
    """Ignore SIGINT (the rank's process decides when the proxy ends), set the imports up, serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pkg_dir = os.path.dirname(os.path.abspath(__file__))       # (this file sits in the package's folder)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != pkg_dir]
    sys.path.insert(0, os.path.dirname(pkg_dir))
    install_stand_ins(pkg_dir)
    from triton_ep.proxy_process import serve
    return serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)


if __name__ == "__main__":
    sys.exit(main())
