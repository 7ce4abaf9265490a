"""``--preemption-notice``: each provider's answers read (table tests of ``tidal.preemption``,
pure), the backoff, the setting's validation, and the watcher (``worker.cloud_watch``)
against a real local HTTP server that answers as each provider documents
(``notice_server``); the whole path, a real job, is in ``test_preemption_e2e``."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from notice_server import AWS_ACTION, TOKEN, VM_NAME, NoticeServer

from tidal.config import JobSpec
from tidal.preemption import (
    Malformed,
    notice_source_error,
    parse_aws,
    parse_azure,
    parse_gcp,
    retry_delay,
)
from tidal.worker.agent.cloud_watch import Aws, Azure, Gcp, Url, Watcher, source_for

ROOT = Path(__file__).resolve().parents[1]
WATCH_LOG = "tidal.worker.agent.cloud_watch"
PREEMPT = {
    "EventId": "A7",
    "EventType": "Preempt",
    "ResourceType": "VirtualMachine",
    "Resources": ["vm-1"],
    "EventStatus": "Scheduled",
    "NotBefore": "Mon, 19 Sep 2026 18:29:47 GMT",
}


def azure(*events: dict) -> str:
    return json.dumps({"DocumentIncarnation": 3, "Events": list(events)})


# -- the answers ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("parse", "status", "body", "notice"),
    [
        # AWS spot/instance-action (and the URL form): 404 until a notice, then JSON
        (parse_aws, 404, "", None),
        (parse_aws, 204, "", None),
        (parse_aws, 200, json.dumps(AWS_ACTION), "terminate at 2026-01-01T00:02:00Z"),
        (parse_aws, 200, '{"action": "stop"}', "stop"),
        (parse_aws, 200, '{"action": "hibernate", "time": 5}', "hibernate"),
        (parse_aws, 200, "<html>captive portal</html>", Malformed),
        (parse_aws, 200, '{"time": "2026-01-01T00:02:00Z"}', Malformed),
        (parse_aws, 200, '["terminate"]', Malformed),
        (parse_aws, 401, "", Malformed),
        (parse_aws, 500, "", Malformed),
        # GCP instance/preempted: FALSE, then TRUE
        (parse_gcp, 200, "FALSE", None),
        (parse_gcp, 200, "TRUE", "preempted"),
        (parse_gcp, 200, "true\n", "preempted"),
        (parse_gcp, 200, "", Malformed),
        (parse_gcp, 200, "maybe", Malformed),
        (parse_gcp, 403, "Missing Metadata-Flavor:Google header.", Malformed),
        (parse_gcp, 503, "", Malformed),
    ],
)
def test_aws_and_gcp_answers(parse, status, body, notice) -> None:
    if notice is Malformed:
        with pytest.raises(Malformed):
            parse(status, body)
    else:
        assert parse(status, body) == notice


@pytest.mark.parametrize(
    ("status", "body", "notice"),
    [
        (200, azure(), None),
        (200, azure(PREEMPT), "Preempt A7, not before Mon, 19 Sep 2026 18:29:47 GMT"),
        (200, azure({**PREEMPT, "EventStatus": "Started"}), "Preempt A7"),
        (200, azure({**PREEMPT, "Resources": ["vm-2"]}), None),  # another VM's
        (200, azure({**PREEMPT, "Resources": []}), None),
        (200, azure({**PREEMPT, "EventType": "Reboot"}), None),  # not a preemption
        (200, azure({**PREEMPT, "EventType": "Freeze"}, {**PREEMPT, "EventId": "B"}), "Preempt B"),
        (200, azure({**PREEMPT, "NotBefore": ""}), "Preempt A7, not before soon"),
        (200, azure("not an event", PREEMPT), "Preempt A7"),
        (200, '{"DocumentIncarnation": 1}', Malformed),
        (200, "[]", Malformed),
        (200, "nope", Malformed),
        (400, '{"error": "Bad request"}', Malformed),
    ],
)
def test_azure_answers(status, body, notice) -> None:
    if notice is Malformed:
        with pytest.raises(Malformed):
            parse_azure(status, body, "vm-1")
    else:
        got = parse_azure(status, body, "vm-1")
        assert got == notice if notice is None else got.startswith(notice)


@pytest.mark.parametrize(
    ("failures", "jitter", "delay"),
    [
        (1, 0.0, 5.0),  # period 5 s: 10 s, half of it with no jitter
        (1, 1.0, 10.0),
        (2, 0.0, 10.0),
        (3, 0.5, 30.0 * 0.75),  # 40 s capped at 30
        (10, 0.0, 15.0),
        (10**6, 1.0, 30.0),  # no overflow, ever
    ],
)
def test_retry_delay_is_capped_exponential_with_jitter(failures, jitter, delay) -> None:
    assert retry_delay(failures, period_s=5.0, jitter=jitter) == pytest.approx(delay)


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        (None, True),
        ("aws", True),
        ("gcp", True),
        ("azure", True),
        ("http://127.0.0.1:8080/w{worker}", True),
        ("https://notices.internal/x", True),
        ("AWS", False),
        ("ibm", False),
        ("ftp://x/y", False),
        ("http://", False),
        ("", False),
    ],
)
def test_the_setting_is_a_provider_or_a_url(value, ok) -> None:
    assert (notice_source_error(value) is None) is ok
    if not ok:
        with pytest.raises(ValueError, match="--preemption-notice must be aws, gcp, azure"):
            JobSpec(name="j", script="x.py", preemption_notice=value)


def test_bad_cli_input_is_one_line_and_a_non_zero_exit(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    for flags, says in (
        (["--preemption-notice", "ibm"], "--preemption-notice must be"),
        (["--max-restarts", "3/w"], "--max-restarts"),
        (["--preemption-poll", "0"], "--preemption-poll must be positive"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "tidal.cli", "run", "--home", str(tmp_path / "h"), *flags,
             str(script)],
            cwd=ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert proc.returncode != 0
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0], proc.stderr


# -- the watcher against a local server ----------------------------------------------------------
@pytest.fixture
def server() -> Iterator[NoticeServer]:
    s = NoticeServer()
    try:
        yield s
    finally:
        s.close()


def watch(source, period_s: float = 0.02) -> tuple[Watcher, list[str]]:
    seen: list[str] = []
    return Watcher(source, seen.append, period_s=period_s, jitter=lambda: 0.0).start(), seen


def wait_until(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda base: Aws(base), "aws: terminate at 2026-01-01T00:02:00Z"),
        (lambda base: Gcp(base), "gcp: preempted"),
        (lambda base: Azure(base), "azure: Preempt A7, not before"),
        (lambda base: Url(f"{base}/w3"), "/w3: terminate at 2026-01-01T00:02:00Z"),
    ],
)
def test_each_source_reads_its_providers_endpoint(server: NoticeServer, make, words) -> None:
    """Quiet while there is no notice (the server refuses what the provider would refuse:
    a request without its headers would be an error, never a notice), then one notice."""
    watcher, seen = watch(make(server.base))
    try:
        wait_until(lambda: watcher.polls >= 5)
        assert seen == [] and watcher.errors == 0
        server.notice()
        wait_until(lambda: seen)
        time.sleep(0.1)
        assert len(seen) == 1 and words in seen[0], seen
        assert not watcher._thread.is_alive()  # a notice ends it
    finally:
        watcher.close()


def test_aws_asks_for_a_new_token_when_its_token_expires(server: NoticeServer) -> None:
    watcher, seen = watch(Aws(server.base))
    try:
        wait_until(lambda: watcher.polls >= 3)
        assert server.paths().count("/latest/api/token") == 1  # one token for many reads
        server.expired_tokens.add(TOKEN)
        wait_until(lambda: server.paths().count("/latest/api/token") >= 2)
        server.expired_tokens.clear()
        server.notice()
        wait_until(lambda: seen)
        assert "terminate" in seen[0]
    finally:
        watcher.close()


def test_errors_back_off_and_are_said_once(server: NoticeServer, caplog) -> None:
    """Six 500s, then 404s: the waits between the erroring reads double (0.02 s period, no
    jitter: 0.02, 0.04, ... s), one warning says it does not answer, one that it answers
    again; an answer the provider does not document is an error too, never a notice."""
    caplog.set_level(logging.WARNING, logger=WATCH_LOG)
    server.errors = 6
    watcher, seen = watch(Url(f"{server.base}/w0"))
    try:
        wait_until(lambda: len(server.requests) >= 10)
        times = [t for _, _, t in server.requests]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        for i, gap in enumerate(gaps[:6]):
            assert gap >= 0.02 * 2**i * 0.9, gaps  # after the (i+1)-th error in a row
        assert max(gaps[6:9]) < 0.5, gaps  # answering again: the period, not 0.64 s
        said = [r.getMessage() for r in caplog.records if r.name == WATCH_LOG]
        assert len(said) == 2, said
        assert "does not answer" in said[0] and "HTTP 500" in said[0]
        assert "answers again" in said[1]
        assert seen == []
    finally:
        watcher.close()


def test_an_unreachable_endpoint_is_said_once_and_spares_the_server(caplog) -> None:
    """Nothing listens on the port (connection refused at once): a period of 0.01 s would
    mean ~100 tries in a second; the backoff makes it a handful, one warning, no crash."""
    caplog.set_level(logging.WARNING, logger=WATCH_LOG)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: refused from now on
    watcher, seen = watch(Url(f"http://127.0.0.1:{port}/x"), period_s=0.01)
    try:
        time.sleep(1.0)
        assert 3 <= watcher.polls <= 9, watcher.polls
        assert watcher._thread.is_alive() and seen == []
        said = [r.getMessage() for r in caplog.records if r.name == WATCH_LOG]
        assert len(said) == 1 and "does not answer" in said[0] and "ConnectError" in said[0]
    finally:
        start = time.monotonic()
        watcher.close()
        assert time.monotonic() - start < 1.0
        assert not watcher._thread.is_alive()


def test_a_worker_watches_its_own_url() -> None:
    assert isinstance(source_for("aws", 1), Aws) and isinstance(source_for("azure", 1), Azure)
    assert source_for("http://h:1/n/{worker}/a", 7).url == "http://h:1/n/7/a"
    assert VM_NAME  # the server's VM name is what Azure's events name
