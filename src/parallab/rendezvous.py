"""A c10d rendezvous whose stores listen on 127.0.0.1 only, for jobs on one machine.

torch's c10d rendezvous binds its two TCPStores (the rendezvous state, and the store it
shares with the workers) to every interface and takes no bind address. A TCPStore does
accept a socket that already listens (`master_listen_fd`, libuv server only), so this
backend makes both stores on a socket bound to loopback; everything else is torch's.
"""

from __future__ import annotations

import socket
from datetime import timedelta

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
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


class _LoopbackHandler(DynamicRendezvousHandler):
    def get_backend(self) -> str:
        return BACKEND

    def _create_tcp_store_server(self, master_addr, master_port) -> TCPStore:
        return loopback_store(master_port)


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    _, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    store = loopback_store(port)
    backend = C10dRendezvousBackend(store, params.run_id)
    return _LoopbackHandler.from_backend(params.run_id, store, backend, params.min_nodes,
                                         params.max_nodes, local_addr=HOST)


def register() -> str:
    """Make the backend known to torch's elastic launcher (idempotent); its name."""
    rendezvous_handler_registry.register(BACKEND, _create_handler)
    return BACKEND
