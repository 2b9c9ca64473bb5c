"""A producer and a consumer in two network namespaces joined by a veth pair (issue 19).

Each test makes its own pair of namespaces and a veth pair created directly inside them (the
host's own interfaces and routes are never touched): the producer's end is 10.213.0.1/30, the
consumer's 10.213.0.2/30. A TLS set for the producer's address (``qualify keys tls``) and the
``--expect`` document (``qualify producer expect``) are made once; then ``qualify producer serve``
runs in one namespace and ``qualify --recipe native-text --producer-at`` in the other, on the
shipped model. The runs: a plain link (qualifies; the handoffs crossed the veth), a delayed and
lossy link (netem: still a verdict), a link slower than the deadlines (netem's or tbf's rate:
fails closed at the handoff deadline), and the link cut while the first handoff is open (fails
closed at the silence deadline). Every failure leaves a receipt that verifies and installs nothing.

Root and a usable ``ip netns`` are needed: otherwise every test skips, naming why, or fails
where ``QUALIFY_REQUIRE_NETNS=1`` (``.ci/run``). A kernel without the netem qdisc skips the netem
runs, naming it (``tc`` says "Specified qdisc kind is unknown"); they are never faked.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import pytest

from qualify.archive.verify import verify_receipt
from qualify.core.assets import REPO_ROOT
from qualify.handoff.tls import CA_CERT, CONSUMER_CERT, CONSUMER_KEY, PRODUCER_CERT, PRODUCER_KEY, RUN_KEY
from qualify.run.run_contract import chosen_lane

pytestmark = [pytest.mark.netns, pytest.mark.slow]

RECIPE = "native-text"
PRODUCER_ADDRESS = "10.213.0.1"
CONSUMER_ADDRESS = "10.213.0.2"
PORT = 7443
REQUIRE_ENV = "QUALIFY_REQUIRE_NETNS"
# Guards against a hang, never a timed assertion: a producer's start, and a whole run.
START_GUARD_S = 300.0
RUN_GUARD_S = 600.0
# The slow-link runs' --deadline-s: every phase, so the handoff (8.4 MB at 256 kbit/s: over four
# minutes) is given up long before it could finish, while the handshake (a few kB) fits easily.
SLOW_DEADLINE_S = 20
_NAMES = itertools.count(1)


def _unusable(reason: str) -> NoReturn:
    """Skip, naming why; fail instead where netns tests are required (CI)."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason}, and {REQUIRE_ENV}=1 requires the network-namespace tests")
    pytest.skip(reason)


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command (ip, tc) to its end; a failure names the command and what it said."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    return done


