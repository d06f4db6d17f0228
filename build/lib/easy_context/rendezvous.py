"""The rendezvous store on loopback for single-node runs.

torch's ``TCPStore`` server listens on every interface (``*:MASTER_PORT``) whatever ``MASTER_ADDR`` says, so any host
that can reach the machine can read and write the store a run coordinates through (the rendezvous, and the
heartbeats ``easy_context_train/watchdog.py`` reads). When the address the ranks connect to is a loopback address (the
single-node default, ``MASTER_ADDR=127.0.0.1``), nothing outside the host needs the port: the server is bound to
127.0.0.1 by handing TCPStore a socket bound there (``master_listen_fd``). Another ``MASTER_ADDR`` (multi-node:
``--main_process_ip``) keeps torch's behaviour.

Where the store is made:
* the groups this package sets up itself (``tools/gloo.py``: the tests' and ``check``'s ranks; ``inference.py``
  without a launcher): ``store_for`` / ``init_process_group``;
* under ``accelerate launch`` / ``torchrun`` the launcher makes it: ``python -m easy_context launch ARGS`` is
  ``accelerate launch ARGS`` with the launcher's store made by ``LoopbackTCPStore`` (``patch_launcher``).
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import socket

_SOCKETS: list = []  # listening sockets handed to stores (kept referenced for the process's life)


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _listen_fd(port: int) -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(2048)
    return s.detach()  # the store's server owns the descriptor from here


def _tcpstore_class():
    import torch.distributed as dist

    class LoopbackTCPStore(dist.TCPStore):
        """``dist.TCPStore`` whose server (``is_master``) listens on 127.0.0.1 only when ``host`` is a loopback
        address; a subclass, so isinstance checks and PrefixStore keep working."""

        def __init__(self, host_name, port, world_size=None, is_master=False,
                     timeout=datetime.timedelta(seconds=300), *args, **kwargs):
            if is_master and is_loopback(host_name) and port and kwargs.get("master_listen_fd") is None \
                    and len(args) < 3:  # master_listen_fd not given positionally
                kwargs["master_listen_fd"] = _listen_fd(int(port))
                kwargs["use_libuv"] = True  # the legacy backend aborts at exit with a handed-in socket
            super().__init__(host_name, port, world_size, is_master, timeout, *args, **kwargs)

    return LoopbackTCPStore


def store_for(rank: int, world_size: int, host: str, port: int, timeout: datetime.timedelta):
    """The store of a group this package sets up: rank 0 serves it (on loopback for a loopback ``host``)."""
    return _tcpstore_class()(host, port, world_size, rank == 0, timeout, wait_for_workers=False)


def init_process_group(backend: str, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    """``dist.init_process_group`` from MASTER_ADDR / MASTER_PORT with the store on loopback when MASTER_ADDR is;
    under a torch elastic launcher (its agent's store) or another address, exactly torch's env:// set-up."""
    import torch.distributed as dist
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or not is_loopback(host):
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        return
    store = store_for(rank, world_size, host, port, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def patch_launcher() -> bool:
    """Make the torch elastic agent's stores (static and c10d rendezvous) ``LoopbackTCPStore``s; False when this
    torch lays them out otherwise (then the launch runs as torch would, and says so)."""
    import torch.distributed as dist
    cls = _tcpstore_class()
    patched = False
    try:
        from torch.distributed.elastic.rendezvous import static_tcp_rendezvous as st
        if getattr(st, "TCPStore", None) is dist.TCPStore:
            st.TCPStore, patched = cls, True
    except ImportError:
        pass
    try:
        from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d
        if getattr(c10d, "TCPStore", None) is dist.TCPStore:
            c10d.TCPStore = cls
    except ImportError:
        pass
    return patched


__all__ = ["is_loopback", "store_for", "init_process_group", "patch_launcher"]
