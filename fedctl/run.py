"""`fedctl run`: a whole cluster on this machine with a live progress bar, then its results.

The processes are the same `fedctl master` / `fedctl worker` a user starts by hand
(:mod:`fedctl.launch` starts them); this module gives the run a folder of its own, follows the
master's metrics log and prints the comparison table at the end.

Runs never mix. A run writes into a fresh folder (``<output>.partial``) that becomes the output
folder only when the run has succeeded; a failed run's folder becomes ``<output>.failed`` with
its logs and a ``FAILED`` file saying why, and never leaves a half-written model beside an
older one. An ``output_dir`` named ``latest`` (the default, ``runs/latest``) keeps a history:
each run gets ``runs/<UTC time>-<id>/`` and ``runs/latest`` links to the newest that finished.
Any other output folder that already holds a finished run is refused unless ``--overwrite``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm

from common import constants as C
from common.atomic import atomic_write_bytes, is_locked
from common.config import ClusterConfig, ConfigError, config_to_dict
from common.constants import MASTER_LOCK, REPORTS_FILE
from common.runlog import MetricsTail, read_metrics, round_cpu
from fedctl.launch import LocalCluster, usable_cores

log = logging.getLogger("fedctl.run")

POLL_S = 0.1  # how often the metrics log and the processes are looked at


HISTORY_LINK = "latest"  # an output folder of this name keeps a history of runs beside it
#: The name of a run of a history (output_folder's `<UTC time>-<id>`), failed or not.
HISTORY_RUN = re.compile(r"\d{8}T\d{6}Z-[0-9a-f]{6}(\.failed)?")


#: What a run writes into its folder (the master, `fedctl run`, the trackers, the workers'
#: snapshots). Only a folder holding nothing else, or an empty one, is ever replaced: a
#: folder with anything more (a project that happens to hold a checkpoint.npz) is the user's.
RUN_FILES = frozenset({
    "cluster.yaml", "logs", "metrics.jsonl", "model.npz", "model.json", "summary.json",
    "comparison.md", "comparison.json", "checkpoint.npz", "curves.png", C.FAILED_NOTE,
    "master.prof", "workers", "tensorboard", "mlruns", MASTER_LOCK, REPORTS_FILE})
#: An atomic write's temp file left by a killed run (common/atomic.py names them so).
_TEMP = re.compile(r"^\..+\.tmp$")


def is_run_folder(path: Path) -> bool:
    """Whether ``path`` is a folder holding only what a fedctl run writes (finished or not)."""
    if not path.is_dir() or path.is_symlink():
        return False
    names = [p.name for p in path.iterdir()]
    return bool(names) and all(n in RUN_FILES or _TEMP.match(n) for n in names)


def output_folder(cfg: ClusterConfig, overwrite: bool = False) -> Path:
    """Where this run's results go: a new ``<UTC time>-<id>`` folder beside an output folder
    named ``latest``; else the output folder itself.

    Raises
    ------
    ConfigError
        When the folder holds a finished run and ``overwrite`` is False, or holds anything
        that is not a fedctl run (a user's files are never replaced, ``--overwrite`` or not),
        or is not a folder.
    """
    out = Path(os.path.abspath(cfg.output_dir))  # "." and ".." have no name to put beside
    if out.name == HISTORY_LINK:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        return out.parent / f"{stamp}-{secrets.token_hex(3)}"
    where = f"{cfg.source}: output_dir: {out}"
    longest = os.pathconf(out.parent, "PC_NAME_MAX") if out.parent.is_dir() else 255
    if len(out.name.encode()) + NAME_SUFFIX_BYTES > longest:
        raise ConfigError(f"{where}: its name is {len(out.name.encode())} bytes long, and fedctl "
                          f"names folders beside it after it (<name>.partial, "
                          f"<name>.failed-<id>): at most {longest - NAME_SUFFIX_BYTES} here")
    if out == out.parent:
        raise ConfigError(f"{where} is the root folder; choose a folder for the run")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{where} is a file, not a folder; choose another --output")
    if out.is_dir() and any(out.iterdir()) and not is_run_folder(out):
        raise ConfigError(f"{where} holds files that are not a fedctl run's, which a run "
                          f"would replace; choose a new or empty folder")
    if is_locked(out / MASTER_LOCK):  # a `fedctl master` of its own still writes there
        raise ConfigError(f"{where}: a master is still writing into it; stop it, or choose "
                          f"another --output")
    if (out / "model.json").exists() and not overwrite:
        raise ConfigError(f"{where} holds a finished run; pass --overwrite to replace it, or "
                          f"choose another --output")
    # (Ctrl-C, a dead worker: its checkpoint is all that is left; a failed run replaces the
    # <out>.failed beside it)
    for stopped in (out, out.with_name(out.name + ".failed")):
        if resumable(stopped) and not overwrite:
            raise ConfigError(f"{cfg.source}: output_dir: {stopped} holds a stopped run that can "
                              f"be resumed (fedctl master --config {stopped / 'cluster.yaml'} "
                              f"--resume), which this run would replace; pass --overwrite to "
                              f"let it, or choose another --output")
    return out


def resumable(folder: Path) -> bool:
    """Whether ``folder`` holds a run that stopped with a checkpoint and no results yet."""
    return (folder / "checkpoint.npz").is_file() and not (folder / "summary.json").is_file()


def resume_folder(link: Path) -> Path:
    """The run ``fedctl master --resume`` continues when its output folder is the history link
    (``runs/latest``): the newest folder beside it holding a checkpoint and no results yet.

    Raises
    ------
    ConfigError
        When there is none.
    """
    candidates = [d for d in link.parent.iterdir() if d.is_dir() and not d.is_symlink()
                  and (d / "checkpoint.npz").is_file() and not (d / "summary.json").is_file()
                  ] if link.parent.is_dir() else []
    if not candidates:
        raise ConfigError(f"--resume: no unfinished run under {link.parent} (a folder with a "
                          f"checkpoint.npz and no summary.json)")
    return max(candidates, key=lambda d: (d.stat().st_mtime, d.name))


def history_link(output_dir: str | Path, resume: bool = False) -> Path | None:
    """The history link a run in ``output_dir`` finishes under: ``output_dir`` itself when it
    is named ``latest``; with ``resume``, a ``latest`` link beside it that points at a run
    folder there (a run of that history continued with ``--config <run>/cluster.yaml
    --resume``, the command a stopped master prints); else None. A new run in a folder of its
    own (``fedctl run --output``, whose master writes into a ``.partial`` folder) moves no
    link, nor does anything beside a ``latest`` that is not a history's."""
    out = Path(os.path.abspath(output_dir))
    if out.name == HISTORY_LINK:
        return out
    beside = out.parent / HISTORY_LINK
    if (not resume or not beside.is_symlink() or HISTORY_RUN.fullmatch(out.name) is None
            or not is_run_folder(out)):
        return None  # (a `.partial` folder, `fedctl run --output`'s own: no history's run)
    target = beside.resolve()
    # The link at a run of the history, or at one deleted since.
    return beside if target.parent == out.parent.resolve() and (
        not target.exists() or is_run_folder(target)) else None


def point_history_link(link: Path, final: Path) -> None:
    """Point ``link`` (``runs/latest``) at the finished run ``final``, atomically."""
    tmp = link.with_name(link.name + ".new")
    tmp.unlink(missing_ok=True)
    os.symlink(final.name, tmp)  # relative: the runs folder may move
    if link.exists() and not link.is_symlink():  # a run from before the history
        link.rename(link.with_name(f"{link.name}.before-history"))
    tmp.replace(link)


def run_local_cluster(cfg: ClusterConfig, progress: bool = True, log_level: str = "info",
                      overwrite: bool = False) -> int:
    """Run the job; returns the exit code (0 when master and every worker succeeded)."""
    final = output_folder(cfg, overwrite)
    staging = final.with_name(final.name + C.STAGING_SUFFIX)
    link = Path(cfg.output_dir) if Path(cfg.output_dir).name == HISTORY_LINK else None
    with _claimed(staging, cfg):
        cfg.output_dir = str(staging)
        try:
            code = _run(cfg, progress, log_level)
        except Exception as exc:  # the preparation failed (or the launcher): still kept
            _keep_failed(staging, final, 1, f"{type(exc).__name__}: {exc}")
            raise
        if code == 0:
            _publish(cfg, staging, final, link)
            try:
                _print_results(final)
            except OSError:  # the reader left (`| head`): the results are in their folder
                # Python's advice for a broken pipe: point stdout at /dev/null, so that the
                # flush at exit fails no more.
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
        else:
            _keep_failed(staging, final, code)
    return code


@contextlib.contextmanager
def _claimed(staging: Path, cfg: ClusterConfig) -> Iterator[None]:
    """``staging`` (``<output>.partial``) made empty and held for this run alone: a second run
    into the same output folder is refused while this one runs (each would clear the other's
    files), by a lock the system drops when this process ends, however it ends."""
    in_the_way = ConfigError(f"{cfg.source}: output_dir: {staging} is in the way (a run "
                             f"writes there first) and is not a fedctl run's; move it or "
                             f"choose another --output")
    if staging.exists() and not staging.is_dir():
        raise in_the_way
    staging.mkdir(parents=True, exist_ok=True)
    fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"{cfg.source}: output_dir: another fedctl run is writing into "
                              f"{staging}; wait for it, or choose another --output") from None
        except OSError as exc:  # a file system without locks (some network mounts)
            log.warning("%s: cannot be locked (%s): a second run into it would not be "
                        "refused", staging, exc.strerror)
        if any(staging.iterdir()) and not is_run_folder(staging):
            raise in_the_way
        if is_locked(staging / MASTER_LOCK):  # a killed `fedctl run`'s master still writes
            raise ConfigError(f"{cfg.source}: output_dir: a master is still writing into "
                              f"{staging} (its `fedctl run` was killed); stop it, or choose "
                              f"another --output")
        if (staging / "checkpoint.npz").is_file() or (staging / "summary.json").is_file():
            # A killed `fedctl run`'s: its master checkpointed, or even finished, after it
            # was killed. Kept as a failed run (resumable), not cleared.
            final = staging.with_name(staging.name.removesuffix(C.STAGING_SUFFIX))
            kept = _keep_failed(staging, final, -signal.SIGKILL,
                                "its `fedctl run` was killed before it ended", quiet=True)
            log.warning("%s: left by a `fedctl run` that was killed; kept as %s%s", staging,
                        kept, f" (resumable: fedctl master --config {kept}/cluster.yaml "
                              f"--resume, and its workers)" if kept and resumable(kept) else "")
            os.close(fd)
            fd = -1
            with _claimed(staging, cfg):
                yield
            return
        for leftover in staging.iterdir():  # an earlier attempt's, never a run
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover)
            else:
                leftover.unlink()
        yield
    finally:
        if fd >= 0:
            os.close(fd)  # the lock goes with it


