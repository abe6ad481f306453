"""The elastic driver: ``ringrun --min-np/--max-np`` (Horovod's elastic ``horovodrun``).

The driver starts workers on the discovered hosts, forms *generations* (a rank for every
worker, the endpoint records relayed), and forms a new one when workers fail or hosts
come and go. Workers talk to it through ``_client.py``; the rest of a generation's life
(the ring, the engine's fail-fast) is the ordinary job's. How a worker is started is a
``Spawn`` (``processes.py``): processes for ``ringrun``, Ray actors for
``ringreduce.ray``'s elastic executor, Spark tasks for ``ringreduce.spark.run_elastic``;
hosts come from a ``Discovery`` (``discovery.py``, Ray's nodes, Spark's tasks).

State machine of a worker, as the driver sees it::

    starting --join--> waiting --generation formed--> member --join--> waiting ...
        \\                 \\                            \\
         `--exit--> gone    `--exit--> gone              `--exit--> gone

Invariants:

* A generation is formed only when every live worker is ``waiting`` (so no worker is
  left behind in an old one) and at least ``min_np`` are; ranks go by age (the oldest
  worker is rank 0, so ``state.sync()`` spreads committed state, never a fresh
  worker's), grouped by host.
* A worker that exits non-zero gets its host blacklisted (as Horovod): no new workers
  start there and the host's other workers are told to leave at their next join. With
  ``--blacklist-cooldown-range`` the host only cools down (``hosts.py``: blacklisted ->
  cooling down -> usable, the period growing with each blacklisting); once usable it is
  like a host added by discovery: the job grows back at the members' next commit. A
  worker that exits 0 on its own means training is done: no more generations form.
* Every host blacklisted and no worker left: the job ends at once, unless a host only
  cools down, no generation's state is lost (none completed its rendezvous) and that
  cooldown ends within ``elastic_timeout`` of the first such moment since the last
  generation formed; then the driver waits for it (a program failing everywhere still
  ends, its cooldowns growing past that bound).
* Hosts added or removed by discovery bump ``serial``; the members learn it at their
  next ``commit()`` (``updates``) and rejoin together.
* Nothing waits forever: a generation that cannot form within ``elastic_timeout``
  (too few slots, a worker that never rejoins) ends the job naming who is missing.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Optional

from ..exceptions import InvalidInputError
from ..launcher import (
    HostSlots,
    OutputSettings,
    _exit_code,
    _how,
    _say,
    is_local_host,
    signals_to,
)
from ._client import DRIVER_VAR, WORKER_VAR, tune
from .discovery import Discovery
from .hosts import Blacklist
from .processes import ProcessSpawner, Spawn, WorkerProcess

__all__ = ["ElasticSettings", "launch_elastic"]


@dataclass
class ElasticSettings:
    """What ``ringrun``'s elastic flags say."""

    min_np: int
    max_np: int
    np: int
    elastic_timeout: float = 600.0
    reset_limit: Optional[int] = None
    discovery_interval: float = 1.0
    cooldown_range: Optional[tuple[float, float]] = None  # None: blacklisted for good


@dataclass
class Worker:
    """One worker process and where it stands."""

    wid: str
    age: int
    host: str
    slot: int
    proc: WorkerProcess
    state: str = "starting"  # starting, waiting, member, gone
    leaving: bool = False
    told_to_leave: bool = False  # was answered "leave" (it exits 0: not a finished job)
    generation: int = -1  # the last one it was assigned to
    wants_sync: bool = True  # what it asked for at its last join
    connected: bool = False  # was in a generation whose rendezvous completed (has state)
    code: Optional[int] = None


