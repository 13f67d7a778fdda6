"""The tuned table: the Configs ``python -m triton_ep tune`` found fastest, in a JSON file the library reads.

Where it lives: ``$TRITON_EP_TUNING_FILE`` when set, else ``$XDG_CACHE_HOME/triton_ep/tuning.json`` (``XDG_CACHE_HOME``
defaulting to ``~/.cache``). The file names the GPU it was measured on (``torch.cuda.get_device_name()``, or
``"cpu"`` for interpreted kernels), the Triton version and the triton-ep version; :func:`load` checks all three
against this process and on a mismatch warns (``UserWarning``) and returns ``None``, so that
``Buffer.get_dispatch_config`` / ``get_combine_config`` fall back to the built-in tables. A file that is absent
gives ``None`` silently; one that cannot be used warns the same way, once per file version: not a regular file
(symlinks followed; a FIFO or device is never read), larger than :data:`MAX_TABLE_BYTES`, unreachable (a symlink
loop), not a table, or with an entry a call could not use (a Config its constructor or the calls refuse).

Format (``"format": "triton-ep tuning table"``, ``"version": 1``): ``gpu``, ``triton``, ``triton_ep``, ``created``
(UTC, ISO 8601), ``command`` (the last tuner run's arguments), and ``entries``: one per measured call and shape, each
``{"call": "dispatch" or "combine", "num_ranks", "hidden", "num_tokens", "num_experts", "num_topk",
"config": {Config.fields()}, "time_us", "builtin_time_us", "builtin_runs_us", "candidates": [{"config", "time_us"},
...]}`` (``time_us``: the best Config's median, slowest rank; ``builtin_time_us``: the same call without a Config,
the built-in tables, timed in the same run before the candidates and again after them, the faster of the two;
``builtin_runs_us``: both, where the tuner wrote them).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ._version import __version__
from .config import Config

#: the environment variable naming the file, and the file's format name and version
ENV_FILE = "TRITON_EP_TUNING_FILE"
FORMAT, VERSION = "triton-ep tuning table", 1
#: the calls a table has entries for
CALLS = ("dispatch", "combine")


def default_path() -> str:
    """``$TRITON_EP_TUNING_FILE``, else ``$XDG_CACHE_HOME/triton_ep/tuning.json`` (``~/.cache`` without it)."""
    env = os.environ.get(ENV_FILE, "").strip()
    if env:
        return os.path.expanduser(env)
    cache = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "triton_ep", "tuning.json")


def path_source() -> str:
    """Where :func:`default_path` took the path from, for a message: ``"$TRITON_EP_TUNING_FILE"`` or
    ``"the default location"`` (the variable unset or blank)."""
    return f"${ENV_FILE}" if os.environ.get(ENV_FILE, "").strip() else "the default location"


def identity() -> dict:
    """This process's ``{"gpu", "triton", "triton_ep"}``: what a table must name to be used here."""
    import triton
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "triton": triton.__version__, "triton_ep": __version__}


@dataclass(frozen=True)
class Entry:
    """One tuned call and shape: ``call`` (``"dispatch"`` or ``"combine"``), ``num_ranks``, ``hidden``,
    ``num_tokens`` and the fastest ``config``."""
    call: str
    num_ranks: int
    hidden: int
    num_tokens: int
    config: Optional[Config]     # None: the built-in tables stay (no candidate was faster)


