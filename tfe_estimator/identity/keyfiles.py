"""Files of keys and certificates, written so that no other local user can read or swap them.

A private file (a key) is created exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600):
never through a file or link someone else put there first. A pre-existing file the caller
owns is replaced (unlinked first, then created afresh); one owned by another user is refused,
naming it and its owner, because whoever created it may keep it open or rename it back.
A directory that other users may write to (its group or everyone, and not sticky), or that
another user owns, is refused for private files: they could swap the file between our write
and its use. A private key is read (`read_private`, e.g. ``ca.key`` to sign) only if it is the
caller's own private file: a regular file the caller owns that no one else may read or write,
in such a directory.

Example::

    write_private("/etc/tfe/hospital-a/ca.key", key_pem)
    write_public("/etc/tfe/hospital-a/ca.crt", cert_pem)
    key_pem = read_private("/etc/tfe/hospital-a/ca.key")
"""
import os
import stat

__all__ = ["write_private", "write_public", "make_private_dir", "read_private"]


def _check_dir(path: str) -> None:
    """Refuses a directory where another user could swap `path` after we write it (or before we read it)."""
    directory = os.path.dirname(os.path.abspath(path))
    info = os.stat(directory)
    if info.st_mode & stat.S_ISVTX:  # sticky (like /tmp): nobody else may rename or remove our file
        return
    if info.st_uid not in (os.getuid(), 0):
        raise ValueError(f"directory {directory} belongs to uid {info.st_uid}, who could replace "
                         f"{os.path.basename(path)}: keep keys in a directory you own.")
    _check_writers(directory, info, f"they could replace {os.path.basename(path)}")


def _check_writers(directory: str, info: os.stat_result, risk: str) -> None:
    """Refuses a (non-sticky) directory its group or every user may write to."""
    if info.st_mode & stat.S_IWOTH:
        raise ValueError(f"directory {directory} is writable by every user (mode {oct(info.st_mode & 0o777)}): "
                         f"{risk}. Run `chmod go-w {directory}` or use a directory only you can write to.")
    if info.st_mode & stat.S_IWGRP:
        raise ValueError(f"directory {directory} is writable by its group (gid {info.st_gid}, mode "
                         f"{oct(info.st_mode & 0o777)}): its members could replace the keys in it ({risk}). Run "
                         f"`chmod g-w {directory}` or use a directory only you can write to.")


def _clear(path: str) -> None:
    """Removes a pre-existing `path` the caller owns; refuses one owned by another user."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if info.st_uid != os.getuid():
        raise ValueError(f"{path} already exists and belongs to uid {info.st_uid}, not to you (uid {os.getuid()}): "
                         "someone else created it and could read what is written into it. Remove it (as its "
                         "owner or root) or choose another directory.")
    if stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{path} is a directory; remove it or choose another output directory.")
    os.unlink(path)  # ours: replace it by a fresh file, never write through an old inode or link


def _write(path: str, data: bytes, mode: int) -> None:
    _clear(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        os.fchmod(fd, mode)  # the umask may have narrowed it; never widened
        with os.fdopen(fd, "wb") as f:
            fd = -1
            f.write(data)
    finally:
        if fd >= 0:
            os.close(fd)


def write_private(path: str, data: bytes) -> None:
    """Writes a private key (or other secret) to a fresh file of mode 0600.

    Raises:
      ValueError: `path` exists and belongs to another user, or its directory is writable by others.
    """
    _check_dir(path)
    _write(path, data, 0o600)


def write_public(path: str, data: bytes) -> None:
    """Writes a certificate or other public file (mode 0644) to a fresh file (a foreign one is refused)."""
    _write(path, data, 0o644)


def make_private_dir(path: str) -> str:
    """Creates `path` (and parents) with mode 0700 if missing; refuses an existing one owned by another user."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.stat(path)
    if info.st_uid != os.getuid():
        raise ValueError(f"directory {path} belongs to uid {info.st_uid}, not to you: keep keys in a directory "
                         "you own.")
    if not info.st_mode & stat.S_ISVTX:
        _check_writers(path, info, "others could replace the keys written there")
    return path


def read_private(path: str) -> bytes:
    """Reads a private key (e.g. a CA's ``ca.key`` to sign with) that is the caller's own private file.

    Raises:
      ValueError: `path` is missing, a link or not a regular file, belongs to another user, may be read or
        written by others (its mode has group or other bits), or sits in a directory others may write to.
    """
    _check_dir(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist.") from None
    except OSError as e:  # ELOOP: a symbolic link
        raise ValueError(f"{path} cannot be opened as your own key file ({e.strerror}); a link is refused: pass "
                         "the key file itself.") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} is not a regular file; pass the key file itself.")
        if info.st_uid != os.getuid():
            raise ValueError(f"{path} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}): a private key "
                             "is used only by the user who made it. Run this as that user (the one who ran "
                             "`tfe-estimator certs ca`), with your own organisation's CA.")
        if info.st_mode & 0o077:
            raise ValueError(f"{path} has mode {oct(info.st_mode & 0o777)}: other users may read or change it, "
                             f"and whoever read it can mint your organisation's identities. Run `chmod 600 {path}`; "
                             "if others did read it, make a new CA (`tfe-estimator certs ca`) and a new federation "
                             "file.")
        return f.read()
