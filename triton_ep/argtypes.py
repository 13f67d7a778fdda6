"""The value types of the ``triton-ep`` command line (``python -m triton_ep``: ``info``, ``tune``) and of the
examples' options, in one place.

Each is an ``argparse`` ``type=``: it takes the option's text and returns its value, or raises
``argparse.ArgumentTypeError`` whose message names the allowed values and the text given; argparse then prints
``OPTION: MESSAGE`` and exits with status 2 (bad usage) before the command does any work. A list option
(:func:`positive_int_list`, :func:`name_list`) refuses a value given twice the same way (it is not folded).
"""
from __future__ import annotations

import argparse
from typing import Callable, Tuple

#: the bound of :func:`seconds`, exclusive, as its message writes it
_MAX_SECONDS_TEXT = "1e9"
MAX_SECONDS = float(_MAX_SECONDS_TEXT)


def int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse type: a decimal int ``>= lo``.

    Raises (the returned callable):
        argparse.ArgumentTypeError: not an int ("must be an int at least LO, got 'TEXT'"), or below ``lo``
            ("must be at least LO, got N").
    """
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int at least {lo}, got {text!r}") from None
        if n < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo}, got {n}")
        return n
    parse.__name__ = parse.__qualname__ = f"int_at_least_{lo}"
    return parse


#: counts of things (``--ranks``, ``--num-qps``, ...): an int >= 1
positive_int = int_at_least(1)
#: counts that may be zero (``--warmup``): an int >= 0
non_negative_int = int_at_least(0)


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an int in ``lo..hi``, decimal or ``0x`` hex (e.g. a traffic class, ``0..255``).

    Raises (the returned callable):
        argparse.ArgumentTypeError: "must be an integer in LO..HI, got ..." (the text where it is no int).
    """
    def parse(text: str) -> int:
        try:
            n = int(text, 0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer in {lo}..{hi}, got {text!r}") from None
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer in {lo}..{hi}, got {n}")
        return n
    parse.__name__ = parse.__qualname__ = f"int_in_{lo}_{hi}"
    return parse


def _each_once(values: tuple, what: str, text: str) -> tuple:
    """``values`` (a list option's items), when none repeats: a repeat would measure or show the same thing twice.

    Raises:
        argparse.ArgumentTypeError: "must be comma-separated WHAT, each once, got 'TEXT' (V twice)", naming the
            first value given more than once.
    """
    seen = set()
    for v in values:
        if v in seen:
            n = values.count(v)
            times = "twice" if n == 2 else f"{n} times"
            raise argparse.ArgumentTypeError(f"must be comma-separated {what}, each once, got {text!r} ({v} {times})")
        seen.add(v)
    return values


def positive_int_list(text: str) -> Tuple[int, ...]:
    """An argparse type: comma-separated ints ``>= 1``, each once (``--tokens 128,1024``), as a tuple in the order
    given.

    Raises:
        argparse.ArgumentTypeError: "must be comma-separated positive ints, got 'TEXT'", or a value repeated
            ("..., each once, got '8,8' (8 twice)"; ``8,08`` too: the same int).
    """
    try:
        out = tuple(int(t) for t in text.split(","))
    except ValueError:
        out = ()
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive ints, got {text!r}")
    return _each_once(out, "positive ints", text)


def seconds(text: str) -> float:
    """An argparse type: a duration in seconds, a float in ``(0, 1e9]`` (:data:`MAX_SECONDS`, as a Buffer's
    ``timeout_s``; ``nan`` and ``inf`` are not).

    Raises:
        argparse.ArgumentTypeError: "must be seconds in (0, 1e9], got 'TEXT'".
    """
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 < v <= MAX_SECONDS:     # (nan fails too)
        raise argparse.ArgumentTypeError(f"must be seconds in (0, {_MAX_SECONDS_TEXT}], got {text!r}")
    return v


def name_list(text: str) -> Tuple[str, ...]:
    """An argparse type: comma-separated non-empty names, each once (``--devices mlx5_0,mlx5_1``), as a tuple in the
    order given (spaces around a name dropped).

    Raises:
        argparse.ArgumentTypeError: "must be comma-separated non-empty names, got 'TEXT'" (``''``, ``','``, ``'a,,b'``),
            or a name repeated ("..., each once, got 'a,a' (a twice)").
    """
    out = tuple(t.strip() for t in text.split(","))
    if not all(out):
        raise argparse.ArgumentTypeError(f"must be comma-separated non-empty names, got {text!r}")
    return _each_once(out, "non-empty names", text)


__all__ = ["MAX_SECONDS", "int_at_least", "int_in", "name_list", "non_negative_int", "positive_int",
           "positive_int_list", "seconds"]