class ElasticDriver:
    """Starts workers, forms generations and answers the workers' requests."""

    handshake_seconds = 30.0  # a new connection's time to authenticate

    def __init__(self, spawn: Spawn, discovery: Discovery, settings: ElasticSettings,
                 driver_addr: Optional[str], grace: float) -> None:
        self.spawn, self.discovery, self.s = spawn, discovery, settings
        self.grace = grace
        self.cond = threading.Condition()
        self.workers: dict[str, Worker] = {}
        self.ages = 0
        self.blacklist = Blacklist(settings.cooldown_range)
        self.hosts: list[HostSlots] = []
        self.generation, self.members = -1, []
        self.records: dict[int, bytes] = {}
        self.sync = True  # whether the current generation's members run state.sync()
        self.any_connected = False  # some generation's rendezvous completed
        self.serial, self.formed_serial, self.removed_only = 0, 0, True
        self.finished = False  # a worker exited 0 on its own
        self.failure: Optional[str] = None  # why the driver ends the job
        self.code: Optional[int] = None
        self.target = settings.np
        self.waiting_since: Optional[float] = None
        self.formed_at = float("inf")  # when the current generation formed
        self.key = secrets.token_hex(32)
        self.listener: Optional[socket.socket] = socket.create_server(("0.0.0.0", 0))
        self.port = self.listener.getsockname()[1]
        self.driver_addr = driver_addr
        self.signum: Optional[int] = None
        self.stop_at: Optional[float] = None  # when to stop the workers that are left
        self.no_hosts_since: Optional[float] = None
        # since when every host was blacklisted with no worker left (reset by a new
        # generation), and whether the wait for a cooldown was announced
        self.cooling_since: Optional[float] = None
        self.awaiting_cooldown = False

    # ----------------------------------------------------------------- workers
    def _address(self) -> str:
        if self.driver_addr:
            return self.driver_addr
        if all(is_local_host(h.host) for h in self.hosts):
            return "127.0.0.1"
        return socket.gethostname()

    def start_worker(self, host: HostSlots, slot: int) -> None:
        self.ages += 1
        wid = f"w{self.ages}"
        mine = {DRIVER_VAR: f"{self._address()}:{self.port}", WORKER_VAR: wid,
                "RINGREDUCE_SECRET": self.key}
        try:
            proc = self.spawn(wid, host, slot, mine)
        except OSError as err:
            _say(f"cannot start worker {wid} on {host.host} ({err}); "
                 f"{self.blacklist_host(host.host)}")
            return
        self.workers[wid] = Worker(wid, self.ages, host.host, slot, proc)
        _say(f"started worker {wid} on {host.host} (slot {slot}, {proc.where})")

    def live(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.state != "gone"]

    def staying(self) -> list[Worker]:
        return [w for w in self.live() if not w.leaving]

    def fill(self) -> None:
        """Start workers on free slots of usable hosts, up to the target size."""
        if self.finished or self.failure or self.code is not None:
            return
        used: dict[str, set] = {}
        for w in self.live():
            used.setdefault(w.host, set()).add(w.slot)
        for h in self.hosts:
            if h.host in self.blacklist:
                continue
            for slot in range(h.slots):
                if len(self.staying()) >= min(self.target, self.s.max_np):
                    return
                if slot not in used.get(h.host, set()):
                    self.start_worker(h, slot)
                    used.setdefault(h.host, set()).add(slot)

    def reap(self) -> None:
        """Note workers that exited; blacklist the host of one that failed."""
        for w in self.live():
            code = w.proc.poll()
            if code is None:
                continue
            w.proc.kill()  # what it left behind (its session's processes, its actor)
            w.state, w.code = "gone", code
            if code == 0 and not w.leaving:
                if not self.finished:
                    _say(f"worker {w.wid} on {w.host} finished training; waiting for the "
                         "others")
                self.finished = True
            elif code != 0:
                self.worker_failed(w)
            self.cond.notify_all()

    def worker_failed(self, w: Worker) -> None:
        if self.code is not None:  # the job is ending anyway
            _say(f"worker {w.wid} on {w.host} {_how(w.code)}")
            return
        left = len(self.staying())
        what = f"worker {w.wid} on {w.host} ({w.proc.where}) {_how(w.code)}"
        if self.finished:  # no generation forms again: no host to blacklist
            _say(f"{what}; {left} worker{'s' * (left != 1)} left")
            if w.generation == self.generation:  # a member of the last generation failed
                self.code = self.code or _exit_code(w.code)
            return
        _say(f"{what}; {self.blacklist_host(w.host)}; {left} worker{'s' * (left != 1)} left")
        for other in self.live():
            if other.host == w.host:
                other.leaving = True

    def blacklist_host(self, host: str) -> str:
        """Blacklist ``host`` (or restart nothing if it is already); say so for the log."""
        seconds = self.blacklist.add(host, time.monotonic())
        if seconds is None:  # a second worker of the host, failing with the first
            return f"host {host} is blacklisted already"
        if seconds == float("inf"):
            return f"blacklisting host {host}"
        return (f"blacklisting host {host} for {seconds:.1f} s (cooldown "
                f"{self.blacklist.times(host)} of this host)")

    def mark_leaving(self) -> None:
        """Which live workers leave at their next join: those already told to, those on a
        slot their host no longer lists, those on a blacklisted host. A host listed again,
        or back from its cooldown, keeps the workers that have not left."""
        slots = {h.host: h.slots for h in self.hosts}
        for w in self.live():
            w.leaving = (w.told_to_leave or w.slot >= slots.get(w.host, 0)
                         or w.host in self.blacklist)

    def check_cooldowns(self, now: float) -> None:
        """Hosts whose blacklist cooldown is over may take workers again. A listed one is
        like a host added by discovery (Horovod treats it so too): the job grows back
        towards --max-np, the members rejoining at their next commit."""
        back = self.blacklist.expire(now)
        if not back or self.finished or self.failure or self.code is not None:
            return
        listed = {h.host for h in self.hosts}
        for host in back:
            _say(f"host {host}'s blacklist cooldown is over; it can take workers again"
                 + ("" if host in listed else " once discovery lists it"))
        self.mark_leaving()
        if not listed.intersection(back):
            return
        if self.generation >= 0 and len(self.staying()) < self.s.max_np:
            self.serial += 1
            self.removed_only = False
        self.target = self.s.max_np

    # ---------------------------------------------------------------- discovery
    def discover(self) -> None:
        """Poll the host list; a change bumps ``serial`` and may start or retire workers.

        Called holding ``cond``; the script runs with it released, so that a slow script
        holds up no commit, join or exchange meanwhile."""
        self.cond.release()
        try:
            hosts = self.discovery.poll()
        finally:
            self.cond.acquire()
        if hosts is None or hosts == self.hosts:
            return
        before = {h.host: h.slots for h in self.hosts}
        now = {h.host: h.slots for h in hosts}
        added = [h for h, n in now.items() if n > before.get(h, 0) and h not in self.blacklist]
        removed = [h for h, n in before.items() if n > now.get(h, 0)]
        self.hosts = hosts
        if before:
            _say(f"hosts changed: {', '.join(f'{h.host}:{h.slots}' for h in hosts) or 'none'}")
        self.mark_leaving()
        # a change that moves no worker (an unused host gone, a host added at --max-np)
        # interrupts nobody
        grows = bool(added) and len(self.staying()) < self.s.max_np
        shrinks = any(w.leaving and w.host in removed for w in self.live())
        if before and (grows or shrinks) and self.generation >= 0:
            self.serial += 1
            self.removed_only = self.removed_only and not grows
        if added and before:
            self.target = self.s.max_np
        self.fill()

    # -------------------------------------------------------------- generations
    def try_form(self) -> None:
        """Form the next generation when every live worker waits and there are enough."""
        if self.failure or self.finished or self.code is not None:
            return
        live = self.live()
        ready = [w for w in live if w.state == "waiting"]
        if not ready or len(ready) != len(live):
            return
        staying = [w for w in ready if not w.leaving]
        if len(staying) < self.s.min_np:
            return
        if self.any_connected and not any(w.connected for w in staying):
            self.fail("no worker of the last generation is left to hand its state on")
            return
        if self.s.reset_limit is not None and self.generation >= self.s.reset_limit:
            self.fail(f"the reset limit ({self.s.reset_limit}) is reached")
            return
        # One answer for every member: a fresh worker syncs, so all must, and so must all
        # if any member asks (its attempt failed: the others may have seen an interrupt).
        self.sync = any(not w.connected or w.wants_sync for w in staying)
        self.generation += 1
        self.members = self.order(staying)
        self.records = {}
        self.formed_serial, self.removed_only = self.serial, True
        self.waiting_since, self.formed_at = None, time.monotonic()
        self.cooling_since = None
        for w in self.members:
            w.state, w.generation = "member", self.generation
        _say(f"generation {self.generation}: {len(self.members)} rank(s): " + ", ".join(
            f"{r}={w.wid}@{w.host}" for r, w in enumerate(self.members)))
        self.cond.notify_all()

    @staticmethod
    def order(workers: list[Worker]) -> list[Worker]:
        """Rank order: rank 0 is the oldest worker that has state (it was in a generation
        whose rendezvous completed; a worker whose only generation broke up while forming
        has none), then host by host, by age."""
        anchor = min(workers, key=lambda w: (not w.connected, w.age))
        first_age: dict[str, int] = {anchor.host: -1}
        for w in sorted(workers, key=lambda w: w.age):
            first_age.setdefault(w.host, w.age)
        return sorted(workers, key=lambda w: (first_age[w.host], w is not anchor, w.age))

    def fail(self, why: str) -> None:
        self.failure = why
        self.cond.notify_all()

    def broken_up(self) -> bool:
        """Whether the current generation is over (a member rejoined or exited), so the
        waiting workers wait for the others to rejoin, not for its next commit."""
        return self.generation < 0 or any(
            w.generation == self.generation and w.state in ("waiting", "gone")
            for w in self.workers.values())

    def check_timeout(self) -> None:
        """Stop the workers that hold up a generation for longer than --elastic-timeout:
        members that do not rejoin once theirs broke up, members that never send their
        record for a new one; end the job when too few workers are left."""
        now = time.monotonic()
        if self.finished or self.failure or self.exchange_overdue(now):
            self.waiting_since = None
            return
        live = self.live()
        waiting = [w for w in live if w.state == "waiting"]
        if not waiting or not self.broken_up():
            self.waiting_since = None  # new workers wait for the members' next commit
            return
        if self.waiting_since is None:
            self.waiting_since = now
        if now - self.waiting_since < self.s.elastic_timeout:
            return
        missing = [w for w in live if w.state != "waiting"]
        staying = len([w for w in waiting if not w.leaving])
        if missing and staying >= self.s.min_np:
            # a frozen or hung worker must not hold the others: stop it and go on
            self.kill(missing, "did not rejoin")
            self.waiting_since = None
            return
        why = (f"workers {', '.join(f'{w.wid}@{w.host} ({w.state})' for w in missing)} did "
               "not rejoin" if missing else
               f"only {staying} worker(s) are available, fewer than --min-np {self.s.min_np}"
               + self.cooling_note(now))
        self.fail(f"no new generation formed within --elastic-timeout "
                  f"{self.s.elastic_timeout:g} s: {why}")

    def exchange_overdue(self, now: float) -> bool:
        """Stop the members of a new generation that have not sent their endpoint record
        within --elastic-timeout of its forming (the others are waiting for them)."""
        if self.generation < 0 or len(self.records) == len(self.members) or \
                now - self.formed_at < self.s.elastic_timeout:
            return False
        late = [w for r, w in enumerate(self.members)
                if r not in self.records and w.state == "member"]
        self.kill(late, "did not send its endpoint record")
        self.formed_at = float("inf")
        return bool(late)

    def kill(self, workers: list[Worker], why: str) -> None:
        for w in workers:
            _say(f"worker {w.wid} on {w.host} ({w.state}) {why} within --elastic-timeout "
                 f"{self.s.elastic_timeout:g} s; stopping it")
            w.proc.kill()

    # ----------------------------------------------------------------- requests
    def serve(self) -> None:
        """Accept the workers' connections, one thread each (requests may block)."""
        while self.listener is not None:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                continue
            threading.Thread(target=self.answer, args=(sock,), daemon=True).start()

    def answer(self, sock: socket.socket) -> None:
        """Authenticate one connection (here, so that a silent one holds up nobody else),
        then answer its requests, one at a time, until it hangs up."""
        conn = authenticated(sock, self.key.encode(), self.handshake_seconds)
        if conn is None:
            return
        handlers = {"join": self.on_join, "exchange": self.on_exchange,
                    "updates": self.on_updates}
        with conn:
            while True:
                try:
                    request = conn.recv()
                    conn.send(handlers[request[0]](*request[1:]))
                except (OSError, EOFError):
                    return  # the worker went away
                except (KeyError, TypeError, IndexError):
                    return  # it spoke nonsense: nothing to answer

    def on_join(self, wid: str, wants_sync: bool = True) -> tuple:
        with self.cond:
            w = self.workers.get(wid)
            if w is None or w.state == "gone":
                return ("fail", f"unknown worker {wid}")
            w.state, last, w.wants_sync = "waiting", w.generation, wants_sync
            self.cond.notify_all()
            while True:
                if w.state == "gone":
                    return ("fail", "it exited")
                if w.leaving:
                    w.told_to_leave = True
                    return ("leave", f"its host {w.host} was removed from the job")
                if self.failure:
                    return ("fail", self.failure)
                if self.code is not None:
                    return ("fail", "ringrun is stopping the job")
                if self.finished:
                    return ("leave", "training finished while it was waiting to join")
                if w.state == "member" and w.generation > last:
                    return ("assign", self.generation, self.members.index(w),
                            len(self.members), bytes.fromhex(self.key), self.sync)
                self.cond.wait(1.0)

    def on_exchange(self, wid: str, generation: int, record: bytes) -> tuple:
        with self.cond:
            if generation != self.generation:
                return ("retry", f"generation {self.generation} replaced it")
            w = self.workers[wid]
            self.records[self.members.index(w)] = record
            self.cond.notify_all()
            while len(self.records) < len(self.members):
                broken = self.broken(generation)
                if broken:
                    return ("retry", broken)
                self.cond.wait(1.0)
            for w in self.members:
                w.connected = True
            self.any_connected = True
            return ("infos", [self.records[r] for r in range(len(self.members))])

    def broken(self, generation: int) -> Optional[str]:
        if generation != self.generation:
            return f"generation {self.generation} replaced it"
        if self.failure:
            return self.failure
        for rank, w in enumerate(self.members):
            if w.state == "gone":
                return f"rank {rank} (worker {w.wid} on {w.host}) {_how(w.code)}"
            if w.state == "waiting":
                return f"rank {rank} (worker {w.wid} on {w.host}) left it"
        return None

    def on_updates(self, wid: str, generation: int) -> tuple:
        with self.cond:
            changed = generation == self.generation and self.serial > self.formed_serial
            return ("updates", changed, changed and self.removed_only)

    # --------------------------------------------------------------- main loop
    def run(self, timeout: Optional[float]) -> int:
        """Drive the job until every worker has exited; return ringrun's exit code."""
        threading.Thread(target=self.serve, daemon=True, name="rr-elastic-serve").start()
        deadline = None if timeout is None else time.monotonic() + timeout
        next_discovery = 0.0
        with self.cond:
            while True:
                now = time.monotonic()
                if now >= next_discovery and not self.finished and not self.failure:
                    self.discover()
                    next_discovery = now + self.s.discovery_interval
                self.reap()
                self.check_cooldowns(now)
                self.fill()
                self.check_hosts(now)
                self.try_form()
                self.check_timeout()
                self.check_end(now, deadline, timeout)
                if not self.live() and (self.finished or self.code is not None or
                                        self.failure):
                    break
                self.cond.wait(0.05)
        self.close()
        return self.code or 0

    def check_end(self, now: float, deadline: Optional[float], timeout: Optional[float]) -> None:
        """Stop the workers on a signal or the timeout at once; when the driver ends the
        job, first tell the waiting workers why (they exit with that error) and stop the
        rest a moment later."""
        if self.code is None:
            if self.signum is not None:
                _say(f"received {signal.Signals(self.signum).name}; stopping the job")
                self.code, self.stop_at = 128 + self.signum, now
            elif deadline is not None and now >= deadline:
                _say(f"timed out after {timeout:g} s; stopping the job")
                self.code, self.stop_at = 124, now
            elif self.failure:
                _say(f"ending the job: {self.failure}")
                self.code, self.stop_at = 1, now + min(self.grace, 2.0)
        if self.stop_at is not None and now >= self.stop_at:
            self.stop_at = float("inf")
            self.stop()

    def check_hosts(self, now: float) -> None:
        """Fail when no worker is left and no host can take a new one (see
        ``all_blacklisted``), and after --elastic-timeout when discovery has found no host
        at all."""
        if self.live() or self.finished or self.failure:
            self.no_hosts_since, self.awaiting_cooldown = None, False
            return
        usable = [h for h in self.hosts if h.host not in self.blacklist]
        if self.hosts and not usable:
            self.all_blacklisted(now)
        elif not self.hosts:
            self.no_hosts_since = self.no_hosts_since or now
            if now - self.no_hosts_since >= self.s.elastic_timeout:
                self.fail(f"host discovery found no host within --elastic-timeout "
                          f"{self.s.elastic_timeout:g} s")

    def all_blacklisted(self, now: float) -> None:
        """No worker is left and every listed host is blacklisted: end the job, or wait for
        a cooldown that can still help (see the module docstring)."""
        why = "every host is blacklisted (a worker failed on each)"
        listed = {h.host for h in self.hosts}
        cooling = {h: s for h, s in self.blacklist.cooling(now).items() if h in listed}
        if not cooling:
            self.fail(why)
        elif self.any_connected:  # fresh workers would have no state to start from
            self.fail(f"{why}, and no worker with the training state is left")
        else:
            host = min(cooling, key=lambda h: cooling[h])
            if self.cooling_since is None:
                self.cooling_since = now
            if now + cooling[host] > self.cooling_since + self.s.elastic_timeout:
                self.fail(f"{why}; the first cooldown to end (host {host}'s) ends in "
                          f"{cooling[host]:.1f} s, past --elastic-timeout "
                          f"{self.s.elastic_timeout:g} s")
            elif not self.awaiting_cooldown:
                self.awaiting_cooldown = True
                _say(f"{why}; waiting {cooling[host]:.1f} s for host {host}'s cooldown")

    def cooling_note(self, now: float) -> str:
        """``; host b cools down (3.2 s left)`` for an error message, or nothing."""
        cooling = self.blacklist.cooling(now)
        return "".join(f"; host {h} cools down ({s:.1f} s left)" for h, s in cooling.items())

    def stop(self) -> None:
        for w in self.live():
            w.proc.terminate()
        kill_at = time.monotonic() + self.grace

        def killer() -> None:
            while time.monotonic() < kill_at and any(w.proc.poll() is None
                                                     for w in list(self.workers.values())):
                time.sleep(0.05)
            for w in list(self.workers.values()):
                w.proc.kill()

        threading.Thread(target=killer, daemon=True).start()

    def close(self) -> None:
        listener, self.listener = self.listener, None
        try:
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
        except OSError:
            pass
        listener.close()
        for w in self.workers.values():
            w.proc.close(5)


