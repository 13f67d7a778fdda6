"""Names and files of triton-ep's shared memory, importable without torch (the RDMA proxy process imports
neither torch nor Triton): the ``$TRITON_EP_SHM_TAG`` naming (:func:`shm_name`, re-exported by
:mod:`triton_ep.transport.ipc`) and :func:`create_file`, a file reserved up front in /dev/shm."""
from __future__ import annotations

import os
import tempfile
from typing import Optional


def shm_dir() -> str:
    """/dev/shm where it exists and is writable, else the temporary folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


#: The environment variable whose value, when set, goes into the name of every shared-memory file triton-ep
#: makes (``triton_ep.<tag>.<rest>``), so a program (a test run, say) can tell its own files, and those of the
#: processes it starts (they inherit it), from other programs'. Letters, digits, ``_`` and ``-`` only.
SHM_TAG_ENV = "TRITON_EP_SHM_TAG"
SHM_PREFIX = "triton_ep."
_SHM_TAG_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
#: The longest tag, in characters: the file names it goes into stay well inside a file name's 255 bytes (NAME_MAX)
SHM_TAG_MAX = 64


def shm_tag(tag: Optional[str] = None) -> str:
    """The shared-memory tag checked: ``tag``, or (``None``) ``$TRITON_EP_SHM_TAG`` as it is now (empty: none).
    A Buffer checks it at construction, before any file is made, and its ranks exchange the verdict (a bad
    value on one rank raises on every rank).

    Raises:
        ValueError: a tag with characters other than letters, digits, ``_`` and ``-``, or longer than
            :data:`SHM_TAG_MAX` characters (it names the variable).
    """
    tag = os.environ.get(SHM_TAG_ENV, "") if tag is None else tag
    if not set(tag) <= _SHM_TAG_CHARS:
        raise ValueError(f"{SHM_TAG_ENV}={tag!r}: the shared-memory tag may hold only letters, digits, _ and -")
    if len(tag) > SHM_TAG_MAX:
        raise ValueError(f"{SHM_TAG_ENV}='{tag[:12]}...': a tag of {len(tag)} characters; the shared-memory tag "
                         f"may hold at most {SHM_TAG_MAX} (it goes into file names)")
    return tag


def shm_name(rest: str, tag: Optional[str] = None) -> str:
    """The file name (no folder) of a shared-memory file of triton-ep: ``triton_ep.<rest>``, or
    ``triton_ep.<tag>.<rest>`` with a nonempty ``tag`` (default: ``$TRITON_EP_SHM_TAG``, read at each call).

    Raises:
        ValueError: a tag with characters other than letters, digits, ``_`` and ``-`` (:func:`shm_tag`).
    """
    tag = shm_tag(tag)
    return f"{SHM_PREFIX}{tag}.{rest}" if tag else f"{SHM_PREFIX}{rest}"


def reserve(fd: int, path: str, nbytes: int, what: str, instead: str = "") -> None:
    """Reserve ``nbytes`` of the new file ``path`` (open as ``fd``) with ``posix_fallocate`` (not only
    ``ftruncate``: a sparse file in a full tmpfs is a SIGBUS at the first touch of a page, long after this
    returns); ``ftruncate`` where the platform has no ``posix_fallocate``. ``what`` names the memory in the error,
    ``instead`` is an optional last advice (", or ...").

    Raises:
        OSError: ``ENOSPC`` (or what ``posix_fallocate`` said) where the folder has no room for ``nbytes``, with a
            message naming the size, the folder, its free space and the container options that enlarge /dev/shm
            (``--shm-size``, ``--ipc=host``); ``path`` is unlinked first (``fd`` stays the caller's to close).
    """
    if not hasattr(os, "posix_fallocate"):
        os.ftruncate(fd, nbytes)
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as ex:
        os.unlink(path)
        d = os.path.dirname(path)
        st = os.statvfs(d)
        raise OSError(ex.errno,
            f"triton-ep: cannot reserve {nbytes} bytes ({nbytes / 2**20:.1f} MiB) in {d} for {what} "
            f"({os.strerror(ex.errno)}; {st.f_bavail * st.f_frsize / 2**20:.1f} MiB free there): a container needs a "
            f"larger /dev/shm (docker run --shm-size=..., or --ipc=host){instead}") from None


def create_file(name: str, nbytes: int) -> str:
    """Create ``name`` (made by :func:`shm_name`) in :func:`shm_dir`, exclusive, mode 0600, and reserve its
    ``nbytes`` (:func:`reserve`). Returns the path; the caller unlinks it.

    Raises:
        OSError: the file cannot be made, or :func:`reserve`'s error (no room; nothing is left behind).
    """
    path = os.path.join(shm_dir(), name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        reserve(fd, path, nbytes, "the RDMA proxy's rings", ", or TRITON_EP_PROXY=thread (the proxy as a thread "
                "of the rank's process, its rings in pinned memory) on every rank")
    finally:
        os.close(fd)
    return path
