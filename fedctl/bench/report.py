"""The report of ``fedctl bench``: the acceptance goals, the plots and the markdown."""

from __future__ import annotations

import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

from fedctl.bench.harness import _fmt


def command_line(root: Path) -> str:
    """How this process was started, for a results file: ``python <script> <args>``, the script
    relative to ``root`` (the checkout) when it lies inside it."""
    script = Path(sys.argv[0]).resolve()
    shown = str(script.relative_to(root)) if script.is_relative_to(root) else sys.argv[0]
    return "python " + " ".join(shlex.quote(a) for a in [shown, *sys.argv[1:]])


def current_commit(root: Path) -> str:
    """The checkout's short commit id, for a results file ("" outside a git checkout)."""
    import subprocess

    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                          capture_output=True, text=True)
    return done.stdout.strip()


def median_range(xs: list[float], digits: int = 4) -> str:
    """A table cell for repeated runs: ``median (min–max)``, the value alone for one run, a
    dash for none."""
    if not xs:
        return "—"
    med = statistics.median(xs)
    if len(xs) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({min(xs):.{digits}f}–{max(xs):.{digits}f})"


def _floor(cpu: float | None, cores: int | None) -> str:
    """A round's shortest possible time on ``cores``: its CPU spread over all of them."""
    return "–" if cpu is None or not cores else f"{1000 * cpu / cores:.1f} ({cores} cores)"


def _least_overhead(a: dict[str, Any]) -> float | None:
    """An estimate (uploads of early finishers may overlap the last training) of the least
    overhead (round − slowest training) of an anatomy run whose every step but the training
    and the bare exchange cost nothing: the workers' training CPU spread over every core, then
    the bare exchange, less the median slowest training. None without the CPU figures."""
    an, cores = a["anatomy"], a.get("cores")
    slowest = [r["slowest_train_s"] for r in (a.get("run") or {}).get("rounds", [])
               if r.get("slowest_train_s") is not None]
    train = statistics.median(slowest) if slowest else an.get("train")  # as the overhead's
    if an.get("train_cpu") is None or train is None or not cores:
        return None
    return max(0.0, an["train_cpu"] / cores - train) + a["bare"]["round_s"]


