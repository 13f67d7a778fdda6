"""Call cards: what each rank says it called, so a disagreement between ranks names its field and values.

Ranks compare their calls on the device through 64-bit signature digests (a mismatch moves nothing and
records ``E_MISMATCH``). A digest says *that* ranks disagree, not *where*. So every collective call also
writes a small card into this rank's slot of the host control block, which every rank of the host maps:

    [ serial | code | value 0 | value 1 | ... | modes | failed | worst 0 | worst 1 ]   int64 words, CARD_WORDS per rank

``serial`` counts this Buffer's collective calls (equal on ranks in step), ``code`` names the operation
(:data:`FIELDS`), the values are the fields that operation's signature covers, in :data:`FIELDS` order.
When a mismatch is raised, :func:`describe` compares this rank's card with the peer's: "hidden: rank 0
passed 256, rank 1 passed 128". Only fields of the operation the ranks called appear.

The last four words are not part of the comparison. ``modes`` says which of this rank's latest calls were
low-latency ones (bit ``serial % MODE_WINDOW``, set when the call is counted): a rank that starts a call of one mode
(normal or low-latency) reads it in every peer's card that has reached the same call (:func:`other_mode`), since the
two modes wait on different words and would otherwise wait for each other until ``timeout_s``. ``failed`` holds the serial of the last call this rank
gave up before it launched anything, or :data:`LEFT` once it left the group (its peers stop waiting for its
card). ``worst 0/1`` carry each rank's ``num_worst_tokens`` of its latest two dispatches with it
(``serial << 32 | value``, in slot ``k & 1`` for the group's ``k``-th such dispatch since the last
re-synchronisation): ranks may pass different values, and each reads every rank's before it sizes the call's
rounds (:func:`publish_worst`, :func:`worst_of`). Serials only grow, so a stale word never matches a later call.
"""
from __future__ import annotations

import zlib
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch

#: int64 words of one rank's card
CARD_WORDS = 17

# card codes (one per operation as callers see it); also the first word of each call's signature digest
DISPATCH, CACHED_DISPATCH, COMBINE, DISPATCH_WORST = 1, 2, 3, 5
LL_DISPATCH, LL_COMBINE = 11, 12
#: ``ElasticBuffer.barrier()``: a dispatch of no tokens that meets every rank, named as the caller's call (a rank
#: whose peer made another call there is told "rank 0 called barrier, rank 1 called dispatch", not the fields of
#: that dispatch of no tokens)
BARRIER = 4

#: a new dispatch's fields (a plain one, one with ``num_worst_tokens``, a barrier's): name, kind
_DISPATCH_FIELDS = (("x dtype", "dtype"), ("hidden", "int"), ("scales dtype", "dtype"), ("scale columns", "int"),
                    ("top-k (topk_idx columns)", "int"), ("topk_weights given", "bool"), ("num_experts", "int"))
#: by card code: the operation's name and its fields (name, kind); kind "dtype" values are dtype codes
FIELDS: Dict[int, Tuple[str, Tuple[Tuple[str, str], ...]]] = {
    DISPATCH: ("dispatch", _DISPATCH_FIELDS),
    DISPATCH_WORST: ("dispatch with num_worst_tokens", _DISPATCH_FIELDS),
    BARRIER: ("barrier", _DISPATCH_FIELDS),
    CACHED_DISPATCH: ("cached dispatch", (("x dtype", "dtype"), ("hidden", "int"), ("scales dtype", "dtype"),
                                          ("scale columns", "int"), ("handle's dispatch number", "int"))),
    COMBINE: ("combine", (("hidden", "int"), ("topk_weights columns", "int"),
                          ("handle's dispatch number", "int"))),
    LL_DISPATCH: ("low_latency_dispatch", (("num_max_dispatch_tokens_per_rank", "int"), ("hidden", "int"),
                                           ("num_experts", "int"), ("top-k (topk_idx columns)", "int"),
                                           ("use_fp8", "bool"), ("use_ue8m0", "bool"))),
    LL_COMBINE: ("low_latency_combine", (("num_max_dispatch_tokens_per_rank", "int"), ("hidden", "int"),
                                         ("num_experts", "int"), ("top-k (topk_idx columns)", "int"),
                                         ("use_logfmt", "bool"))),
}
#: the word saying which of this rank's latest calls were low-latency calls (bit ``serial % MODE_WINDOW``)
MODES_WORD = CARD_WORDS - 4
#: calls the ``modes`` word covers: a peer at most this many calls ahead still says what its call ``serial`` was
MODE_WINDOW = 62
#: the word holding the serial of a call this rank gave up before launching anything
FAILED_WORD = CARD_WORDS - 3
#: the two words carrying ``num_worst_tokens`` (slot ``k & 1`` for the ``k``-th dispatch with it)
WORST_WORDS = (CARD_WORDS - 2, CARD_WORDS - 1)
assert all(2 + len(f) <= MODES_WORD for _, f in FIELDS.values())
#: the operations of low-latency mode (every other code is a normal-mode call's)
LOW_LATENCY = frozenset((LL_DISPATCH, LL_COMBINE))


