"""`xpyd bench transfer`: real processes, real sockets, small sizes."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

import pytest

from xpyd.bench import transfer_bench as tb
from xpyd.bench import transfer_procs as tp

KiB, MiB = 1 << 10, 1 << 20
REQUIRED = {"size_bytes", "gbps", "memcpy_gbps", "socket_gbps"}


@pytest.fixture(autouse=True)
def no_leftover_processes():
    yield
    assert mp.active_children() == []


def _check_report(report: dict, backend: str, sizes: list[int], repeats: int, regions: int) -> None:
    assert report["backend"] == backend
    assert [r["size_bytes"] for r in report["results"]] == sizes
    assert report["repeats"] == repeats and report["regions"] == regions
    for r in report["results"]:
        assert REQUIRED <= set(r)
        for key in ("gbps", "memcpy_gbps", "socket_gbps", "best_gbps", "median_s", "min_s"):
            assert isinstance(r[key], float) and r[key] > 0, (key, r[key])
        assert r["best_gbps"] >= r["gbps"]
        assert r["backend_vs_socket"] == pytest.approx(r["gbps"] / r["socket_gbps"])
        assert r["regions"] == regions
        assert len(r["samples_s"]) == len(r["socket_samples_s"]) == len(r["memcpy_samples_s"]) == repeats
        # the same run's memcpy plus one round trip, recomputed from the report's own numbers
        rtt = report["socket_rtt_s"]
        assert r["round_trip_bound"] == pytest.approx(r["memcpy_median_s"] / (r["memcpy_median_s"] + rtt))
        assert 0 < r["round_trip_bound"] < 1
    assert isinstance(report["socket_rtt_s"], float) and report["socket_rtt_s"] > 0
    assert 0 < report["socket_rtt_p10_s"] <= report["socket_rtt_s"]
    assert "round_trip_bound" in report["method"]
    assert json.loads(json.dumps(report)) == report  # JSON as is


def _check_table(out: str, report: dict) -> None:
    """The bound column (last, 3 decimals, one per size) and the round-trip line under the table."""
    name = report["backend"]
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if f"{name} GB/s | memcpy GB/s" in line)
    assert lines[head].endswith(f"{name}/memcpy | bound")
    rows = lines[head + 2:head + 2 + len(report["results"])]
    for row, r in zip(rows, report["results"]):
        assert row.split(" | ")[-1].strip() == f"{r['round_trip_bound']:.3f}"
    assert lines[head + 2 + len(rows)] == (
        "round trip (1-byte ping-pong, two Python processes, TCP loopback): "
        f"median {report['socket_rtt_s'] * 1e6:.1f} us, p10 {report['socket_rtt_p10_s'] * 1e6:.1f} us")


def test_measure_small_sizes():
    sizes = [64 * KiB, 1 * MiB]
    report = tb.measure("tcp", sizes, repeats=2)
    _check_report(report, "tcp", sizes, 2, 1)
    assert report["units"].startswith("GB/s = 1e9 bytes")
    assert report["host"]["cpu_count"] >= 1
    _check_table(tb.format_table(report), report)


def test_cli_writes_json_and_prints_table(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    tb.add_arguments(parser)
    path = tmp_path / "out.json"
    args = parser.parse_args(["--sizes", "64K,256K", "--repeats", "2", "--regions", "3", "--json", str(path)])
    assert tb.run(args) == 0
    report = json.loads(path.read_text())
    _check_report(report, "tcp", [64 * KiB, 256 * KiB], 2, 3)
    out = capsys.readouterr().out
    assert "tcp GB/s | memcpy GB/s | socket GB/s | tcp/socket | tcp/memcpy | bound" in out
    assert "64 KiB" in out and "256 KiB" in out and "3 region(s)" in out
    _check_table(out, report)


def test_cli_defaults():
    parser = argparse.ArgumentParser()
    tb.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.backend, args.sizes, args.repeats, args.regions, args.json) == (
        "tcp", [MiB, 16 * MiB, 64 * MiB], 5, 1, None)


def test_unknown_backend_is_a_clear_error(capsys):
    with pytest.raises(ValueError, match="unknown transfer backend 'nope'; known: .*tcp"):
        tb.measure("nope", [64 * KiB], repeats=1)
    with pytest.raises(ValueError, match="'fake'.*between two processes"):
        tb.measure("fake", [64 * KiB], repeats=1)
    parser = argparse.ArgumentParser()
    tb.add_arguments(parser)
    assert tb.run(parser.parse_args(["--backend", "nope", "--sizes", "64K", "--repeats", "1"])) == 2
    err = capsys.readouterr().err
    assert "xpyd bench transfer: error: unknown transfer backend 'nope'" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("kw, match", [
    ({"sizes": []}, "sizes"),
    ({"sizes": [0]}, "sizes"),
    ({"sizes": [1.5]}, "sizes"),
    ({"repeats": 0}, "repeats"),
    ({"regions": 0}, "regions"),
    ({"sizes": [4], "regions": 5}, "regions"),
    ({"timeout": 0}, "timeout"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        tb.measure("tcp", **{"sizes": [64 * KiB], "repeats": 1, **kw})


@pytest.mark.parametrize("threads", [1, 2])
def test_shm_copy_threads_are_used_and_recorded(threads):
    sizes = [64 * KiB, 9 * MiB]  # 9 MiB: one piece above the 8 MiB split threshold
    report = tb.measure("shm", sizes, repeats=1, copy_threads=threads)
    _check_report(report, "shm", sizes, 1, 1)
    assert report["backend_kwargs"]["copy_threads"] == threads
    assert report["receiver_copy_threads"] == threads  # what the receiving backend ran with
    assert f"; {threads} copy thread(s); " in tb.format_table(report).splitlines()[0]


def test_copy_threads_are_checked():
    with pytest.raises(ValueError, match="--copy-threads applies to auto and shm only, not 'tcp'"):
        tb.measure("tcp", [64 * KiB], repeats=1, copy_threads=2)
    for bad in (0, 17, 1.5):
        with pytest.raises(ValueError, match="copy_threads must be an int in 1..16"):
            tb.measure("shm", [64 * KiB], repeats=1, copy_threads=bad)


def test_sizes_parsing():
    assert tb.parse_sizes("1M,16M,64M") == [MiB, 16 * MiB, 64 * MiB]
    assert tb.parse_sizes("64K, 1MiB,4096,1g") == [64 * KiB, MiB, 4096, 1 << 30]
    for bad in ("", "1X", "0", "-1M", "1.5M", ","):
        with pytest.raises(ValueError):
            tb.parse_sizes(bad)
    parser = argparse.ArgumentParser()
    tb.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--sizes", "lots"])
    assert tb.format_size(64 * KiB) == "64 KiB" and tb.format_size(1000) == "1000 B"
    assert tp._split(10, 3) == [(0, 4), (4, 3), (7, 3)]


def test_sides_parsing_and_an_explicit_loopback_side():
    assert tb.parse_place("10.77.1.2@xnb-bed-rx") == tp.Place("10.77.1.2", "xnb-bed-rx")
    assert tb.parse_place("[::1]") == tp.Place("::1", None)
    for bad in ("", "@ns", "10.0.0.1@", "10.0.0.1@a/b"):
        with pytest.raises(ValueError, match="ADDR@NETNS"):
            tb.parse_place(bad)
    parser = argparse.ArgumentParser()
    tb.add_arguments(parser)
    args = parser.parse_args(["--receiver", "127.0.0.1"])
    assert (args.sender, args.receiver) == (None, tp.Place("127.0.0.1", None))
    with pytest.raises(ValueError, match="invalid network namespace"):
        tp.enter_netns("../x")
    # (namespaces need root: tests/multihost runs the two sides on two hosts)
    report = tb.measure("tcp", [64 * KiB], repeats=1, receiver=tp.Place("127.0.0.1"))
    assert report["sides"] == {"sender": {"host": "127.0.0.1", "netns": None},
                               "receiver": {"host": "127.0.0.1", "netns": None}}
    assert report["socket_path"] == "TCP 127.0.0.1 -> 127.0.0.1"


# -- a failing or stuck child stops both processes -----------------------------------


def _failing(peer):
    raise ValueError("boom")


def _waiting(peer):
    return tp._peer_recv(peer, "anything", 30)


def test_failing_child_stops_its_peer():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        tp._run_pair("test", _failing, _waiting, {}, timeout=30)
    msg = str(e.value)
    assert msg.startswith("test: the receiver process failed: ValueError: boom")  # the cause first
    assert time.monotonic() - t0 < 15


def test_stuck_children_are_stopped_at_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no result from the receiver and sender process within 0.5s"):
        tp._run_pair("test", _waiting, _waiting, {}, timeout=0.5)
    assert time.monotonic() - t0 < 10


def test_socket_pair_reports_round_trips():
    """The socket phase alone: one rtt sample per timed ping-pong, each a positive duration."""
    out = tp._run_pair("socket baseline", tp._socket_receiver, tp._socket_sender,
                       {"max_size": 4 * KiB, "sizes": [4 * KiB], "reps": 2}, timeout=30)
    rtt = out["sender"]["rtt_samples_s"]
    assert len(rtt) == tp.RTT_SAMPLES and all(isinstance(t, float) and t > 0 for t in rtt)
    assert out["receiver"] == {} and len(out["sender"]["times"][4 * KiB]) == 2 - tp.WARMUP


def test_round_trip_bound_formula():
    assert tb._round_trip_bound(30e-6, 90e-6) == pytest.approx(0.25)
    assert tb._round_trip_bound(1.0, 0.0) == 1.0
    assert tb._p10([float(i) for i in range(1, 12)]) == pytest.approx(2.0)


def test_corrupted_bytes_are_caught():
    import numpy as np

    buf = tp._pattern(1000)
    tp._check_landed(buf, 1000, "x")
    buf[777] ^= 1
    with pytest.raises(RuntimeError, match="first at offset 777"):
        tp._check_landed(buf, 1000, "x")
    with pytest.raises(RuntimeError):
        tp._check_landed(np.full(1000, 0x55, np.uint8), 1000, "x")