@dataclass(frozen=True)
class Table:
    """A loaded tuned table: its ``path`` and its :class:`Entry` list."""
    path: str
    entries: Tuple[Entry, ...]

    def config(self, call: str, num_ranks: int, hidden: Optional[int] = None,
               num_tokens: Optional[int] = None) -> Optional[Config]:
        """The tuned Config of ``call`` for ``num_ranks`` ranks (exactly), or ``None``: of the entries for that
        group size, those of ``hidden`` when given and some have it, then the one nearest ``num_tokens`` (in
        ratio) when given, else the one of the most tokens (normal mode's prefill shapes)."""
        es = [e for e in self.entries if e.call == call and e.num_ranks == num_ranks]
        if hidden is not None and any(e.hidden == hidden for e in es):
            es = [e for e in es if e.hidden == hidden]
        if not es:
            return None
        if num_tokens is not None:
            t = max(int(num_tokens), 1)
            best = min(es, key=lambda e: (max(e.num_tokens, 1) / t if e.num_tokens >= t else t / max(e.num_tokens, 1),
                                          -e.num_tokens))
        else:
            best = max(es, key=lambda e: e.num_tokens)
        return best.config


#: the fields of an entry's ``config`` (:meth:`Config.fields`: DeepEP's five and ``num_warps``), every one named
CONFIG_FIELDS = tuple(Config().fields())

#: the most bytes :func:`load` reads of a table (a tuned table of every shape takes well under 1 MiB); a larger file
#: is not used (a warning)
MAX_TABLE_BYTES = 16 << 20

_CACHE: dict = {}


#: what applies instead of a table that is not used, as its warning (and ``triton-ep info``) says, where ``tune``
#: may replace the file as it is (a table of another GPU or version, or with a bad entry): :func:`fallback`
_AGAIN = "the built-in tables apply (run `{tune}` again)"
FALLBACK = _AGAIN.format(tune="python -m triton_ep tune")


def fallback(path: str) -> str:
    """What applies instead of the table at ``path`` that is not used, and what makes one usable there, by the
    checks ``tune`` makes before it writes (:func:`check_target`): :data:`FALLBACK` where ``tune`` replaces the file
    as it is; the ``--force`` it needs where the file is no tuned table; where ``tune`` refuses the path even with
    ``--force`` (a FIFO, a directory, a symbolic link, a file it cannot write), its reason and the way out.
    (``--output path`` is named where ``path`` is not :func:`default_path`.)"""
    tune = "python -m triton_ep tune" + ("" if path == default_path() else f" --output {path}")
    try:
        real = check_target(path, force=True)
    except ValueError as e:
        return (f"the built-in tables apply (`{tune}` refuses this path too: {e}; set {ENV_FILE} to a path it "
                f"writes, a file that is absent or a tuned table, then run it)")
    if not os.path.lexists(real) or _is_table(real) is None:
        return _AGAIN.format(tune=tune)
    return (f"the built-in tables apply (`{tune}` replaces a file that is no tuned table only with --force: "
            f"run `{tune} --force`, or remove the file)")


def _mismatch(path: str, why: str) -> None:
    warnings.warn(f"triton-ep: not using the tuned table {path}: {why}; {fallback(path)}", stacklevel=3)


