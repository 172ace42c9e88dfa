"""Where the ranks that a test starts on this machine meet: a TCPStore that the test process hosts.

The store listens on a port that the kernel picks when the store binds it, and keeps it until the
test drops the store. Each rank joins as a client (TORCHELASTIC_USE_AGENT_STORE, the mode in
which torchrun's agent hosts the store for its workers: `torch.distributed.rendezvous`'s env://
handler then starts no server on rank 0). No port is found free, released and bound again, a gap
in which another test process, or a connection of the ranks' own, can take it.
"""

from __future__ import annotations

from torch.distributed import TCPStore

HOST = "127.0.0.1"


def rendezvous_store(world: int) -> TCPStore:
    """A store for one launch of `world` ranks (a launch's keys are its own: a new store each time)."""
    return TCPStore(HOST, 0, world_size=world, is_master=True, wait_for_workers=False)


def rank_environment(store: TCPStore, rank: int, world: int) -> dict[str, str]:
    """The environment variables that make a process rank `rank` of `world` meeting at `store`."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": HOST,
            "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
