"""A correct client's time to "producer ready" over TLS, alone and while a hostile network holds the port.

A real producer process (``qualify.interfaces.producer_command`` on a loopback port under a TLS set
from ``qualify.handoff.tls.issue_tls_set``, serving :mod:`bench.handoff`'s engine on a small KV)
is dialled by a client holding the set and the run key, first with no other peer, then while
``--peers`` connections hold the port: a third silent TCP peers, a third TLS handshakes started
and stalled, a third certificate holders idle after TLS (no run key). Each round opens fresh
peers, times the client's connect + TLS + hello/auth + ``ready?`` (``RemoteProducer.start``), and
closes them. Quiet and held rounds alternate, so load on a shared machine hits both.

    .venv/bin/python bench/hostile_peers.py [--peers 100] [--rounds 5]

Last line: ``hostile_peers_ready_ratio: <median held ready / median quiet ready>``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.handoff import BENCH_DIGESTS, BENCH_IDENTITY, GEOMETRY_ENV, bench_model_geometry
from qualify.contract.lanes import ProducerMode
from qualify.handoff.client import RemoteProducer
from qualify.handoff.protocol import PRODUCER_MODULE, PhaseDeadlines, ProducerExpectation
from qualify.handoff.tls import (
    CA_CERT,
    CONSUMER_CERT,
    CONSUMER_KEY,
    PRODUCER_CERT,
    PRODUCER_KEY,
    RUN_KEY,
    client_context,
    issue_tls_set,
)

LAYERS, KV_HEADS, HEAD_DIM, POSITIONS = 2, 2, 64, 256  # a small KV: the bench times admission, not payload
DEADLINES = PhaseDeadlines(ready_s=60.0, verify_s=60.0, handoff_s=60.0, silence_s=60.0)


def start_producer(tls_set: Path, work: Path) -> tuple[subprocess.Popen[str], int]:
    """``producer serve`` on a loopback port under ``tls_set``; returns it and its port once ready."""
    model = bench_model_geometry(LAYERS, KV_HEADS, HEAD_DIM, POSITIONS)
    expect = work / "expect.json"
    expect.write_text(json.dumps(ProducerExpectation(engine_version="bench-1", geometry=model,
                                                     identity_sha256=BENCH_IDENTITY,
                                                     digests=BENCH_DIGESTS).to_document()))
    argv = [sys.executable, "-m", PRODUCER_MODULE, "--lane", "bench", "--mode", "exact", "--expect", str(expect),
            "--key-file", str(tls_set / RUN_KEY), "--port", "0", "--engine-factory", "bench.handoff:build_bench_engine",
            "--tls-cert", str(tls_set / PRODUCER_CERT), "--tls-key", str(tls_set / PRODUCER_KEY),
            "--tls-client-ca", str(tls_set / CA_CERT)]
    env = dict(os.environ, **{GEOMETRY_ENV: f"{LAYERS},{KV_HEADS},{HEAD_DIM},{POSITIONS}"},
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("QUALIFY_HANDOFF_KEY", None)
    process = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env=env)
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], 120)
    line = process.stdout.readline() if ready else ""
    if not line:
        process.kill()
        raise SystemExit("hostile_peers: the producer did not become ready")
    return process, int(json.loads(line)["address"].rsplit(":", 1)[1])


def hold(port: int, peers: int, client: ssl.SSLContext) -> list[socket.socket]:
    """``peers`` hostile connections: silent TCP, stalled TLS handshakes, idle certificate holders."""
    held: list[socket.socket] = []
    for index in range(peers):
        peer = socket.create_connection(("127.0.0.1", port), timeout=30)
        if index % 3 == 1:
            peer.sendall(b"\x16\x03\x01\x02\x00\x01")  # a handshake record's header, one body byte
        elif index % 3 == 2:
            peer = client.wrap_socket(peer, server_hostname="127.0.0.1")
        held.append(peer)
    return held


def ready_seconds(port: int, key: bytes, client: ssl.SSLContext, round_index: int) -> float:
    producer = RemoteProducer(host="127.0.0.1", port=port, key=key, run_id=f"bench-{round_index}", lane="bench",
                              mode=ProducerMode.EXACT, deadlines=DEADLINES, tls=client)
    began = time.perf_counter()
    producer.start()
    elapsed = time.perf_counter() - began
    producer.close()
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hostile-peers-") as scratch:
        work = Path(scratch)
        tls_set = work / "set"
        issue_tls_set(tls_set, ["127.0.0.1"])
        key = bytes.fromhex((tls_set / RUN_KEY).read_text().strip())
        client = client_context(ca=tls_set / CA_CERT, cert=tls_set / CONSUMER_CERT, key=tls_set / CONSUMER_KEY)
        process, port = start_producer(tls_set, work)
        quiet, held_times = [], []
        try:
            for round_index in range(args.rounds):
                quiet.append(ready_seconds(port, key, client, 2 * round_index))
                held = hold(port, args.peers, client)
                try:
                    held_times.append(ready_seconds(port, key, client, 2 * round_index + 1))
                finally:
                    for peer in held:
                        peer.close()
                print(f"  round {round_index}: ready {quiet[-1] * 1000:.1f} ms alone, "
                      f"{held_times[-1] * 1000:.1f} ms with {args.peers} hostile peers")
        finally:
            process.kill()
            process.communicate()
    quiet_median, held_median = statistics.median(quiet), statistics.median(held_times)
    print(f"ready (median of {args.rounds}): {quiet_median * 1000:.1f} ms alone, "
          f"{held_median * 1000:.1f} ms with {args.peers} hostile peers holding the port")
    print(f"hostile_peers_ready_ratio: {held_median / quiet_median:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
