"""Warnings ahead of a certificate's expiry, naming the file and the date.

Example::

    warn_expiring([("/etc/tfe/worker-0/worker-0.crt", pem)], days=7)
"""
import datetime
import logging
import threading
from typing import Iterable, List, Optional, Tuple

from cryptography import x509

__all__ = ["expiring", "warn_expiring", "WARN_DAYS"]

_LOG = logging.getLogger("tfe_estimator")
#: Warn this many days ahead.
WARN_DAYS = 7.0
_warned = set()
_lock = threading.Lock()


def expiring(files: Iterable[Tuple[str, bytes]], days: float = WARN_DAYS,
             now: Optional[datetime.datetime] = None) -> List[str]:
    """A message for each ``(name, pem)`` whose certificate expired or expires within `days`."""
    return [message for _, message in _expiring(files, days, now)]


def _expiring(files, days, now):
    now = now or datetime.datetime.now(datetime.timezone.utc)
    out = []
    for name, pem in files:
        try:
            cert = x509.load_pem_x509_certificate(pem)
        except ValueError:
            continue  # not a certificate: reported where it is used
        end = cert.not_valid_after_utc
        if end < now:
            subject = cert.subject.rfc4514_string()
            out.append(((name, end), f"certificate {name} ({subject}) EXPIRED on {end:%Y-%m-%d %H:%M} UTC: "
                       "renew it (`tfe-estimator certs request` + `certs sign`)."))
        elif end < now + datetime.timedelta(days=days):
            subject = cert.subject.rfc4514_string()
            out.append(((name, end), f"certificate {name} ({subject}) expires on {end:%Y-%m-%d %H:%M} UTC, "
                       f"in {(end - now).total_seconds() / 86400:.1f} days: renew it before then "
                       "(`tfe-estimator certs request` + `certs sign`)."))
    return out


def warn_expiring(files: Iterable[Tuple[str, bytes]], days: float = WARN_DAYS) -> List[str]:
    """Logs `expiring`'s messages as warnings, each once per process; returns them."""
    found = _expiring(files, days, None)
    for key, message in found:
        with _lock:
            if key in _warned:
                continue
            _warned.add(key)
        _LOG.warning("%s", message)
    return [message for _, message in found]