def _kind(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``) is, for a message: ``"a FIFO"``, ``"a directory"``..."""
    return next((k for test, k in _KINDS if test(mode)), "not a regular file")


def _readable(st: os.stat_result) -> None:
    """``ValueError`` unless ``st`` is a regular file of at most :data:`MAX_TABLE_BYTES`."""
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"it is {_kind(st.st_mode)}, not a regular file")
    if st.st_size > MAX_TABLE_BYTES:
        raise ValueError(f"it is {st.st_size} bytes, more than the {MAX_TABLE_BYTES} a table may take")


def read_doc(path: str, st: Optional[os.stat_result] = None) -> object:
    """The JSON document of the table file at ``path``, read safely: only a regular file (symlinks followed) of at
    most :data:`MAX_TABLE_BYTES`, checked before it is opened and again through its descriptor (it is opened without
    blocking, so a FIFO put there in the meantime is refused too, never waited on); at most that many bytes are
    read. ``st``: ``os.stat(path)`` where the caller has it.

    Raises:
        OSError: the file cannot be reached or read (``FileNotFoundError`` where it is absent, ``ELOOP`` for a
            symlink loop...).
        ValueError: it is not a regular file, is larger than :data:`MAX_TABLE_BYTES`, or is not JSON (the message
            says which).
    """
    _readable(os.stat(path) if st is None else st)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    with open(fd, "rb") as f:
        _readable(os.fstat(f.fileno()))
        data = f.read(MAX_TABLE_BYTES + 1)      # (a file that grew since, or a /proc file of size 0: bounded too)
    if len(data) > MAX_TABLE_BYTES:
        raise ValueError(f"it holds more than the {MAX_TABLE_BYTES} bytes a table may take")
    return json.loads(data)


def check_doc(doc) -> Tuple[Optional[str], Tuple["Entry", ...]]:
    """Check a table's document ``doc`` (:func:`read_doc`'s) against this process: ``(why, entries)``, ``why`` the
    :func:`identity` fields it names otherwise (``None`` where they match), ``entries`` its checked entries (``()``
    where ``why`` is set).

    Raises:
        ValueError: not a table of this format and version, or an entry that a call could not use (:func:`_entry`;
            the message names the entry by its index).
    """
    if (not isinstance(doc, dict) or doc.get("format") != FORMAT or type(doc.get("version")) is not int
            or doc["version"] != VERSION):      # (True and 1.0 equal 1: the version is the integer itself)
        raise ValueError(f"not a {FORMAT!r} of version {VERSION}")
    here = identity()
    diff = [f"{k} {doc.get(k)!r} (here {v!r})" for k, v in here.items() if doc.get(k) != v]
    if diff:
        return "it was measured for another " + ", ".join(diff), ()
    if not isinstance(doc.get("entries"), list):
        raise ValueError(f"its entries are not a list, got {type(doc.get('entries')).__name__}")
    entries, seen = [], {}
    for i, e in enumerate(doc["entries"]):
        try:
            entries.append(_entry(e))
        except KeyError as ex:
            raise ValueError(f"entry {i} has no {ex.args[0]!r}") from None
        except (ValueError, TypeError) as ex:
            raise ValueError(f"entry {i}: {ex}") from None
        x = entries[-1]
        shape = (x.call, x.num_ranks, x.hidden, x.num_tokens)
        if shape in seen:           # (tune writes one entry per shape: which one would hold is not for us to guess)
            raise ValueError(f"entries {seen[shape]} and {i} are both for {x.call} at num_ranks {x.num_ranks}, "
                             f"hidden {x.hidden}, num_tokens {x.num_tokens}")
        seen[shape] = i
    return None, tuple(entries)


@dataclass(frozen=True)
class Verdict:
    """What :func:`examine` found at a table's ``path``: whether something is there (``exists``; a symlink loop or a
    FIFO counts, a dangling symlink does not), the :class:`Table` :func:`load` would use here (``table``; ``None``
    otherwise) and, for a file that is there but would not be used, the reason (``why``, :func:`load`'s warning's)."""
    path: str
    exists: bool
    table: Optional[Table]
    why: Optional[str]


def _stat(path: str) -> Tuple[Optional[os.stat_result], Optional[str]]:
    """``(os.stat(path), None)``; ``(None, None)`` where nothing is there; ``(None, why)`` where it cannot be
    reached (a symlink loop, no permission)."""
    try:
        return os.stat(path), None
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"it cannot be reached ({type(e).__name__}: {e.strerror or e})"


def _judge(path: str, st: os.stat_result) -> Tuple[Optional[Table], Optional[str]]:
    """The file at ``path`` (``st``: its ``os.stat``) as this process would use it: ``(table, None)``, or
    ``(None, why)`` (:func:`read_doc`'s and :func:`check_doc`'s checks)."""
    try:
        why, entries = check_doc(read_doc(path, st))
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:    # (RecursionError: JSON nested deep)
        return None, f"it cannot be read ({type(e).__name__}: {e})"
    return (None, why) if why else (Table(path, entries), None)


def examine(path: Optional[str] = None) -> Verdict:
    """What :func:`load` would make of the table at ``path`` (default :func:`default_path`), by its checks, without
    a warning and without its cache (``triton-ep info`` reports it): nothing is opened that could block (a FIFO) and
    at most :data:`MAX_TABLE_BYTES` are read."""
    path = default_path() if path is None else path
    st, why = _stat(path)
    table, why = (None, why) if st is None else _judge(path, st)
    return Verdict(path, st is not None or why is not None, table, why)


def load(path: Optional[str] = None) -> Optional[Table]:
    """The tuned table at ``path`` (default :func:`default_path`), or ``None``: absent (silently), or unusable here,
    with one ``UserWarning`` per file version naming the reason: another GPU, Triton or triton-ep version; not a
    regular file (a FIFO, device, directory...: never opened in a way that could block), larger than
    :data:`MAX_TABLE_BYTES`, unreachable (a symlink loop, no permission), not a table, or an entry a call could not
    use (:func:`_entry`'s checks: the Config constructor's and the calls' ``num_sms`` minimum). Read again only when
    the file changes (its modification time and size)."""
    path = default_path() if path is None else path
    st, why = _stat(path)
    if st is None and why is None:
        return None
    key = (path, why) if st is None else (path, st.st_mtime_ns, st.st_size, st.st_mode)
    if key in _CACHE:
        return _CACHE[key]
    table, why = (None, why) if st is None else _judge(path, st)
    if why:
        _mismatch(path, why)
    _CACHE.clear()
    _CACHE[key] = table
    return table


def _shape(e: dict) -> tuple:
    """An entry's call and shape: ``(call, num_ranks, hidden, num_tokens)`` (what a table holds one entry of)."""
    return e["call"], e["num_ranks"], e["hidden"], e["num_tokens"]


def kept_entries(path: str, entries: List[dict]) -> Tuple[List[dict], Optional[str]]:
    """What ``tune`` keeps of the table already at ``path`` when it saves ``entries`` there: ``(kept, why)``. Where
    that table is one :func:`load` would use here (a regular file of this GPU, Triton and triton-ep version, every
    entry valid), ``kept`` is its entries of other calls and shapes (``(call, num_ranks, hidden, num_tokens)``) than
    ``entries``', as they are, and ``why`` ``None``. Otherwise ``kept`` is empty: ``why`` is ``None`` where there is
    no file, else the reason the file is replaced whole (another GPU, a file that does not parse...)."""
    try:
        doc = read_doc(path)
        why, _ = check_doc(doc)
    except FileNotFoundError:
        return [], None
    except (OSError, ValueError, RecursionError) as e:
        return [], f"it cannot be read ({type(e).__name__}: {e})"
    if why:
        return [], why
    new = {_shape(e) for e in entries}
    return [e for e in doc["entries"] if _shape(e) not in new], None


def _count(e: dict, name: str) -> int:
    """Entry ``e``'s ``name``: an int of at least 1 (``ValueError`` otherwise)."""
    v = e[name]
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be an int of at least 1, got {v!r}")
    return v


def _entry(e: dict) -> Entry:
    """One entry of a table's document as the library would use it: its ``call`` one of :data:`CALLS`, its counts
    ints of at least 1, its ``config`` null or one the Config constructor takes and whose ``num_sms`` every normal
    mode's calls take (:func:`triton_ep.runtime.checks.check_config_num_sms`).

    Raises:
        ValueError, KeyError, TypeError: naming what is wrong.
    """
    from .runtime.checks import check_config_num_sms
    if not isinstance(e, dict):
        raise TypeError(f"an entry must be a JSON object, got {type(e).__name__}")
    if e["call"] not in CALLS:
        raise ValueError(f"entry call {e['call']!r} is not one of {CALLS}")
    config = None               # (null: no candidate beat the built-in tables, which stay)
    if e["config"] is not None:
        if not isinstance(e["config"], dict) or set(e["config"]) != set(CONFIG_FIELDS):
            raise ValueError(f"its config must name exactly {', '.join(CONFIG_FIELDS)} (what tune writes), got "
                             f"{sorted(e['config']) if isinstance(e['config'], dict) else type(e['config']).__name__}")
        c = dict(e["config"])
        warps = c.pop("num_warps", None)
        config = Config(**c, num_warps=warps)
        check_config_num_sms(config)
    return Entry(e["call"], _count(e, "num_ranks"), _count(e, "hidden"), _count(e, "num_tokens"), config)


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def _file_system(path: str) -> Optional[str]:
    """The type of the file system ``path`` lies on (``"proc"``, ``"sysfs"``, ``"ext4"``...), from
    ``/proc/self/mounts`` (the mount point that is the longest prefix of ``path``); ``None`` where it is unknown."""
    best, kind = "", None
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        return None
    return kind


def _is_table(path: str) -> Optional[str]:
    """``None`` where the file at ``path`` is a triton-ep tuned table (:func:`read_doc` reads it and its ``format`` is
    ours, of any version, GPU, Triton or triton-ep version: :func:`save` may replace those), else what it is
    instead, for a message."""
    try:
        doc = read_doc(path)
    except (OSError, ValueError, RecursionError) as e:
        return f"{type(e).__name__}: {e}"
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return f"its JSON has no \"format\": {FORMAT!r}"
    return None


def check_target(path: str, create_dir: bool = False, force: bool = False) -> str:
    """Check that :func:`save` may write the table to ``path``, before any measuring: the path is not empty; it is not
    a symbolic link (never followed, dangling or not: a link put in a shared directory such as ``/tmp`` would send
    the table elsewhere; the directories above it may be links); where it exists it is a regular file, never a
    device, FIFO, socket or directory (a file renamed over ``/dev/null`` would replace the device for the whole
    machine), that may be written (opened for writing, which changes nothing, and not read-only by its mode: root
    may open a read-only file, or ``/proc/version``, for writing, but a table should not replace it) and, unless
    ``force``, a triton-ep tuned table (:func:`_is_table`: of our format, for any GPU or version; a source file
    named by a typo is never replaced); its directory exists (made first with ``create_dir``, the default cache
    location's case; never for a path the user named) and takes a new file (one is created and removed there, so
    ``/proc``, ``/sys`` and read-only mounts are refused too).

    Returns:
        The file to write: ``path`` with ``~`` expanded (no link resolved).
    Raises:
        ValueError: the reason, naming the path and, where the system refused something, its reason
            (e.g. ``Permission denied``, ``Read-only file system``).
    """
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"the table's file must be a non-empty path, got {path!r}")
    real = os.path.expanduser(path)
    shown = path if real == path else f"{path} ({real})"
    try:
        mode = os.lstat(real).st_mode
    except (FileNotFoundError, NotADirectoryError):
        mode = None
    except OSError as e:
        raise ValueError(f"{shown} cannot be checked ({e.strerror or e})") from None
    if mode is not None and stat.S_ISLNK(mode):
        try:
            to = f" (to {os.readlink(real)})"
        except OSError:
            to = ""
        raise ValueError(f"{shown} is a symbolic link{to}; tune never writes through one (a link in a shared "
                         f"directory could send the table anywhere): name the file itself")
    if mode is not None and not stat.S_ISREG(mode):
        raise ValueError(f"{shown} is {_kind(mode)}, not a regular file; name the table's file (a .json path)")
    if mode is not None:
        try:
            os.close(os.open(real, os.O_WRONLY | os.O_NOCTTY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)))
        except OSError as e:        # (no O_TRUNC: nothing changes)
            raise ValueError(f"{shown} cannot be written ({e.strerror or e})") from None
        if not mode & 0o222:
            raise ValueError(f"{shown} cannot be written (read-only: mode {stat.S_IMODE(mode):04o}); make it "
                             f"writable or name another file")
        what = None if force else _is_table(real)
        if what is not None:
            raise ValueError(f"{shown} exists and is not a triton-ep tuned table ({what}); the table would replace it "
                             f"whole: name another file, or pass --force to replace it")
    parent = os.path.dirname(real) or "."
    if create_dir:
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise ValueError(f"{shown}: its directory {parent} cannot be made ({e.strerror or e})") from None
    try:
        parent_mode = os.stat(parent).st_mode
    except FileNotFoundError as e:
        raise ValueError(f"{shown}: its directory {parent} does not exist ({e.strerror}; it is not made for "
                         f"you)") from None
    except OSError as e:
        raise ValueError(f"{shown}: its directory {parent} cannot be reached ({e.strerror or e})") from None
    if not stat.S_ISDIR(parent_mode):
        raise ValueError(f"{shown}: its directory {parent} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(real)}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        fs = _file_system(os.path.abspath(parent))
        on = f" (a {fs} file system)" if fs else ""
        raise ValueError(f"{shown}: its directory {parent}{on} takes no new file ({e.strerror or e})") from None
    return real


#: the longest :func:`save` waits for another process's save to the same file (its lock), seconds; a save takes
#: milliseconds
LOCK_TIMEOUT_S = 30.0


def lock_path(path: str) -> str:
    """The lock file :func:`save` takes beside the table at ``path``: ``.NAME.lock`` in its directory (left there:
    removing it would let two savers lock two different files)."""
    d, name = os.path.split(path)
    return os.path.join(d, f".{name}.lock")


@contextlib.contextmanager
def locked(path: str, timeout_s: float = LOCK_TIMEOUT_S):
    """Hold an exclusive ``flock`` on :func:`lock_path` of ``path`` for the ``with`` block (released when its
    descriptor is closed, on every way out, and by the system if the process dies). The lock file is opened without
    following a symlink and must be a regular file.

    Raises:
        TimeoutError: another process held it for more than ``timeout_s`` seconds (polled every 20 ms).
        ValueError: the lock file cannot be opened or is not a regular file (naming it and the system's reason).
    """
    import fcntl
    lp = lock_path(path)
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)
    try:
        try:
            fd = os.open(lp, os.O_RDWR | os.O_CREAT | flags, 0o666)      # (umask applies)
        except PermissionError:
            fd = os.open(lp, os.O_RDONLY | flags)       # (another user's lock file: flock needs no write access)
    except OSError as e:
        raise ValueError(f"{path}: its lock file {lp} cannot be opened ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: its lock file {lp} is {_kind(st.st_mode)}, not a regular file")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{path}: another process held its lock file {lp} for more than {timeout_s} s "
                                       f"(another tune saving there?); nothing was written") from None
                time.sleep(0.02)
        yield lp
    finally:
        os.close(fd)