@pytest.fixture(scope="module")
def netns_usable() -> None:
    """Root, ``ip`` and a namespace that can be made and removed; else every test skips (or fails)."""
    if os.geteuid() != 0:
        _unusable("network-namespace tests need root (ip netns, veth, tc)")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        _unusable("network-namespace tests need iproute2's ip and tc")
    probe = f"tl-probe-{os.getpid()}"
    made = sh("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        _unusable(f"ip netns is unusable here: {made.stderr.strip()}")
    sh("ip", "netns", "del", probe)


@dataclass
class Link:
    """Two namespaces joined by a veth pair: the producer's side and the consumer's."""

    producer_ns: str
    consumer_ns: str
    producer_veth: str
    consumer_veth: str
    processes: list[subprocess.Popen[str]] = field(default_factory=list)

    def shape(self, kind: str, *parameters: str) -> None:
        """A root qdisc on the producer's end (the direction the KV payload travels); a kernel
        without ``kind`` skips the test, naming the qdisc."""
        done = sh("ip", "netns", "exec", self.producer_ns, "tc", "qdisc", "add", "dev", self.producer_veth,
                  "root", kind, *parameters, check=False)
        if done.returncode != 0:
            said = done.stderr.strip()
            if "qdisc kind is unknown" in said:
                pytest.skip(f"the kernel has no {kind} qdisc (sch_{kind}; tc said: {said}): this {kind} run was not run")
            raise AssertionError(f"tc qdisc add {kind} {' '.join(parameters)}: {said}")

    def cut(self) -> None:
        """Take the producer's end of the veth down: the link dies, nothing more crosses."""
        sh("ip", "-n", self.producer_ns, "link", "set", "dev", self.producer_veth, "down")

    def tx_bytes(self) -> int:
        """Bytes the producer's end of the veth has sent."""
        shown = json.loads(sh("ip", "-j", "-s", "-n", self.producer_ns, "link", "show", "dev",
                              self.producer_veth).stdout)
        return int(shown[0]["stats64"]["tx"]["bytes"])


@pytest.fixture
def link(netns_usable: None) -> Iterator[Link]:
    """A fresh namespace pair and veth pair, named for this process (xdist workers never collide);
    removed, with every process started in it, whatever the test did."""
    tag = f"{os.getpid()}-{next(_NAMES)}"
    made = Link(producer_ns=f"tl-producer-{tag}", consumer_ns=f"tl-consumer-{tag}",
                producer_veth=f"tlp{tag}", consumer_veth=f"tlc{tag}")
    assert len(made.producer_veth) <= 15  # IFNAMSIZ
    try:
        sh("ip", "netns", "add", made.producer_ns)
        sh("ip", "netns", "add", made.consumer_ns)
        # Created inside the namespaces: the veth never exists in the host's own namespace.
        sh("ip", "link", "add", made.producer_veth, "netns", made.producer_ns, "type", "veth",
           "peer", "name", made.consumer_veth, "netns", made.consumer_ns)
        for namespace, veth, address in ((made.producer_ns, made.producer_veth, PRODUCER_ADDRESS),
                                         (made.consumer_ns, made.consumer_veth, CONSUMER_ADDRESS)):
            sh("ip", "-n", namespace, "addr", "add", f"{address}/30", "dev", veth)
            sh("ip", "-n", namespace, "link", "set", "dev", veth, "up")
            sh("ip", "-n", namespace, "link", "set", "dev", "lo", "up")
        yield made
    finally:
        for process in made.processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=60)
        for namespace in (made.producer_ns, made.consumer_ns):
            sh("ip", "netns", "del", namespace, check=False)


# ------------------------------------------------------------------------------------------
# the set, the expectation, the two processes


def qualify_command(*args: str) -> list[str]:
    """``qualify ARGS`` from this checkout (its path given explicitly: ``ip netns exec`` runs it)."""
    return ["env", f"PYTHONPATH={REPO_ROOT}", sys.executable, "-m", "qualify.interfaces.cli", *args]


def child_env() -> dict[str, str]:
    """The test's environment (its own signing key), without an operator's run key, and wide
    enough that every step line of a run is one line."""
    env = {name: value for name, value in os.environ.items() if name != "QUALIFY_HANDOFF_KEY"}
    env["COLUMNS"] = "4000"
    return env


@pytest.fixture(scope="module")
def tls_set(netns_usable: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``qualify keys tls`` for the producer's namespace address."""
    directory = tmp_path_factory.mktemp("netns-tls") / "set"
    made = subprocess.run(qualify_command("keys", "tls", "--dir", str(directory), "--producer-host", PRODUCER_ADDRESS),
                          cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=START_GUARD_S)
    assert made.returncode == 0, made.stderr
    return directory


@pytest.fixture(scope="module")
def expect_document(netns_usable: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``qualify producer expect``: what the run will expect the producer to be."""
    path = tmp_path_factory.mktemp("netns-expect") / "expect.json"
    made = subprocess.run(qualify_command("producer", "expect", "--recipe", RECIPE, "--out", str(path)),
                          cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=START_GUARD_S)
    assert made.returncode == 0, made.stderr
    return path


def serve(link: Link, tls_set: Path, expect: Path, log: Path) -> None:
    """``qualify producer serve`` on the producer's namespace address, waited for until ready."""
    lane = chosen_lane(RECIPE, "reference", "reference")
    argv = ["ip", "netns", "exec", link.producer_ns, *qualify_command(
        "producer", "serve", "--lane", lane.name, "--mode", lane.mode.value, "--expect", str(expect),
        "--key-file", str(tls_set / RUN_KEY), "--host", PRODUCER_ADDRESS, "--allow-non-loopback",
        "--port", str(PORT), "--tls-cert", str(tls_set / PRODUCER_CERT), "--tls-key", str(tls_set / PRODUCER_KEY),
        "--tls-client-ca", str(tls_set / CA_CERT), "--exit-with-stdin")]
    with log.open("w", encoding="utf-8") as errors:
        process = subprocess.Popen(argv, cwd=REPO_ROOT, env=child_env(), stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=errors, text=True)
    link.processes.append(process)
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], START_GUARD_S)
    line = process.stdout.readline() if ready else ""
    assert line, f"producer not ready: {log.read_text(encoding='utf-8')[-2000:]}"
    assert json.loads(line)["address"] == f"tls:{PRODUCER_ADDRESS}:{PORT}"


