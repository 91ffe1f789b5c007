"""The one module that imports tf-encrypted: players, protocols, randomness.

Importing tf_encrypted starts TensorFlow's runtime and sets a global
protocol, so nothing imports this module at `tfe_estimator` import time;
`SecureAggregation` imports it (through `protocols.load_backend`, in a
throwaway graph) when it first builds a reduction.

tf-encrypted keeps its player registry in a global `Config`. We never replace
it for good: `players_scope` installs a `DevicePlayers` config (players named
after the devices that hold them) only while a reduction is built, and restores
the previous one. `DevicePlayers` runs in tf-encrypted's "debug" mode, which
turns off its process-wide node memo cache (a cache keyed by Python object ids
that is not safe across the many graphs an Estimator builds).

Compatibility with TensorFlow 2.15 lives here, each piece with its reason:

- `_define_dropped_while_v2_flag`: tf-encrypted 0.9.1 imports a module flag
  of TensorFlow 2.9 that 2.10+ dropped; it runs before `import tf_encrypted`.
- `install_secure_random`: tf-encrypted's compiled ops exist for TensorFlow
  2.9.1 only; on any other TensorFlow its `secure_random_module` is None and it
  silently falls back to predictable randomness. We install our AES-128-CTR
  generator (`tfe_estimator.secure.kernels`) in its place, on both stacks, so Pond,
  ABY3 and every other tf-encrypted path draw masks and seeds from it.

Example::

    from tfe_estimator.secure import tfe_backend
    tfe_backend.require_secure_randomness()
    players = tfe_backend.DevicePlayers(["/job:tfe/task:0", "/job:tfe/task:1",
                                         "/job:tfe/task:2"])
    with tfe_backend.players_scope(players):
        prot = tfe_backend.make_protocol("pond", precision, players.servers)
"""
import contextlib
import io
import logging
from typing import Dict, List, Sequence

import tensorflow as tf
from tensorflow.python.ops import while_v2


def _define_dropped_while_v2_flag() -> None:
    """Defines `while_v2.glob_stateful_parallelism` where TensorFlow dropped it.

    tf-encrypted 0.9.1's ABY3 does ``from tensorflow.python.ops.while_v2 import
    glob_stateful_parallelism`` (a module flag TensorFlow 2.9 has, default
    False, and 2.10+ removed), so on TensorFlow 2.15 `import tf_encrypted`
    fails on that line alone. ABY3 reads the flag only in its own while-loop
    helper, which secure aggregation never uses; False is TensorFlow 2.9's
    default, so both stacks behave the same.
    """
    if not hasattr(while_v2, "glob_stateful_parallelism"):
        while_v2.glob_stateful_parallelism = False


class _QuietMissingOpLibraries(logging.Filter):
    """Drops tf-encrypted's import-time warnings about its missing op libraries.

    On any TensorFlow but 2.9.1 it logs "Falling back to insecure randomness
    ... compiling custom ops" for each library. That is not what happens here:
    `install_secure_random` replaces its generator, and `require_secure_randomness`
    refuses to run without one, with an error that says why.
    """

    def filter(self, record):
        return "compiling custom ops" not in record.getMessage()


_define_dropped_while_v2_flag()  # must run before the first tf_encrypted import below
_QUIET = _QuietMissingOpLibraries()
logging.getLogger("tf_encrypted").addFilter(_QUIET)
try:
    # pylint: disable=wrong-import-position
    import tf_encrypted  # noqa: E402,F401  (on TF 2.9.1 also registers its compiled ops)
    from tf_encrypted.config import Config, get_config, set_config  # noqa: E402
    from tf_encrypted.operations import secure_random  # noqa: E402
    from tf_encrypted.operations.secure_random import secure_random as _tfe_secure_random_impl  # noqa: E402
    from tf_encrypted.player import Player  # noqa: E402
    from tf_encrypted.protocol.aby3 import ABY3  # noqa: E402
    from tf_encrypted.protocol.pond import Pond  # noqa: E402
finally:
    logging.getLogger("tf_encrypted").removeFilter(_QUIET)

from tfe_estimator.errors import InsecureRandomnessError  # noqa: E402
from tfe_estimator.secure.precision import Precision  # noqa: E402

# pylint: enable=wrong-import-position

_LOG = logging.getLogger("tfe_estimator")

__all__ = [
    "DevicePlayers",
    "players_scope",
    "make_protocol",
    "install_secure_random",
    "require_secure_randomness",
]


#: The generator object we installed in tf-encrypted.
_installed = None