#: The most bytes fedctl adds to the output folder's name for a folder beside it (the longest:
#: an earlier failed run moved aside, ".<name>.failed.old-<8 hex>").
NAME_SUFFIX_BYTES = len("..failed.old-") + 8


def _aside(path: Path, suffix: str) -> Path:
    """A free hidden name beside ``path`` to move it to before deleting it: never the name of
    something of the user's."""
    return path.with_name(f".{path.name}{suffix}-{secrets.token_hex(4)}")


def _publish(cfg: ClusterConfig, staging: Path, final: Path, link: Path | None) -> None:
    """Move the finished run into place (replacing an older run there only when the caller
    allowed it) and point the history link at it."""
    cfg.output_dir = str(final)  # what the saved config says, for `fedctl master --resume`
    atomic_write_bytes(staging / "cluster.yaml",
                       yaml.safe_dump(config_to_dict(cfg), sort_keys=False).encode())
    if final.exists():
        old = _aside(final, ".old")
        final.rename(old)
        staging.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(final)
    if link is not None:
        point_history_link(link, final)


def _keep_failed(staging: Path, final: Path, code: int, why: str | None = None,
                 quiet: bool = False) -> Path | None:
    """The failed run's folder, with its logs, marked failed beside where it would have gone
    (``<output>.failed``; an earlier failed run there is replaced, a user's folder of that
    name is not: the run then goes to a free name beside it); where it went. ``quiet``: the
    caller says what happened (it is not this process's run)."""
    if not staging.exists():
        return None
    failed = final.with_name(final.name + ".failed")
    if failed.exists():
        if is_run_folder(failed) and not resumable(failed):
            old = _aside(failed, ".old")
            failed.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        else:
            failed = final.with_name(f"{final.name}.failed-{secrets.token_hex(3)}")
    logs = staging / "logs"
    started = logs.is_dir() and any(logs.iterdir())  # (Ctrl-C while embedding: none yet)
    if why is None:
        what = "interrupted" if code > 128 else "a process failed"
        why = (f"see logs/ ({what})" if started
               else f"{what} before the cluster started (no process logs)")
    (staging / C.FAILED_NOTE).write_text(f"exit code {code}: {why}\n")
    staging.rename(failed)
    if not quiet and started:
        log.error("the run failed; its logs are in %s", failed / "logs")
    elif not quiet:
        log.error("the run failed before the cluster started: %s", failed)
    _moved_to(staging, failed, quiet)
    return failed


