"""The ``deep_ep`` import hook: an opt-in switch that lets a serving engine's ``import deep_ep`` find triton-ep.

vLLM looks for DeepEP with ``importlib.util.find_spec("deep_ep")`` and SGLang with ``from deep_ep import
Buffer, Config``; neither knows triton-ep. With ``TRITON_EP_AS_DEEP_EP=1`` in the environment, a meta-path
finder (PEP 451 ``importlib.abc.MetaPathFinder``) answers for the top-level name ``deep_ep`` with triton-ep's
DeepEP-shaped package (``triton_ep/_deep_ep``: ``Buffer``, ``Config``, ``EventOverlap``, ``topk_idx_t`` and
DeepEP's module paths ``deep_ep.buffer``, ``deep_ep.utils``, ``deep_ep.buffers.legacy``, ...). Submodules
``deep_ep.*`` are found through that package's ``__path__``. Nothing is written over a real DeepEP's files.

Who installs the finder: the ``triton_ep_deep_ep.pth`` file that ``pip install`` puts into site-packages with
triton-ep. Python's ``site`` runs it at every interpreter start; it only reads the variable and, when the switch
is on, loads this file by its path (it never imports torch or the ``triton_ep`` package: this module imports the
standard library only). Spawned workers (multiprocessing ``spawn``, Ray) inherit the environment and so the
switch. Without the ``.pth`` (a source checkout on ``PYTHONPATH``), call :func:`install` before the engine
imports ``deep_ep``.

The switch's values (``TRITON_EP_AS_DEEP_EP``):

- unset, ``""``, ``"0"``, ``"false"``, ``"no"``, ``"off"``: off; nothing changes.
- ``"1"`` (or ``"true"``, ``"yes"``, ``"on"``): ``deep_ep`` is triton-ep, also where a real DeepEP is
  installed; then a WARNING at the first ``import deep_ep`` names the DeepEP it shadows.
- ``"missing"``: triton-ep only where no other ``deep_ep`` imports: a real DeepEP that imports wins; one that is
  found but does not import (a source checkout whose ``deep_ep_cpp`` extension was never built, say) gives way to
  triton-ep, and a WARNING at the first ``import deep_ep`` names it and its import error.

Any other value is a ``ValueError`` naming the variable, raised by :func:`install` (the ``.pth`` prints it
and leaves the import system alone). ``triton-ep info`` shows the switch and which ``deep_ep`` is in use.
"""
from __future__ import annotations

import importlib.util
import os
import sys
# (no typing import: annotations stay strings under the __future__ import, and typing costs start-up time)

ENV = "TRITON_EP_AS_DEEP_EP"
#: The package directory that stands in for ``deep_ep`` (next to this file).
SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_deep_ep")
_OFF = ("", "0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")
MISSING = "missing"
#: Why this module imports so little (no ``logging``, ``dataclasses``, ``importlib.abc`` at import time): the
#: ``.pth`` loads it at every interpreter start while the switch is on, and those pull in ``inspect``,
#: ``pathlib`` and more (tens of milliseconds each on a loaded machine). A meta-path finder needs no base class:
#: an object with ``find_spec`` is one (PEP 451).


def parse_switch(value: Optional[str]) -> Optional[str]:
    """The mode a value of ``TRITON_EP_AS_DEEP_EP`` selects: ``None`` (off), ``"on"`` or ``"missing"``.

    Raises:
        ValueError: any other value, naming the variable and the values it takes.
    """
    v = (value or "").strip().lower()
    if v in _OFF:
        return None
    if v in _ON:
        return "on"
    if v == MISSING:
        return MISSING
    raise ValueError(f"{ENV}={value!r}: expected 1 / true / yes / on (deep_ep is triton-ep), 'missing' (triton-ep "
                     f"only where no DeepEP is installed) or 0 / false / no / off / empty / unset (off), in any case")


class HookState:
    """What the finder decided, for the log line and ``triton-ep info`` (a plain class, not a dataclass: see the
    note above).

    Attributes:
        mode: ``"on"`` or ``"missing"`` (see the module docstring).
        installed_by: ``"pth"`` (site-packages' ``.pth`` at start-up) or ``"install()"`` (a direct call).
        real_origin: where another ``deep_ep`` (a real DeepEP) is, as its spec says (a path), or ``None``;
            known once ``deep_ep`` was looked up.
        served: True once this finder answered for ``deep_ep`` (triton-ep is in use); False where it left it to
            a real DeepEP; None before any look-up.
        real_error: in mode ``"missing"``, why the real DeepEP found did not import (``"ModuleNotFoundError: No
            module named 'deep_ep_cpp'"``), so that triton-ep served ``deep_ep`` instead; ``None`` otherwise.
        announced: the first-use log line was written.
    """

    __slots__ = ("mode", "installed_by", "real_origin", "served", "real_error", "announced")

    def __init__(self, mode: str, installed_by: str) -> None:
        self.mode, self.installed_by = mode, installed_by
        self.real_origin: Optional[str] = None
        self.served: Optional[bool] = None
        self.real_error: Optional[str] = None
        self.announced = False

    def __repr__(self) -> str:
        return "HookState(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"


