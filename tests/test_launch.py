"""The launcher's two ways of starting a process (fedctl/launch.py): forked from the fork server
(what `fedctl run` does) and a fresh interpreter (``FEDCTL_FORK=0``, profiling). Each `fedctl
run` of the other tests goes the forked way; here both are held to the same behaviour: the
exit code, the log and the end by a signal."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from fedctl.launch import ForkedProcess, child_env, spawn
from tests.conftest import MakeConfig, wait_for

WAYS = ["forked", "fresh"]


def _start(way: str, args: list[str], log: Path, env: dict[str, str]):
    if way == "forked":
        return ForkedProcess(args, log, env, new_session=True)
    return spawn(args, log, env, new_session=True)


@pytest.mark.parametrize("way", WAYS)
def test_both_ways_give_the_same_exit_codes_and_logs(way: str, tmp_path: Path) -> None:
    ok = _start(way, ["--version"], tmp_path / "ok.log", child_env())
    assert ok.wait(timeout=60) == 0
    assert "version" in (tmp_path / "ok.log").read_text()
    bad = _start(way, ["worker", "--no-such-option"], tmp_path / "bad.log", child_env())
    assert bad.wait(timeout=60) == 2 and bad.poll() == 2
    assert "Error: No such option '--no-such-option'" in (tmp_path / "bad.log").read_text()


@pytest.mark.parametrize("way", WAYS)
def test_both_ways_end_on_terminate(way: str, tmp_path: Path, make_config: MakeConfig
                                    ) -> None:
    """A master waiting for its workers ends on SIGTERM, forked as a fresh interpreter does."""
    config = make_config(tmp_path, workers=1, join_timeout=120)
    log = tmp_path / "master.log"
    env = child_env(tmp_path / "cache", threads=1)
    proc = _start(way, ["master", "--config", str(config)], log, env)
    try:
        wait_for(lambda: "waiting for w1" in log.read_text(), 60, "the master to listen",
                 interval=0.2)
        assert proc.poll() is None
        proc.terminate()
        code = proc.wait(timeout=30)
    finally:
        proc.kill()  # (nothing when it has ended)
    # Stopped in order (its log and checkpoint writer closed), with one line and 128 + 15.
    assert code == 128 + signal.SIGTERM, code
    assert proc.poll() == code
    assert log.read_text().strip().splitlines()[-1] == "Error: stopped by SIGTERM"
    if way == "forked":
        assert code == spawn_code(tmp_path, config)


def spawn_code(tmp_path: Path, config: Path) -> int:
    """The exit code a fresh interpreter's master gives SIGTERM at the same point."""
    log = tmp_path / "fresh.log"
    proc = spawn(["master", "--config", str(config)], log, child_env(threads=1),
                 new_session=True)
    try:
        wait_for(lambda: "waiting for w1" in log.read_text(), 60, "the master to listen",
                 interval=0.2)
        proc.terminate()
        return proc.wait(timeout=30)
    finally:
        proc.kill()


def test_a_process_killed_by_a_signal_is_said_so() -> None:
    """`w3 exited with code -9` said nothing of the out-of-memory killer."""
    from fedctl.launch import exit_reason

    assert exit_reason(-9) == "-9 (killed by SIGKILL: out of memory, or kill -9)"
    assert exit_reason(-15) == "-15 (killed by SIGTERM)"
    assert exit_reason(1) == "1" and exit_reason(None) == "None"
