"""`fedctl`: the command line of the cluster.

    fedctl master --config cluster.yaml
    fedctl worker --config cluster.yaml --id w1 [--data PATH]
    fedctl run    [--config cluster.yaml] [--workers N]
    fedctl check  [--config cluster.yaml]
    fedctl bench  [--quick] [--out benchmarks/results]
    fedctl predict [RUN] INPUT.jsonl [-o OUT.jsonl]
    fedctl topics | show [RUN];  fedctl runs [FOLDER]
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
from itertools import pairwise
from pathlib import Path
from typing import NoReturn

import click

from common import constants as C
from common.config import (
    WORKER_NAME,
    WORKER_NAME_RULE,
    ClusterConfig,
    ConfigError,
    check_threshold,
    load_config,
)
from fedctl.errors import fail, one_line

LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), format=LOG_FORMAT,
                        stream=sys.stderr)


def _load(config: str, workers: int | None = None, rounds: int | None = None,
          output: str | None = None, overrides: tuple[str, ...] = ()) -> ClusterConfig:
    cfg = load_config(config, overrides)
    if workers is not None:
        own = [w.name for w in cfg.workers if w.data]
        if own:
            logging.getLogger("fedctl").warning(
                "--workers %d: w1..w%d share data.path; the config's workers with files of "
                "their own (%s) are not used", workers, workers, ", ".join(own))
        cfg = cfg.with_workers(workers)
    if rounds is not None:
        if not 1 <= rounds <= C.MAX_ROUNDS:
            raise ConfigError(f"--rounds: expected an integer from 1 to {C.MAX_ROUNDS:,}, "
                              f"got {rounds}")
        cfg.rounds = rounds
    if output is not None:
        cfg.output_dir = os.path.abspath(output)  # a link (runs/latest) stays a link
    check_threshold(cfg)  # (against the workers --workers made)
    return cfg




#: Whether this process is the ``fedctl`` command itself (:func:`entry`), which
#: :func:`_end` may end at once; not so when :func:`main` is called from other code.
_OWN_PROCESS = False


def _end() -> None:
    """End a command that succeeded now, without the interpreter's teardown.

    Freeing torch's, scikit-learn's and matplotlib's modules at exit takes 0.6-1.5 s (measured:
    `import torch` then exit, 1.85 s; then `os._exit`, 1.12 s), which `fedctl run` waits for in
    the master, the workers and itself. What the teardown would still do for us is done first:
    the exit handlers (logging's, the trackers') run and the streams are flushed. It returns
    instead (the usual exit follows) where a thread is still at work, which that exit waits
    for, under a profiler or tracer, which writes its results then, and where :func:`main` was
    called from other code rather than as the command (:func:`entry`).
    """
    import threading

    main_thread = threading.main_thread()
    if (not _OWN_PROCESS  # called in-process (a test's CliRunner): return to the caller
            or sys.getprofile() is not None or sys.gettrace() is not None  # cProfile writes
            # its file at the usual exit (fedctl bench --profile)
            or any(t.is_alive() and not t.daemon for t in threading.enumerate()
                   if t is not main_thread)):
        return
    _exit_now(0)


def _exit_now(code: int) -> NoReturn:
    """Exit with ``code`` without the interpreter's teardown, after what it would still do for
    us: the exit handlers (logging's, the trackers', multiprocessing's) and the streams'
    flush."""
    import atexit

    atexit._run_exitfuncs()  # public since Python 2 in all but name; logging.shutdown is one
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it anyway
            pass
    os._exit(code)


_config = click.option("--config", "-c", default="cluster.yaml", show_default=True,
                       type=click.Path(dir_okay=False), help="Cluster description.")
_overrides = click.option(
    "--set", "overrides", multiple=True, metavar="FIELD=VALUE",
    help="Override a field of the config, checked like the file (repeatable): "
         "--set model.lr=0.01 --set data.limit=600.")
_log_level = click.option("--log-level", default="info", show_default=True,
                          type=click.Choice(["debug", "info", "warning", "error"]))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fedctl")
def main() -> None:
    """fedctl: federated learning for text over ZeroMQ.

    A master publishes the global model (PUB) and takes updates (REP); workers train on
    documents that never leave them (SUB + REQ).
    """


@main.command()
@_config
@_overrides
@click.option("--workers", type=int, default=None,
              help="Expect workers w1..wN instead of the config's worker list.")
@click.option("--rounds", type=int, default=None, help="Override the number of rounds.")
@click.option("--output", "-o", type=click.Path(file_okay=False), default=None,
              help="Output folder (default: output_dir of the config).")
@click.option("--resume", is_flag=True,
              help="Continue from the checkpoint in the output folder; running workers "
                   "reconnect by themselves.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads of the master's torch and BLAS / OpenMP pools (default: "
                   "OMP_NUM_THREADS if set; else with master.host on loopback, where every "
                   "worker runs on this host too, its share of the cores beside them; else "
                   "every core).")
@_log_level
def master(config: str, overrides: tuple[str, ...], workers: int | None, rounds: int | None,
           output: str | None, resume: bool, threads: int | None, log_level: str) -> None:
    """Run the master: announce, collect updates, aggregate, write results."""
    _setup_logging(log_level)
    _master_threads(config, overrides, workers, threads)
    from common.net.security import SecurityError
    from fedctl.run import Stopped, raise_if_stopped, stopped_by_signals
    from master.server import Master

    try:
        # From the start: a SIGTERM while the master binds or restores ends it in order too.
        with stopped_by_signals():
            cfg = _load(config, workers, rounds, output, overrides)
            from fedctl.run import (
                HISTORY_LINK,
                history_link,
                output_folder,
                point_history_link,
                resume_folder,
            )

            # An output folder named `latest` keeps a history, as with `fedctl run`: a new run gets
            # a folder of its own beside it, --resume finds the newest unfinished one. A run of a
            # history continued by its own folder (the command a stopped master prints) finishes
            # under that history's link too.
            link = history_link(cfg.output_dir, resume)
            if Path(cfg.output_dir).name == HISTORY_LINK:
                cfg.output_dir = str(resume_folder(link) if resume else output_folder(cfg))
                new_folder = None if resume else Path(cfg.output_dir)
            elif not resume and (Path(cfg.output_dir) / "summary.json").is_file():
                # A new job there would append to its log and write over its results.
                raise ConfigError(f"{config}: output_dir: {cfg.output_dir} holds a finished run; "
                                  f"choose another --output, or an output_dir named latest "
                                  f"(a new folder each run)")
            server = Master(cfg, resume=resume)
            server.on_tick = raise_if_stopped
            server.bind()
            summary = server.serve()
            if summary.get("failed"):
                raise RuntimeError(summary["failed"])
            _draw_curves(Path(cfg.output_dir))
            if link is not None:
                point_history_link(link, Path(cfg.output_dir))
    except (ConfigError, SecurityError, OSError, TimeoutError, RuntimeError) as exc:
        fail(exc)
    except (KeyboardInterrupt, Stopped) as exc:
        # serve() has closed its checkpoint writer and log on the way out.
        out = Path(cfg.output_dir) if "cfg" in locals() else None
        kept = out is not None and (out / "checkpoint.npz").is_file()
        name = "SIGINT" if isinstance(exc, KeyboardInterrupt) else str(exc)
        fail(RuntimeError(f"stopped by {name}"
                          + (f"; the checkpoint in {out} is kept: continue with `fedctl master "
                             f"--config {out / 'cluster.yaml'} --resume`" if kept else "")),
             128 + (signal.SIGINT if isinstance(exc, KeyboardInterrupt) else exc.signum))
    finally:
        if "server" in locals():
            server.close()
        if locals().get("new_folder") is not None:
            _drop_if_nothing_trained(new_folder)
    _end()


def _loopback_cluster(config: str, overrides: tuple[str, ...], workers: int | None) -> int:
    """The processes of a cluster whose master is on loopback (so every one of them is on
    this host): its workers and the master; 0 when the master is elsewhere, or the config
    cannot be read (the command's own loading then says why, in one line)."""
    try:
        cfg = load_config(config, overrides)
    except (ConfigError, OSError):
        return 0
    if cfg.master.host not in ("127.0.0.1", "localhost", "::1"):
        return 0
    n = workers or len(cfg.workers) or cfg.min_workers  # (none listed: at least min_workers)
    return n + 1


def _master_threads(config: str, overrides: tuple[str, ...], workers: int | None,
                    threads: int | None) -> None:
    """Cap the master's CPU threads: ``--threads``, else its share of the cores when its
    workers run on this host (master.host on loopback). A master spinning two OpenMP threads
    beside three workers on two cores made synchronized steps 20-25 % slower (29.6 against
    36.6 steps a second)."""
    if threads is None and not os.environ.get("OMP_NUM_THREADS"):  # (fedctl run sets it)
        cluster = _loopback_cluster(config, overrides, workers)
        if cluster:
            threads = max(1, (os.cpu_count() or 1) // cluster)
    if threads is not None:
        from fedctl.launch import limit_threads

        limit_threads(threads)
        # (debug: a master that fails to start still says so in one line)
        logging.getLogger("fedctl.master").debug(
            "CPU threads: %d (--threads to choose)", threads)


def _drop_if_nothing_trained(folder: Path) -> None:
    """Remove a history's new run folder whose master stopped before its first round (keys
    missing, a port taken, no workers came): `fedctl runs` listed such a start as a run. One
    that trained a round is kept, checkpoint or not: its log says what happened."""
    from common.runlog import read_metrics
    from fedctl.run import is_run_folder

    if not folder.is_dir() or not (is_run_folder(folder) or not any(folder.iterdir())):
        return
    if any((folder / name).exists() for name in ("checkpoint.npz", "summary.json")):
        return
    metrics = folder / "metrics.jsonl"
    try:
        events = read_metrics(metrics) if metrics.is_file() else []
    except (OSError, ValueError):
        return  # unreadable: not ours to judge
    if all(e.get("event") in ("start", "register") for e in events):
        shutil.rmtree(folder, ignore_errors=True)


def _draw_curves(out: Path) -> None:
    """``curves.png`` of a finished run; a picture that cannot be drawn costs a warning, not
    the run."""
    try:
        from fedctl.plots import plot_runs

        plot_runs([out], out / "curves.png")
    except Exception as exc:  # matplotlib's many errors: the run itself is fine
        logging.getLogger("fedctl").warning("curves.png not drawn: %s", exc)


def _runs_fedctl(args: list[bytes]) -> bool:
    """Whether a command line is fedctl itself: ``fedctl ...``, ``python .../fedctl ...`` or
    ``python -m fedctl(.cli) ...``; not a wrapper that starts it (``timeout 600 fedctl worker``
    counted as a second worker, halving the threads)."""
    program = os.path.basename(args[0]) if args else b""
    if program == b"fedctl":
        return True
    if not program.startswith(b"python"):
        return False
    rest = args[1:]  # `python -m cProfile -o x -m fedctl.cli` too (fedctl_command's profile)
    return (any(a == b"-m" and b in (b"fedctl", b"fedctl.cli") for a, b in pairwise(rest))
            or (bool(rest) and os.path.basename(rest[0]) == b"fedctl"))


def _workers_on_this_host() -> int:
    """``fedctl worker`` processes running on this host, this one included (from /proc on
    Linux; 1 where there is none)."""
    # hand-written: one count over /proc; psutil for this alone is not worth a dependency
    count = 0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if b"worker" in args and _runs_fedctl(args):
            count += 1
    return max(1, count)


@main.command()
@_config
@_overrides
@click.option("--id", "worker_id", required=True, help="This worker's name, e.g. w1.")
@click.option("--data", type=click.Path(dir_okay=False, exists=True), default=None,
              help="JSONL {text, label} of this worker's own documents "
                   "(default: its share of data.path).")
@click.option("--device", default=None, help="auto, cpu, cuda, cuda:N (default: from config).")
@click.option("--workers", type=int, default=None,
              help="The cluster has workers w1..wN (as given to the master).")
@click.option("--rounds", type=int, default=None, help="As given to the master.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads of torch and of numpy / scikit-learn / numba's BLAS and OpenMP "
                   "pools (default: this worker's fair share of the cores, counting the "
                   "`fedctl worker` processes running on this host when it starts and, with "
                   "master.host on loopback and no OMP_NUM_THREADS set, the cluster's own "
                   "workers and master; alone, every core).")
@_log_level
def worker(config: str, overrides: tuple[str, ...], worker_id: str, data: str | None,
           device: str | None, workers: int | None, rounds: int | None, threads: int | None,
           log_level: str) -> None:
    """Run a worker: join the master, train on local data each round, report."""
    _setup_logging(log_level)
    if WORKER_NAME.fullmatch(worker_id) is None:  # a file name too: its snapshots' folder
        fail(ConfigError(f"--id: expected {WORKER_NAME_RULE}, got {worker_id!r}"))
    if threads is None:
        here = _workers_on_this_host()
        # With master.host on loopback the whole cluster is on this host, started yet or not
        # (four terminals: w1, started first, took both cores beside the others).
        cluster = (0 if os.environ.get("OMP_NUM_THREADS")  # the user's (or ansible's) word
                   else _loopback_cluster(config, overrides, workers))
        if max(here, cluster) > 1:  # each taking every core, three workers: a 0.3 s round 4 s
            threads = max(1, (os.cpu_count() or 1) // max(here, cluster))
            logging.getLogger("fedctl.worker").info(
                "%d fedctl workers on this host%s: %d CPU thread(s) each (--threads to "
                "choose)", here, f", a cluster of {cluster} processes on loopback"
                if cluster > here else "", threads)
    from fedctl.launch import limit_threads

    if threads:
        limit_threads(threads)
    from common.net.transport import PeerUnreachable, RemoteError
    from worker.client import JOB_FAILED_EXIT, JobFailed, Worker
    from worker.devices import GPUMemoryError

    if threads:  # again: the families' imports load pools of their own (scipy, scikit-learn)
        limit_threads(threads, report=True)

    try:
        cfg = _load(config, workers, rounds, overrides=overrides)
        worker = Worker(cfg, worker_id, data_path=data, device=device)
        worker.run()
    except RemoteError as exc:  # e.g. a refused registration: one line, not a traceback
        diverged = getattr(locals().get("worker"), "diverged_", None)
        fail(RuntimeError(f"{worker_id}'s {diverged}; the master refused it: {exc}"
                          if diverged else f"the master refused {worker_id}: {exc}"))
    except JobFailed as exc:
        fail(exc, JOB_FAILED_EXIT)
    except KeyboardInterrupt:  # as the master says it (click printed "Aborted!", status 1)
        snapshots = "cfg" in locals() and cfg.worker_snapshots
        fail(RuntimeError(f"{worker_id} stopped by SIGINT; the same command starts it again, "
                          f"and it rejoins the job"
                          + (" from its snapshot" if snapshots else "")), 128 + signal.SIGINT)
    except (ConfigError, ValueError, OSError, TimeoutError, PeerUnreachable,
            GPUMemoryError) as exc:
        fail(exc)  # SecurityError is a ValueError
    except Exception as exc:  # anything else ends the worker in one line too
        logging.getLogger("fedctl.worker").debug("worker failed", exc_info=True)
        fail(RuntimeError(f"{worker_id} stopped: {type(exc).__name__}: {exc} (--log-level "
                           f"debug shows where)"))
    _end()


@main.command()
@_config
@_overrides
@click.option("--workers", "-n", type=int, default=None,
              help="Start N workers w1..wN (default: the config's worker list).")
@click.option("--rounds", type=int, default=None, help="Override the number of rounds.")
@click.option("--output", "-o", type=click.Path(file_okay=False), default=None,
              help="Output folder (default: output_dir of the config).")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Live progress bars (rounds, and embedding the data the first time).")
@click.option("--overwrite", is_flag=True,
              help="Replace a finished run in the output folder (an output folder named "
                   "`latest` never needs it: each run gets a new folder beside it).")
@_log_level
def run(config: str, overrides: tuple[str, ...], workers: int | None, rounds: int | None,
        output: str | None, progress: bool, overwrite: bool, log_level: str) -> None:
    """Run a whole cluster on this machine: a master and N workers as separate processes
    over TCP loopback, with a live progress display; prints the comparison table.

    First checks what `fedctl check` checks. Results go to a new folder that replaces the
    output folder only once the run has succeeded (with output_dir `runs/latest`, the default:
    `runs/<UTC time>-<id>/`, and `runs/latest` links to it); a failed run's folder is kept as
    `<output>.failed` with its logs.
    """
    _setup_logging(log_level)
    try:
        cfg = _load(config, workers, rounds, output, overrides)
        if not cfg.workers:  # a master alone would wait for ever for workers nobody starts
            raise ConfigError(f"{config}: workers: none listed; `fedctl run` starts one "
                              f"process per listed worker: list them, or pass --workers N")
        # Imported once the config has loaded: a bad config is reported without waiting for
        # torch and the model families to import.
        from fedctl.run import run_local_cluster
        from master.preflight import preflight

        for note in preflight(cfg).family.notes:  # what `fedctl check` checks, before any
            click.echo(f"Note: {note}", err=True)  # process starts
        code = run_local_cluster(cfg, progress=progress, log_level=log_level,
                                 overwrite=overwrite)
    except (ConfigError, ValueError, OSError) as exc:
        fail(exc)
    except KeyboardInterrupt:  # before any process started (else the run handles it): 130
        fail(RuntimeError("interrupted"), 130)
    if code:
        sys.exit(code)
    _end()


@main.command()
@_config
@click.option("--dir", "keys_dir", type=click.Path(file_okay=False), default=None,
              help="Key folder (default: security.keys_dir of the config, else ./keys).")
@click.option("--workers", type=int, default=None,
              help="Keys for workers w1..wN instead of the config's worker list.")
@click.option("--force", is_flag=True, help="Replace existing keys.")
def keygen(config: str, keys_dir: str | None, workers: int | None, force: bool) -> None:
    """Write CURVE key pairs for the master and every worker, and the admitted keys.

    Copy keys/master.key_secret and keys/admitted/ to the master's node, and to each worker's
    node keys/master.key plus keys/workers/NAME.key_secret; then set
    `security: {mode: curve, keys_dir: keys}` in cluster.yaml.
    """
    from common.net.security import keygen as write_keys

    try:
        cfg = _load(config, workers)
    except ConfigError as exc:
        fail(exc)
    folder = Path(keys_dir or cfg.security.keys_dir or "keys")
    names = [w.name for w in cfg.workers]
    if not names:
        fail(ConfigError(f"{cfg.source}: workers: no workers to make keys for"))
    try:
        written = write_keys(folder, names, overwrite=force)
    except OSError as exc:  # a folder not writable, a path through a file
        fail(OSError(f"{exc.filename or folder}: cannot write ({exc.strerror or exc})"))
    click.echo(f"{len(written)} key file(s) written to {folder} "
               f"(master + {len(names)} worker(s); existing keys kept unless --force).")
    click.echo(f"Copy to the master's node: {folder / 'master.key_secret'} and "
               f"{folder / 'admitted'}/; to each worker's node: {folder / 'master.key'} and "
               f"its own {folder / 'workers'}/NAME.key_secret"
               + ("; all of them are new, on every node" if force and written else "")
               + ". Then `fedctl check` on each node (with --id NAME on a worker's) names any "
                 "key file it lacks.")


@main.command()
@_config
@_overrides
@click.option("--family/--no-family", default=True, show_default=True,
              help="Also build the model family and its strategy as the master does, read "
                   "every worker's data as the worker will and check the family can train on "
                   "it (imports torch, a few seconds; nothing is embedded).")
@click.option("--ports/--no-ports", default=True, show_default=True,
              help="Also check the master's ports are free, when it binds them on this host.")
@click.option("--as", "display_name", default=None, metavar="NAME",
              help="Call the file NAME in messages (to check a new file before it replaces "
                   "NAME).")
@click.option("--id", "worker_id", default=None, metavar="NAME",
              help="On a worker's node: check that worker alone (its documents, its keys), "
                   "as `fedctl worker --id NAME` will read them.")
@click.option("--data", type=click.Path(dir_okay=False, exists=True), default=None,
              help="With --id: the worker's own JSONL, as given to `fedctl worker --data`.")
@click.option("--workers", "-n", "n_workers", type=int, default=None,
              help="Check as `fedctl run --workers N` will run it: w1..wN.")
@click.option("--rounds", type=int, default=None, help="Override the number of rounds.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
def check(config: str, overrides: tuple[str, ...], family: bool, ports: bool,
          worker_id: str | None, data: str | None, display_name: str | None,
          n_workers: int | None, rounds: int | None, as_json: bool) -> None:
    """Check a cluster.yaml and what it points to, as `fedctl master` and `fedctl worker` will.

    Reads the file (a key written twice is an error naming both lines), builds the family,
    reads each worker's data with the workers' reader (stopping at the first bad line, with
    file:line), checks the family can train on it (labels for a classifier, documents for
    each worker's splits, a vocabulary left after the filters, rounds enough for one step)
    and that the master's ports are free on this host. A problem exits with status 1 and one
    line naming it; a good file prints a summary. Nothing is started or written.
    """
    import json

    logging.basicConfig(level=logging.WARNING, format="Warning: %(message)s")
    found = None
    try:
        if data is not None and worker_id is None:
            raise click.UsageError("--data needs --id (the worker whose documents they are)")
        cfg = _load(config, n_workers, rounds, overrides=overrides)
        if family:
            from master.preflight import preflight

            # A worker's node binds nothing: the master's ports are the master node's concern.
            found = preflight(cfg, ports=ports and worker_id is None, worker=worker_id,
                              data=data)
    except (ConfigError, ValueError, TypeError, OSError) as exc:
        text = one_line(exc)
        raise click.ClickException(text.replace(config, display_name) if display_name
                                   else text) from None
    from common.privacy.dp import describe
    from fedctl.runs import strategy_name
    from master.families import server_family_class
    from worker.families import client_family_class

    notes = list(found.family.notes) if found is not None else []
    small = sorted((b, w) for w, (_, b) in (found.documents.items() if found else ())
                   if 0 < b < SMALL_TEST_SPLIT)
    if small:  # (the run's table said nothing: 1 document scored 0 or 1)
        notes.append(f"{', '.join(f'{w} ({b})' for b, w in small[:3])}"
                     f"{f' and {len(small) - 3} more' if len(small) > 3 else ''}: test "
                     f"split(s) under {SMALL_TEST_SPLIT} documents, where one document moves a "
                     f"score by a tenth or more (more data, fewer workers, or a larger "
                     f"data.test_fraction)")
    summary = {"config": display_name or config, "family": cfg.family,
               "strategy": (strategy_name(cfg) if family else "dpfedavg"
                            if cfg.privacy.client_dp is not None else cfg.strategy["name"]),
               "rounds": cfg.rounds,
               "workers": [w.name for w in cfg.workers], "master": cfg.master.rep_endpoint,
               "security": cfg.security.mode}
    privacy = cfg.privacy
    said = []
    if privacy.dp_sgd is not None:
        said.append(f"record-level DP-SGD (σ {privacy.dp_sgd.noise_multiplier:g}, per-document "
                    f"clip {privacy.dp_sgd.max_grad_norm:g})")
    if privacy.client_dp is not None:
        said.append(f"client-level DP-FedAvg (σ {privacy.client_dp.noise_multiplier:g}, update "
                    f"clip {privacy.client_dp.clip:g})")
    if said:
        target = ("" if privacy.target_epsilon is None
                  else f", training ends before ε passes {privacy.target_epsilon:g}")
        said = [f"{' and '.join(said)}, ε at δ {privacy.delta:g}{target}"]
    sa = privacy.secure_aggregation
    if sa is not None:
        # The family says how (with --no-family, nothing of it is imported).
        clip_text = (server_family_class(cfg).secure_clip_text(cfg.family_params, sa.clip)
                     if family else f"clip {sa.clip:g}")
        said.append(f"secure aggregation (the master sees only each round's sum; threshold "
                    f"{sa.threshold if sa.threshold is not None else 'a majority'}, "
                    f"{'every pair' if sa.neighbours is None else f'{sa.neighbours} neighbours'}"
                    f", {clip_text})")
    from common.privacy.laplace import laplace_epsilon

    laplace = laplace_epsilon(cfg.family, cfg.family_params)
    if laplace:
        said.append(f"iFTM's Laplace noise (ε {laplace:g}) on each party's document–topic "
                    f"counts")
    if said:
        summary["privacy"] = describe(privacy)
        said_line = f" Privacy: {'; '.join(said)}."
        if family:  # what no mechanism covers, lest a user think it does
            clear = [*client_family_class(cfg).sent_in_the_clear,
                     "the round's metrics and sample counts"]
            said_line += (f" In the clear all the same: {'; '.join(clear)} "
                          f"(docs/PRIVACY.md).")
    else:
        said_line = ""
    if found is not None:
        summary |= {"documents": {w: {"train": a, "test": b}
                                  for w, (a, b) in found.documents.items()},
                    "labelled": found.labelled, "not_on_this_host": found.not_here,
                    "ports_checked": found.ports_checked}
    keys = ""
    if cfg.security.curve:
        from common.net.security import missing_keys

        missing = (missing_keys(cfg.security.keys_dir, [w.name for w in cfg.workers])
                   if worker_id is None else
                   missing_keys(cfg.security.keys_dir, [worker_id], master=False))
        summary["keys_missing"] = [str(p) for p in missing]
        if missing:
            shown = ", ".join(str(p) for p in missing[:3]) + (
                f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            node = f"`fedctl worker --id {worker_id}` needs" if worker_id else (
                "`fedctl run` makes them, `fedctl master` needs")
            keys = (f" Note: CURVE key files not on this host: {shown}; {node} them "
                    f"(`fedctl keygen --config {summary['config']}`, then each node its part: "
                    f"README, Security).")
    if as_json:
        click.echo(json.dumps(summary))
        return
    data = ""
    if found is not None:
        n = sum(a + b for a, b in found.documents.values())
        data = (f" Data: {n} {'labelled' if found.labelled else 'unlabelled'} document(s) "
                f"read for {worker_id or f'{len(found.documents)} worker(s)'}"
                + (f" ({', '.join(found.not_here)}: own file not on this host, not read)"
                   if found.not_here else "")
                + ("; ports free." if found.ports_checked else "."))
    out = Path(cfg.output_dir)
    taken = (" Note: output_dir holds a finished run; `fedctl run` needs --overwrite to replace "
             "it (or another --output)." if out.name != "latest"
             and (out / "model.json").is_file() else "")
    click.echo(f"{summary['config']}: valid. Family {cfg.family} (strategy "
               f"{summary['strategy']}{'' if family else ', not built'}), {cfg.rounds} rounds, "
               f"{len(cfg.workers)} worker(s) ({', '.join(summary['workers']) or _ANY}), "
               f"master {summary['master']}, security {cfg.security.mode}.{data}{said_line}"
               f"{taken}{keys}" + "".join(f" Note: {n}." for n in notes))


#: A test split smaller than this is named by `check`: its scores are too coarse to read.
SMALL_TEST_SPLIT = 10

#: What `check` says of a config that lists no worker.
_ANY = ("none listed: the master admits any worker that registers; `fedctl run` needs them "
        "listed or --workers N")


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
              add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args: tuple[str, ...]) -> None:
    """Timing benchmarks over loopback: centralized vs federated, round anatomy, scaling,
    compression; writes benchmarks/results/cluster_report.{md,json} and plots.

    Options (see `fedctl bench --help`): --quick, --out DIR, --only SECTIONS, --config FILE.
    """
    from fedctl.bench import main as bench_main

    sys.exit(bench_main(list(args)))


def _register_subcommands() -> None:
    from fedctl.datasets.cli import data
    from fedctl.use_cli import COMMANDS

    main.add_command(data)
    for command in COMMANDS:
        main.add_command(command)


_register_subcommands()


def _exit_interrupted() -> NoReturn:
    """Exit 130 after a Ctrl-C, another Ctrl-C ignored meanwhile: the interpreter's teardown
    puts SIGINT's default action back, and one arriving then ended the command killed by the
    signal instead (seen once in a few dozen runs interrupted in their first second). In a
    process of its own, without that teardown, as :func:`_end` does: freeing a library whose
    threads were cut off mid-work (`fedctl data embed` interrupted while embedding) once
    ended the command by SIGSEGV after its "Error: interrupted"."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _OWN_PROCESS:
        _exit_now(128 + signal.SIGINT)
    sys.exit(128 + signal.SIGINT)


def entry() -> None:
    """The ``fedctl`` command (and ``python -m fedctl``, ``python -m fedctl.cli``): :func:`main`
    in a process of its own, which a command that succeeded may end without the
    interpreter's teardown (:func:`_end`)."""
    global _OWN_PROCESS
    _OWN_PROCESS = True
    try:
        code = main.main(prog_name="fedctl", standalone_mode=False)
    except click.exceptions.Abort:
        # Ctrl-C where a command does not say it itself: click printed "Aborted!" and exited
        # 1, which a script cannot tell from a failure.
        click.echo("Error: interrupted", err=True)
        _exit_interrupted()
    except click.ClickException as exc:  # as click's standalone mode shows it
        exc.show()
        if exc.exit_code == 128 + signal.SIGINT:
            _exit_interrupted()
        sys.exit(exc.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    entry()
