"""The rendezvous of a job on one machine: its stores listen on 127.0.0.1 only.

torch's c10d rendezvous binds its two TCPStores (the rendezvous state, and the store it
shares with the workers) to every interface and takes no bind address. A TCPStore does
accept a socket that already listens (`master_listen_fd`, libuv server only), so this
backend makes both stores on a socket bound to loopback.
"""

from __future__ import annotations

import socket
from datetime import timedelta

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

BACKEND = "parallab-loopback"
HOST = "127.0.0.1"


def loopback_store(port: int = 0) -> TCPStore:
    """A TCPStore server reachable from this machine only; port 0 picks a free one."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((HOST, port))
        listener.listen(128)
        port = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    return TCPStore(HOST, port, is_master=True, timeout=timedelta(minutes=5),
                    wait_for_workers=False, master_listen_fd=listener.detach(), use_libuv=True)


class OneMachine(RendezvousHandler):
    """The rendezvous of parallab's own launcher: one agent on one machine (more nodes come
    through torchrun, SLURM or mpirun), so it completes at once, where torch's dynamic
    rendezvous waits a random fraction of a second and polls each second (a second of a
    small job's launch). Each round (a restart of the workers) gets its own key space of
    the agent's store; the workers' store stays the same."""

    def __init__(self, run_id: str, port: int):
        self.run_id = run_id
        self.store = loopback_store(port)  # the agent's
        self.workers_store: TCPStore | None = None  # MASTER_ADDR:MASTER_PORT of the workers
        self.round = 0
        self.closed = False

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers' store lives as long as the agent

    def next_rendezvous(self) -> RendezvousInfo:
        if self.closed:
            raise RendezvousClosedError()
        if self.workers_store is None:
            self.workers_store = loopback_store()
        self.round += 1
        store = PrefixStore(f"torch.rendezvous.{self.run_id}.{self.round}", self.store)
        return RendezvousInfo(store, rank=0, world_size=1, bootstrap_store_info=(
            RendezvousStoreInfo(HOST, self.workers_store.port)))

    def is_closed(self) -> bool:
        return self.closed

    def set_closed(self) -> None:
        self.closed = True

    def num_nodes_waiting(self) -> int:
        return 0  # one node: none ever waits to join

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        self.closed = True
        return True


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    _, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    return OneMachine(params.run_id, port)


def register() -> str:
    """Make the backend known to torch's elastic launcher (idempotent); its name."""
    rendezvous_handler_registry.register(BACKEND, _create_handler)
    return BACKEND