def goals(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's acceptance goals, each with its measured value and whether it is met."""
    g: list[dict[str, Any]] = []
    c = res.get("centralized")
    if c:
        r = c["ratio_federated_to_pooled"]
        g.append({"goal": "federated training <= 1.1 x pooled centralized (default job)",
                  "value": f"{r:.2f} x", "met": r <= 1.1})
        ov = c["federated_noeval"]["median_overhead_s"]
        g.append({"goal": "median overhead <= 5 ms at 0.1 M parameters (default job, "
                          f"security {c['security']})", "value": f"{1000 * ov:.2f} ms",
                  "met": ov <= 0.005})
    for key, a in (res.get("anatomy") or {}).items():
        ov = a["run"]["median_overhead_s"]
        limit = 0.005 if a["params"] < 1e6 else (0.5 if a["params"] > 1e7 else None)
        if limit is not None:
            g.append({"goal": f"median overhead <= {limit * 1000:g} ms at "
                              f"{a['params'] / 1e6:.2f} M parameters (anatomy, hidden {key})",
                      "value": f"{1000 * ov:.2f} ms (bare exchange "
                               f"{1000 * a['bare']['round_s']:.2f} ms)",
                      "met": ov <= limit})
        bare = a["bare"]["round_s"]
        least = _least_overhead(a)
        g.append({"goal": f"median overhead <= 2 x the bare exchange at "
                          f"{a['params'] / 1e6:.2f} M parameters (anatomy, hidden {key})",
                  "value": f"{ov / bare:.1f} x ({1000 * ov:.2f} against {1000 * bare:.2f} ms)"
                           + ("" if least is None else
                              f"; estimated least a framework costing nothing could reach on "
                              f"{a['cores']} cores: {least / bare:.1f} x"),
                  "met": ov <= 2 * bare})
    s = res.get("scaling")
    if s:
        sizes = [v["broadcast_bytes"] for v in s.values()]
        pubs = [v["median_publish_s"] for v in s.values() if v["median_publish_s"] is not None]
        # One message whatever N; it grows only by the participant list in its header.
        g.append({"goal": "broadcast cost flat in N (one serialization per round)",
                  "value": f"broadcast {min(sizes):,.0f}-{max(sizes):,.0f} bytes "
                           f"(+{100 * (max(sizes) / min(sizes) - 1):.2f} %, the participant "
                           f"list); master publish {1000 * min(pubs):.2f}-"
                           f"{1000 * max(pubs):.2f} ms",
                  "met": max(sizes) <= 1.01 * min(sizes)})
        big = s.get(str(max(int(k) for k in s)))
        g.append({"goal": f"{big['n']} workers complete rounds",
                  "value": f"{big['completed_rounds']} rounds, all updates "
                           f"{big['all_updates']}", "met": bool(big["all_updates"])})
    return g


def _plots(res: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    a = res.get("anatomy")
    if a:
        comps = ["broadcast", "eval", "train", "upload", "aggregate", "other"]
        fig, axes = plt.subplots(1, len(a), figsize=(4 * len(a), 4), squeeze=False)
        for ax, (key, v) in zip(axes[0], a.items(), strict=True):
            bottom = 0.0
            for comp in comps:
                h = 1000 * (v["anatomy"][comp] or 0.0)
                ax.bar(["fedctl round"], [h], bottom=bottom, label=comp)
                bottom += h
            bare = v["bare"]
            ax.bar(["bare pyzmq"], [1000 * bare["broadcast_s"]], color="C0")
            ax.bar(["bare pyzmq"], [1000 * (bare["round_s"] - bare["broadcast_s"])],
                   bottom=[1000 * bare["broadcast_s"]], color="C3")
            cpu, cores = v["anatomy"].get("cpu"), v.get("cores")
            if cpu and cores:  # no round can be shorter: its CPU over every core
                ax.axhline(1000 * cpu / cores, color="0.3", ls="--", lw=1,
                           label=f"floor: the round's CPU ÷ {cores} cores")
            ax.set_title(f"{v['params'] / 1e6:.2f} M parameters (h={key})")
            ax.set_ylabel("median ms per round")
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8,
                   frameon=False)
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        fig.savefig(out / "cluster_anatomy.png", dpi=100)
        plt.close(fig)
        files.append("cluster_anatomy.png")
    s = res.get("scaling")
    if s:
        ns = [v["n"] for v in s.values()]
        fig, axes = plt.subplots(1, 3, figsize=(13, 4))
        axes[0].plot(ns, [1000 * v["median_round_s"] for v in s.values()], "o-", label="round")
        axes[0].plot(ns, [1000 * v["median_overhead_s"] for v in s.values()], "o-",
                     label="overhead")
        axes[0].plot(ns, [1000 * v["median_publish_s"] for v in s.values()], "o-",
                     label="master publish")
        axes[0].set_ylabel("median ms")
        axes[1].plot(ns, [100 * (v["master_cpu_cores"] or 0) for v in s.values()], "o-",
                     label="master CPU % of a core")
        axes[1].plot(ns, [v["master_hwm_mib"] or 0 for v in s.values()], "o-",
                     label="master peak RSS MiB")
        axes[2].plot(ns, [v["broadcast_bytes"] / 1e6 for v in s.values()], "o-",
                     label="PUB broadcast MB")
        axes[2].plot(ns, [v["bytes_in"] / 1e6 for v in s.values()], "o-",
                     label="uploads MB")
        for ax in axes:
            ax.set_xscale("log")
            ax.set_xlabel("workers")
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "cluster_scaling.png", dpi=100)
        plt.close(fig)
        files.append("cluster_scaling.png")
    comp = (res.get("compression") or {}).get("table")
    if comp:
        fig, ax = plt.subplots(figsize=(6, 4))
        labels = list(comp)
        ax.bar(labels, [v["bytes_in"] / 1e3 for v in comp.values()])
        ax.set_ylabel("update kB per round (all workers)")
        ax2 = ax.twinx()
        ax2.plot(labels, [v["federated_macro_f1"] or 0 for v in comp.values()], "ko-")
        ax2.set_ylabel("final federated macro-F1 (pooled test)")
        fig.tight_layout()
        fig.savefig(out / "cluster_compression.png", dpi=100)
        plt.close(fig)
        files.append("cluster_compression.png")
    return files


