"""A dead or hung rank stops the run within ``--collective-timeout``, with one line naming it and the phase.

Every rank runs a daemon thread that, every ``interval`` seconds, writes a heartbeat (time, phase, step, pid, host)
into the launch's TCPStore (torchrun / accelerate launch host it in the launcher, so it answers even when a worker
is stopped) and checks its own main thread: when ``easy_context.phase.TRACKER`` has not moved (no collective
entered or left) for ``--collective-timeout`` seconds, the rank is waiting on a peer that does not answer. The
lowest rank whose heartbeat is fresh prints one line naming the silent rank(s) (heartbeat age, their last phase
and step, pid and host) and this rank's own phase; every stuck rank exits with ``EXIT_LOST_RANK``, and the
launcher stops the rest (a SIGSTOPped worker ignores SIGTERM until continued: torch elastic SIGKILLs it after
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s by default).

The process group's own timeout is set a little longer (``backstop_timeout``): the watchdog speaks first (NCCL's
timeout aborts the process without a word about which peer was missing), torch's timeout remains the backstop.
A rank that fails on its own (out of memory, a failed checkpoint write) records why under its exit key; a peer that
then sees the connection drop finds the reason there and exits quietly instead of reporting a second fault.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time

from easy_context.phase import TRACKER

EXIT_LOST_RANK = 4


def backstop_timeout(timeout: float) -> float:
    """torch's process-group timeout: the watchdog's plus 10% (at least 10 s)."""
    return timeout + max(10.0, 0.1 * timeout)


def heartbeat_interval(timeout: float) -> float:
    return min(10.0, max(0.5, timeout / 10))


class Watchdog:
    def __init__(self, rank: int, world: int, timeout: float, prog: str = "train.py"):
        self.rank, self.world, self.timeout, self.prog = rank, world, timeout, prog
        self.interval = heartbeat_interval(timeout)
        env = os.environ.get
        ns = f"easy_context/faults/{env('TORCHELASTIC_RUN_ID', '')}/{env('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.keys = lambda kind, r: f"{ns}/{kind}/{r}"  # noqa: E731
        self.store = self._connect()
        self.armed = threading.Event()
        self._stop = threading.Event()
        self.beat()
        self.thread = threading.Thread(target=self._run, name="easy_context-watchdog", daemon=True)
        self.thread.start()

    def _connect(self):
        """A client of the launch's store (its own connection: the heartbeat thread never shares a socket)."""
        import torch.distributed as dist
        try:
            return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                 timeout=datetime.timedelta(seconds=min(10.0, self.timeout)))
        except Exception as e:  # noqa: BLE001 - the watchdog still stops a hung rank, it only cannot name peers
            print(f"{self.prog}: warning: rank {self.rank}: no heartbeat store ({e}); a hung peer will stop the "
                  "run without being named", file=sys.stderr, flush=True)
            return None

    # ---------------------------------------------------------------------------------- heartbeats
    def beat(self) -> None:
        if self.store is None:
            return
        rec = {"t": time.time(), "phase": TRACKER.current or TRACKER.last, "step": TRACKER.step, "pid": os.getpid(),
               "host": socket.gethostname()}
        try:
            self.store.set(self.keys("hb", self.rank), json.dumps(rec))
        except Exception:  # noqa: BLE001 - the store's host is gone: the timeout below still fires
            pass

    def record_exit(self, reason: str) -> None:
        """Tell the peers why this rank is leaving (before the process exits and its sockets close)."""
        if self.store is not None:
            try:
                self.store.set(self.keys("exit", self.rank), reason)
            except Exception:  # noqa: BLE001
                pass

    def peers(self) -> dict[int, dict]:
        """Every rank's last heartbeat (``age`` in seconds added) and exit reason, as far as the store answers."""
        out = {}
        if self.store is None:
            return out
        now = time.time()
        for r in range(self.world):
            rec = {}
            try:
                if self.store.check([self.keys("exit", r)]):
                    rec["exit"] = self.store.get(self.keys("exit", r)).decode()
                if self.store.check([self.keys("hb", r)]):
                    rec.update(json.loads(self.store.get(self.keys("hb", r))))
                    rec["age"] = now - rec["t"]
            except Exception:  # noqa: BLE001 - a store that stopped answering: report what we have
                break
            out[r] = rec
        return out

    def silent(self, peers: dict[int, dict]) -> list[int]:
        """Ranks whose heartbeat is older than 3 intervals, that never wrote one, or whose process is gone."""
        bad = []
        for r in range(self.world):
            rec = peers.get(r, {})
            gone = _proc_state(rec, r) == "gone"
            if r != self.rank and (rec.get("age", float("inf")) > 3 * self.interval or gone or "exit" in rec):
                bad.append(r)
        return bad

    # ---------------------------------------------------------------------------------- the report
    def describe(self, what: str) -> tuple[str | None, bool]:
        """(the line to print, or None when another rank prints it; whether a peer already explained itself)."""
        peers = self.peers()
        silent = self.silent(peers)
        if any("exit" in peers.get(r, {}) for r in silent):
            return None, True  # it printed its own reason (out of memory, disk full, ...)
        live = [r for r in range(self.world) if r not in silent]
        if peers and live and live[0] != self.rank:
            return None, False
        me = f"rank {self.rank} in {TRACKER.current or TRACKER.last or 'no collective yet'} of step {TRACKER.step + 1}"
        if not peers:
            return (f"{what} ({me}); the heartbeat store does not answer (its host, the launcher or rank 0, is "
                    f"gone or stopped); rerun with --resume"), False
        if not silent:
            where = "; ".join(f"rank {r} in {p.get('phase')} of step {p.get('step', -1) + 1}"
                              for r, p in sorted(peers.items()))
            return (f"{what} ({me}): every rank is alive but they wait in different collectives ({where}): a bug "
                    "(mismatched collectives), please report it"), False
        who = "; ".join(_peer_text(r, peers.get(r, {})) for r in silent)
        return (f"{what} ({me}): {who}; check that rank's host and GPU, then rerun with --resume "
                "(--collective-timeout sets the limit)"), False

    def lost_peer(self, what: str) -> tuple[str | None, bool]:
        """The main thread's collective failed (a peer's connection dropped): (the line to print if this rank
        prints it, whether a peer is missing at all). Waits up to 3 heartbeat intervals for the lost rank to turn
        silent (its last heartbeat may still be fresh)."""
        deadline = time.monotonic() + 3 * self.interval + 1
        while True:
            peers = self.peers()
            if self.silent(peers) or not peers:
                return self.describe(what)[0], True
            if time.monotonic() > deadline:
                return None, False
            time.sleep(min(0.5, self.interval))

    def fire(self) -> None:
        """The main thread made no progress for ``timeout`` seconds: report (one rank), exit every stuck rank."""
        line, _ = self.describe(f"no progress for {self.timeout:g}s (--collective-timeout)")
        if line:
            print(f"{self.prog}: error: {line}", file=sys.stderr, flush=True)
        self.record_exit("timeout")
        self.kill_stopped()
        os._exit(EXIT_LOST_RANK)

    def kill_stopped(self) -> None:
        """SIGKILL the silent peers of this host that are stopped (SIGSTOP): they cannot act on the launcher's
        SIGTERM, which torch elastic follows with SIGKILL only 30 s later (a fixed wait). Only a pid that is a
        worker of this launch (``same_launch``): the store's heartbeats are not authenticated."""
        import signal
        for r, rec in self.peers().items():
            if r != self.rank and _proc_state(rec, r) == "stopped":  # only this launch's own workers
                try:
                    os.kill(rec["pid"], signal.SIGKILL)
                except OSError:
                    pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat()
            if self.armed.is_set() and time.monotonic() - TRACKER.changed > self.timeout:
                self.fire()

    def arm(self, on: bool = True) -> None:
        TRACKER.changed = time.monotonic()
        (self.armed.set if on else self.armed.clear)()

    def close(self) -> None:
        self._stop.set()


