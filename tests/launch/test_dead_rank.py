"""A rank that dies on another node is named by the ranks that survive it
(``launch/jobs/peers.py``, ``launch.jobs.runs.run_job``).

- Fast: the decision from the heartbeat counters of a fake rendezvous store: ranks whose counter
  stopped (and that did not mark their own exit) are named with their node and host; a store
  that does not answer names global rank 0 unreachable; nothing is named when every peer beats;
  the ranks that marked leaving on an error (a file on this node, a store key) are found.
- Slow: two launchers on loopback (DeepSpeed's ``launch.py`` for node 0 and for node 1, one
  process each, as ``launch/multinode.sh``'s ``deepspeed --no_ssh --node_rank R`` starts them),
  the LM job; node 1's rank gets SIGKILL after two progress lines, and node 0's rank exits
  within a bound with a last line naming rank 1, node 1 and the host (the pid check only looks
  at its own node: this is the heartbeat path).
"""
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from launch.jobs.peers import Peer, peer_failure, silent_ranks

PEERS = [Peer("gpu01", 0, 100), Peer("gpu01", 0, 101), Peer("gpu02", 1, 200),
         Peer("gpu02", 1, 201)]


class FakeStore:
    """``TCPStore.add`` over a dict; every ``sleep`` advances the counters of ``beating``."""

    def __init__(self, beating, exiting=(), answers=True):
        self.values = {f"megaloss/exiting/{r}": 1 for r in exiting}
        self.beating, self.answers, self.sleeps = set(beating), answers, 0

    def add(self, key, amount):
        if not self.answers:
            raise RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed.")
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]

    def sleep(self, seconds):
        self.sleeps += 1
        for r in self.beating:
            self.add(f"megaloss/alive/{r}", 1)


def test_the_silent_ranks_of_other_nodes_are_named():
    # rank 3 stopped beating; rank 1 stopped too but marked its exit (it left on an error)
    store = FakeStore(beating={0, 2}, exiting={1})
    assert silent_ranks(store, [0, 1, 2, 3], wait=3.0, poll=0.25, sleep=store.sleep) == [3]
    assert store.sleeps == 12  # the whole window: a counter never moved
    store = FakeStore(beating={0, 2})
    msg = peer_failure(0, store, PEERS, sleep=store.sleep)
    assert msg == ("rank 1 (node 0, host gpu01), rank 3 (node 1, host gpu02) stopped (no heartbeat "
                   "in the rendezvous store for 3 s: killed, crashed or its node is down)")
    store = FakeStore(beating={0, 1})
    assert peer_failure(0, store, PEERS, sleep=store.sleep) == (
        "ranks 2, 3 (node 1, host gpu02) stopped (no heartbeat in the rendezvous store for 3 s: "
        "killed, crashed or its node is down)")
    # every peer beats: nothing named, and no longer than their first beat
    store = FakeStore(beating={0, 1, 2, 3})
    assert peer_failure(2, store, PEERS, sleep=store.sleep) is None and store.sleeps == 1
    # the store (in global rank 0's process) is gone
    store = FakeStore(beating=(), answers=False)
    assert peer_failure(3, store, PEERS, sleep=store.sleep) == (
        "rank 0 (node 0, host gpu01) is unreachable (the rendezvous store it holds does not "
        "answer: killed, crashed or its node is down)")
    # one node (a host name and a node rank): no heartbeats, nothing to read
    assert peer_failure(0, FakeStore(beating=()), PEERS[:2]) is None


def test_the_ranks_that_left_on_an_error_are_found_on_this_node_and_over_the_store(
        tmp_path, monkeypatch):
    """A peer that marked leaving on an error (``launch.jobs.peers.mark_left``: a file beside
    ``MEGALOSS_ERROR_FILE`` on its node, a key in the store over several nodes) is not dead."""
    from launch.jobs import peers

    monkeypatch.setenv("MEGALOSS_ERROR_FILE", str(tmp_path / "err"))
    monkeypatch.setattr(peers, "_STORE", [])
    peers.mark_left(1)  # this node: its file
    assert (tmp_path / "err.left00001").exists()
    store = FakeStore(beating=())
    store.values["megaloss/left/3"] = 1  # another node's rank, through the store
    assert peers.left_on_error(0, world=4, store=store) == [1, 3]
    assert peers.left_on_error(1, world=4, store=store) == [3]  # not itself
    assert peers.left_on_error(0, world=4, store=FakeStore(beating=(), answers=False)) == [1]
    monkeypatch.delenv("MEGALOSS_ERROR_FILE")  # a bare launch on one node: nothing to find
    assert peers.left_on_error(0, world=4) == []


