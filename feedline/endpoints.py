"""Addresses an operator gives on the command line, checked before anything binds or connects.

Every daemon takes ZeroMQ addresses (``tcp://HOST:PORT``, ``ipc:///path``) and a metrics
port. libzmq reports a bad one as ``ZMQError: Invalid argument`` deep in a traceback, and it
*replaces* a live ``ipc://`` socket file when a second process binds the same path (the
first process keeps its old connections, and every new one goes to the second). The checks
here run at start-up, before the daemon binds anything, and raise :class:`AddressError`,
whose message is one line naming the flag, the value, the reason and what to do.

- :func:`check_connect`: a client's address (``--broker``): scheme, syntax, host resolvable.
- :func:`check_bind`: a server's address (``--ingress``, ``--egress``): the same, plus a TCP
  port that another socket listens on (tried with a bind, as libzmq binds: SO_REUSEADDR) or
  an ``ipc://`` path that another process answers on (tried with a connect; a stale file
  nobody listens on may be replaced, a file that is not a socket may not).
- :func:`check_port`: a TCP port for an HTTP server (``--metrics-port``).
- :func:`ipc_owner` / :func:`remove_ipc`: remove an ``ipc://`` socket file at exit only if it
  is still the one this process bound (same device, inode and change time).
- :func:`reach`: who can reach a listening address, in words (for ``--insecure`` warnings).

A check is a snapshot: another process may bind in the moment between the check and the
bind, and the bind then fails as it always did. The checks catch the common case (a second
``docker compose up``, a copied command line) before it does harm.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import stat
from dataclasses import dataclass

from feedline.errors import AddressError as AddressError

SCHEMES = ("tcp", "ipc")
# sun_path is 108 bytes on Linux, one of them the terminating NUL.
_SUN_PATH_MAX = 107


@dataclass(frozen=True)
class Endpoint:
    """A parsed address: ``tcp`` with ``host`` and ``port`` (None: any, ``*``), or ``ipc``
    with ``path`` (a leading ``@`` is Linux's abstract namespace)."""

    addr: str
    scheme: str
    host: str = ""
    port: int | None = None
    path: str = ""

    @property
    def wildcard(self) -> bool:
        return self.scheme == "tcp" and self.host in ("*", "0.0.0.0")


def parse(addr: str, flag: str) -> Endpoint:
    """Split ``addr`` into its parts; :class:`AddressError` for a missing or unknown scheme, a
    missing host or port, or a port that is not a number in 1..65535 (``*`` or 0 for a
    server's "any free port")."""
    addr = addr.strip()
    if "://" not in addr:
        raise AddressError(f"{flag} {addr}: no scheme; use {_hint(addr)}")
    scheme, rest = addr.split("://", 1)
    if scheme not in SCHEMES:
        raise AddressError(f"{flag} {addr}: unknown scheme {scheme!r}; use tcp://HOST:PORT or "
                           "ipc:///path")
    if scheme == "ipc":
        if not rest:
            raise AddressError(f"{flag} {addr}: no path; use ipc:///path/to/socket")
        return Endpoint(addr, scheme, path=rest)
    host, sep, port_text = rest.rpartition(":")
    if not sep or not host:
        raise AddressError(f"{flag} {addr}: needs a host and a port; use tcp://HOST:PORT "
                           "(e.g. tcp://127.0.0.1:7878)")
    if host.startswith("["):
        raise AddressError(f"{flag} {addr}: IPv6 addresses are not supported (feedline's "
                           "sockets are IPv4); use an IPv4 address or a host name")
    if port_text == "*":
        return Endpoint(addr, scheme, host=host, port=None)
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise AddressError(f"{flag} {addr}: port {port_text!r} is not a number in 1..65535; "
                           "use tcp://HOST:PORT")
    return Endpoint(addr, scheme, host=host, port=int(port_text) or None)


def _hint(addr: str) -> str:
    """The address the operator probably meant (``host:port`` -> ``tcp://host:port``)."""
    for scheme in SCHEMES:
        if addr.startswith(f"{scheme}:"):  # "ipc:/tmp/x", "tcp:/h:1": slashes missing
            rest = addr[len(scheme) + 1:].lstrip("/")
            return f"ipc:///{rest}" if scheme == "ipc" else f"tcp://{rest}"
    if addr.startswith("/"):
        return f"ipc://{addr}"
    host, sep, port = addr.rpartition(":")
    if sep and port.isdigit():
        return f"tcp://{host or '127.0.0.1'}:{port}"
    return "tcp://HOST:PORT or ipc:///path"


def _resolve(ep: Endpoint, flag: str) -> str:
    """The IPv4 address of ``ep.host`` (``*`` is 0.0.0.0, an interface name its address)."""
    if ep.host == "*":
        return "0.0.0.0"
    try:
        return str(ipaddress.IPv4Address(ep.host))
    except ValueError:
        pass
    nic = _interface_address(ep.host)
    if nic is not None:
        return nic
    try:
        infos = socket.getaddrinfo(ep.host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise AddressError(f"{flag} {ep.addr}: cannot resolve host {ep.host!r} ({reason}); "
                           "check the name, or give an IP address") from None
    return str(infos[0][4][0])


def _interface_address(name: str) -> str | None:
    """The IPv4 address of the network interface ``name`` (libzmq binds ``tcp://eth0:P``)."""
    try:
        if name not in {n for _, n in socket.if_nameindex()}:
            return None
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = struct.pack("256s", name.encode()[:15])
            res = fcntl.ioctl(s.fileno(), 0x8915, req)  # SIOCGIFADDR
        return socket.inet_ntoa(res[20:24])
    except (OSError, ImportError):
        return None


def check_connect(addr: str, flag: str, resolve: bool = True) -> Endpoint:
    """A client's address: parsed, and its host resolvable (an ipc path may not exist yet: the
    server may start later). ``resolve=False``: the syntax only (a library's caller, whose
    broker's name may appear in DNS after it starts: libzmq resolves it on each attempt)."""
    ep = parse(addr, flag)
    if ep.scheme == "tcp":
        if ep.port is None:
            raise AddressError(f"{flag} {addr}: a client needs the server's port; use "
                               "tcp://HOST:PORT")
        if ep.host in ("*", "0.0.0.0"):
            raise AddressError(f"{flag} {addr}: {ep.host} is a listening address, not a host "
                               f"to connect to; use tcp://127.0.0.1:{ep.port} or the server's "
                               "name")
        if resolve:
            _resolve(ep, flag)
    return ep


def check_bind(addr: str, flag: str) -> Endpoint:
    """A server's address: parsed, resolvable, and free (see the module's docstring)."""
    ep = parse(addr, flag)
    if ep.scheme == "ipc":
        _check_ipc_free(ep, flag)
        return ep
    host = _resolve(ep, flag)
    if ep.port is not None:
        _check_tcp_free(host, ep.port, f"{flag} {addr}",
                        f"stop the process that holds it (another feedline broker?) or give "
                        f"{flag} another port")
    return ep


def check_port(port: int, addr: str = "0.0.0.0", flag: str = "--metrics-port") -> None:
    """A TCP port an HTTP server will bind on ``addr``: free, or :class:`AddressError`.
    0 means "no server" and is not checked."""
    if not port:
        return
    if not 0 < port <= 65535:
        raise AddressError(f"{flag} {port}: not a port number in 1..65535 (0 turns metrics "
                           "off)")
    host = _resolve(Endpoint(f"tcp://{addr}:{port}", "tcp", addr, port), "--metrics-addr")
    _check_tcp_free(host, port, f"{flag} {port}",
                    f"give {flag} another port, or {flag} 0 to serve no metrics")


def _check_tcp_free(host: str, port: int, what: str, todo: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As libzmq and Python's HTTP servers bind: a port in TIME_WAIT after a restart is
        # free, one with a listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise AddressError(f"{what}: port {port} on {host} is already in use; "
                                   f"{todo}") from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise AddressError(f"{what}: {host} is not an address of this host; bind "
                                   "one of its own addresses, 127.0.0.1 or 0.0.0.0") from None
            if e.errno == errno.EACCES:
                raise AddressError(f"{what}: port {port} needs privileges (ports below 1024 "
                                   "are reserved); use a port above 1023") from None
            raise AddressError(f"{what}: cannot bind {host}:{port} ({e.strerror})") from None


def _unix_name(path: str) -> str:
    return "\0" + path[1:] if path.startswith("@") else path


def _answers(path: str) -> bool:
    """Whether a process accepts connections on the unix socket ``path`` now."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(_unix_name(path))
        except OSError:  # ECONNREFUSED: a stale file; ENOENT: none; a timeout: a full backlog
            return False
        return True


def _check_ipc_free(ep: Endpoint, flag: str) -> None:
    path = ep.path
    if len(path.encode()) > _SUN_PATH_MAX:
        raise AddressError(f"{flag} {ep.addr}: the path is {len(path.encode())} bytes, longer "
                           f"than a unix socket allows ({_SUN_PATH_MAX}); use a shorter path")
    if path.startswith("@"):  # abstract: no file, but a live name is as taken as a file
        if _answers(path):
            raise AddressError(f"{flag} {ep.addr}: another process is listening there "
                               f"(another feedline broker?); stop it or give {flag} another "
                               "name")
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise AddressError(f"{flag} {ep.addr}: directory {parent} does not exist; create it "
                           "or use a path in an existing directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise AddressError(f"{flag} {ep.addr}: cannot create a socket in {parent} (no write "
                           "permission); use a directory this user can write to")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise AddressError(f"{flag} {ep.addr}: {path} exists and is not a socket; binding "
                           "would delete it. Move it away or use another path")
    if _answers(path):
        raise AddressError(f"{flag} {ep.addr}: another process is listening on {path} "
                           f"(another feedline broker?); binding would take it over. Stop "
                           f"that process or give {flag} another path")
    # A socket file nobody answers on was left by a process that died: libzmq replaces it.


# device, inode and change time: an inode number freed by an unlink is soon reused.
FileId = tuple[int, int, int]


def ipc_owner(addr: str) -> FileId | None:
    """(device, inode, ctime) of the socket file of an ``ipc://`` address just bound by this process
    (None for tcp://, abstract names and missing files); give it to :func:`remove_ipc`."""
    if not addr.startswith("ipc://") or addr[len("ipc://"):].startswith("@"):
        return None
    try:
        st = os.lstat(addr[len("ipc://"):])
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns) if stat.S_ISSOCK(st.st_mode) else None


def remove_ipc(addr: str, owner: FileId | None = None) -> bool:
    """Remove the socket file of ``addr`` at exit if it is still ours; True if removed.

    With ``owner`` (from :func:`ipc_owner` right after the bind) the file is removed only if
    it is that same file: a socket another process bound at the path since then stays. Without
    it, only a file nobody answers on is removed (call it after closing the socket).
    """
    if not addr.startswith("ipc://") or addr[len("ipc://"):].startswith("@"):
        return False
    path = addr[len("ipc://"):]
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISSOCK(st.st_mode):
        return False
    if owner is not None and (st.st_dev, st.st_ino, st.st_ctime_ns) != owner:
        return False
    if owner is None and _answers(path):
        return False
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def reach(addr: str) -> str:
    """Who can connect to a server listening on ``addr``, in words."""
    try:
        ep = parse(addr, "")
    except AddressError:
        return f"whoever can reach {addr}"
    if ep.scheme == "ipc":
        return "processes on this host that can open the socket file"
    port = ep.port if ep.port is not None else "(any)"
    if ep.wildcard:
        return f"any host that can reach port {port} on any interface of this machine"
    return f"any host that can reach {ep.host}:{port}"


__all__ = ["AddressError", "Endpoint", "check_bind", "check_connect", "check_port",
           "ipc_owner", "parse", "reach", "remove_ipc"]
