"""Which peer rank is gone when a collective fails, so a job's last line names it rather than
the collective's ``Connection closed by peer`` (:func:`launch.jobs.runs.run_job`).

- On this node (same host name and node rank): the peers' pids, recorded at start-up
  (:func:`record_peers`), checked in ``/proc`` (:func:`dead_peers`): exact, and at once (a
  process in its exit path counts as gone: the kernel marks it before its sockets close; a
  short grace covers the rest).
- On other nodes, where no pid can be checked: every rank of a world that spans several nodes
  keeps a heartbeat in the job's rendezvous store (``torch.distributed.TCPStore`` at
  ``MASTER_ADDR:MASTER_PORT``, the store ``init_process_group``'s ``env://`` rendezvous started in
  global rank 0's process): a daemon thread with its own store client adds 1 to
  ``megaloss/alive/<rank>`` every :data:`HEARTBEAT_SECONDS`. After a failed collective a rank
  watches the counters for at most :data:`SILENCE_SECONDS` (:func:`silent_ranks`): a rank whose
  counter did not move and that did not mark its own exit (:func:`mark_exiting`, which every rank
  sets as it leaves :func:`launch.jobs.runs.run_job`) is named, with its node and host; when the
  store itself cannot be reached, global rank 0 (which holds it) is named unreachable; global rank
  0 keeps it up until the other ranks have left (:func:`linger_for_peers`, at most a few seconds).

A rank that leaves on an error of its own (or told of another's) marks it first
(:func:`mark_left`, before its process groups close): ``$MEGALOSS_ERROR_FILE.left<r>`` (the
file ``launch/multinode.sh`` names, one per node) and, over several nodes, ``megaloss/left/<r>``
in the store. A rank whose collective then fails finds the mark (:func:`left_on_error`) and
leaves quietly: its peer's own message is the cause, and that peer is never called dead.

A node is identified by (host name, node rank): DeepSpeed's ``launch.py`` sets ``CROSS_RANK``
(torchrun: ``GROUP_RANK``), so two launchers on one machine over loopback are two nodes.
"""
from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from typing import Any, Callable, List, NamedTuple, Optional, Sequence

__all__ = ["HEARTBEAT_SECONDS", "SILENCE_SECONDS", "Peer", "node_rank", "record_peers",
           "dead_peers", "silent_ranks", "mark_exiting", "peer_failure", "linger_for_peers",
           "leave", "mark_left", "left_on_error"]

HEARTBEAT_SECONDS = 1.0
# How long a surviving rank watches the counters: a live rank's moves about 3 times in it (its
# heartbeat thread only needs the GIL for a moment, which a collective or a kernel releases).
SILENCE_SECONDS = 3.0
_POLL_SECONDS = 0.25
# After a failed collective, how long a local peer's exit may take to show in /proc
_EXIT_GRACE_SECONDS = 2.0
_ALIVE, _EXITING, _LEFT = "megaloss/alive/{}", "megaloss/exiting/{}", "megaloss/left/{}"


class Peer(NamedTuple):
    host: str  # socket.gethostname()
    node: int  # node rank (node_rank())
    pid: int


_PEERS: List[Peer] = []  # every global rank's, from record_peers
_STORE: List[Any] = []  # this process's client of the rendezvous store (several nodes only)
_GONE: List[int] = []  # the ranks the last peer_failure named
_STOP = threading.Event()  # the heartbeat's end (leave)
_BEATING: List[threading.Thread] = []


def node_rank() -> int:
    """This process's node rank: ``CROSS_RANK`` (DeepSpeed's ``launch.py``), ``GROUP_RANK``
    (torchrun), else 0."""
    return int(os.environ.get("CROSS_RANK", os.environ.get("GROUP_RANK", 0)))


def _here() -> Peer:
    return Peer(socket.gethostname(), node_rank(), os.getpid())


def _several_nodes(peers: Sequence[Peer]) -> bool:
    return len({(p.host, p.node) for p in peers}) > 1


def record_peers(dist: Any) -> None:
    """Every rank's :class:`Peer` (one object all-gather over ``dist``, the initialised
    ``torch.distributed``; collective) and, when they span several nodes, this rank's heartbeat
    thread."""
    peers: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peers, tuple(_here()))
    _PEERS[:] = [Peer(*p) for p in peers]
    if _several_nodes(_PEERS):
        _start_heartbeat(dist.get_rank())


def _store_client() -> Any:
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=timedelta(seconds=SILENCE_SECONDS), wait_for_workers=False)