def _diverged(logs: Path) -> str | None:
    """The first worker's word that its training diverged (worker.client says it once), or
    None."""
    for path in sorted(logs.glob("*.log")) if logs.is_dir() else ():
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        at = text.find(DIVERGED)
        if at >= 0:
            return f"{path.stem}: " + text[at:].split("\n", 1)[0]
    return None


def _summary_failure(folder: Path) -> str | None:
    """Why a job that ran to its end failed (summary.json's ``failed``), or None."""
    try:
        summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    failed = summary.get("failed") if isinstance(summary, dict) else None
    return str(failed) if failed else None


def _moved_to(staging: Path, failed: Path, quiet: bool = False) -> None:
    """The failed folder's cluster.yaml names the folder it is in now (its master wrote to the
    staging folder, and a resume from the old name found nothing); with a checkpoint, say how
    to go on (the master's own stop hint named the staging folder too)."""
    config = failed / "cluster.yaml"
    if config.is_file():
        try:
            raw = yaml.safe_load(config.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            raw = None
        if isinstance(raw, dict):
            # Paths, component by component: the staging folder itself, or inside it.
            inside = str(staging) + os.sep

            def moved(v: Any) -> Any:
                if isinstance(v, dict):
                    return {k: moved(x) for k, x in v.items()}
                if isinstance(v, list):
                    return [moved(x) for x in v]
                if isinstance(v, str) and (v == str(staging) or v.startswith(inside)):
                    return str(failed) + v[len(str(staging)):]
                return v

            atomic_write_bytes(config, yaml.safe_dump(moved(raw), sort_keys=False).encode())
    master_log = failed / "logs" / "master.log"
    if master_log.is_file() and (failed / "checkpoint.npz").is_file():
        # (its last lines named the staging folder, gone: a resume from there found nothing)
        with master_log.open("a", encoding="utf-8") as fh:
            fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} INFO    fedctl.run: this folder "
                     f"was {staging} and is now {failed}: continue with `fedctl master "
                     f"--config {config} --resume`\n")
    if quiet:
        return
    ended, diverged = _summary_failure(failed), _diverged(failed / "logs")
    if ended is not None:  # the job ran to its end: a resume would end the same way
        log.error("it ran to its end: %s; change the config and run it again", ended)
    elif diverged is not None:  # resumed, it would diverge again
        log.error("%s; change the config and run it again", diverged)
    else:
        if (failed / "model.npz").is_file():  # written once training is over
            log.error("training was over: its model is kept (`fedctl predict %s FILE`); its "
                      "comparison was not finished", failed)
        if (failed / "checkpoint.npz").is_file() and config.is_file():
            log.error("its checkpoint is kept: continue with `fedctl master --config %s "
                      "--resume` and its workers (`fedctl worker --config %s --id <w>`)",
                      config, config)