def test_rank_0_keeps_the_store_until_the_others_left(monkeypatch):
    from launch.jobs import peers

    store = FakeStore(beating=(), exiting={1})
    monkeypatch.setattr(peers, "_STORE", [store])
    monkeypatch.setattr(peers, "_PEERS", PEERS)
    monkeypatch.setattr(peers, "_GONE", [3])  # rank 3 is gone: not waited for
    left = iter([False, False, True])  # rank 2 leaves after two polls

    def sleep(seconds):
        store.sleeps += 1
        if next(left):
            mark = "megaloss/exiting/2"
            store.values[mark] = 1

    peers.linger_for_peers(0, sleep=sleep)
    assert store.sleeps == 3
    peers.linger_for_peers(1, sleep=sleep)  # only rank 0 holds the store
    assert store.sleeps == 3
    del store.values["megaloss/exiting/2"]
    store.sleeps = 0
    peers.linger_for_peers(0, wait=1.0, sleep=lambda s: setattr(store, "sleeps", store.sleeps + 1))
    assert store.sleeps == 4  # bounded: rank 2 never left


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(360)
def test_a_rank_killed_on_another_node_is_named(tmp_path):
    import psutil

    from megaloss.testing import free_port
    from tests.helpers.launch_helpers import REPO, launcher_env

    stdlib = os.path.dirname(os.__file__)
    port = str(free_port())
    job = [str(REPO / "launch" / "train_lm.py"), "--model_size", "tiny", "--seq_len", "32",
           "--vocab_size", "300", "--eval_blocks", "1", "--eval_every", "0", "--steps", "400",
           "--train_data", os.path.join(stdlib, "heapq.py"), "--eval_data",
           os.path.join(stdlib, "bisect.py"), "--output_dir", str(tmp_path / "out"),
           "--cache_dir", str(tmp_path / "cache")]
    # DeepSpeed's launch.py as `deepspeed --no_ssh --num_nodes 2 --node_rank R --num_gpus 1`
    # starts it (its runner only adds a process start-up): it sets CROSS_RANK to the node rank
    world = base64.urlsafe_b64encode(json.dumps({"node0": [0], "node1": [0]}).encode()).decode()
    procs, lines = [], ([], [])
    for node in (0, 1):
        cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}",
               "--master_addr=127.0.0.1", f"--master_port={port}", f"--node_rank={node}", *job]
        p = subprocess.Popen(cmd, cwd=tmp_path, env=launcher_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        procs.append(p)
        threading.Thread(target=lambda p=p, out=lines[node]: out.extend(p.stdout),
                         daemon=True).start()
    try:
        # two progress lines of rank 0 (one every 20 steps): mid-run, both ranks in collectives
        deadline = time.monotonic() + 240
        while sum(ln.startswith("train ") for ln in lines[0]) < 2:
            assert all(p.poll() is None for p in procs), "".join(lines[0] + lines[1])[-3000:]
            assert time.monotonic() < deadline, "".join(lines[0])[-3000:]
            time.sleep(0.1)
        (rank1,) = psutil.Process(procs[1].pid).children()
        rank1.kill()
        t0 = time.monotonic()
        rc = procs[0].wait(60)
        seconds = time.monotonic() - t0
        procs[1].wait(30)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
    output = "".join(lines[0])
    named = (f"rank 1 (node 1, host {socket.gethostname()}) stopped (no heartbeat in the "
             "rendezvous store for 3 s")
    assert rc != 0 and named in output, output[-3000:]
    assert seconds < 60, f"node 0 exited {seconds:.1f} s after the kill"
    # the message is the rank's last word, not the collective's
    tail = [ln for ln in output.splitlines() if "Connection closed" in ln or named in ln]
    assert named in tail[-1], output[-3000:]