def authenticated(sock: socket.socket, key: bytes, seconds: float) -> Optional[Connection]:
    """An accepted socket as a ``multiprocessing`` connection once its peer proved it knows
    ``key`` (what ``Listener.accept`` does, but on the caller's thread, not the accept
    thread); None, the socket closed, for a stranger, a wrong key or ``seconds`` of
    silence. Its reads then wait as long as it takes."""
    tune(sock.fileno())
    # A worker answers the challenge at once; a connection that stays silent is not
    # one, and must not hold a thread and its socket for the rest of the job.
    _receive_timeout(sock, seconds)
    conn = Connection(sock.detach())
    try:
        deliver_challenge(conn, key)
        answer_challenge(conn, key)
    except (OSError, EOFError, AuthenticationError):
        conn.close()
        return None
    with socket.socket(fileno=os.dup(conn.fileno())) as same:
        _receive_timeout(same, 0)  # requests come as rarely as commits
    return conn


def _receive_timeout(sock: socket.socket, seconds: float) -> None:
    """Make blocking reads of ``sock`` fail after ``seconds`` (0: never). SO_RCVTIMEO, not
    ``settimeout``: Connection reads the descriptor with os.read, and settimeout would make
    it non-blocking."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                    struct.pack("ll", whole, int((seconds - whole) * 1e6)))


def launch_elastic(command: Sequence[str], discovery: Discovery, settings: ElasticSettings, *,
                   env: Optional[dict] = None, ssh_command: Optional[str] = None,
                   ssh_port: Optional[int] = None, driver_addr: Optional[str] = None,
                   prefix_output: bool = True, timeout: Optional[float] = None,
                   grace: float = 5.0, output: Optional[OutputSettings] = None) -> int:
    """Run an elastic job (what ``ringrun --min-np ...`` does); return the exit code.

    Parameters
    ----------
    command : sequence of str
        Every worker's program.
    discovery : Discovery
        Where the hosts come from (a fixed list or a discovery script).
    settings : ElasticSettings
        ``min_np``, ``max_np``, the initial ``np``, ``elastic_timeout``, ``reset_limit``,
        ``cooldown_range`` (``(MIN, MAX)`` seconds a failed host is blacklisted for, growing
        with each failure there; None: for good).
    env, ssh_command, ssh_port, prefix_output, timeout, grace :
        As for ``ringreduce.launcher.launch``.
    output : OutputSettings, optional
        As for ``launch``, with a folder ``worker.<N>`` per worker (N counts the workers
        started, from 1) instead of ``rank.<rank>``: a worker's rank changes with resets.
    driver_addr : str, optional
        The address workers reach this driver at (default 127.0.0.1 for a local job,
        else this host's name).

    Returns
    -------
    int
        0 once training finished on the last generation; 1 when the driver ended the job
        (reason printed); 124 on timeout; 128+N on signal N; else a failed worker's code
        after training had finished elsewhere.
    """
    if not command:
        raise InvalidInputError("no command given")
    if not 1 <= settings.min_np <= settings.np <= settings.max_np:
        raise InvalidInputError(f"need 1 <= --min-np ({settings.min_np}) <= -np "
                                f"({settings.np}) <= --max-np ({settings.max_np})")
    spawn = ProcessSpawner(command, dict(env or {}), ssh_command, ssh_port, prefix_output,
                           output)
    return drive(ElasticDriver(spawn, discovery, settings, driver_addr, grace), timeout)


def drive(driver: ElasticDriver, timeout: Optional[float]) -> int:
    """Run ``driver`` to the end of its job (its exit code), with SIGINT/SIGTERM stopping
    the job; its workers are stopped however this ends."""
    with signals_to(driver):
        try:
            return driver.run(timeout)
        finally:
            with driver.cond:
                if driver.live():  # an exception in the driver itself: stop everything
                    driver.grace = 0
                    driver.stop()
