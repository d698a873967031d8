"""Real ``redis-server`` processes for the tests of the remote tier: a single node and a
three-node cluster, on loopback, on free ports, each in a temporary directory of its own.

No fake stands in for the server. The fixtures of ``tests/conftest.py`` start the servers
on first use (:class:`RedisServers`), put them back in their initial state after each test
(:meth:`RedisServers.reset`: resumed, restarted if killed, no memory limit), delete each
test's keys (:meth:`RedisServers.clean_keyspace`) and stop them all at the end of the
session (:meth:`RedisServers.close`), whatever the tests did. A server also dies with the
test process if that is killed (``PR_SET_PDEATHSIG``), so that none is ever left behind.

Talking to the servers here goes through :func:`command`, a minimal RESP client on a plain
socket: the harness does not depend on the client library the tier uses (redis-py).

``ASYNCPIN_TEST_SERVER=valkey`` runs Valkey (``valkey-server``, ``valkey-cli``) instead of
Redis (``redis-server``, ``redis-cli``, the default).
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

HOST = "127.0.0.1"
SERVER = os.environ.get("ASYNCPIN_TEST_SERVER", "redis")
if SERVER not in ("redis", "valkey"):
    raise ValueError(f"ASYNCPIN_TEST_SERVER={SERVER!r}: use redis or valkey")
SERVER_BIN, CLI_BIN = f"{SERVER}-server", f"{SERVER}-cli"
START_TIMEOUT_S = 20.0  # start-up of a process, and forming or healing a cluster
STOP_TIMEOUT_S = 10.0
COMMAND_TIMEOUT_S = 10.0
# Ports the servers may take: below the kernel's ephemeral range (32768 on Linux), with the
# cluster bus port (port + 10000) free as well.
_PORTS = (15000, 22000)
_BUS_OFFSET = 10000

Reply = None | int | str | bytes | list["Reply"]


class _PortTaken(RuntimeError):
    pass


class RedisReplyError(Exception):
    """An error reply of the server (``-ERR ...``, ``-OOM ...``, ``-MOVED ...``)."""


def _required(reason: str | None) -> str | None:
    """``reason``, unless ``ASYNCPIN_TEST_SERVER_REQUIRED=1`` says that the servers must
    run (as in .ci/run's Valkey pass): then a RuntimeError, so that nothing is skipped."""
    if reason is not None and os.environ.get("ASYNCPIN_TEST_SERVER_REQUIRED") == "1":
        raise RuntimeError(f"ASYNCPIN_TEST_SERVER_REQUIRED=1, but {reason}")
    return reason


def available() -> str | None:
    """Why the servers cannot run here (a skip reason), or None when they can."""
    missing = [name for name in (SERVER_BIN, CLI_BIN) if shutil.which(name) is None]
    if missing:
        return _required(
            f"{' and '.join(missing)} not on PATH: install the {SERVER_BIN} package "
            f"(`apt-get install {SERVER_BIN}`; .ci/run does)"
        )
    return None


# --- a minimal RESP client -------------------------------------------------------------------


def _encode(args: tuple[str | bytes | int, ...]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self._file = sock.makefile("rb")

    def _line(self) -> bytes:
        line = self._file.readline()
        if not line.endswith(b"\r\n"):
            raise ConnectionError("the server closed the connection")
        return line[:-2]

    def reply(self) -> Reply:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RedisReplyError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self._file.read(n + 2)
            if len(data) != n + 2:
                raise ConnectionError("the server closed the connection")
            return data[:-2]
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.reply() for _ in range(n)]
        raise ConnectionError(f"not a RESP2 reply: {line!r}")


def command(port: int, *args: str | bytes | int, timeout: float = COMMAND_TIMEOUT_S) -> Reply:
    """Send one command to the server on ``port`` and return its reply (error replies raise
    :class:`RedisReplyError`; a server that is down raises ``OSError``)."""
    return pipeline(port, [args], timeout=timeout)[0]


def pipeline(
    port: int, commands: list[tuple[str | bytes | int, ...]], *, timeout: float = COMMAND_TIMEOUT_S
) -> list[Reply]:
    """Send several commands in one go; the first error reply raises."""
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        sock.sendall(b"".join(_encode(args) for args in commands))
        reader = _Reader(sock)
        return [reader.reply() for _ in commands]


def _fields(reply: Reply) -> dict[str, str]:
    """The ``name:value`` lines of an INFO or CLUSTER INFO reply."""
    assert isinstance(reply, bytes)
    pairs = (line.split(":", 1) for line in reply.decode().splitlines() if ":" in line)
    return {key: value for key, value in pairs}


# --- processes -------------------------------------------------------------------------------


_PRCTL = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)  # Linux only
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the test process dies, however it dies.
    (Resolved beforehand: the child of a threaded parent may not load libraries.)"""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _preexec() -> Callable[[], None] | None:
    """The death signal goes when the *thread* that started the child ends: only a child of
    the main thread gets it (one started from a worker thread is stopped by the fixtures'
    teardown all the same, but would die with the worker thread otherwise)."""
    return _die_with_parent if threading.current_thread() is threading.main_thread() else None


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(*, cluster: bool = False) -> int:
    """A loopback port that nothing listens on (and its cluster bus port, for a node)."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(*_PORTS)
        if _bindable(port) and (not cluster or _bindable(port + _BUS_OFFSET)):
            return port
    raise RuntimeError(f"no free port in {_PORTS}")


