"""The one module that imports tf-encrypted: players, protocols, randomness.

Importing tf_encrypted starts TensorFlow's runtime and sets a global
protocol, so nothing imports this module at `tfe_estimator` import time;
`SecureAggregation` imports it when it first builds a reduction.

tf-encrypted keeps its player registry in a global `Config`. We never replace
it for good: `players_scope` installs a `DevicePlayers` config (players named
after the devices that hold them) only while a reduction is built, and restores
the previous one. `DevicePlayers` runs in tf-encrypted's "debug" mode, which
turns off its process-wide node memo cache (a cache keyed by Python object ids
that is not safe across the many graphs an Estimator builds).

Example::

    from tfe_estimator import tfe_backend
    tfe_backend.require_secure_randomness()
    players = tfe_backend.DevicePlayers(["/job:tfe/task:0", "/job:tfe/task:1",
                                         "/job:tfe/task:2"])
    with tfe_backend.players_scope(players):
        prot = tfe_backend.make_protocol("pond", precision, players.servers)
"""
import contextlib
import io
from typing import Dict, List, Sequence

import tf_encrypted  # noqa: F401  (registers the secure random ops)
from tf_encrypted.config import Config, get_config, set_config
from tf_encrypted.operations import secure_random
from tf_encrypted.player import Player
from tf_encrypted.protocol.aby3 import ABY3
from tf_encrypted.protocol.pond import Pond

from tfe_estimator.errors import InsecureRandomnessError
from tfe_estimator.precision import Precision

__all__ = [
    "DevicePlayers",
    "players_scope",
    "make_protocol",
    "require_secure_randomness",
]


def require_secure_randomness() -> None:
    """Refuses to go on when tf-encrypted lacks its secure random op.

    Without its compiled op tf-encrypted silently falls back to TensorFlow's
    ordinary (predictable) random number generators, and shares made with
    them hide nothing.

    Raises:
      InsecureRandomnessError: if the op library did not load.
    """
    if not secure_random.supports_secure_randomness():
        raise InsecureRandomnessError(
            "tf-encrypted cannot load its secure random op library "
            "(secure_random_module_tf_<version>.so), so secret shares would be "
            "drawn from a predictable generator. Secure aggregation refuses to run "
            "without it. tf-encrypted 0.9.1 ships that library for TensorFlow 2.9.1 "
            "only: install the pinned versions with `pip install -e .` in a Python "
            "3.10 environment (see README, 'Versions')."
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
