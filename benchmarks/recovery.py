"""Exact recovery on a real cluster (issue 24's experiment, at this machine's size).

For five families (mlp; nmf with FedAdam and ``mi_weight: 0.1``; prodlda ``mode: sync``; fstc
on the StackOverflow sample with ``init: kfed``; lda), a master and three workers are started
by hand as separate processes (``fedctl master --config ...``, ``fedctl worker --config ...
--id wN --threads 1``) with CURVE on (keys from ``fedctl keygen``), ``heartbeat_timeout`` and
``round_deadline`` 600 s so that a restarted worker is waited for. Each job runs three times:

* **undisturbed**;
* **master kill**: at about mid-run the workers are paused (SIGSTOP, so that a fast job cannot
  end meanwhile), the master is SIGKILLed and ``fedctl master --resume`` started; once it logs
  "resumed job" the workers carry on (SIGCONT);
* **worker kill**: at about mid-run w1 and w3 are paused, w2 is SIGKILLed, started again 3 s
  later, and w1 and w3 carry on.

Per family and disturbance: the rounds logged (``round`` events of ``metrics.jsonl``: each
once, none missing?), the steps trained (``summary.json`` ``trained``), the largest |Δ| of any
array of ``model.npz`` against the undisturbed run (0: bit-identical), the family's headline
score (mean over the workers of the federated macro-F1, perplexity or clustering ACC) of both
runs, the processes' exit codes, and whether any worker log says "Traceback" or "not writable".
Every job's config, output and logs stay in the work folder printed at the start.

Usage: ``python benchmarks/recovery.py [--families mlp,nmf,prodlda,fstc,lda]
[--runs calm,master,worker] [--work DIR]``. Writes ``benchmarks/results/recovery.{md,json}``
(``--results`` elsewhere).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.net.transport import free_ports  # noqa: E402
from common.runlog import read_metrics  # noqa: E402
from fedctl.bench.report import command_line  # noqa: E402
from fedctl.launch import child_env, fedctl_command  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
WORKERS = ("w1", "w2", "w3")
DBPEDIA = ROOT / "data" / "dbpedia_10k" / "dbpedia_10k.jsonl"
STACKOVERFLOW = ROOT / "data" / "stackoverflow" / "stackoverflow_1500.jsonl"
RUN_TIMEOUT_S = 420  # a disturbed job still running this long after its start is a hang
STEP_ROUNDS = 5  # prodlda sync with batch norm over the union batch: 5 rounds a step

#: Each family's job (examples/*.yaml, smaller). ``score``: the comparison's federated column
#: that is the family's headline, averaged over the workers.
JOBS: dict[str, dict[str, Any]] = {
    "mlp": {"score": "macro_f1", "cfg": {
        "rounds": 100, "model": {"family": "mlp", "hidden": 64, "local_epochs": 30,
                                 "lr": 0.001},
        "data": {"path": str(DBPEDIA), "task": "multiclass", "limit": 600}}},
    "nmf": {"score": "macro_f1", "cfg": {
        "rounds": 80, "model": {"family": "nmf", "n_topics": 8, "mi_weight": 0.1,
                                "vocab_size": 400, "local_epochs": 5, "lr": 0.5},
        "strategy": {"name": "fedadam", "eta": 0.01, "beta_1": 0.9, "beta_2": 0.99,
                     "tau": 0.001},
        "data": {"path": str(DBPEDIA), "task": "multiclass", "limit": 600}}},
    "prodlda": {"score": "perplexity", "cfg": {
        "rounds": 300 * STEP_ROUNDS,
        "model": {"family": "prodlda", "mode": "sync", "n_topics": 8, "vocab_size": 400,
                  "batch_size": 32},
        "data": {"path": str(DBPEDIA), "task": "multiclass", "limit": 600}}},
    "fstc": {"score": "accuracy", "cfg": {
        "rounds": 40, "model": {"family": "fstc", "n_clusters": 20, "iterations": 40,
                                "init": "kfed"},
        "data": {"path": str(STACKOVERFLOW), "task": "multiclass", "partition": "iid",
                 "limit": 600}}},
    "lda": {"score": "perplexity", "cfg": {
        "rounds": 200, "model": {"family": "lda", "n_topics": 6, "sweeps": 100,
                                "vocab_size": 400},
        "data": {"path": str(DBPEDIA), "task": "multiclass", "limit": 600}}},
}
RUNS = ("calm", "master", "worker")
RUN_NAMES = {"calm": "undisturbed", "master": "master SIGKILL + --resume",
             "worker": "w2 SIGKILL + restart 3 s later"}


class Hang(Exception):
    """A job that did not end (or did not reach a point) in time."""


class Job:
    """One job's processes (logs in ``<dir>/logs/<name>.log``)."""

    def __init__(self, folder: Path, cfg: Path, cache: Path) -> None:
        self.dir, self.cfg, self.cache = folder, cfg, cache
        self.out = folder / "out"
        self.logs = folder / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.codes: dict[str, int | None] = {}

    def start(self, name: str, *args: str) -> None:
        with open(self.logs / f"{name}.log", "wb") as fh:
            self.procs[name] = subprocess.Popen(
                fedctl_command(*args), cwd=ROOT, env=child_env(self.cache, threads=1),
                stdout=fh, stderr=subprocess.STDOUT)

    def master(self, *extra: str, name: str = "master") -> None:
        self.start(name, "master", "--config", str(self.cfg), *extra)

    def worker(self, wid: str, name: str | None = None) -> None:
        self.start(name or wid, "worker", "--config", str(self.cfg), "--id", wid,
                   "--threads", "1")

    def signal(self, names: tuple[str, ...], sig: signal.Signals) -> None:
        for name in names:
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(sig)

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.codes[name] = self.procs[name].wait(timeout=30)
        del self.procs[name]

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def rounds(self) -> list[int]:
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return []
        return [e["round"] for e in read_metrics(path) if e["event"] == "round"]

    def failed(self) -> dict[str, int]:
        return {n: p.returncode for n, p in self.procs.items() if p.poll() not in (None, 0)}

    def wait_until(self, predicate: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.failed():
                raise Hang(f"while waiting for {what}: process(es) failed {self.failed()}")
            if time.monotonic() > deadline:
                raise Hang(f"timed out after {timeout:g} s waiting for {what}")
            time.sleep(0.02)

    def wait_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for name, p in self.procs.items():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise Hang(f"{name} still running {timeout:g} s after the job's start") from None

    def stop(self) -> None:
        """SIGCONT (a paused process cannot stop), SIGTERM, then SIGKILL what is left."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        for name, p in self.procs.items():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            self.codes[name] = p.returncode


def write_config(folder: Path, job: dict[str, Any], keys: Path, cache: Path) -> Path:
    pub, rep = free_ports(2)
    raw: dict[str, Any] = {
        "master": {"host": "127.0.0.1", "bind": "127.0.0.1", "pub_port": pub,
                   "rep_port": rep},
        "workers": list(WORKERS), "min_workers": len(WORKERS),
        "heartbeat_timeout": 600, "round_deadline": 600, "join_timeout": 120,
        "security": {"mode": "curve", "keys_dir": str(keys)},
        "output_dir": str(folder / "out"), "baselines": False, "seed": 0,
        **copy.deepcopy(job["cfg"])}
    raw["data"]["cache_dir"] = str(cache)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def prepare(cfg_path: Path, keys: Path, cache: Path) -> None:
    """CURVE keys (``fedctl keygen``, once) and the family's one-off work (the embedding of
    the shared dataset, for the families that embed text), so no process of a run embeds."""
    if not (keys / "master.key").exists():
        subprocess.run(fedctl_command("keygen", "--config", str(cfg_path), "--dir", str(keys)),
                       cwd=ROOT, env=child_env(cache), check=True, capture_output=True)
    code = ("import sys; from common.config import load_config; "
            "from master.families import server_family_class; "
            "cfg = load_config(sys.argv[1]); "
            "server_family_class(cfg).prepare(cfg, progress=False)")
    subprocess.run([sys.executable, "-c", code, str(cfg_path)], cwd=ROOT,
                   env=child_env(cache), check=True)


def run_job(folder: Path, cfg: Path, cache: Path, kind: str, at: int) -> dict[str, Any]:
    """One job, undisturbed (``calm``) or with the master or w2 killed after round ``at``."""
    job = Job(folder, cfg, cache)
    t0 = time.monotonic()
    res: dict[str, Any] = {"kind": kind, "dir": str(folder), "error": None}
    try:
        job.master()
        for w in WORKERS:
            job.worker(w)
        if kind == "master":
            job.wait_until(lambda: len(job.rounds()) >= at, RUN_TIMEOUT_S, f"round {at}")
            job.signal(WORKERS, signal.SIGSTOP)
            job.kill("master")
            res["killed_after_round"] = len(job.rounds())
            res["ended_before_kill"] = (job.out / "summary.json").exists()
            job.master("--resume", name="master-resumed")
            job.wait_until(lambda: "resumed job" in job.log("master-resumed"), RUN_TIMEOUT_S,
                           "the master to resume")
            job.signal(WORKERS, signal.SIGCONT)
        elif kind == "worker":
            job.wait_until(lambda: len(job.rounds()) >= at, RUN_TIMEOUT_S, f"round {at}")
            job.signal(("w1", "w3"), signal.SIGSTOP)
            job.kill("w2")
            res["killed_after_round"] = len(job.rounds())
            res["ended_before_kill"] = (job.out / "summary.json").exists()
            time.sleep(3)
            job.worker("w2", name="w2-restarted")
            job.signal(("w1", "w3"), signal.SIGCONT)
        job.wait_all(RUN_TIMEOUT_S - (time.monotonic() - t0))
    except Hang as exc:
        res["error"] = str(exc)
    finally:
        job.stop()
    res["wall_s"] = time.monotonic() - t0
    res["exit_codes"] = job.codes
    res["rounds"] = job.rounds()
    res["resume_events"] = 0
    if (job.out / "metrics.jsonl").exists():
        evs = read_metrics(job.out / "metrics.jsonl")
        res["resume_events"] = sum(e["event"] == "resume" for e in evs)
        res["resumed_after_round"] = [e["completed_round"] for e in evs
                                      if e["event"] == "resume"]
        res["rejoins"] = [e["worker"] for e in evs if e["event"] == "register"
                          and e.get("rejoin")]
    summary = job.out / "summary.json"
    res["summary"] = json.loads(summary.read_text()) if summary.exists() else None
    logs = {p.stem: p.read_text(errors="replace") for p in sorted(job.logs.glob("*.log"))}
    workers_text = "".join(t for n, t in logs.items() if n.startswith("w"))
    res["worker_traceback"] = "Traceback" in workers_text
    res["worker_not_writable"] = "not writable" in workers_text
    res["went_back"] = "back to w" in workers_text
    res["warnings"] = {n: [ln.strip() for ln in t.splitlines()
                           if re.search(r"WARNING|Error", ln)][:20] for n, t in logs.items()}
    return res


def model_arrays(folder: Path) -> dict[str, np.ndarray] | None:
    path = folder / "out" / "model.npz"
    if not path.exists():
        return None
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def max_diff(calm: dict[str, np.ndarray] | None, hit: dict[str, np.ndarray] | None
             ) -> tuple[float | None, str]:
    """The largest |Δ| over every array (None: no model); the arrays that differ."""
    if calm is None or hit is None:
        return None, "no model.npz"
    if calm.keys() != hit.keys():
        return float("inf"), f"arrays differ: {sorted(set(calm) ^ set(hit))}"
    diffs = {k: float(np.abs(calm[k].astype(np.float64) - hit[k].astype(np.float64)).max())
             if calm[k].shape == hit[k].shape and calm[k].size else
             (0.0 if calm[k].shape == hit[k].shape else float("inf")) for k in calm}
    worst = max(diffs.values(), default=0.0)
    differing = [f"{k} {v:.3g}" for k, v in sorted(diffs.items(), key=lambda kv: -kv[1]) if v]
    return worst, ", ".join(differing)


def score(summary: dict[str, Any] | None, metric: str) -> float | None:
    """Mean over the workers of the federated ``metric`` (None when unavailable)."""
    if not summary:
        return None
    values = [r.get(f"federated_{metric}") for r in summary.get("comparison", [])]
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def resumed(r: dict[str, Any]) -> str:
    """ ", resumed from its checkpoint of round N" for a resumed master."""
    done = r.get("resumed_after_round") or []
    return f" (checkpoint of round {', '.join(map(str, done))})" if done else ""


def fmt(x: float | None, digits: int = 4) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(JOBS))
    ap.add_argument("--runs", default=",".join(RUNS),
                    help="calm (undisturbed, always run), master, worker")
    ap.add_argument("--work", type=Path, default=None,
                    help="folder of the jobs' configs, outputs and logs (default: a new one "
                         "under the temporary folder)")
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    command = command_line(ROOT)
    families = args.families.split(",")
    kinds = [k for k in RUNS if k == "calm" or k in args.runs.split(",")]
    work = args.work or Path(tempfile.mkdtemp(prefix="recovery_"))
    work.mkdir(parents=True, exist_ok=True)
    keys, cache = work / "keys", work / "embeddings"
    print(f"work folder (configs, outputs, logs): {work}", flush=True)
    t_all = time.monotonic()
    results: dict[str, Any] = {}
    for fam in families:
        job = JOBS[fam]
        runs: dict[str, Any] = {}
        for kind in kinds:
            folder = work / fam / kind
            cfg = write_config(folder, job, keys, cache)
            if kind == "calm":
                prepare(cfg, keys, cache)
            at = job["cfg"]["rounds"] // 2
            if fam == "prodlda":  # mid-step, so that a kill catches a step midway
                at += STEP_ROUNDS // 2
            runs[kind] = run_job(folder, cfg, cache, kind, at)
            r = runs[kind]
            print(f"{fam} {kind}: {len(r['rounds'])} rounds, {r['wall_s']:.1f} s, "
                  f"exit {r['exit_codes']}, error {r['error']}", flush=True)
        calm_model = model_arrays(work / fam / "calm")
        for kind, r in runs.items():
            r["max_abs_diff"], r["differing_arrays"] = max_diff(
                calm_model, model_arrays(work / fam / kind))
            r["score"] = score(r["summary"], job["score"])
            r["trained"] = r["summary"]["trained"] if r["summary"] else None
            n = len(r["rounds"])
            r["rounds_each_once"] = r["rounds"] == list(range(1, n + 1))
            r["rounds"] = n  # the count, not the list: every round is logged once or not
        results[fam] = {"score_metric": job["score"], "config": job["cfg"], "runs": runs}
    wall = time.monotonic() - t_all

    rows = []
    for fam, fr in results.items():
        calm = fr["runs"]["calm"]
        planned = fr["config"]["rounds"]
        for kind, r in fr["runs"].items():
            trained = r["trained"] or {}
            steps = (f"{trained['steps']} steps" if "steps" in trained
                     else f"{trained.get('rounds', '—')} rounds")
            diff = r["max_abs_diff"]
            ok = [c for c in r["exit_codes"].values()]
            rows.append(
                f"| {fam} | {RUN_NAMES[kind]} | {r['rounds']}/{planned}"
                f"{'' if r['rounds_each_once'] else ' (not each once)'} | "
                f"{r.get('killed_after_round', '—')}"
                f"{resumed(r)} | {steps} | "
                f"{'—' if kind == 'calm' else ('no model' if diff is None else f'{diff:.3g}')}"
                f" | {fr['score_metric']} {fmt(calm['score'])}"
                f"{'' if kind == 'calm' else ' → ' + fmt(r['score'])} | "
                f"{','.join(str(c) for c in ok)} | "
                f"{'yes' if r['worker_traceback'] else 'no'} / "
                f"{'yes' if r['worker_not_writable'] else 'no'} | "
                f"{r['error'] or ''} |")
    lines = [
        "# Exact recovery: a master or worker SIGKILL mid-run against the undisturbed run",
        "",
        f"`{command}`",
        "",
        f"Master + 3 worker processes (`--threads 1`) per job, CURVE on, heartbeat_timeout and "
        f"round_deadline 600 s, seed 0, {os.cpu_count()} CPU cores (load average "
        f"{os.getloadavg()[0]:.1f} at the end), {wall / 60:.1f} min in all. Master kill: "
        f"workers paused, master SIGKILLed, `fedctl master --resume`, workers resumed. "
        f"Worker kill: w1 and w3 paused, w2 SIGKILLed and started again 3 s later. "
        f"Max |Δ|: the largest absolute difference of any array of `model.npz` against the "
        f"undisturbed run (0: bit-identical). Score: mean over the workers of the federated "
        f"column, undisturbed → this run. Exit codes: the killed process first (-9, killed on "
        f"purpose), then the master, the workers and the restarted one (JSON: by name). "
        f"prodlda's budget is in steps (5 rounds a step): a step a kill caught midway is "
        f"redone, so it logs a few rounds past its "
        f"plan, each once, for the same 300 steps. Work folder: `{work}`.",
        "",
        "| family | run | rounds logged | killed after round (resumed from) | trained "
        "| max \\|Δ\\| | score | exit codes | Traceback / not writable in worker logs | failure |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    notes = [f"* {fam}, {RUN_NAMES[k]}: differing arrays {r['differing_arrays']}"
             for fam, fr in results.items() for k, r in fr["runs"].items()
             if k != "calm" and r["max_abs_diff"] != 0]
    if notes:
        lines += ["", "Not bit-identical:", "", *notes]
    md = "\n".join(lines)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "recovery.md").write_text(md + "\n")
    res = {"command": command, "work": str(work), "wall_s": wall, "cpu_count": os.cpu_count(),
           "load_average_at_end": os.getloadavg()[0], "families": results}
    for fr in results.values():  # the comparison tables are in each run's summary.json
        for r in fr["runs"].values():
            r["summary"] = ({k: r["summary"][k] for k in ("rounds", "version", "trained",
                                                          "workers", "excluded")
                             if k in r["summary"]} if r["summary"] else None)
    (args.results / "recovery.json").write_text(json.dumps(res, indent=2, default=str))
    print(md)


if __name__ == "__main__":
    main()
