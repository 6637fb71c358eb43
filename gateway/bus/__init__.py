"""How committed entries travel from the process that wrote them to the hubs that push them.

``Bus`` is the interface; ``LocalBus`` is the in-process implementation (one gateway process, the SQLite
default). A bus only carries news of commits: the store stays the truth, and a hub that sees a version
jump fills the gap from the store.
"""

from gateway.bus.base import Bus, Listener
from gateway.bus.local import LocalBus

__all__ = ["Bus", "Listener", "LocalBus"]