def install_secure_random():
    """Makes tf-encrypted draw all its randomness from our AES-128-CTR generator.

    tf-encrypted reads the module global
    `tf_encrypted.operations.secure_random.secure_random.secure_random_module`
    at every call (`secure_seed`, `seeded_random_uniform`, `random_uniform`,
    and ABY3's `supports_seeded_randomness` check), so replacing that object
    reroutes Pond, ABY3 and every other tf-encrypted path. tf-encrypted's own
    module (its ChaCha op, TF 2.9.1 only) stays as the `fallback` for the
    128-bit (`i128_*`) calls our generator does not implement; on TF 2.15 there
    is none, and those calls raise NotImplementedError.

    Idempotent. `protocols.load_backend` calls it, so it also loads (and on
    first use builds) the kernel library, as every process running our ops
    must before its TensorFlow server starts.

    Returns:
      The installed module object.

    Raises:
      tfe_estimator.secure.kernels.KernelBuildError, KernelSelfTestError: the kernel
        library cannot be built or fails its known-answer test (the message
        names the fix, e.g. `tfe-estimator build-kernels`). There is no
        fallback to tf-encrypted's generator.
    """
    global _installed  # pylint: disable=global-statement
    current = _tfe_secure_random_impl.secure_random_module
    if _installed is not None and current is _installed:
        return current
    from tfe_estimator.secure import kernels  # pylint: disable=import-outside-toplevel

    ours = kernels.tfe_random_module(fallback=current)
    _tfe_secure_random_impl.secure_random_module = ours
    _installed = ours
    _LOG.debug("tf-encrypted draws its randomness from %r", ours)
    return ours


def require_secure_randomness() -> None:
    """Refuses to go on unless tf-encrypted draws from our AES-CTR generator.

    Without a compiled generator tf-encrypted silently falls back to
    TensorFlow's ordinary (predictable) random number generators, and shares
    made with them hide nothing.

    Raises:
      InsecureRandomnessError: if tf-encrypted does not use our generator.
      tfe_estimator.secure.kernels.KernelBuildError, KernelSelfTestError: from
        `install_secure_random`.
    """
    module = install_secure_random()
    if module is not _tfe_secure_random_impl.secure_random_module or not secure_random.supports_secure_randomness():
        raise InsecureRandomnessError(
            f"tf-encrypted on TensorFlow {tf.__version__} does not draw its shares from "
            "tfe_estimator's AES-CTR generator (its secure random op library is missing or was "
            "replaced), so shares would come from a predictable generator and secure aggregation "
            "refuses to run. tf-encrypted 0.9.1 ships its own op (secure_random_module_tf_<version>.so) "
            "for TensorFlow 2.9.1 only; tfe_estimator's kernels replace it on every version "
            "(`tfe-estimator build-kernels`; see README, 'Versions')."
        )


class DevicePlayers(Config):
    """A tf-encrypted `Config` whose players are TensorFlow devices.

    Args:
      server_devices: the devices of the protocol's three parties, in the
        order the protocol names them (Pond: server0, server1, crypto
        producer; ABY3: server0, server1, server2).
    """

    def __init__(self, server_devices: Sequence[str]) -> None:
        super().__init__(debug_mode=True)
        self._players: Dict[str, Player] = {}
        self.servers: List[Player] = [
            self._add(f"server{i}", device) for i, device in enumerate(server_devices)
        ]

    def _add(self, name: str, device: str) -> Player:
        player = Player(name=name, index=len(self._players), device_name=device)
        self._players[name] = player
        return player

    def device_player(self, device: str) -> Player:
        """The player (a replica or a destination) that owns `device`."""
        name = f"device:{device}"
        return self._players.get(name) or self._add(name, device)

    @property
    def players(self) -> List[Player]:
        return list(self._players.values())

    def get_player(self, name_or_player):
        if isinstance(name_or_player, Player):
            return name_or_player
        return self._players.get(name_or_player)


@contextlib.contextmanager
def players_scope(players: DevicePlayers):
    """Makes `players` tf-encrypted's config while the block runs."""
    previous = get_config()
    set_config(players)
    try:
        yield players
    finally:
        set_config(previous)


def make_protocol(name: str, precision: Precision, servers: Sequence[Player]):
    """Builds tf-encrypted's protocol `name` on `servers` with `precision`.

    Call inside `players_scope`. tf-encrypted prints warnings about
    truncation headroom when it validates a fixed-point setting; secure
    aggregation never multiplies or truncates, so they do not apply and are
    swallowed here (our own headroom rule is `Precision.check_headroom`).
    """
    fixedpoint = precision.fixedpoint_config()
    with contextlib.redirect_stdout(io.StringIO()):
        if name == "pond":
            return Pond(
                server_0=servers[0],
                server_1=servers[1],
                triple_source=servers[2],
                fixedpoint_config=fixedpoint,
            )
        if name == "aby3":
            return ABY3(
                server_0=servers[0],
                server_1=servers[1],
                server_2=servers[2],
                fixedpoint_config=fixedpoint,
            )
    raise ValueError(f"Unknown protocol {name!r}")