def _shim_spec():
    """The spec of triton-ep's ``_deep_ep`` package under the name ``deep_ep`` (its ``submodule_search_locations``
    is that directory, so ``deep_ep.buffers.legacy`` and the other submodules load from there)."""
    return importlib.util.spec_from_file_location("deep_ep", os.path.join(SHIM_DIR, "__init__.py"),
                                                  submodule_search_locations=[SHIM_DIR])


class FallbackLoader:
    """In mode ``"missing"``, the loader of a real DeepEP's spec: installed means importable. ``exec_module`` runs
    the real loader; where that raises (``deep_ep_cpp`` never built, an ABI mismatch...), what the failed import
    put in ``sys.modules`` (``deep_ep`` and its submodules) is removed, the reason is kept in
    :attr:`HookState.real_error`, and triton-ep's package is loaded as ``deep_ep`` instead (the import system
    returns what ``sys.modules["deep_ep"]`` holds after ``exec_module``: PEP 451). Other attributes are the real
    loader's."""

    def __init__(self, real, state: HookState) -> None:
        self.real, self.state = real, state

    def __getattr__(self, name):
        return getattr(self.real, name)

    def create_module(self, spec):
        make = getattr(self.real, "create_module", None)
        return make(spec) if make is not None else None

    def exec_module(self, module) -> None:
        try:
            self.real.exec_module(module)
            return
        except Exception as ex:     # noqa: BLE001 - any failure: that DeepEP is not importable
            self.state.real_error = f"{type(ex).__name__}: {ex}"
        for name in [n for n in sys.modules if n == "deep_ep" or n.startswith("deep_ep.")]:
            del sys.modules[name]
        self.state.served = True
        spec = _shim_spec()
        shim = importlib.util.module_from_spec(spec)
        sys.modules["deep_ep"] = shim
        try:
            spec.loader.exec_module(shim)
        except BaseException:
            sys.modules.pop("deep_ep", None)
            raise


class DeepEPFinder:
    """The meta-path finder for the top-level name ``deep_ep`` (PEP 451). Other names: ``None`` (not mine).

    ``find_spec("deep_ep")`` returns :func:`_shim_spec`, triton-ep's package, unless the mode is ``"missing"`` and
    another finder knows a ``deep_ep``: then that spec, loaded by a :class:`FallbackLoader` (triton-ep's package
    where the real one does not import).
    """

    #: marks the finder for :func:`current_finder` (this module may be loaded twice: by the ``.pth`` and as
    #: ``triton_ep.deep_ep_hook``)
    triton_ep_deep_ep = True

    def __init__(self, state: HookState) -> None:
        self.state = state

    def _real_spec(self):
        for finder in sys.meta_path:
            if getattr(finder, "triton_ep_deep_ep", False) or not hasattr(finder, "find_spec"):
                continue
            try:
                spec = finder.find_spec("deep_ep", None)
            except Exception:    # noqa: BLE001 - a broken third-party finder: treat as "not there"
                spec = None
            if spec is not None:
                return spec
        return None

    def find_spec(self, fullname, path=None, target=None):
        """PEP 451: a spec for ``deep_ep`` (see the class docstring), ``None`` for every other name."""
        if fullname != "deep_ep":
            return None
        real = self._real_spec()
        self.state.real_origin = None if real is None else (real.origin or str(list(real.submodule_search_locations
                                                                                    or [])))
        if self.state.mode == MISSING and real is not None:
            self.state.served = False
            if not isinstance(real.loader, FallbackLoader):
                real.loader = FallbackLoader(real.loader, self.state)
            return real
        self.state.served = True
        return _shim_spec()


def current_finder() -> Optional[DeepEPFinder]:
    """The installed ``deep_ep`` finder on ``sys.meta_path``, or ``None``."""
    for finder in sys.meta_path:
        if getattr(finder, "triton_ep_deep_ep", False):
            return finder
    return None


