"""`fedctl`: the command line of the cluster.

    fedctl master --config cluster.yaml
    fedctl worker --config cluster.yaml --id w1 [--data PATH]
    fedctl run    [--config cluster.yaml] [--workers N]
    fedctl check  [--config cluster.yaml]
    fedctl bench  [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from common.config import ClusterConfig, ConfigError, load_config

LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), format=LOG_FORMAT,
                        stream=sys.stderr)


def _load(config: str, workers: int | None = None, rounds: int | None = None,
          output: str | None = None) -> ClusterConfig:
    cfg = load_config(config)
    if workers is not None:
        cfg = cfg.with_workers(workers)
    if rounds is not None:
        if rounds < 1:
            raise ConfigError(f"--rounds: expected an integer >= 1, got {rounds}")
        cfg.rounds = rounds
    if output is not None:
        cfg.output_dir = str(Path(output).resolve())
    return cfg


def _fail(exc: BaseException) -> None:
    raise click.ClickException(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


_config = click.option("--config", "-c", default="cluster.yaml", show_default=True,
                       type=click.Path(dir_okay=False), help="Cluster description.")
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
@click.option("--workers", type=int, default=None,
              help="Expect workers w1..wN instead of the config's worker list.")
@click.option("--rounds", type=int, default=None, help="Override the number of rounds.")
@click.option("--output", "-o", type=click.Path(file_okay=False), default=None,
              help="Output folder (default: output_dir of the config).")
@click.option("--resume", is_flag=True,
              help="Continue from the checkpoint in the output folder; running workers "
                   "reconnect by themselves.")
@_log_level
def master(config: str, workers: int | None, rounds: int | None, output: str | None,
           resume: bool, log_level: str) -> None:
    """Run the master: announce, collect updates, aggregate, write results."""
    _setup_logging(log_level)
    from common.net.security import SecurityError
    from master.server import Master

    try:
        cfg = _load(config, workers, rounds, output)
        server = Master(cfg, resume=resume)
        server.bind()
        server.serve()
    except (ConfigError, SecurityError, OSError, TimeoutError, RuntimeError) as exc:
        _fail(exc)
    finally:
        if "server" in locals():
            server.close()


def _limit_threads(n: int, report: bool = False) -> None:
    """Cap torch and every BLAS / OpenMP pool at ``n`` threads: the environment for the
    libraries not loaded yet, threadpoolctl for those already in the process."""
    import os

    import torch
    from threadpoolctl import threadpool_info, threadpool_limits

    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "NUMBA_NUM_THREADS"):
        os.environ[var] = str(n)
    torch.set_num_threads(n)
    threadpool_limits(n)  # not as a context: in force for the rest of the process
    if report:
        pools = sorted({f"{p['internal_api']} {p['num_threads']}" for p in threadpool_info()})
        logging.getLogger("fedctl.worker").info(
            "CPU threads: torch %d, %s", torch.get_num_threads(), ", ".join(pools) or "no pool")


@main.command()
@_config
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
                   "pools (default: theirs, often every core).")
@_log_level
def worker(config: str, worker_id: str, data: str | None, device: str | None,
           workers: int | None, rounds: int | None, threads: int | None, log_level: str) -> None:
    """Run a worker: join the master, train on local data each round, report."""
    _setup_logging(log_level)
    if threads:
        _limit_threads(threads)
    from common.net.transport import PeerUnreachable
    from worker.client import Worker

    if threads:  # again: the families' imports load pools of their own (scipy, scikit-learn)
        _limit_threads(threads, report=True)

    try:
        cfg = _load(config, workers, rounds)
        Worker(cfg, worker_id, data_path=data, device=device).run()
    except (ConfigError, ValueError, OSError, TimeoutError, PeerUnreachable) as exc:
        _fail(exc)  # SecurityError is a ValueError


@main.command()
@_config
@click.option("--workers", "-n", type=int, default=None,
              help="Start N workers w1..wN (default: the config's worker list).")
@click.option("--rounds", type=int, default=None, help="Override the number of rounds.")
@click.option("--output", "-o", type=click.Path(file_okay=False), default=None,
              help="Output folder (default: output_dir of the config).")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Live progress bar.")
@_log_level
def run(config: str, workers: int | None, rounds: int | None, output: str | None,
        progress: bool, log_level: str) -> None:
    """Run a whole cluster on this machine: a master and N workers as separate processes
    over TCP loopback, with a live progress display; prints the comparison table."""
    _setup_logging(log_level)
    try:
        cfg = _load(config, workers, rounds, output)
        # Imported once the config has loaded: a bad config is reported without waiting for
        # torch and the model families to import.
        from fedctl.run import run_local_cluster
        from master.families import make_server_family

        make_server_family(cfg)  # the model and strategy sections, checked before any process
        code = run_local_cluster(cfg, progress=progress, log_level=log_level)
    except (ConfigError, ValueError, OSError) as exc:
        _fail(exc)
    if code:
        sys.exit(code)


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
        _fail(exc)
    folder = Path(keys_dir or cfg.security.keys_dir or "keys")
    names = [w.name for w in cfg.workers]
    if not names:
        _fail(ConfigError(f"{cfg.source}: workers: no workers to make keys for"))
    written = write_keys(folder, names, overwrite=force)
    click.echo(f"{len(written)} key file(s) written to {folder} "
               f"(master + {len(names)} worker(s); existing keys kept unless --force)")


@main.command()
@_config
@click.option("--family/--no-family", default=True, show_default=True,
              help="Also build the model family and its strategy as the master does "
                   "(imports torch, a few seconds).")
@click.option("--as", "display_name", default=None, metavar="NAME",
              help="Call the file NAME in messages (to check a new file before it replaces "
                   "NAME).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
def check(config: str, family: bool, display_name: str | None, as_json: bool) -> None:
    """Check a cluster.yaml exactly as `fedctl master` and `fedctl worker` will load it.

    A bad file exits with status 1 and one line naming the file, the field and what was
    expected; a good one prints a summary. Nothing is started or written.
    """
    import json

    logging.basicConfig(level=logging.WARNING, format="Warning: %(message)s")
    try:
        cfg = load_config(config)
        if family:
            from master.families import make_server_family

            make_server_family(cfg)
    except (ConfigError, ValueError, TypeError) as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise click.ClickException(text.replace(config, display_name) if display_name
                                   else text) from None
    summary = {"config": display_name or config, "family": cfg.family,
               "strategy": cfg.strategy["name"], "rounds": cfg.rounds,
               "workers": [w.name for w in cfg.workers], "master": cfg.master.rep_endpoint,
               "security": cfg.security.mode}
    if as_json:
        click.echo(json.dumps(summary))
        return
    click.echo(f"{summary['config']}: valid. Family {cfg.family} (strategy "
               f"{summary['strategy']}{'' if family else ', not built'}), {cfg.rounds} rounds, "
               f"{len(cfg.workers)} worker(s) ({', '.join(summary['workers']) or 'none'}), "
               f"master {summary['master']}, security {cfg.security.mode}.")


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

    main.add_command(data)


_register_subcommands()

if __name__ == "__main__":
    main()