def _proc_state(rec: dict, rank: int | None = None) -> str | None:
    """'gone' / 'stopped' / 'running' for a peer on this host (from /proc), None when it cannot be seen or the pid is
    not rank ``rank`` of this launch (heartbeats are unauthenticated: a reused or forged pid is never acted on)."""
    pid = rec.get("pid")
    if rec.get("host") != socket.gethostname() or not isinstance(pid, int):
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        state, ppid = fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return "gone"
    if state in ("Z", "X"):
        return "gone"
    if not same_launch(pid, ppid, rank):
        return None
    return {"T": "stopped", "t": "traced"}.get(state, "running")


def same_launch(pid: int, ppid: int, rank: int | None) -> bool:
    """Whether ``pid`` (parent ``ppid``) is a worker of this launch: a child of this process's parent (the launcher;
    never init), and, where /proc shows its environment, rank ``rank`` of this rendezvous (RANK, MASTER_PORT)."""
    if pid == os.getpid() or os.getppid() == 1 or ppid != os.getppid():
        return False
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return True  # not readable here: the parent check stands
    port = os.environ.get("MASTER_PORT", "").encode()
    return (rank is None or env.get(b"RANK") == str(rank).encode()) and env.get(b"MASTER_PORT", port) == port


def _peer_text(r: int, rec: dict) -> str:
    if not rec:
        return f"rank {r} never sent a heartbeat"
    where = (f"last heard {rec['age']:.0f}s ago in {rec.get('phase') or 'no collective yet'} of step "
             f"{rec.get('step', -1) + 1}")
    state = {"gone": "is gone (its process exited)", "stopped": "is stopped (SIGSTOP; killed now)",
             "traced": "is held by a debugger"}.get(
        _proc_state(rec, r), "is not responding (stopped, hung or dead)")
    return f"rank {r} (pid {rec.get('pid')} on {rec.get('host')}) {state}, {where}"