#: How a worker's log says its training diverged (worker.client's line).
DIVERGED = "training diverged"


class Stopped(BaseException):
    """A signal asked this run to stop (``signum``): what Ctrl-C's KeyboardInterrupt is to
    SIGINT, for SIGTERM (``kill``, ``timeout``, a scheduler, ``docker stop``) and SIGHUP (the
    terminal closed). A BaseException, as KeyboardInterrupt is: no ``except Exception`` on the
    way catches it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


#: The signals this process was stopped by. The exception a handler raises may not arrive as
#: such: an extension may turn it into its own (a Ctrl-C while openvino's module loaded came
#: out as "ImportError: initialization failed", a traceback, exit 1), or swallow it (raised
#: inside a ZeroMQ frame's ``__dealloc__``, Python prints it as "Exception ignored" and goes
#: on: a SIGTERMed master served on until its workers' absence ended the job).
_SIGNALLED: list[int] = []


def raise_if_stopped() -> None:
    """Raise again the stop a signal asked for, if one did: called in a loop that must not
    serve on past a stop whose exception was swallowed (:data:`_SIGNALLED`)."""
    if _SIGNALLED:
        signum = _SIGNALLED[0]
        raise KeyboardInterrupt if signum == signal.SIGINT else Stopped(signum)


def _stop_on(signum: int, frame: object) -> None:
    _SIGNALLED.append(signum)
    raise Stopped(signum)


def _interrupt_on(signum: int, frame: object) -> None:
    _SIGNALLED.append(signum)
    raise KeyboardInterrupt


#: Signals that stop a run as Ctrl-C does. The processes it started have sessions of their own
#: (a Ctrl-C at the terminal reaches this process only), so left to the default action these
#: would end this process and leave the master and workers running, orphaned.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _catch_stop_signals() -> dict[int, Any]:
    """Make each of :data:`STOP_SIGNALS` raise :class:`Stopped`, except one this process was
    started ignoring (``nohup`` ignores SIGHUP so that closing the terminal stops nothing),
    and Ctrl-C, left to Python's own, raise KeyboardInterrupt as before; each recorded in
    :data:`_SIGNALLED`. Returns the handlers it replaced."""
    before = {s: signal.signal(s, _stop_on) for s in STOP_SIGNALS
              if signal.getsignal(s) is not signal.SIG_IGN}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        before[signal.SIGINT] = signal.signal(signal.SIGINT, _interrupt_on)
    return before


@contextlib.contextmanager
def stopped_by_signals() -> Iterator[None]:
    """Within: SIGTERM and SIGHUP raise :class:`Stopped` where this (main) thread is, so that
    ``finally`` blocks run as for Ctrl-C (a master closes its checkpoint writer, its log)."""
    before = _catch_stop_signals()
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _stopping(signum: int) -> int:
    """Say that a signal stops the run; its exit status."""
    log.warning("%s: stopping the master and workers", "interrupted (Ctrl-C)"
                if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}")
    return 128 + signum


def _run(cfg: ClusterConfig, progress: bool, log_level: str) -> int:
    cluster = LocalCluster(cfg, log_level=log_level, progress=progress)
    metrics_path = cluster.out / "metrics.jsonl"
    _SIGNALLED.clear()
    before = _catch_stop_signals()
    bar = None
    code = 0
    try:
        log.info("preparing %s (once for all %d workers)", cfg.family, len(cfg.workers))
        cluster.prepare()
        raise_if_stopped()  # (a Ctrl-C an extension swallowed while preparing)
        cluster.start()
        log.info("started master and %d worker(s); logs in %s", len(cfg.workers), cluster.logs)
        bar = tqdm(total=cfg.rounds, desc="rounds", unit="round", disable=not progress,
                   dynamic_ncols=True)
        code = _follow(cluster, metrics_path, bar, cfg.baselines)
    except KeyboardInterrupt:
        code = _stopping(signal.SIGINT)
    except Stopped as exc:
        code = _stopping(exc.signum)
    except Exception:
        if not _SIGNALLED:
            raise
        # (the signal's own exception, turned into another by an extension on the way)
        log.debug("stopped by a signal, raised as another exception", exc_info=True)
        code = _stopping(_SIGNALLED[0])
    finally:
        # A second signal (Ctrl-C again too) must not cut the stop short: it is bounded.
        held = {s: signal.signal(s, signal.SIG_IGN)
                for s in dict.fromkeys((signal.SIGINT, *before))}
        try:
            cluster.stop()  # first: whatever fails after, nothing is left running
        finally:
            for s, handler in {**held, **before}.items():  # the originals
                signal.signal(s, handler)
            if bar is not None:
                # The terminal may be gone (SIGHUP), or the pipe's reader (a killed parent).
                with contextlib.suppress(OSError):
                    bar.close()
    return code


def _follow(cluster: LocalCluster, metrics_path: Path, bar: tqdm, baselines: bool = True
            ) -> int:
    """Advance the bar round by round until every process has exited; 1 if one failed."""
    tail = MetricsTail(metrics_path)
    while True:
        time.sleep(POLL_S)
        raise_if_stopped()  # a stop whose exception was swallowed (_SIGNALLED)
        for e in tail.new_events():
            if e["event"] == "training_done":
                # The baselines may take longer than the training: say what the wait is for.
                said = ("training done, model saved; now the workers' final reports"
                        + (", their local-only baselines and the centralized one"
                           if baselines else ""))
                if bar.disable:
                    log.info("%s", said)
                with contextlib.suppress(OSError):
                    bar.set_postfix_str(said)
            if e["event"] != "round":
                continue
            f1 = e.get("mean_macro_f1")  # of the model the round started from
            said = ([f"F1 at round start {f1:.3f}"] if f1 is not None else []) + [
                f"{1000 * e['overhead_s']:.1f} ms overhead"]
            said += [f"{label} {e[key]:.2f}" for key, label in
                     (("epsilon", "ε"), ("client_epsilon", "client ε")) if e.get(key) is not None]
            if bar.total is not None and bar.n >= bar.total:
                bar.total = bar.n + 1  # a redone synchronous step takes rounds past `rounds`
            try:
                bar.set_postfix_str(", ".join(x for x in said if x))
                bar.update(1)
            except OSError:
                # The terminal or the pipe's reader is gone (`fedctl run | head`, a closed
                # window under nohup): the run goes on without its bar (it ended with exit 1).
                bar.disable = True
        failed = cluster.failed()
        if failed:
            log.error("%s", cluster.failure_report(failed))
            return 1
        if not cluster.running():
            break
    return 0


def _print_results(out: Path) -> None:
    events = read_metrics(out / "metrics.jsonl")
    wall = events[-1]["time"] - events[0]["time"] if len(events) > 1 else 0.0
    rounds = [e for e in events if e["event"] == "round"]
    table = (out / "comparison.md").read_text() if (out / "comparison.md").exists() else ""
    print("")
    print(table)
    if rounds:
        durations = [e["duration_s"] for e in rounds]
        overheads = [e["overhead_s"] for e in rounds]
        median = statistics.median(durations)
        print(f"{wall:.1f} s from the master's start to its end, {len(rounds)} round(s): "
              f"training {sum(durations):.2f} s, median round "
              + (f"{median:.2f} s" if median >= 1 else f"{1000 * median:.1f} ms")
              + f", median overhead (round - slowest worker's training) "
              f"{1000 * statistics.median(overheads):.2f} ms")
        cpu = round_cpu(events)
        if cpu and len(cpu) == len(rounds):  # every process here: what a round cost the machine
            cores, median = usable_cores(), statistics.median(cpu.values())
            print(f"a round cost the master and the workers {1000 * median:.1f} ms of CPU "
                  f"(median, every thread): on this machine's {cores} core(s), rounds cannot "
                  f"follow each other faster than every {1000 * median / cores:.1f} ms")
    trained = json.loads((out / "summary.json").read_text()).get("trained", {})
    seen = sum(e.get("n_samples", 0) for e in events if e["event"] == "worker_round")
    family = str(json.loads((out / "model.json").read_text()).get("family", "")
                 ) if (out / "model.json").is_file() else ""
    weights = "tokens" if family in ("lda", "sentencelda") else "training documents"
    print("trained: " + ", ".join(f"{n} {unit.removesuffix('s') if n == 1 else unit}"
                                  for unit, n in trained.items())
          # (what the updates declared, not what the strategy kept: Krum keeps one a round)
          + f"; the updates received declared {seen} {weights} in all (each worker's once a "
            f"round, whatever its local epochs)")
    print(f"model, metrics, comparison and logs in {out}")
