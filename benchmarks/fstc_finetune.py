"""FSTC with a fine-tuned encoder against the paper's Table 2, on a GPU (issue 31).

Hu et al., "Federated Learning for Short Text Clustering" (2023), Table 2: FSTC fine-tunes
all-MiniLM-L6-v2 beside its clustering head, m = 4 IID clients, 40 rounds × 100 local
iterations, batch 200; ACC / NMI 79.70 / 68.83 on StackOverflow and 85.10 / 62.45 on AG News
(8,000). Each cell here is one dataset and seed, simulated in one process with the cluster's
exact steps (:class:`common.models.fstc.FederatedFSTC`, as ``fstc_table2.py``), and scores on
all documents:

* **FSBERT**: k-FED on the frozen sentence embeddings (every FSTC row's start);
* **FSTC, frozen**: the paper's FSTC row on the frozen embeddings (what a CPU runs);
* **FSTC, fine-tuned**: the same row with ``encoder: finetune`` (Φ trains, lr 5e-6).

The paper's row: ``variant: fstc``, no neighbour term, no balance term, head lr 5e-4, equal
marginal, λ 0.01 on StackOverflow and 1 on AG News.

Usage (``--jobs`` cells at once, each in its own process sharing the GPU)::

    python benchmarks/fstc_finetune.py [--seeds 3] [--rounds 40] [--iterations 100]
        [--datasets stackoverflow agnews_8000] [--device cuda] [--jobs 6]
        [--data ../shared/data] [--deadline SECONDS] [--out benchmarks/results]

Each finished cell is written at once to ``OUT/fstc_finetune_cells.jsonl`` (a run stopped at
its deadline keeps what it finished); the table goes to ``OUT/fstc_finetune.{md,json}``.
``--quick`` is a CPU smoke run (1 seed, 1 round × 2 iterations on 200 documents).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fstc_table2 import (  # noqa: E402
    DATASETS,
    FSTC_ROWS,
    N_INIT,
    PAPER,
    PAPER_ALIGN,
    PAPER_ITERATIONS,
    PAPER_ROUNDS,
    TITLES,
    _scores,
)

from common.atomic import atomic_write_bytes  # noqa: E402
from common.data.embedding import embed_texts  # noqa: E402
from common.data.partitions import partition  # noqa: E402
from common.data.reading import read_jsonl  # noqa: E402
from common.models.fstc import FederatedFSTC, FSTCParams  # noqa: E402
from common.models.kfed import KFed  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"
METHODS = ("FSBERT", "FSTC, frozen", "FSTC, fine-tuned")
CLIENTS = 4


def run_cell(task: dict[str, Any]) -> dict[str, Any]:
    """One dataset and seed: FSBERT, FSTC frozen and FSTC fine-tuned, scored on every
    document in the clients' order."""
    import torch

    torch.set_float32_matmul_precision(task["matmul"])  # "high": TF32 on the GPU's matmuls
    t0 = time.perf_counter()
    ds = read_jsonl(Path(task["data"]) / task["dataset"] / f"{task['dataset']}.jsonl")
    texts = ds.texts[:task["limit"]] if task["limit"] else ds.texts
    y = np.unique(ds.labels[:len(texts)], return_inverse=True)[1]
    k = int(y.max()) + 1
    X = embed_texts(texts, device=task["device"], progress=False)
    parts = partition(y, CLIENTS, scheme="iid", seed=task["seed"])
    order = np.concatenate(parts)
    client_texts = [[texts[i] for i in p] for p in parts]
    params = FSTCParams(iterations=task["iterations"], align_weight=PAPER_ALIGN[task["dataset"]])
    params = replace(params, **FSTC_ROWS["FSTC"])
    out: dict[str, Any] = {k2: task[k2] for k2 in ("dataset", "seed", "rounds", "iterations",
                                                   "device", "limit", "matmul")}
    out.update(scores={}, seconds={}, n_docs=len(texts), n_clusters=k)

    t = time.perf_counter()
    fsbert = KFed(k, n_init=N_INIT, random_state=task["seed"]).fit([X[p] for p in parts])
    out["scores"]["FSBERT"] = _scores(y[order], fsbert.predict(X[order]))
    out["seconds"]["FSBERT"] = time.perf_counter() - t

    t = time.perf_counter()
    fed = FederatedFSTC(params, k, rounds=task["rounds"], random_state=task["seed"],
                        device=task["device"])
    fed.fit([X[p] for p in parts], init_centers=fsbert.cluster_centers_, texts=client_texts)
    out["scores"]["FSTC, frozen"] = _scores(y[order], fed.predict(X[order]))
    out["seconds"]["FSTC, frozen"] = time.perf_counter() - t

    t = time.perf_counter()
    if task["device"].startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    fine = replace(params, encoder="finetune")
    print(f"  {task['dataset']} seed {task['seed']}: fine-tuning", flush=True)
    fed = FederatedFSTC(fine, k, rounds=task["rounds"], random_state=task["seed"],
                        device=task["device"], verbose=1)  # a line per round: the run's pace
    # Its k-FED start on the encoder's own representation (the same model, not yet trained).
    fed.fit(client_texts, texts=client_texts)
    out["scores"]["FSTC, fine-tuned"] = _scores(y[order], fed.predict([texts[i] for i in order]))
    out["seconds"]["FSTC, fine-tuned"] = time.perf_counter() - t
    if task["device"].startswith("cuda"):
        out["gpu_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["gpu"] = torch.cuda.get_device_name()
    out["total_seconds"] = time.perf_counter() - t0
    print(f"  {task['dataset']:13s} seed {task['seed']}: "
          + ", ".join(f"{m} {s['acc']:.1f}/{s['nmi']:.1f}" for m, s in out["scores"].items())
          + f"  ({out['total_seconds']:.0f}s)", flush=True)
    return out


def table(cells: list[dict[str, Any]], datasets: list[str]) -> str:
    """Markdown: ACC and NMI per dataset and method (mean ± std over seeds), the paper's
    FSTC beside them."""
    lines = ["| dataset | method | seeds | ACC | NMI | paper ACC / NMI | s per cell |",
             "|---|---|---|---|---|---|---|"]
    for d in datasets:
        cs = [c for c in cells if c["dataset"] == d]
        if not cs:
            lines.append(f"| {TITLES[d]} | — | 0 | not run | | | |")
            continue
        for m in METHODS:
            acc = [c["scores"][m]["acc"] for c in cs]
            nmi = [c["scores"][m]["nmi"] for c in cs]
            paper = PAPER[d]["FSTC"] if m == "FSTC, fine-tuned" else None
            lines.append(f"| {TITLES[d]} | {m} | {len(cs)} | {np.mean(acc):.2f} ± "
                         f"{np.std(acc):.2f} | {np.mean(nmi):.2f} ± {np.std(nmi):.2f} | "
                         + (f"{paper[0]:.2f} / {paper[1]:.2f}" if paper else "")
                         + f" | {np.mean([c['seconds'][m] for c in cs]):.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=PAPER_ROUNDS)
    ap.add_argument("--iterations", type=int, default=PAPER_ITERATIONS)
    ap.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--jobs", type=int, default=1, help="cells at once (processes)")
    ap.add_argument("--data", type=Path, default=DATA, help="folder of the shared datasets")
    ap.add_argument("--limit", type=int, default=0, help="first N documents (0: all)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds after which no cell starts and the table is written")
    ap.add_argument("--matmul", choices=("highest", "high"), default="high",
                    help="torch float32 matmul precision (high: TF32 on a GPU that has it)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run")
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.rounds, args.iterations, args.limit = 1, 1, 2, 200
        args.device = "cpu"
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    cells_path = args.out / "fstc_finetune_cells.jsonl"
    cells_path.write_text("")  # this run's cells only (appended as each one ends)
    tasks = [{"dataset": d, "seed": s, "rounds": args.rounds, "iterations": args.iterations,
              "device": args.device, "data": str(args.data), "limit": args.limit,
              "matmul": args.matmul}
             for s in range(args.seeds) for d in args.datasets]
    for d in args.datasets:  # embed once, before the processes all want it (cached)
        ds = read_jsonl(args.data / d / f"{d}.jsonl")
        embed_texts(ds.texts[:args.limit] if args.limit else ds.texts, device=args.device,
                    progress=False)
    print(f"{len(tasks)} cell(s), {args.jobs} at once, {args.rounds} rounds x "
          f"{args.iterations} iterations on {args.device}", flush=True)
    cells: list[dict[str, Any]] = []
    with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(run_cell, t) for t in tasks]
        deadline = None if args.deadline is None else started + args.deadline
        try:
            for f in as_completed(futures, timeout=None if deadline is None
                                  else max(1.0, deadline - time.perf_counter())):
                cell = f.result()
                cells.append(cell)
                with open(cells_path, "a") as fh:
                    fh.write(json.dumps(cell) + "\n")
        except TimeoutError:
            print(f"deadline: {len(cells)} of {len(tasks)} cell(s) done; the rest dropped",
                  flush=True)
            for f in futures:
                f.cancel()
            for p in pool._processes.values():  # their cells cannot finish in time
                p.kill()
    command = ("python benchmarks/fstc_finetune.py "
               f"--seeds {args.seeds} --rounds {args.rounds} --iterations {args.iterations} "
               f"--device {args.device} --jobs {args.jobs} --matmul {args.matmul}"
               + (f" --limit {args.limit}" if args.limit else ""))
    gpu = next((c["gpu"] for c in cells if "gpu" in c), None)
    md = (f"# FSTC with a fine-tuned encoder against the paper (issue 31)\n\n`{command}`\n\n"
          f"m = {CLIENTS} IID clients, {args.rounds} rounds × {args.iterations} local "
          f"iterations, batch 200, the paper's FSTC row (λ 0.01 StackOverflow, 1 AG News, head "
          f"lr 5e-4, encoder lr 5e-6); device {args.device}, float32 matmul precision "
          f"{args.matmul}"
          + (f" ({gpu})" if gpu else "") + f"; {len(cells)} of {len(tasks)} cell(s) finished "
          f"in {(time.perf_counter() - started) / 60:.1f} min, {args.jobs} at once. "
          "Scores on every document: ACC (Hungarian) and NMI, mean ± std over seeds.\n\n"
          + table(cells, args.datasets) + "\n")
    atomic_write_bytes(args.out / "fstc_finetune.md", md.encode())
    atomic_write_bytes(args.out / "fstc_finetune.json",
                       json.dumps({"command": command, "cells": cells}, indent=1).encode())
    print(md)


if __name__ == "__main__":
    main()