def _start_heartbeat(rank: int) -> None:
    try:  # two clients: the beating thread and the reader never share a socket
        beat, _STORE[:] = _store_client(), [_store_client()]
    except Exception:  # noqa: BLE001 - no heartbeat: failures are named by the collective only
        return
    key = _ALIVE.format(rank)

    def run() -> None:
        while not _STOP.is_set():
            try:
                beat.add(key, 1)
            except Exception:  # noqa: BLE001 - the store is gone (rank 0 ended): nothing to tell
                return
            _STOP.wait(HEARTBEAT_SECONDS)

    _BEATING[:] = [threading.Thread(target=run, name="megaloss-heartbeat", daemon=True)]
    _BEATING[0].start()


def dead_peers(wait: float = 0.0, poll: float = 0.05,
               exclude: Sequence[int] = ()) -> List[int]:
    """The global ranks on this node (same host and node rank) whose process is gone (killed,
    crashed), from the pids :func:`record_peers` recorded, but for those in ``exclude`` (peers
    that left on an error of their own, :func:`left_on_error`). ``wait`` > 0: when none is
    found, look again every ``poll`` seconds for at most ``wait`` seconds (a killed peer's
    sockets can reset this rank's collective a moment before ``/proc`` shows it exiting)."""
    import time

    me = _here()
    deadline = time.monotonic() + wait
    while True:
        found = [r for r, p in enumerate(_PEERS)
                 if r not in exclude and (p.host, p.node) == (me.host, me.node)
                 and p.pid != me.pid and _gone(p.pid)]
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(poll)


_PF_EXITING = 0x4  # include/linux/sched.h: set early in do_exit, before the files (sockets) close


def _gone(pid: int) -> bool:
    try:  # a killed rank stays a zombie until the launcher reaps it (it polls once a second)
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0] in ("Z", "X") or bool(int(fields[6]) & _PF_EXITING)
    except FileNotFoundError:
        return True
    except (OSError, IndexError, ValueError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def silent_ranks(store: Any, ranks: Sequence[int], *, wait: float = SILENCE_SECONDS,
                 poll: float = _POLL_SECONDS,
                 sleep: Optional[Callable[[float], Any]] = None) -> List[int]:
    """The ``ranks`` whose heartbeat counter in ``store`` did not move within ``wait`` seconds
    and that did not mark their exit (:func:`mark_exiting`). Returns as soon as every counter
    moved. ``store``: anything with ``TCPStore.add(key, amount) -> int`` (``add(key, 0)``
    reads a counter without blocking; a missing key reads 0).

    Raises:
        the store's error (``torch.distributed.DistNetworkError``) when it cannot be reached.
    """
    import time

    sleep = time.sleep if sleep is None else sleep
    first = {r: store.add(_ALIVE.format(r), 0) for r in ranks}
    waiting = list(ranks)
    for _ in range(max(1, round(wait / poll))):
        if not waiting:
            break
        sleep(poll)
        waiting = [r for r in waiting if store.add(_ALIVE.format(r), 0) == first[r]]
    return [r for r in waiting if not store.add(_EXITING.format(r), 0)]


def mark_exiting(rank: int) -> None:
    """Tell the other nodes' ranks that ``rank`` leaves on its own (an error it reports), so its
    heartbeat stopping later does not name it (several nodes only; nothing when the store is
    gone)."""
    if _STORE:
        try:
            _STORE[0].add(_EXITING.format(rank), 1)
        except Exception:  # noqa: BLE001 - the store is gone: peer_failure names rank 0
            pass


def _left_file(rank: int) -> Optional[Path]:
    base = os.environ.get("MEGALOSS_ERROR_FILE")
    return Path(f"{base}.left{rank:05d}") if base else None


def mark_left(rank: int) -> None:
    """Mark that ``rank`` leaves on an error (its own, or one :func:`agreed` told it of), not by
    dying: ``$MEGALOSS_ERROR_FILE.left<r>`` and, over several nodes, ``megaloss/left/<r>`` in
    the store. Call before the process groups close (the peers' collectives fail then). Nothing
    when neither exists (a plain ``deepspeed`` launch on one node: a peer is then named dead)."""
    path = _left_file(rank)
    if path is not None:
        try:
            path.write_text("", encoding="utf-8")
        except OSError:
            pass
    if _STORE:
        try:
            _STORE[0].add(_LEFT.format(rank), 1)
        except Exception:  # noqa: BLE001 - the store is gone: the error file still says it
            pass


def left_on_error(rank: int, world: Optional[int] = None, store: Any = None) -> List[int]:
    """The peers of ``rank`` (global ranks below ``world``, default the recorded peers') that
    marked leaving on an error (:func:`mark_left`): on this node from their files, over several
    nodes from the store (default this process's client; unreachable: none found there)."""
    world = len(_PEERS) if world is None else world
    store = (_STORE[0] if _STORE else None) if store is None else store
    found = []
    for r in range(world):
        if r == rank:
            continue
        path = _left_file(r)
        if path is not None and path.exists():
            found.append(r)
            continue
        if store is not None:
            try:
                if store.add(_LEFT.format(r), 0):
                    found.append(r)
            except Exception:  # noqa: BLE001 - the store lives in global rank 0's process
                store = None
    return found


def _named(ranks: Sequence[int], peers: Sequence[Peer]) -> str:
    groups: dict = {}
    for r in ranks:
        p = peers[r] if r < len(peers) else Peer("?", -1, -1)
        groups.setdefault((p.node, p.host), []).append(r)
    return ", ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} "
                     f"(node {node}, host {host})" for (node, host), rs in groups.items())