@dataclass
class RunResult:
    code: int
    lines: list[str]
    stderr: str
    receipt: Path

    def step_line(self, label: str) -> str:
        found = [line for line in self.lines if line.lstrip(" ✓✗").startswith(label)]
        assert len(found) == 1, self.lines
        return found[0]

    def sample(self, repetition: int) -> dict[str, object]:
        document = json.loads((self.receipt / "samples" / f"sample-{repetition}.json").read_text(encoding="utf-8"))
        assert isinstance(document, dict)
        return document

    def command_log(self) -> str:
        return (self.receipt / "command.log").read_text(encoding="utf-8")

    def summary(self) -> dict[str, object]:
        document = json.loads((self.receipt / "validation-summary.json").read_text(encoding="utf-8"))
        assert isinstance(document, dict)
        return document


def qualify_across(link: Link, tls_set: Path, tmp_path: Path, *extra: str,
                   on_line: Callable[[str], None] | None = None) -> RunResult:
    """``qualify --recipe native-text --producer-at`` in the consumer's namespace, to its end;
    ``on_line`` sees each line of its output as it is printed."""
    receipts = tmp_path / "receipts"
    receipts.mkdir()
    errors = tmp_path / "consumer.stderr"
    argv = ["ip", "netns", "exec", link.consumer_ns, *qualify_command(
        "--recipe", RECIPE, "--reference-once", "--producer-at", f"{PRODUCER_ADDRESS}:{PORT}",
        "--tls-ca", str(tls_set / CA_CERT), "--tls-cert", str(tls_set / CONSUMER_CERT),
        "--tls-key", str(tls_set / CONSUMER_KEY), "--key-file", str(tls_set / RUN_KEY),
        "--receipts", str(receipts), *extra)]
    with errors.open("w", encoding="utf-8") as stderr:
        process = subprocess.Popen(argv, cwd=REPO_ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=stderr,
                                   text=True)
    link.processes.append(process)
    assert process.stdout is not None
    lines: list[str] = []
    guard = time.monotonic() + RUN_GUARD_S
    while True:
        ready, _, _ = select.select([process.stdout], [], [], max(guard - time.monotonic(), 0))
        if not ready:
            process.kill()
            raise AssertionError(f"the run did not end within {RUN_GUARD_S:g} s: {lines[-5:]}")
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if on_line is not None:
            on_line(line)
    code = process.wait(timeout=60)
    made = sorted(receipts.glob("2*"))
    assert len(made) == 1, (code, lines[-5:], errors.read_text(encoding="utf-8"))
    return RunResult(code, lines, errors.read_text(encoding="utf-8"), made[0])


@pytest.fixture
def producer(link: Link, tls_set: Path, expect_document: Path, tmp_path: Path) -> Link:
    serve(link, tls_set, expect_document, tmp_path / "producer.stderr")
    return link


