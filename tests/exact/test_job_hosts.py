"""One exact stream served by several training hosts with real processes: a `feedline
coordinator`, three brokers started with --coordinator (one per "host", each with its own
producers and its own trainer), and the check that in every epoch the union of what the
three trainers took is every sample exactly once, byte for byte as a clean run makes it;
and the job restarted from its checkpoint on other numbers of hosts and ranks.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from feedline.exact.cursor import Cursor
from feedline.procs import Daemon, free_port, wait_for
from tests.support.exact_run import (
    LIVENESS,
    Seen,
    assert_exactly_once,
    pipeline,
    remote,
    rest,
    samples,
    take,
)

N_JOB, HOSTS = 192, 3


def coordinator(daemons, tmp_path: Path, port: int):
    d = daemons("feedline", "coordinator", "--bind", f"tcp://127.0.0.1:{port}", "--state-dir",
                tmp_path / "job-state", "--metrics-port", "0", "--heartbeat-timeout", "1.5",
                name="coordinator")
    # Its own line, not the port: another process's listener on a port taken at once by a
    # parallel worker would look ready while this one exits with "cannot bind".
    wait_for(lambda: "coordinator up" in d.log_text() or not d.alive(), 30,
             what="coordinator up")
    assert d.alive(), d.log_text()
    return d


def host(daemons, tmp_path: Path, i: int, job: str, port: int = 0) -> tuple[str, str, Daemon]:
    port = port or free_port()
    ingress, egress = f"tcp://127.0.0.1:{port}", f"ipc://{tmp_path}/egress-{i}.sock"
    d = daemons("feedline.broker", "--ingress", ingress, "--egress", egress, "--metrics-port",
                "0", *LIVENESS, "--state-dir", tmp_path / f"state-{i}", "--coordinator", job,
                "--host-name", f"host-{i}", name=f"broker-{i}")
    wait_for(lambda: "broker up" in d.log_text() or not d.alive(), 30, what="broker up")
    assert d.alive(), d.log_text()
    return ingress, egress, d


def hosts_up(daemons, tmp_path: Path, names: list[int], job: str, cfg: Path
             ) -> list[tuple[str, Daemon, Daemon]]:
    """Brokers ``host-N`` for each N of ``names`` (on their state directories: a name that
    served before goes on from its journal), started at once, each with a producer: (egress,
    broker, producer) each."""
    out = []
    for i in names:
        ingress, egress = f"tcp://127.0.0.1:{free_port()}", f"ipc://{tmp_path}/egress-{i}.sock"
        d = daemons("feedline.broker", "--ingress", ingress, "--egress", egress,
                    "--metrics-port", "0", *LIVENESS, "--state-dir", tmp_path / f"state-{i}",
                    "--coordinator", job, "--host-name", f"host-{i}", name=f"broker-{i}")
        out.append((i, ingress, egress, d))
    hosts = []
    for i, ingress, egress, d in out:
        wait_for(lambda d=d: "broker up" in d.log_text() or not d.alive(), 30,
                 what="broker up")
        assert d.alive(), d.log_text()
        p = daemons("feedline.producer", "--config", cfg, "--broker", ingress, "--id", f"p{i}",
                    *LIVENESS, name=f"p{i}")
        hosts.append((egress, d, p))
    return hosts


def crash(hosts: list[tuple[str, Daemon, Daemon]], *others: Daemon) -> None:
    """kill -9 of the hosts' brokers and producers, and of ``others``."""
    for _, broker, producer in hosts:
        broker.kill9()
        producer.kill9()
    for d in others:
        d.kill9()


def resume_ranks(egress: list[str], cursor: Cursor) -> list[Seen]:
    """One rank at each ``egress`` address (an address twice: two ranks there), each resumed from
    ``cursor``, reading the rest of its epoch; what each took. The ranks leave together, as a
    job's ranks do (a rank that resumed after every other rank of its launch left would be a
    restart of the job: a launch of its own)."""
    got: list[Seen] = [[] for _ in egress]
    errors: list[BaseException] = []
    together = threading.Barrier(len(egress), timeout=60)

    def rank(i: int) -> None:
        try:
            with remote(egress[i], timeout=60, resume=cursor.encode()) as src:
                got[i] += rest(src)
                together.wait()
        except BaseException as e:  # the main thread reports it
            errors.append(e)
            together.abort()

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(egress))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a rank's epoch did not end"
    return got