def tls_available() -> str | None:
    """Why a TLS server cannot run here (a skip reason), or None when it can."""
    if shutil.which("openssl") is None:
        return _required(
            "openssl not on PATH (it makes the TLS server's certificate): install openssl"
        )
    return None


def make_certificate(directory: Path) -> Path:
    """A self-signed certificate for 127.0.0.1 and its key, ``cert.pem`` and ``key.pem`` in
    ``directory``; returns the certificate's path (the CA a client trusts, too)."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "cert.pem", directory / "key.pem"
    argv = [
        "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-subj", f"/CN={HOST}", "-addext", f"subjectAltName=IP:{HOST}",
        "-keyout", str(key), "-out", str(cert),
    ]  # fmt: skip
    subprocess.run(argv, check=True, capture_output=True, timeout=COMMAND_TIMEOUT_S)
    return cert


class RedisServer:
    """One ``redis-server`` process on ``127.0.0.1:port``, no persistence, in ``workdir``.
    With ``tls=True`` it also listens for TLS on ``tls_port`` (``tls_url``), with the
    self-signed certificate ``certificate`` (the harness's own commands stay on ``port``).

    The fault methods act on the real process: :meth:`kill` (SIGKILL), :meth:`restart`
    (start again, empty, on the same port), :meth:`pause`/:meth:`resume` (SIGSTOP and
    SIGCONT), :meth:`set_maxmemory` (CONFIG SET). :meth:`reset` undoes them all.
    """

    def __init__(
        self, workdir: Path, *, port: int | None = None, cluster: bool = False, tls: bool = False
    ) -> None:
        self.workdir = workdir
        self.cluster = cluster
        self.port = port if port is not None else free_port(cluster=cluster)
        self.tls_port: int | None = None
        self.certificate: Path | None = None
        if tls:
            self.certificate = make_certificate(workdir / "tls")
            self.tls_port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._configured = False
        self._started_once = False

    def __repr__(self) -> str:
        return f"RedisServer({self.url}, pid={self._proc.pid if self._proc else None})"

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}"

    @property
    def tls_url(self) -> str:
        if self.tls_port is None:
            raise RuntimeError(f"{self!r} has no TLS port")
        return f"rediss://{HOST}:{self.tls_port}"

    @property
    def address(self) -> tuple[str, int]:
        return HOST, self.port

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError(f"{self!r} is not running")
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def log(self) -> Path:
        return self.workdir / "redis.log"

    def _argv(self) -> list[str]:
        argv = [
            SERVER_BIN,
            "--port", str(self.port),
            "--bind", HOST,
            "--protected-mode", "yes",
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "no",
            "--logfile", str(self.log),
            "--daemonize", "no",
        ]  # fmt: skip
        if self.tls_port is not None and self.certificate is not None:
            key = self.certificate.with_name("key.pem")
            argv += [
                "--tls-port", str(self.tls_port),
                "--tls-cert-file", str(self.certificate),
                "--tls-key-file", str(key),
                "--tls-ca-cert-file", str(self.certificate),
                "--tls-auth-clients", "no",
            ]  # fmt: skip
        if self.cluster:
            argv += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "2000",
            ]  # fmt: skip
        return argv

    def start(self) -> None:
        """Start the process and return once it answers PING. The first start takes another
        free port if another process took this one meanwhile; a restart keeps its port."""
        if self.alive:
            raise RuntimeError(f"{self!r} is already running")
        for _ in range(5):
            try:
                self._start()
                return
            except _PortTaken:
                if self._started_once:
                    raise
                self.log.unlink(missing_ok=True)
                self.port = free_port(cluster=self.cluster)
        raise RuntimeError("no free port after 5 tries")

    def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(
            self._argv(),
            cwd=self.workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C reaches pytest, whose teardown stops us
            preexec_fn=_preexec(),
        )
        self._paused = False
        self._configured = False
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self._proc.poll() is not None:
                self._proc = None
                log = self._log_tail()
                if "Address already in use" in log:
                    raise _PortTaken(log)
                raise RuntimeError(f"{SERVER_BIN} on port {self.port} exited: {log}")
            try:
                # Ours only if the answer names our process: another server on this port
                # answers too, until our process has found the port taken and exited.
                info = command(self.port, "INFO", "server", timeout=1.0)
                if _fields(info).get("process_id") == str(self._proc.pid):
                    self._started_once = True
                    return
            except (OSError, RedisReplyError):
                pass  # not listening yet, or still loading
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"{SERVER_BIN} on port {self.port} did not answer PING within "
                    f"{START_TIMEOUT_S} s: {self._log_tail()}"
                )
            time.sleep(0.01)  # poll interval of the readiness loop, not a wait for an event

    def _log_tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL if it lingers); a no-op when it is not
        running."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            if proc is not None:
                proc.wait()
            return
        if self._paused:
            proc.send_signal(signal.SIGCONT)
            self._paused = False
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL the process (as a crash would) and reap it."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        self._paused = False

    def restart(self) -> None:
        """Kill the process if it runs, then start a new one on the same port: it comes back
        empty (no persistence). A cluster node keeps its ``nodes.conf``, so it comes back as
        the same node with the same slots; :meth:`RedisCluster.wait_ok` waits for the
        cluster to see it again."""
        self.kill()
        self._proc = None
        for path in self.workdir.iterdir():
            if path.name not in ("nodes.conf", self.log.name, "tls"):
                path.unlink()
        self.start()

    def pause(self) -> None:
        """SIGSTOP the process: connections stay open, nothing is answered."""
        if not self.alive:
            raise RuntimeError(f"{self!r} is not running")
        os.kill(self.pid, signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT the process after :meth:`pause`."""
        if not self.alive:
            raise RuntimeError(f"{self!r} is not running")
        os.kill(self.pid, signal.SIGCONT)
        self._paused = False

    def command(self, *args: str | bytes | int) -> Reply:
        """One command on a fresh connection (see :func:`command`)."""
        return command(self.port, *args)

    def set_maxmemory(self, nbytes: int, policy: str = "noeviction") -> None:
        """CONFIG SET maxmemory and maxmemory-policy (``noeviction``, ``allkeys-lru``...)."""
        self.command("CONFIG", "SET", "maxmemory", nbytes, "maxmemory-policy", policy)
        self._configured = True

    def used_memory(self) -> int:
        return int(_fields(self.command("INFO", "memory"))["used_memory"])

    def flushall(self) -> None:
        self.command("FLUSHALL", "SYNC")

    def reset(self) -> bool:
        """Undo the faults: resume a paused process, restart a dead one, lift the memory
        limit. Returns whether anything was undone."""
        changed = False
        if self._paused:
            self.resume()
            changed = True
        if not self.alive:
            self.restart()
            changed = True
        if self._configured:
            self.set_maxmemory(0, "noeviction")
            self._configured = False
            changed = True
        return changed

    def keys(self, prefix: str) -> list[bytes]:
        """Every key of this server that starts with ``prefix`` (SCAN MATCH)."""
        found: list[bytes] = []
        cursor: str | bytes = "0"
        while True:
            reply = self.command("SCAN", cursor, "MATCH", _glob_escape(prefix) + "*", "COUNT", 1000)
            assert isinstance(reply, list) and isinstance(reply[0], bytes)
            assert isinstance(reply[1], list)
            cursor = reply[0]
            found += [key for key in reply[1] if isinstance(key, bytes)]
            if cursor == b"0":
                return found

    def unlink_prefix(self, prefix: str) -> int:
        """UNLINK every key of this server that starts with ``prefix`` (one key per command:
        the keys of a cluster node span slots). Returns how many went."""
        keys = self.keys(prefix)
        if not keys:
            return 0
        replies = pipeline(self.port, [("UNLINK", key) for key in keys])
        return sum(r for r in replies if isinstance(r, int))


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisCluster:
    """Three master nodes (no replicas) that cover all 16384 slots between them."""

    def __init__(self, root: Path, size: int = 3) -> None:
        self.nodes = [RedisServer(root / f"node{i}", cluster=True) for i in range(size)]

    def __repr__(self) -> str:
        return f"RedisCluster({[node.port for node in self.nodes]})"

    @property
    def url(self) -> str:
        """A start-up node's URL, for ``RedisCluster.from_url``: the client learns the rest."""
        return self.nodes[0].url

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def start(self) -> None:
        """Start the nodes, join them with ``redis-cli --cluster create``, wait for
        ``cluster_state:ok`` on every node."""
        for node in self.nodes:
            node.start()
        addresses = [f"{HOST}:{node.port}" for node in self.nodes]
        create = ["--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"]
        result = subprocess.run(
            [CLI_BIN, *create],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S * 3,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{CLI_BIN} --cluster create failed: {result.stdout}{result.stderr}")
        self.wait_ok()

    def wait_ok(self, timeout: float = START_TIMEOUT_S) -> None:
        """Return once every node says ``cluster_state:ok`` and knows every other node as
        connected; raise after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        states: dict[int, str] = {}
        while True:
            for node in self.nodes:
                try:
                    info = _fields(command(node.port, "CLUSTER", "INFO"))
                    states[node.port] = info.get("cluster_state", "?")
                    if states[node.port] == "ok" and int(info["cluster_known_nodes"]) != len(
                        self.nodes
                    ):
                        states[node.port] = f"knows {info['cluster_known_nodes']} nodes"
                except (OSError, RedisReplyError) as exc:
                    states[node.port] = repr(exc)
            if all(state == "ok" for state in states.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster is not ok after {timeout} s: {states}")
            time.sleep(0.05)  # poll interval, as for PING at start-up

    def node_for_slot(self, slot: int) -> RedisServer:
        """The node that serves ``slot``, as the cluster itself says (CLUSTER SLOTS)."""
        reply = command(self.nodes[0].port, "CLUSTER", "SLOTS")
        assert isinstance(reply, list)
        for entry in reply:
            assert isinstance(entry, list)
            low, high, master = entry[0], entry[1], entry[2]
            assert isinstance(low, int) and isinstance(high, int) and isinstance(master, list)
            if low <= slot <= high:
                port = master[1]
                return next(node for node in self.nodes if node.port == port)
        raise LookupError(f"no node serves slot {slot}")

    def keyslot(self, key: str | bytes) -> int:
        reply = command(self.nodes[0].port, "CLUSTER", "KEYSLOT", key)
        assert isinstance(reply, int)
        return reply

    def set_maxmemory(self, nbytes: int, policy: str = "noeviction") -> None:
        for node in self.nodes:
            node.set_maxmemory(nbytes, policy)

    def flushall(self) -> None:
        for node in self.nodes:
            node.flushall()

    def reset(self) -> bool:
        """Reset every node (see :meth:`RedisServer.reset`), then wait for the cluster to be
        ok: also when nothing was left to undo, since a node a test paused and resumed
        itself may still be marked failed by the others. Returns whether anything was
        undone."""
        changed = [node.reset() for node in self.nodes]
        self.wait_ok()
        return any(changed)

    def stop(self) -> None:
        errors: list[Exception] = []
        for node in self.nodes:
            try:
                node.stop()
            except Exception as exc:  # stop the others all the same
                errors.append(exc)
        if errors:
            raise errors[0]


_DIR_PREFIX = "asyncpin-redis-"


def _remove_stale_dirs() -> None:
    """Delete the directories of earlier sessions whose process is gone: a session killed
    outright (SIGKILL) had its servers killed with it, but not its directory deleted."""
    for path in Path(tempfile.gettempdir()).glob(f"{_DIR_PREFIX}*-*"):
        pid = path.name.removeprefix(_DIR_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


class RedisServers:
    """The servers of one test session: started on first use, stopped by :meth:`close`."""

    def __init__(self) -> None:
        self._root: Path | None = None
        self._server: RedisServer | None = None
        self._tls_server: RedisServer | None = None
        self._cluster: RedisCluster | None = None

    def _dir(self) -> Path:
        if self._root is None:
            _remove_stale_dirs()
            self._root = Path(tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-"))
        return self._root

    def server(self) -> RedisServer:
        if self._server is None:
            server = RedisServer(self._dir() / "single")
            try:
                server.start()
            except BaseException:
                server.stop()
                raise
            self._server = server
        return self._server

    def tls_server(self) -> RedisServer:
        """A single node that also listens for TLS (``tls_url``, ``certificate``)."""
        if self._tls_server is None:
            server = RedisServer(self._dir() / "tls-single", tls=True)
            try:
                server.start()
            except BaseException:
                server.stop()
                raise
            self._tls_server = server
        return self._tls_server

    def cluster(self) -> RedisCluster:
        if self._cluster is None:
            cluster = RedisCluster(self._dir() / "cluster")
            try:
                cluster.start()
            except BaseException:
                cluster.stop()
                raise
            self._cluster = cluster
        return self._cluster

    def started(self) -> Iterator[RedisServer]:
        """Every process started so far (the single node, the cluster's nodes)."""
        if self._server is not None:
            yield self._server
        if self._tls_server is not None:
            yield self._tls_server
        if self._cluster is not None:
            yield from self._cluster.nodes

    def reset(self) -> None:
        """Undo whatever faults a test left (see :meth:`RedisServer.reset`)."""
        for server in (self._server, self._tls_server):
            if server is not None:
                server.reset()
        if self._cluster is not None:
            self._cluster.reset()

    def clean_keyspace(self, prefix: str) -> int:
        """Delete every key that starts with ``prefix``, on every server and cluster node
        started so far. Returns how many went."""
        self.reset()
        return sum(node.unlink_prefix(prefix) for node in self.started())

    def close(self) -> None:
        """Stop every process and delete the temporary directory; a no-op when nothing was
        started."""
        try:
            if self._cluster is not None:
                self._cluster.stop()
            for server in (self._server, self._tls_server):
                if server is not None:
                    server.stop()
        finally:
            self._server = self._tls_server = self._cluster = None
            if self._root is not None:
                shutil.rmtree(self._root, ignore_errors=True)
                self._root = None
