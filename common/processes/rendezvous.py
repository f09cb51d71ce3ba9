"""Where a process group's ranks meet: torch's TCPStore, its server listening on one address only.

torch.distributed's TCPStore server binds every interface of its machine whatever host name it is given, and
its peers are not authenticated: any process that reaches it can read or write the group's keys. Here the
server takes over a socket bound to the one address the other ranks were told (`master_listen_fd`), so it
listens no wider than it must; and a listener made when its port is chosen holds that port until the store
takes it (no port picked, released, and taken by another process before it is bound again).

    listener = listen(node_ip)                  # where rank 0 will be found: (node_ip, listener's port)
    store = tcp_store(node_ip, port, world_size, timeout_s=600, is_master=True, listener=listener)  # rank 0
    store = tcp_store(node_ip, port, world_size, timeout_s=600)                                     # the others
"""
from __future__ import annotations

import datetime
import socket


def listen(address: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on `address` alone (port 0: one the kernel picks; read it from getsockname).
    An address that is not this machine's is a clear error."""
    family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # a restarted run's port in TIME_WAIT
        sock.bind((address, port))
        sock.listen(512)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {address}:{port} for a process group's rendezvous "
                                 f"({exc.strerror}): the address must be one of this machine's, and the port free") \
            from exc
    return sock


def tcp_store(address: str, port: int, world_size: int, *, timeout_s: float, is_master: bool = False,
              listener: socket.socket | None = None):
    """A torch TCPStore for a group of `world_size` meeting at address:port. The master serves it on that
    address alone, through `listener` where it holds one (the store owns it from here on), else on a socket it
    binds now; the others connect. Returns at once: the store does not wait for workers."""
    import torch.distributed as dist

    fd = None
    if is_master:
        listener = listener or listen(address, port)
        port = listener.getsockname()[1]
        fd = listener.detach()          # the store's from now on (it closes it)
    return dist.TCPStore(address, port, world_size, is_master, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=fd)
