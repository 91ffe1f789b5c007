"""Server0's record of the blind keys it released, kept in its state directory across a restart.

Server0 answers each owner of a released step with the step's blind key, after
server1 took its forwarded part (and may have answered the owners already). If
server0 dies in between, server1 keeps the step and replays it, and a restarted
server0 must answer the SAME blind key, or no owner can reveal the step. So
server0 writes ``(channel, step, blind key, the owners' key digests)`` here
BEFORE it forwards; a restarted server0 reads it back (`load`):

- an owner puts a step the record holds: server0 asks server1 whether it
  released the step with those key digests (a confirmation that adds nothing);
  if so it answers from the record (a replay), else it sums the step anew;
- a step summed anew from keys with the recorded digests is blinded with the
  recorded key, so its forwarded part is bit-identical (never a second mask).

The file (``server0-releases.log``, mode 0600, in a directory the server's user
owns and nobody else may write; made with mode 0700) is one header line naming the owners and server1, then one
JSON line per release. A file of other owners or another server1 is another
run's: it is removed. A file another user may read, owned by another user, or
with a line that does not parse is refused with an error naming the fix. Each
line is one ``write``: it survives the process's death (SIGKILL, OOM), not the
machine's (no fsync; a lost line means the step is summed anew, as without the
record). Only the last `keep` steps per channel are kept (the replay window);
the file is rewritten (a new file, then a rename) when it holds 4x more lines.

Example::

    log = ReleaseLog("/var/lib/tfe/state", owners=["chief:0", "worker:0"], server1="tfe1:7001", keep=64)
    log.write(("grads", 64, 1000), 7, blind, digests)      # before the forward
    record = log.get(("grads", 64, 1000), 7)                # after a restart: (blind, digests) or None
"""
import json
import logging
import os
import stat
import threading
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

__all__ = ["ReleaseLog", "Record", "FILE_NAME"]

FILE_NAME = "server0-releases.log"
_FORMAT = "tfe-estimator server0 releases"
_LOG = logging.getLogger("tfe_estimator")

ChannelKey = Tuple[str, int, int]  # (name, ring_bits, num_elements), as `server.AggregationServer` keys channels


class Record(NamedTuple):
    """A release: its blind key (16 bytes) and the digests of the owners' keys it summed, in owner order."""
    blind: bytes
    digests: Tuple[bytes, ...]


def _private_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.stat(path)
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise ValueError(f"state directory {path} (mode {oct(info.st_mode & 0o777)}, uid {info.st_uid}) must "
                         f"belong to this user (uid {os.getuid()}) and be writable by nobody else (e.g. mode 0700): "
                         "another user could swap server0's release log in it. Run `chmod go-w "
                         f"{path}` as its owner, or pass another directory (`tfe-estimator server` reads "
                         "it from TFE_ESTIMATOR_STATE_DIR).")


class ReleaseLog:
    """Server0's releases in `directory` (see the module docstring); thread-safe.

    Args:
      directory: the state directory (made with mode 0700 if missing).
      owners: the owners in configured order; server1: server1's address (both name the run in the header).
      keep: steps kept per channel (the replay window's ``window_steps``).

    Raises:
      ValueError: the file or directory is readable by others or owned by another user, or the file is corrupt.
    """

    def __init__(self, directory: str, owners: Sequence[str], server1: str, keep: int = 64):
        self.path = os.path.join(os.path.abspath(directory), FILE_NAME)
        self._header = {"format": _FORMAT, "version": 1, "owners": list(owners), "server1": server1}
        self._keep = max(int(keep), 1)
        self._lock = threading.Lock()
        self._records: Dict[ChannelKey, Dict[int, Record]] = {}
        _private_dir(os.path.dirname(self.path))
        self._lines = self._load()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0))

    def _refuse(self, why: str) -> ValueError:
        return ValueError(f"server0's release log {self.path} {why}. It keeps the blind keys of the steps server0 "
                          "released, for a restart. Delete it and restart both aggregation servers (the owners "
                          "then restore their checkpoints).")

    def _load(self) -> int:
        """Reads the file (or makes a fresh one); returns how many lines it has."""
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            return self._rewrite()
        except OSError as e:
            raise self._refuse(f"cannot be opened ({e})") from None
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
                raise self._refuse(f"has mode {oct(info.st_mode & 0o777)} and uid {info.st_uid}: it must be a file "
                                   f"of this user (uid {os.getuid()}) that nobody else may read (mode 0600)")
            lines = f.read().split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        try:
            header = json.loads(lines[0]) if lines else None
        except ValueError:
            header = None
        if not isinstance(header, dict) or header.get("format") != _FORMAT:
            raise self._refuse("does not start with its header line (it is not such a log, or it was damaged)")
        if header != self._header:
            _LOG.info("aggregation server0: %s belongs to another run (owners %s, server1 %s); starting afresh",
                      self.path, header.get("owners"), header.get("server1"))
            os.unlink(self.path)
            return self._rewrite()
        for number, line in enumerate(lines[1:], start=2):
            try:
                entry = json.loads(line)
                key = (str(entry["c"]), int(entry["r"]), int(entry["n"]))
                record = Record(bytes.fromhex(entry["b"]), tuple(bytes.fromhex(d) for d in entry["d"]))
                step = int(entry["t"])
                if len(record.blind) != 16 or len(record.digests) != len(self._header["owners"]):
                    raise ValueError("a field has the wrong size")
            except (ValueError, KeyError, TypeError) as e:
                raise self._refuse(f"line {number} does not parse ({e}; a line cut by a crash of the machine?)") \
                    from None
            self._add(key, step, record)
        return len(lines)

    def _add(self, key: ChannelKey, step: int, record: Record) -> None:
        steps = self._records.setdefault(key, {})
        steps[step] = record
        while len(steps) > self._keep:
            del steps[min(steps)]

    def _rewrite(self) -> int:
        """Writes the header and the kept records to a fresh file (mode 0600) and renames it over the log."""
        lines = [json.dumps(self._header)] + [self._line(key, step, record) for key, steps in self._records.items()
                                              for step, record in sorted(steps.items())]
        temporary = self.path + ".new"
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, ("\n".join(lines) + "\n").encode())
        finally:
            os.close(fd)
        os.replace(temporary, self.path)
        return len(lines)

    @staticmethod
    def _line(key: ChannelKey, step: int, record: Record) -> str:
        return json.dumps({"c": key[0], "r": key[1], "n": key[2], "t": step, "b": record.blind.hex(),
                           "d": [d.hex() for d in record.digests]})

    def get(self, key: ChannelKey, step: int) -> Optional[Record]:
        """The recorded release of `step` on channel `key`, or None."""
        with self._lock:
            return self._records.get(key, {}).get(step)

    def recorded(self) -> List[Tuple[ChannelKey, int]]:
        """Every recorded ``(channel key, step)``."""
        with self._lock:
            return [(key, step) for key, steps in self._records.items() for step in steps]

    def write(self, key: ChannelKey, step: int, blind: bytes, digests: Sequence[bytes]) -> None:
        """Records a release (one ``write`` of one line) before its forward; rewrites the file when it grew 4x."""
        record = Record(bytes(blind), tuple(bytes(d) for d in digests))
        with self._lock:
            if self._fd is None:
                raise OSError(f"{self.path} is closed (the server is stopping)")
            self._add(key, step, record)
            os.write(self._fd, (self._line(key, step, record) + "\n").encode())
            self._lines += 1
            live = sum(len(steps) for steps in self._records.values())
            if self._lines > max(1024, 4 * (live + 1)):
                self._lines = self._rewrite()
                os.close(self._fd)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0))

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
