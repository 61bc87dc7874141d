"""Network guard for tests: refuse and record every connect beyond loopback, in every Python process.

A directory holding this file is put first on ``PYTHONPATH``, so every Python process started with
that environment (the test's driver, Ray's dashboard, log monitor, autoscaler monitor, dashboard
agent and workers) imports it at start-up (``site`` imports ``sitecustomize``). With
``ADBATCH_NETGUARD_LOG`` set it patches the Python socket layer: ``connect``/``connect_ex``/``sendto``
to an address that is neither loopback nor this host's own, and ``getaddrinfo`` of a name other than
this host's own or ``localhost``,
raise ``ConnectionRefusedError`` / ``gaierror`` and append one JSON line (pid, argv, what, where)
to that file; each guarded process also appends a ``loaded`` line, so a test can check that the
process it cares about was guarded at all. Connects made in C (Ray's gcs_server / raylet, gRPC core)
are not seen.
"""

from __future__ import annotations

import os

LOG_ENV = "ADBATCH_NETGUARD_LOG"


def install(log_path: str) -> None:
    import errno
    import ipaddress
    import json
    import socket
    import sys
    import traceback

    if getattr(socket, "_adbatch_netguard", None):
        return
    own_names = {"", "localhost", "localhost.localdomain", "ip6-localhost", socket.gethostname()}
    try:
        own_names.add(socket.getfqdn())
    except OSError:
        pass
    try:  # this host's own interface addresses (a Ray node's IP): a connect there stays on the host
        import psutil

        own_names.update(a.address.split("%", 1)[0] for addrs in psutil.net_if_addrs().values() for a in addrs
                         if a.family in (socket.AF_INET, socket.AF_INET6))
    except ImportError:
        pass

    def record(what: str, where: object) -> None:
        line = {"pid": os.getpid(), "argv": sys.argv[:3], "what": what, "where": repr(where),
                "stack": "".join(traceback.format_stack(limit=8)[:-2])[-1500:] if what != "loaded" else ""}
        with open(log_path, "a") as fh:
            fh.write(json.dumps(line) + "\n")

    def loopback_host(host: object) -> bool:
        if host is None:
            return True
        host = host.decode() if isinstance(host, bytes) else str(host)
        host = host.split("%", 1)[0]
        if host in own_names:
            return True
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False  # a name to resolve: refused unless it is this host's own
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return ip.is_loopback or ip.is_unspecified

    def allowed(sock: socket.socket, address: object) -> bool:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return True  # unix sockets, netlink ...
        host = address[0] if isinstance(address, tuple) else address
        return loopback_host(host)

    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_sendto, real_getaddrinfo = socket.socket.sendto, socket.getaddrinfo

    def connect(self, address):
        if not allowed(self, address):
            record("connect", address)
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"netguard: connect to {address!r} refused")
        return real_connect(self, address)

    def connect_ex(self, address):
        if not allowed(self, address):
            record("connect_ex", address)
            return errno.ECONNREFUSED
        return real_connect_ex(self, address)

    def sendto(self, data, *args):
        address = args[-1]
        if not allowed(self, address):
            record("sendto", address)
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"netguard: sendto {address!r} refused")
        return real_sendto(self, data, *args)

    def getaddrinfo(host, *args, **kwargs):
        if not loopback_host(host):
            # an IP literal needs no lookup; its connect is judged by connect()
            try:
                ipaddress.ip_address(host.decode() if isinstance(host, bytes) else str(host))
            except ValueError:
                record("getaddrinfo", host)
                raise socket.gaierror(socket.EAI_NONAME, f"netguard: lookup of {host!r} refused") from None
        return real_getaddrinfo(host, *args, **kwargs)

    socket.socket.connect, socket.socket.connect_ex, socket.socket.sendto = connect, connect_ex, sendto
    socket.getaddrinfo = getaddrinfo
    socket._adbatch_netguard = (real_connect, real_connect_ex, real_sendto, real_getaddrinfo)
    record("loaded", None)


def uninstall() -> None:
    import socket

    saved = getattr(socket, "_adbatch_netguard", None)
    if saved:
        socket.socket.connect, socket.socket.connect_ex, socket.socket.sendto, socket.getaddrinfo = saved
        del socket._adbatch_netguard


if os.environ.get(LOG_ENV):
    install(os.environ[LOG_ENV])