def install(value: Optional[str] = None, installed_by: str = "install()") -> Optional[DeepEPFinder]:
    """Install the ``deep_ep`` finder at the front of ``sys.meta_path`` when the switch is on (idempotent).

    Args:
        value: the switch's value; ``None`` reads ``TRITON_EP_AS_DEEP_EP``.
        installed_by: recorded in :class:`HookState` (``"pth"`` from the ``.pth`` file).

    Returns:
        The finder (the one already there if any), or ``None`` when the switch is off.

    Raises:
        ValueError: a bad value (see :func:`parse_switch`).
    """
    mode = parse_switch(os.environ.get(ENV) if value is None else value)
    if mode is None:
        return None
    finder = current_finder()
    if finder is None:
        finder = DeepEPFinder(HookState(mode, installed_by))
        sys.meta_path.insert(0, finder)
    return finder


def uninstall() -> None:
    """Remove the finder from ``sys.meta_path`` (an already imported ``deep_ep`` stays in ``sys.modules``)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "triton_ep_deep_ep", False)]


def announce(version: str) -> None:
    """Write the first-use log line (once): which ``deep_ep`` is in use, and the DeepEP it shadows if any.

    Called by triton-ep's ``deep_ep`` package when it is first imported. A shadowed DeepEP is a WARNING; the
    plain case is INFO on the ``triton_ep`` logger.
    """
    import logging
    log = logging.getLogger("triton_ep")
    finder = current_finder()
    state = finder.state if finder is not None else None
    if state is not None and state.announced:
        return
    how = f"{ENV}={os.environ.get(ENV, '')!r}" if state is not None else "imported directly"
    if state is not None:
        state.announced = True
        if state.real_error:
            log.warning("deep_ep is triton-ep %s (%s): the DeepEP at %s does not import (%s)", version, how,
                        state.real_origin, state.real_error)
            return
        if state.real_origin:
            log.warning("deep_ep is triton-ep %s (%s): the DeepEP at %s is shadowed; unset %s, or set it to "
                        "'missing', to use it", version, how, state.real_origin, ENV)
            return
    log.info("deep_ep is triton-ep %s (%s, from %s)", version, how, SHIM_DIR)


def describe(env=None) -> List[str]:
    """Lines for ``triton-ep info``: the switch, whether the finder is installed, and which ``deep_ep`` an
    ``import deep_ep`` in this process gets. Where that is a real DeepEP not imported yet (the switch off or
    ``"missing"``) it is imported, to tell whether it imports (installed means importable: with ``"missing"`` one
    that does not gives way to triton-ep); triton-ep's own ``deep_ep`` is looked up only."""
    env = os.environ if env is None else env
    raw = env.get(ENV)
    lines = [f"  switch     {ENV}={raw!r}" if raw is not None else f"  switch     {ENV} unset (off)"]
    try:
        mode = parse_switch(raw)
    except ValueError as ex:
        return lines + [f"  error      {ex}"]
    finder = current_finder()
    if finder is None:
        lines.append("  hook       not installed" + (
            ": the switch is on but no finder is on sys.meta_path (is triton-ep installed with pip, so that "
            "triton_ep_deep_ep.pth is in site-packages? else call triton_ep.deep_ep_hook.install())"
            if mode else ""))
    else:
        lines.append(f"  hook       installed by {finder.state.installed_by}, mode {finder.state.mode!r}")
    origin, error = _origin(), None
    if origin is not None and not _is_shim(origin) and "deep_ep" not in sys.modules and (
            finder is None or finder.state.mode == MISSING):
        if finder is not None:
            finder.state.announced = True       # (these lines say what its log line would)
        try:
            importlib.import_module("deep_ep")
        except Exception as ex:     # noqa: BLE001 - any failure: it does not import
            error = f"{type(ex).__name__}: {ex}"
        origin = _origin() if "deep_ep" in sys.modules else origin
    if origin is None:
        lines.append("  deep_ep    not found: `import deep_ep` fails here")
    elif _is_shim(origin):
        lines.append(f"  deep_ep    triton-ep ({SHIM_DIR})")
    else:
        lines.append(f"  deep_ep    a DeepEP at {origin}" + (f", which does not import ({error}): `import deep_ep` "
                                                               f"fails here" if error else ""))
    state = finder.state if finder is not None else None
    if state is not None and state.real_error:
        lines.append(f"  not used   the DeepEP at {state.real_origin}: it does not import ({state.real_error})")
    elif state is not None and state.real_origin and state.served:
        lines.append(f"  shadowed   the DeepEP at {state.real_origin}")
    return lines


def _is_shim(origin: str) -> bool:
    return os.path.dirname(os.path.abspath(origin)) == SHIM_DIR


def _origin() -> Optional[str]:
    """The file of the ``deep_ep`` imported, else of the one a look-up finds (``None``: none)."""
    loaded = sys.modules.get("deep_ep")
    if loaded is not None:
        return getattr(loaded, "__file__", None)
    try:
        spec = importlib.util.find_spec("deep_ep")
    except (ImportError, ValueError):
        spec = None
    return None if spec is None else spec.origin
