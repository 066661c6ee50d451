"""The shared queue of samples for extraction across nodes
(pipeline.cluster.workqueue), tested directly with real processes as the node
workers: no sample handed out twice, none left out, and a worker SIGKILLed
(a lost node) or frozen mid-chunk has its unfinished samples taken over."""

import multiprocessing as mp
import os
import signal
import time

from pipeline.cluster.workqueue import WorkQueue, plan_chunks
from pipeline.model.hsfile import hs_path
from tests.helpers import wait_for


def _worker(qdir, files, name, lost_after_s, pause_after=None, delay=0.0, barrier=None):
    """A node worker: 'extracts' each row it is handed by writing its file
    (atomically, as the backends do) and logging the row. With `barrier` (a
    folder) it says it is up there and waits for the test's `go`: spawned
    workers start up to a second apart on a loaded machine, time enough for
    the first ones to take every row."""
    if barrier is not None:
        open(os.path.join(barrier, f"up-{name}"), "w").close()
        while not os.path.exists(os.path.join(barrier, "go")):
            time.sleep(0.01)
    q = WorkQueue(qdir, name, lost_after_s)
    log = open(os.path.join(qdir, f"log-{name}"), "a")
    done = 0
    while rows := q.next_rows(files):
        for i in rows:
            time.sleep(delay)
            tmp = hs_path(files, i).with_suffix(".tmp")
            tmp.write_text(name)
            os.replace(tmp, hs_path(files, i))
            log.write(f"{i}\n")
            log.flush()
            done += 1
            if pause_after is not None and done == pause_after:
                os.kill(os.getpid(), signal.SIGSTOP)   # frozen (or SIGKILLed by the test) here
    q.finish()


def _logs(qdir) -> dict[str, list[int]]:
    return {p.name[4:]: [int(x) for x in p.read_text().split()]
            for p in qdir.iterdir() if p.name.startswith("log-")}


def _start(qdir, files, name, lost, **kw):
    p = mp.get_context("spawn").Process(target=_worker, args=(str(qdir), str(files), name, lost),
                                        kwargs=kw)
    p.start()
    return p


def test_plan_is_a_partition_longest_first():
    lengths = [5, 90, 12, 7, 300, 1, 44, 44, 8, 2, 61]
    rows = [0, 1, 2, 4, 6, 7, 8, 10]
    chunks = plan_chunks(rows, lengths, workers=2, chunk_samples=3)
    flat = [i for c in chunks for i in c]
    assert sorted(flat) == sorted(rows) and len(flat) == len(set(flat))
    assert flat[0] == 4 and [lengths[i] for i in flat] == sorted((lengths[i] for i in rows),
                                                                  reverse=True)
    assert all(len(c) <= 3 for c in chunks)
    assert plan_chunks(list(range(1000)), [1] * 1000, workers=4) and \
        max(len(c) for c in plan_chunks(list(range(1000)), [1] * 1000, workers=4)) <= 64


def test_workers_share_the_rows_once_each(tmp_path):
    qdir, files = tmp_path / "q", tmp_path / "hs"
    files.mkdir()
    rows = list(range(0, 120, 1))
    WorkQueue.create(qdir, plan_chunks(rows, [1] * 120, workers=3, chunk_samples=5))
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = [_start(qdir, files, f"n{k}", 30.0, delay=0.01, barrier=str(barrier))
             for k in range(3)]
    try:
        wait_for(lambda: len(list(barrier.glob("up-*"))) == 3, timeout=60, what="3 workers up")
    finally:
        (barrier / "go").touch()   # never leave a worker waiting (the test would hang on it)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    logs = _logs(qdir)
    flat = [i for rows_ in logs.values() for i in rows_]
    assert sorted(flat) == rows, "a row done twice or not at all"
    assert all(len(v) > 0 for v in logs.values()), "a worker got nothing: no sharing"
    q = WorkQueue(qdir, "observer")
    assert q.done() == set(range(len(q.chunks))) and q.remaining_rows() == 0
    assert all(q.exited(f"n{k}") for k in range(3))


def test_a_lost_worker_s_chunk_goes_to_the_others_without_redoing_its_files(tmp_path):
    qdir, files = tmp_path / "q", tmp_path / "hs"
    files.mkdir()
    WorkQueue.create(qdir, plan_chunks(list(range(40)), [1] * 40, workers=2, chunk_samples=4))
    doomed = _start(qdir, files, "lost", 1.0, pause_after=6)   # row 6 is mid chunk 2
    wait_for(lambda: len(_logs(qdir).get("lost", [])) == 6, timeout=30, what="6 rows done")
    os.kill(doomed.pid, signal.SIGKILL)    # the node is gone, mid-chunk
    doomed.join()
    survivor = _start(qdir, files, "survivor", 1.0, delay=0.01)
    survivor.join(60)
    assert survivor.exitcode == 0
    logs = _logs(qdir)
    flat = logs["lost"] + logs["survivor"]
    assert sorted(flat) == list(range(40)), "the lost worker's rows were redone or dropped"
    owners = WorkQueue(qdir, "observer").owners()
    assert owners[1] == (1, "survivor"), "chunk 1 was not claimed again (generation 1)"
    assert WorkQueue(qdir, "observer").remaining_rows() == 0


def test_a_frozen_worker_loses_its_chunk_and_gives_it_up(tmp_path):
    """A worker that stops beating (SIGSTOP: a hung node, a network
    partition) is taken over; when it comes back it does not mark the chunk
    as its own, takes no more of it, and ends with the rest."""
    qdir, files = tmp_path / "q", tmp_path / "hs"
    files.mkdir()
    WorkQueue.create(qdir, plan_chunks(list(range(24)), [1] * 24, workers=2, chunk_samples=6))
    frozen = _start(qdir, files, "frozen", 1.0, pause_after=2)
    wait_for(lambda: len(_logs(qdir).get("frozen", [])) == 2, timeout=30, what="2 rows done")
    other = _start(qdir, files, "other", 1.0)
    other.join(60)
    assert other.exitcode == 0
    os.kill(frozen.pid, signal.SIGCONT)
    frozen.join(60)
    assert frozen.exitcode == 0
    logs = _logs(qdir)
    assert sorted(set(logs["frozen"] + logs["other"])) == list(range(24))
    # Awake again, it finishes the rows it had in hand (the same files again,
    # each written atomically) and takes nothing else.
    assert set(logs["frozen"]) <= set(range(6))
    assert WorkQueue(qdir, "observer").owners()[0] == (1, "other")


def test_stop_and_a_queue_of_a_previous_attempt(tmp_path):
    qdir, files = tmp_path / "q", tmp_path / "hs"
    files.mkdir()
    WorkQueue.create(qdir, [[0, 1], [2, 3]])
    q = WorkQueue(qdir, "a", 5.0)
    assert q.next_rows(files) == [0, 1]
    q.request_stop()
    assert q.next_rows(files) == []
    q.finish()
    WorkQueue.create(qdir, [[2, 3]])       # a resumed attempt: the old claims are void
    q2 = WorkQueue(qdir, "b", 5.0)
    assert q2.owners() == {} and not q2.stop_requested()
    assert q2.next_rows(files) == [2, 3]
    assert q2.next_rows(files, wait=False) == []    # its own chunk in flight: no wait
    for i in (2, 3):
        hs_path(files, i).write_text("x")
    assert q2.next_rows(files) == [] and q2.done() == {0}
    q2.finish()


def test_an_empty_plan_ends_at_once(tmp_path):
    WorkQueue.create(tmp_path / "q", [])
    assert WorkQueue(tmp_path / "q", "a").next_rows(tmp_path) == []