def report_markdown(res: dict[str, Any], plots: list[str]) -> str:
    """The human-readable report of :func:`run_benchmarks`' results."""
    env = res["environment"]
    quick = " — **quick mode** (smoke settings, not the published figures)" if res["quick"] else ""
    lines = [
        "# fedctl cluster timing report", "",
        f"{env['date']}, {env['platform']}, {env['cpus']} CPU(s), Python {env['python']}, "
        f"load average at start {env['loadavg_start']}, at end {env['loadavg_end']}"
        f"{quick}.",
        "Timings on a loaded machine (load average above the CPU count) are noisy.", "",
        "Reproduce: `fedctl bench` (or `python benchmarks/cluster_bench.py`); "
        "`--quick` for a smoke run.", ""]
    g = res.get("goals") or []
    if g:
        lines += ["## Goals", "", "| goal | measured | met |", "|---|---|---|"]
        lines += [f"| {x['goal']} | {x['value']} | {'yes' if x['met'] else '**no**'} |"
                  for x in g]
        lines.append("")
    c = res.get("centralized")
    if c:
        fed = c["federated_noeval"]
        c1, ca = c["central_1thread"], c["central_all_threads"]
        lines += ["## Centralized against federated (default job)", "",
                  f"Same model and epochs ({c1['epochs']} = rounds x local_epochs). Centralized: "
                  f"`MLPClassifier.fit` in one process with `torch.set_num_threads(1)` (what "
                  f"`fedctl run` gives each of 3 workers on 2 cores) and with "
                  f"{ca['threads']} threads. Federated: sum of round durations (first "
                  f"broadcast to last aggregation), security `{c['security']}`, "
                  f"{fed['n_workers']} worker processes; start-up (process launch to first "
                  f"broadcast) apart.", "",
                  "| what | documents | training s (1 thread) | training s "
                  f"({ca['threads']} threads) |", "|---|---|---|---|"]
        for name, v in c1["local"].items():
            lines.append(f"| local-only {name} | {v['n_train']} | {v['seconds']:.2f} | "
                         f"{ca['local'][name]['seconds']:.2f} |")
        lines.append(f"| pooled centralized | {c1['pooled']['n_train']} | "
                     f"{c1['pooled']['seconds']:.2f} | {ca['pooled']['seconds']:.2f} |")
        for key, label in (("federated_noeval", "federated, eval_every 0"),
                           ("federated_eval", "federated, evaluation every round")):
            if key in c:
                r = c[key]
                lines.append(f"| {label} | {c1['pooled']['n_train']} | {r['train_s']:.2f} "
                             f"(start-up {r['startup_s']:.1f} s apart; median round "
                             f"{1000 * r['median_round_s']:.1f} ms, overhead "
                             f"{1000 * r['median_overhead_s']:.2f} ms) | |")
        lines += ["", f"Federated / pooled (1 thread): **{c['ratio_federated_to_pooled']:.2f}"
                  " x** (the seed: 12–18 x).", ""]
    a = res.get("anatomy")
    if a:
        lines += ["## Round anatomy", "",
                  "3 worker processes, MLP of the given width, `data.limit` "
                  f"{res['plan']['anatomy_limit']} (iid), batch 1024, 1 local epoch, "
                  "eval_every 0, security none. Median ms per round along the critical path "
                  "(the worker with the longest broadcast + evaluation + training + upload): "
                  "broadcast = master send to worker receipt (serialize + wire + queue), "
                  "upload = worker send to master receipt of the update, other = the rest "
                  "(parameter copies on the worker, validation, event-loop latency). Bare = "
                  "plain pyzmq PUB to 3 SUB processes + 3 REQ/REP uploads of the same arrays, "
                  "zero-copy, in the same run. CPU = the CPU time a round cost the master and "
                  "the workers together (each process's `cpu_s` in metrics.jsonl, every "
                  "thread), of which training = the workers' training (their `fit_cpu_s`); "
                  "floor = CPU ÷ the cores: rounds cannot follow each other faster, however "
                  "the work is scheduled, and the bare exchange does no training.", "",
                  "| params | rounds × bare exchanges | MB | round | broadcast | train | upload | "
                  "aggregate | other | "
                  "overhead (round − slowest training) | bare round | bare broadcast | "
                  "bare upload | CPU (core-ms) | of which training | floor |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for v in a.values():
            an, b, run = v["anatomy"], v["bare"], v["run"]
            lines.append(
                f"| {v['params'] / 1e6:.2f} M | {len(run['rounds'])} × {b.get('reps', '?')} | "
                f"{b['bytes'] / 1e6:.1f} | "
                f"{_fmt(run['median_round_s'], 1000)} | {_fmt(an['broadcast'], 1000, 2)} | "
                f"{_fmt(an['train'], 1000)} | {_fmt(an['upload'], 1000, 2)} | "
                f"{_fmt(an['aggregate'], 1000, 2)} | {_fmt(an['other'], 1000, 2)} | "
                f"**{_fmt(run['median_overhead_s'], 1000, 2)}** | {_fmt(b['round_s'], 1000, 2)}"
                f" | {_fmt(b['broadcast_s'], 1000, 2)} | {_fmt(b['upload_s'], 1000, 2)} | "
                f"{_fmt(an.get('cpu'), 1000)} | {_fmt(an.get('train_cpu'), 1000)} | "
                f"{_floor(an.get('cpu'), v.get('cores'))} |")
        lines += ["", "The components are medians over rounds taken separately, so they need not "
                  "add up to the median round.", ""]
        for v in a.values():
            top = v["run"].get("master_profile")
            if top:
                lines += [f"Master main thread, cProfile, {v['params'] / 1e6:.2f} M parameters "
                          "(own time over the whole run, start-up included):", "",
                          "| function | calls | own s | cumulative s |", "|---|---|---|---|"]
                lines += [f"| `{r['function']}` | {r['calls']} | {r['tottime_s']:.3f} | "
                          f"{r['cumtime_s']:.3f} |" for r in top[:10]]
                lines.append("")
    s = res.get("scaling")
    if s:
        lines += ["## Scaling with workers", "",
                  f"MLP h=256, `data.limit` {res['plan']['scaling_limit']} split iid, "
                  "eval_every 0, security none; master a process, workers processes "
                  f"(N < {res['plan']['scaling_threads_from']}) or threads of the "
                  "benchmark process "
                  "(one torch thread each). Master CPU: /proc utime+stime over the training "
                  "window (1.0 = one core); memory: VmRSS max in the window, VmHWM.", "",
                  "| N | workers as | rounds | median round ms | median overhead ms | master "
                  "publish ms | slowest broadcast latency ms | PUB bytes/round | update bytes/"
                  "round | master CPU (cores) | master RSS MiB | master peak MiB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for v in s.values():
            lines.append(
                f"| {v['n']} | {v['mode']} | {v['completed_rounds']} | "
                f"{_fmt(v['median_round_s'], 1000)} | {_fmt(v['median_overhead_s'], 1000)} | "
                f"{_fmt(v['median_publish_s'], 1000, 3)} | "
                f"{_fmt(v['median_broadcast_latency_max_s'], 1000)} | "
                f"{v['broadcast_bytes']:,.0f} | {v['bytes_in']:,.0f} | "
                f"{_fmt(v['master_cpu_cores'], 1, 2)} | {_fmt(v['master_rss_mib'])} | "
                f"{_fmt(v['master_hwm_mib'])} |")
        lines.append("")
    comp = (res.get("compression") or {}).get("table")
    if comp:
        lines += ["## Update compression (default job)", "",
                  "Update bytes per round = all workers' uploads (the master's `bytes_in`); "
                  "final federated macro-F1 on all workers' test splits pooled.", "",
                  "| compression | update bytes/round | vs none | PUB bytes/round | "
                  "final macro-F1 | median round ms |", "|---|---|---|---|---|---|"]
        none = comp.get("none", {}).get("bytes_in")
        for label, v in comp.items():
            lines.append(f"| {label} | {v['bytes_in']:,.0f} | "
                         f"{(v['bytes_in'] / none if none else float('nan')):.3f} | "
                         f"{v['broadcast_bytes']:,.0f} | {_fmt(v['federated_macro_f1'], 1, 4)} | "
                         f"{_fmt(v['median_round_s'], 1000)} |")
        lines.append("")
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"