def _keep_owner_and_mode(fd: int, st: Optional[os.stat_result]) -> None:
    """Give the new file ``fd`` the owner (where the system allows it) and permission bits of the file it replaces
    (``st``; ``None``: a new table, ``0o666`` less the umask)."""
    if st is None:
        return
    for uid, gid in ((st.st_uid, st.st_gid), (-1, st.st_gid)):
        try:
            os.fchown(fd, uid, gid)
            break
        except OSError:         # (not root: another owner is refused; the group too unless the caller is in it)
            pass
    os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o777)


def backup_path(path: str) -> str:
    """Where :func:`save` with ``backup`` keeps the file it replaces at ``path``: ``path.bak`` beside it."""
    return f"{path}.bak"


def _write_beside(real: str, st: Optional[os.stat_result], write, force: bool) -> None:
    """Put a new file at ``real`` atomically: ``write(f)`` fills a new temporary file (binary) in the same directory,
    given the permission bits and owner of ``st`` (the file it replaces, :func:`_keep_owner_and_mode`), then it is
    renamed over ``real`` (after :func:`check_target` of ``real`` with ``force`` once more, just before the rename:
    only a regular file is replaced). The temporary file is removed on every failure."""
    tmp = f"{real}.tmp{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)  # (umask)
    try:
        with os.fdopen(fd, "wb") as f:
            _keep_owner_and_mode(f.fileno(), st)
            write(f)
        check_target(real, force=force)
        os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _back_up(real: str, st: os.stat_result) -> str:
    """Copy the file at ``real`` (``st``: its ``lstat``) to :func:`backup_path`, replacing an older backup there
    (:func:`check_target` of it first: never through a symlink, nor over anything but a regular file). Returns that
    path. Raises ValueError where the backup path is refused or the file there is no longer a regular file."""
    bak = check_target(backup_path(real), force=True)
    fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_NOFOLLOW", 0))
    with open(fd, "rb") as src:
        if not stat.S_ISREG(os.fstat(src.fileno()).st_mode):
            raise ValueError(f"{real} is no longer a regular file; nothing was written")
        _write_beside(bak, st, lambda f: f.write(src.read()), force=True)
    return bak