def dtype_code(dtype: Optional[torch.dtype]) -> int:
    """The int a card (and a call signature) carries for a dtype, the same on every rank; 0 for ``None``."""
    code = _CODES.get(dtype)
    if code is None:
        code = _CODES[dtype] = zlib.crc32(str(dtype).encode()) if dtype is not None else 0
    return code


#: dtype -> its code, worked out once (a call asks for one or two per call)
_CODES: dict = {}


_DTYPE_NAMES = {dtype_code(d): str(d).replace("torch.", "") for d in vars(torch).values()
                if isinstance(d, torch.dtype)}


def write(card: np.ndarray, serial: int, code: int, values: Sequence[int]) -> None:
    """Publish this rank's call: ``card`` is its int64 view (``Comm.card(rank)``)."""
    card[2:2 + len(values)] = values
    card[1] = code
    card[0] = serial


def count(card: np.ndarray, serial: int, low_latency: bool) -> None:
    """Record the mode of this rank's call ``serial`` (counted, its card not written yet) in its ``modes`` word:
    a peer reads it once this rank's card names that call or a later one (:func:`other_mode`)."""
    bit = 1 << (serial % MODE_WINDOW)
    m = int(card[MODES_WORD])
    card[MODES_WORD] = (m | bit) if low_latency else (m & ~bit)


def other_mode(theirs: np.ndarray, serial: int, low_latency: bool) -> Optional[bool]:
    """Whether the peer whose card is ``theirs`` made its call ``serial`` in the other mode than this rank
    (``low_latency``: this rank's call is a low-latency one): ``None`` when its card cannot tell (it has not
    published that call yet, or it is so far ahead that the ``modes`` word no longer covers that call)."""
    t = int(theirs[0])          # (the serial first: the modes word read after it covers that call)
    # (a peer may have counted one call past its card, a call it refused: that call's bit is the latest)
    if t < serial or t + 1 - serial >= MODE_WINDOW:
        return None
    return bool((int(theirs[MODES_WORD]) >> (serial % MODE_WINDOW)) & 1) != bool(low_latency)


def mode_phrase(theirs: np.ndarray, serial: int) -> str:
    """What the peer whose card is ``theirs`` called at call ``serial``, as :func:`describe` names operations:
    the operation's name where its card is at that call, else its mode."""
    if int(theirs[0]) == serial and int(theirs[1]) in FIELDS:
        return FIELDS[int(theirs[1])][0]
    if (int(theirs[MODES_WORD]) >> (serial % MODE_WINDOW)) & 1:
        return "a low-latency operation (low_latency_dispatch or low_latency_combine)"
    return "a normal-mode operation (dispatch or combine)"


def publish_worst(card: np.ndarray, k: int, serial: int, value: int) -> None:
    """Publish this rank's ``num_worst_tokens`` ``value`` (``< 2**31``) of call ``serial``, the group's ``k``-th
    dispatch with it since the last re-synchronisation."""
    card[WORST_WORDS[k & 1]] = (int(serial) << 32) | int(value)


def worst_of(card: np.ndarray, k: int, serial: int) -> Optional[int]:
    """A rank's ``num_worst_tokens`` of call ``serial`` (the ``k``-th dispatch with it), ``None`` until it is
    published."""
    v = int(card[WORST_WORDS[k & 1]])
    return v & 0xFFFFFFFF if v >> 32 == serial else None


#: the ``failed`` word of a rank that left the group (it takes no later call)
LEFT = -1


def mark_failed(card: np.ndarray, serial: int) -> None:
    """Say that this rank gave up call ``serial`` before launching anything (:data:`LEFT`: every later call:
    it left the group). A rank that left stays marked."""
    if int(card[FAILED_WORD]) != LEFT:
        card[FAILED_WORD] = serial


def _show(kind: str, v: int) -> str:
    if kind == "dtype":
        return "none" if v == 0 else _DTYPE_NAMES.get(v, f"dtype #{v}")
    if kind == "bool":
        return str(bool(v))
    return str(v)


def describe(mine: np.ndarray, theirs: np.ndarray, me: int, peer: int) -> Optional[str]:
    """What differs between this rank's card and the peer's, e.g. ``"hidden: rank 0 passed 256, rank 1
    passed 128"``; ``None`` when the cards cannot tell (the peer has not called yet, or they agree)."""
    mine, theirs = [int(v) for v in mine], [int(v) for v in theirs]
    if theirs[1] not in FIELDS or mine[1] not in FIELDS:
        return None
    if theirs[1] != mine[1]:
        return (f"the operation: rank {me} called {FIELDS[mine[1]][0]}, rank {peer} called "
                f"{FIELDS[theirs[1]][0]}")
    name, fields = FIELDS[mine[1]]
    diffs = [f"{n}: rank {me} passed {_show(k, a)}, rank {peer} passed {_show(k, b)}"
             for (n, k), a, b in zip(fields, mine[2:], theirs[2:]) if a != b]
    if not diffs:
        return None
    later = "" if theirs[0] == mine[0] else f" (rank {peer}'s latest call; it is at call {theirs[0]}, this rank at {mine[0]})"
    return f"{name}: " + "; ".join(diffs) + later