def assert_failed_closed(run: RunResult, cause: str) -> None:
    """Exit 1 with the cause on the failed handoff's one step line; a receipt that verifies and
    records the failure; sample 1 failed with nothing received whole, so nothing installed."""
    assert run.code == 1, (run.lines[-10:], run.stderr)
    assert "Traceback" not in run.stderr
    line = run.step_line("handoff 1/3")
    assert line.lstrip().startswith("✗") and re.search(cause, line), line
    assert verify_receipt(run.receipt) == []
    assert run.summary()["status"] == "failed" and run.summary()["passed"] is False
    first = run.sample(1)
    error = str(first.get("error"))
    assert error.startswith("producer failed: ") and re.search(cause, error), error
    assert "\n" not in error
    # Received whole is what a handoff must be before it is verified or installed: none was.
    assert "sample-1: transport tls" not in run.command_log()
    assert first.get("payload_sha256") is None and first.get("install_s") is None


# ------------------------------------------------------------------------------------------
# the runs


def test_a_run_qualifies_across_the_veth_pair(producer: Link, tls_set: Path, tmp_path: Path) -> None:
    run = qualify_across(producer, tls_set, tmp_path)
    assert run.code == 0, (run.lines[-10:], run.stderr)
    assert verify_receipt(run.receipt) == []
    assert run.summary()["status"] == "passed"
    log = run.command_log()
    assert f"producer at tls:{PRODUCER_ADDRESS}:{PORT} (--producer-at; TLSv1.3" in log
    for repetition in (1, 2, 3):
        assert f"sample-{repetition}: transport tls: " in log
    # The three payloads crossed the producer's end of the veth (and nothing else carried them).
    payloads = sum(int(str(run.sample(repetition)["payload_bytes"])) for repetition in (1, 2, 3))
    assert producer.tx_bytes() >= payloads


def test_a_delayed_lossy_link_still_reaches_its_verdict(link: Link, tls_set: Path, expect_document: Path,
                                                       tmp_path: Path) -> None:
    """netem: 10 ms delay and 0.5% loss on the payload's way. TCP retransmits; the run is slower
    and still qualifies, every byte what the producer sealed."""
    link.shape("netem", "delay", "10ms", "loss", "0.5%")
    serve(link, tls_set, expect_document, tmp_path / "producer.stderr")
    run = qualify_across(link, tls_set, tmp_path)
    assert run.code == 0, (run.lines[-10:], run.stderr)
    assert verify_receipt(run.receipt) == []
    assert run.summary()["status"] == "passed"


@pytest.mark.parametrize(("kind", "parameters"), [
    ("netem", ("rate", "256kbit", "delay", "20ms")),
    ("tbf", ("rate", "256kbit", "burst", "32kb", "latency", "60s")),
], ids=["netem", "tbf"])
def test_a_link_slower_than_the_deadline_fails_closed(link: Link, tls_set: Path, expect_document: Path,
                                                      tmp_path: Path, kind: str, parameters: tuple[str, ...]) -> None:
    """256 kbit/s: the handshake crosses, the first handoff's 8.4 MB would take over four minutes
    and is given up at the handoff deadline (never at the silence deadline: bytes keep arriving)."""
    link.shape(kind, *parameters)
    serve(link, tls_set, expect_document, tmp_path / "producer.stderr")
    run = qualify_across(link, tls_set, tmp_path, "--deadline-s", str(SLOW_DEADLINE_S))
    assert_failed_closed(run, f"no answer within the handoff deadline of {SLOW_DEADLINE_S} s")


def test_a_link_cut_during_the_first_handoff_fails_closed(producer: Link, tls_set: Path, tmp_path: Path) -> None:
    """The producer's end taken down once the run prints its cold recompute: the first handoff's
    request is then on its way (the producer's prefill takes seconds, its answer never leaves).
    The run's own deadlines (the basis receipt's; silence 15 s) end it."""

    def cut_after_reference(line: str) -> None:
        if line.lstrip(" ✓").startswith("reference computed"):
            producer.cut()

    run = qualify_across(producer, tls_set, tmp_path, on_line=cut_after_reference)
    assert_failed_closed(run, "silent for [0-9.]+ s during handoff")