def save(path: str, entries: List[dict], command: str, *, merge: bool = False, force: bool = False,
         backup: bool = False, lock_timeout_s: float = LOCK_TIMEOUT_S
         ) -> Tuple[List[dict], Optional[str], Optional[str]]:
    """Write a table of ``entries`` (dicts of the module docstring's form) to ``path`` with this process's
    :func:`identity`, atomically: a new temporary file in the same directory, renamed over the target (never
    through a symlink), with the replaced file's permission bits and owner (where the system allows). With
    ``merge`` (``tune``'s), the table also gets :func:`kept_entries` of the table already there. With ``backup``
    (``tune``'s), a file already there is first copied to :func:`backup_path` (one generation: an older backup is
    replaced), so that the table before this save can be put back. The whole read-merge-write holds
    :func:`locked`, so two processes saving to one file at once keep each other's entries. The directory is not
    made (:func:`check_target` with ``create_dir`` does that for the default location).

    Args:
        force: replace an existing regular file that is not a tuned table (:func:`check_target`).
    Returns:
        ``(kept, why, backup)``: the entries kept from the table there and, where it was replaced whole, the reason
        (:func:`kept_entries`; ``([], None)`` without ``merge``); the backup's path, or ``None`` where no file was
        there or ``backup`` is off.
    Raises:
        ValueError: :func:`check_target`'s reasons (an empty path, a symlink, a target that is not a regular file,
            is not a table without ``force`` or cannot be written, a directory that is absent or takes no file,
            the same for the backup's path) or :func:`locked`'s; nothing is written or replaced then.
        TimeoutError: :func:`locked`'s: another save held the file for ``lock_timeout_s``.
        OSError: the write itself failed (the temporary file is removed).
    """
    import datetime
    real = check_target(path, force=force)
    with locked(real, lock_timeout_s):
        check_target(real, force=force)     # (again under the lock: what is there now is what gets replaced)
        kept, why = kept_entries(real, entries) if merge else ([], None)
        doc = {"format": FORMAT, "version": VERSION, **identity(),
               "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": command, "entries": kept + list(entries)}
        try:
            old = os.lstat(real)
        except FileNotFoundError:
            old = None
        kept_at = _back_up(real, old) if backup and old is not None else None
        text = (json.dumps(doc, indent=1) + "\n").encode()
        _write_beside(real, old, lambda f: f.write(text), force=force)
    return kept, why, kept_at


__all__ = ["CALLS", "ENV_FILE", "Entry", "FALLBACK", "LOCK_TIMEOUT_S", "MAX_TABLE_BYTES", "Table", "Verdict",
           "backup_path", "check_doc", "check_target", "default_path", "examine", "fallback", "identity",
           "kept_entries", "load", "lock_path", "locked", "path_source", "read_doc", "save"]