def peer_failure(rank: int, store: Any = None, peers: Optional[Sequence[Peer]] = None, *,
                 wait: float = SILENCE_SECONDS,
                 sleep: Optional[Callable[[float], Any]] = None,
                 exclude: Sequence[int] = ()) -> Optional[str]:
    """Which peers of ``rank`` are gone, in words (None when none is found): ranks on this node
    whose process is gone (:func:`dead_peers`, at most 2 s); else, when the world spans several
    nodes, ranks whose heartbeat stopped (:func:`silent_ranks`, at most ``wait`` seconds) or
    global rank 0 when the rendezvous store it holds is unreachable. ``exclude``: peers not to
    name (they left on an error of their own: :func:`left_on_error`). ``store`` / ``peers``:
    default this process's client and record (a test passes its own)."""
    peers = _PEERS if peers is None else peers
    dead = (dead_peers(wait=_EXIT_GRACE_SECONDS, exclude=exclude) if peers is _PEERS else [])
    _GONE[:] = dead
    if dead:
        return f"rank {', '.join(map(str, dead))} died (its process is gone: killed or crashed)"
    store = (_STORE[0] if _STORE else None) if store is None else store
    if store is None or not _several_nodes(peers):
        return None
    others = [r for r in range(len(peers)) if r != rank and r not in exclude]
    try:
        silent = silent_ranks(store, others, wait=wait, sleep=sleep)
    except Exception:  # noqa: BLE001 - the store lives in global rank 0's process
        return (f"{_named([0], peers)} is unreachable (the rendezvous store it holds does not "
                "answer: killed, crashed or its node is down)")
    _GONE[:] = silent
    if not silent:
        return None
    return (f"{_named(silent, peers)} stopped (no heartbeat in the rendezvous store for {wait:g} "
            "s: killed, crashed or its node is down)")


def linger_for_peers(rank: int, wait: float = SILENCE_SECONDS + 2.0,
                     sleep: Optional[Callable[[float], Any]] = None) -> None:
    """On global rank 0 of a world over several nodes, after its own :func:`peer_failure`: keep
    the rendezvous store (which lives in this process) up until every other rank not found gone
    has marked its exit (:func:`mark_exiting`, after its own :func:`peer_failure`), at most
    ``wait`` seconds, so that they name the dead peer rather than rank 0."""
    import time

    if rank != 0 or not _STORE:
        return
    sleep = time.sleep if sleep is None else sleep
    waiting = [r for r in range(1, len(_PEERS)) if r not in _GONE]
    try:
        for _ in range(max(1, round(wait / _POLL_SECONDS))):
            waiting = [r for r in waiting if not _STORE[0].add(_EXITING.format(r), 0)]
            if not waiting:
                return
            sleep(_POLL_SECONDS)
    except Exception:  # noqa: BLE001 - the store is in this process: nothing left to keep up
        pass


def leave(rank: int) -> None:
    """The last use of the store by ``rank`` as it leaves (:func:`launch.jobs.runs.run_job`,
    every exit path, before the process groups are destroyed; several nodes only): its heartbeat
    stopped, its exit marked (:func:`mark_exiting`), and on global rank 0
    :func:`linger_for_peers`, so that no rank finds the store gone at the end of a run either
    (a store client that loses its server prints a C++ warning)."""
    if not _STORE:
        return
    _STOP.set()
    for thread in _BEATING:
        thread.join(HEARTBEAT_SECONDS)
    mark_exiting(rank)
    linger_for_peers(rank)