def test_a_job_resumed_from_its_checkpoint_on_other_numbers_of_hosts_and_ranks(daemons,
                                                                              tmp_path):
    """3 hosts x 2 ranks take part of epoch 0, each rank saves its cursor and takes a little
    more (lost in the crash), and everything is killed -9, the coordinator too. The job
    restarts from the ranks' merged cursor on 2 hosts x 3 ranks (the coordinator from its
    journal): what they take and the cursor are epoch 0 exactly once. Everything but the
    coordinator is killed again, and the job restarts from the same checkpoint on 4 hosts x 1
    rank (one host never served the job): the same again."""
    port = free_port()
    job = f"tcp://127.0.0.1:{port}"
    coord = coordinator(daemons, tmp_path, port)
    # Paced (20 ms a sample, a third of a second a unit) so that no host's producer opens
    # the units a trainer of another host needs before that host's producer joins (a host
    # whose trainers left keeps its units); two epochs, so that the run is not over when the
    # second launch ends its epoch 0.
    cfg = pipeline(tmp_path, epochs=2, n=N_JOB, delay=0.02)
    first = hosts_up(daemons, tmp_path, [0, 1, 2], job, cfg)
    before: list[Seen] = [[] for _ in range(6)]
    saved: list[bytes] = [b""] * 6
    errors: list[BaseException] = []

    def rank(i: int, egress: str) -> None:
        try:
            with remote(egress, timeout=60) as src:
                it = src.epoch()
                before[i] += take(it, 2)
                saved[i] = src.state().encode()  # its checkpoint
                take(it, 1)  # taken after it: lost with the crash
        except BaseException as e:  # the main thread reports it
            errors.append(e)

    ranks = [threading.Thread(target=rank, args=(i, first[i // 2][0])) for i in range(6)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(60)
    assert not errors, errors
    crash(first, coord)
    merged = Cursor.merge(Cursor.decode(s) for s in saved)  # gathered at save time
    taken = [s for b in before for s in b]
    assert merged.count() == 12 and len(taken) == 12 * 4

    coord = coordinator(daemons, tmp_path, port)  # from its journal
    second = hosts_up(daemons, tmp_path, [0, 1], job, cfg)
    got = resume_ranks([e for e, _, _ in second for _ in range(3)], merged)
    assert_exactly_once(taken + [s for g in got for s in g], cfg, 0)
    assert sum(1 for g in got if g) >= 2, [len(g) for g in got]  # the ranks shared it

    crash(second)
    third = hosts_up(daemons, tmp_path, [0, 1, 2, 3], job, cfg)
    got = resume_ranks([e for e, _, _ in third], merged)
    assert_exactly_once(taken + [s for g in got for s in g], cfg, 0)
    assert coord.alive() and "launch 3 resumed" in coord.log_text(), coord.log_text()[-3000:]


def read_epochs(addr: str, epochs: int, out: list[Seen], errors: list[BaseException]
                ) -> None:
    try:
        with remote(addr, timeout=60) as src:
            for _ in range(epochs):
                out.append([s for b in src.epoch() for s in samples(b)])
    except BaseException as e:  # the main thread reports it
        errors.append(e)


def test_three_hosts_one_job_every_sample_once_per_epoch(daemons, tmp_path):
    port = free_port()
    job = f"tcp://127.0.0.1:{port}"
    coordinator(daemons, tmp_path, port)
    # Paced (5 ms a sample, about a second an epoch) so that every host's producer joins in.
    cfg = pipeline(tmp_path, epochs=2, n=N_JOB, delay=0.005)
    hosts = [host(daemons, tmp_path, i, job) for i in range(HOSTS)]
    for i, (ingress, _, _) in enumerate(hosts):
        daemons("feedline.producer", "--config", cfg, "--broker", ingress, "--id", f"p{i}",
                *LIVENESS, name=f"p{i}")
    taken: list[list[Seen]] = [[] for _ in hosts]
    errors: list[BaseException] = []
    readers = [threading.Thread(target=read_epochs, args=(egress, 2, taken[i], errors))
               for i, (_, egress, _) in enumerate(hosts)]
    for t in readers:
        t.start()
    for t in readers:
        t.join(120)
    assert not errors, errors
    assert all(len(t) == 2 for t in taken), [len(t) for t in taken]
    for epoch in range(2):
        union = [s for t in taken for s in t[epoch]]
        assert_exactly_once(union, cfg, epoch)
    # The job's units were served by more than one host (else this shows nothing).
    assert sum(1 for t in taken if t[0] or t[1]) >= 2, [[len(e) for e in t] for t in taken]


def test_a_producer_a_broker_and_the_coordinator_killed_9_nothing_lost_or_twice(daemons,
                                                                              tmp_path):
    """Paced producers (50 ms a sample: an epoch takes a few seconds); mid-epoch 0: one of
    host 0's two producers is killed -9; host 1's broker is killed -9 and started again on
    its state directory and port; the coordinator is killed -9 and started again on its
    journal. Each epoch's union over the three trainers is still every sample exactly
    once."""
    port = free_port()
    job = f"tcp://127.0.0.1:{port}"
    coord = coordinator(daemons, tmp_path, port)
    cfg = pipeline(tmp_path, epochs=2, n=N_JOB, delay=0.05)
    ports = [free_port() for _ in range(HOSTS)]
    hosts = [host(daemons, tmp_path, i, job, ports[i]) for i in range(HOSTS)]
    producers = {}
    for i, (ingress, _, _) in enumerate(hosts):
        producers[f"p{i}"] = daemons("feedline.producer", "--config", cfg, "--broker", ingress,
                                     "--id", f"p{i}", *LIVENESS, name=f"p{i}")
    producers["p0b"] = daemons("feedline.producer", "--config", cfg, "--broker", hosts[0][0],
                               "--id", "p0b", *LIVENESS, name="p0b")
    taken: list[list[Seen]] = [[] for _ in hosts]
    errors: list[BaseException] = []
    readers = [threading.Thread(target=read_epochs, args=(egress, 2, taken[i], errors))
               for i, (_, egress, _) in enumerate(hosts)]
    for t in readers:
        t.start()
    time.sleep(1.0)
    producers["p0b"].kill9()
    time.sleep(0.5)
    hosts[1][2].kill9()
    time.sleep(0.5)
    host(daemons, tmp_path, 1, job, ports[1])
    time.sleep(0.5)
    coord.kill9()
    time.sleep(0.5)
    coord = coordinator(daemons, tmp_path, port)
    assert all(t.is_alive() for t in readers), "the faults came after the run: pace it more"
    for t in readers:
        t.join(150)
    assert not errors, errors
    assert all(len(t) == 2 for t in taken), [len(t) for t in taken]
    for epoch in range(2):
        assert_exactly_once([s for t in taken for s in t[epoch]], cfg, epoch)
    assert "restored from its journal" in coord.log_text()


def test_a_host_whose_producers_all_died_gives_its_units_back(daemons, tmp_path):
    """Host 2's only producer is killed -9 mid-epoch: after a few seconds with no producer
    there, host 2 gives its open units back (with what its trainer took of them) and the
    other hosts' producers make the rest; the epoch is still every sample exactly once."""
    port = free_port()
    job = f"tcp://127.0.0.1:{port}"
    coordinator(daemons, tmp_path, port)
    cfg = pipeline(tmp_path, epochs=1, n=N_JOB, delay=0.05)
    hosts = [host(daemons, tmp_path, i, job) for i in range(HOSTS)]
    procs = [daemons("feedline.producer", "--config", cfg, "--broker", ingress, "--id",
                     f"p{i}", *LIVENESS, name=f"p{i}") for i, (ingress, _, _) in enumerate(hosts)]
    taken: list[list[Seen]] = [[] for _ in hosts]
    errors: list[BaseException] = []
    readers = [threading.Thread(target=read_epochs, args=(egress, 1, taken[i], errors))
               for i, (_, egress, _) in enumerate(hosts)]
    for t in readers:
        t.start()
    wait_for(lambda: "producer p2 joined" in hosts[2][2].log_text(), 30, what="p2 serving")
    time.sleep(1.0)
    procs[2].kill9()
    assert all(t.is_alive() for t in readers), "the epoch ended before the kill: pace it more"
    for t in readers:
        t.join(120)
    assert not errors, errors
    assert_exactly_once([s for t in taken for s in t[0]], cfg, 0)
    assert "given back to the job" in hosts[2][2].log_text()


def test_a_host_of_another_pipeline_is_refused_in_one_line(daemons, tmp_path):
    port = free_port()
    job = f"tcp://127.0.0.1:{port}"
    coordinator(daemons, tmp_path, port)
    first = pipeline(tmp_path / "a", epochs=1, n=N_JOB)
    other = pipeline(tmp_path / "b", epochs=1, n=N_JOB, seed=4)
    hosts = [host(daemons, tmp_path, i, job) for i in range(2)]
    daemons("feedline.producer", "--config", first, "--broker", hosts[0][0], "--id", "p0",
            *LIVENESS, name="p0")
    wait_for(lambda: "joined stream" in hosts[0][2].log_text(), 30, what="p0 registered")
    time.sleep(1.0)  # host 0 joined the job with the first pipeline
    daemons("feedline.producer", "--config", other, "--broker", hosts[1][0], "--id", "p1",
            *LIVENESS, name="p1")
    line = wait_for(lambda: next((x for x in hosts[1][2].log_text().splitlines()
                                  if "refuses this host" in x), None), 30, what="refusal")
    assert "another pipeline" in line and "give every host the same pipeline" in line


def test_a_coordinator_that_cannot_be_reached_is_said_in_one_line(daemons, tmp_path):
    cfg = pipeline(tmp_path, epochs=1, n=N_JOB)
    job = f"tcp://127.0.0.1:{free_port()}"
    ingress, _, d = host(daemons, tmp_path, 0, job)
    # Before any producer: the broker says it is a job's host and when it will join.
    assert f"host host-0 of a job: each exact stream joins the job's coordinator at {job}" \
        in d.log_text()
    daemons("feedline.producer", "--config", cfg, "--broker", ingress, "--id", "p0",
            *LIVENESS, name="p0")
    line = wait_for(lambda: next((x for x in d.log_text().splitlines()
                                  if "has not answered" in x), None), 40, what="the line")
    assert "start `feedline coordinator` there" in line


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
