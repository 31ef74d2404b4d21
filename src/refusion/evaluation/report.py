"""Tables and plots from `refusion eval` summaries.

    refusion report results/ --out results/report.md --plot results/accuracy_vs_tps.png
    refusion report results/study --curves-plot results/study/accuracy_vs_steps.png

Rows are grouped by model, decoder and decoder parameters: one decoder run with two parameter
settings gives two rows (refusion#1, refusion#2, each listed with its settings), never one average
of both. Averages over tasks are only comparable between rows that cover the same tasks; rows whose
task set differs from the most common one are marked, in the table and in the plot.

A model labelled NAME@STEP (`refusion eval --label refusion@4000`: run NAME's checkpoint at STEP, as
scripts/study.sh labels them) is a point of NAME's curve over training steps: the report then adds
a table per run (decoder x step) and `--curves-plot` draws accuracy against steps. The accuracy-vs-TPS
plot shows each such run at its last step only.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
from pathlib import Path

from refusion.evaluation.evaluate import wilson_interval
from refusion.files import write_text

REQUIRED = {"model", "task", "decoder", "accuracy", "tps"}
CURVE_LABEL = re.compile(r"(?P<name>.+)@(?P<step>[0-9]+)")


def curve_point(model: str) -> tuple[str, int] | None:
    """(run name, step) of a model labelled NAME@STEP; None for any other label."""
    m = CURVE_LABEL.fullmatch(model)
    return (m["name"], int(m["step"])) if m else None


def _model_order(model: str) -> tuple[str, int]:
    """Sort key: labels alphabetically, the points of one curve by step (2000 before 16000)."""
    point = curve_point(model)
    return point if point is not None else (model, -1)


def _read_json(f: Path):
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{f} is not UTF-8 text ({e.reason} at byte {e.start}); is it an eval summary?") from None
    except json.JSONDecodeError as e:
        hint = " (a per-sample records file: report reads the .json summaries next to it)" if f.suffix == ".jsonl" else ""
        raise ValueError(f"{f}:{e.lineno}: not valid JSON ({e.msg}){hint}") from None


def load_summaries(paths: list[str | Path]) -> list[dict]:
    """Every summary JSON under the given files / directories (records .jsonl files are skipped in
    directories; a file named on its own must be a summary). A file reached twice is read once."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.rglob("*.json"))
        elif p.is_file():
            if p.suffix == ".jsonl":
                raise ValueError(f"{p} is a per-sample records file; pass the .json summary next to it, "
                                 "or the directory")
            files.append(p)
        else:
            raise ValueError(f"{p}: no such file or directory")
    out, seen = [], set()
    for f in files:
        if f.resolve() in seen:
            continue
        seen.add(f.resolve())
        d = _read_json(f)
        if isinstance(d, dict) and REQUIRED <= set(d):
            out.append(d)
        elif f in map(Path, paths):
            raise ValueError(f"{f} is not an eval summary (it lacks {', '.join(sorted(REQUIRED - set(d)))})"
                             if isinstance(d, dict) else f"{f} is not an eval summary")
    if not out:
        raise ValueError(f"no eval summaries found in {', '.join(map(str, paths))} (run `refusion eval` first)")
    _name_settings(out)
    return out


def _settings(params: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(params.items()) if v is not None) or "defaults"


def _name_settings(rows: list[dict]) -> None:
    """rows[i]["run"]: the decoder's name, suffixed #1, #2, ... where one decoder name was run with
    different parameters (those rows must not be averaged together)."""
    variants: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        key = json.dumps(r.get("params", {}), sort_keys=True)
        if key not in variants[r["decoder"]]:
            variants[r["decoder"]].append(key)
    for r in rows:
        keys = variants[r["decoder"]]
        key = json.dumps(r.get("params", {}), sort_keys=True)
        r["run"] = r["decoder"] if len(keys) == 1 else f"{r['decoder']}#{keys.index(key) + 1}"


def markdown_table(rows: list[dict]) -> str:
    lines = ["| model | task | decoder | n | accuracy (95% CI) | TPS | TPF | latency p50 (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["task"], _model_order(r["model"]), r["run"])):
        lo, hi = r["ci95"]
        lines.append(f"| {r['model']} | {r['task']} | {r['run']} | {r['n']} | {100 * r['accuracy']:.1f} "
                     f"({100 * lo:.1f}-{100 * hi:.1f}) | {r['tps']:.1f} | {r['tpf']:.2f} | {r['latency_p50']:.3f} |")
    return "\n".join(lines)


def settings_table(rows: list[dict]) -> str:
    seen = {}
    for r in rows:
        seen.setdefault(r["run"], _settings(r.get("params", {})))
    lines = ["| decoder | settings |", "|---|---|"]
    lines += [f"| {run} | {s} |" for run, s in sorted(seen.items())]
    return "\n".join(lines)


def averages(rows: list[dict]) -> list[dict]:
    """Per (model, decoder with its settings): accuracy averaged over tasks, TPS = all tokens / all
    seconds. `mixed` marks a row whose task set differs from the most common one."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["model"], r["run"])].append(r)
    out = []
    for (model, run), rs in sorted(groups.items(), key=lambda g: (_model_order(g[0][0]), g[0][1])):
        out.append({"model": model, "decoder": run, "tasks": sorted(r["task"] for r in rs),
                    "accuracy": sum(r["accuracy"] for r in rs) / len(rs),
                    "tps": sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs),
                    "tpf": sum(r["tokens"] for r in rs) / max(sum(r["forwards"] for r in rs), 1)})
    common = Counter(tuple(a["tasks"]) for a in out).most_common(1)[0][0]
    for a in out:
        a["mixed"] = tuple(a["tasks"]) != common
    return out


def averages_table(avg: list[dict]) -> str:
    lines = ["| model | decoder | tasks | mean accuracy | TPS | TPF |", "|---|---|---|---|---|---|"]
    for a in avg:
        tasks = ", ".join(a["tasks"]) + (" *" if a["mixed"] else "")
        lines.append(f"| {a['model']} | {a['decoder']} | {tasks} | {100 * a['accuracy']:.1f} | {a['tps']:.1f} "
                     f"| {a['tpf']:.2f} |")
    if any(a["mixed"] for a in avg):
        lines += ["", "\\* averaged over a different set of tasks from the other rows: not comparable with them."]
    return "\n".join(lines)


def curves(rows: list[dict], avg: list[dict]) -> list[dict]:
    """The averages (`avg`, of `rows`) of models labelled NAME@STEP as points of NAME's curve, ordered
    by run, decoder and step; each with its tasks' accuracies and the 95% Wilson interval of the mean
    accuracy over all of the point's prompts (the pooled counts when every task has the same n, as in
    the study; wider than the stratified interval when the tasks' accuracies differ)."""
    tasks: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    for r in rows:
        tasks[(r["model"], r["run"])][r["task"]] = r
    out = []
    for a in avg:
        point = curve_point(a["model"])
        if point is None:
            continue
        rs = tasks[(a["model"], a["decoder"])]
        n = sum(r["n"] for r in rs.values())
        out.append({**a, "model": point[0], "step": point[1], "n": n,
                    "ci95": wilson_interval(a["accuracy"] * n, n),
                    "task_accuracy": {t: r["accuracy"] for t, r in rs.items()}})
    return sorted(out, key=lambda c: (c["model"], c["decoder"], c["step"]))


def curves_tables(points: list[dict]) -> str:
    """One table per run: a row per decoder and step, the mean accuracy with its interval, each task's
    accuracy (- where a point lacks the task), TPS and TPF."""
    parts = []
    for model in sorted({c["model"] for c in points}):
        pts = [c for c in points if c["model"] == model]
        tasks = sorted({t for c in pts for t in c["task_accuracy"]})
        lines = [f"### {model}", "",
                 "| decoder | step | mean accuracy (95% CI) | " + " | ".join(tasks) + " | TPS | TPF |",
                 "|---|---|---|" + "---|" * len(tasks) + "---|---|"]
        for c in pts:
            lo, hi = c["ci95"]
            cells = [f"{100 * c['task_accuracy'][t]:.1f}" if t in c["task_accuracy"] else "-" for t in tasks]
            mean = f"{100 * c['accuracy']:.1f} ({100 * lo:.1f}-{100 * hi:.1f})" + (" *" if c["mixed"] else "")
            lines.append(f"| {c['decoder']} | {c['step']} | {mean} | " + " | ".join(cells)
                         + f" | {c['tps']:.1f} | {c['tpf']:.2f} |")
        parts.append("\n".join(lines))
    text = "\n\n".join(parts)
    if any(c["mixed"] for c in points):
        text += "\n\n\\* averaged over a different set of tasks from the other rows: not comparable with them."
    return text


def last_steps(avg: list[dict]) -> list[dict]:
    """`avg` with each curve's run only at its last step (models not labelled NAME@STEP all kept)."""
    last: dict[str, int] = {}
    for a in avg:
        point = curve_point(a["model"])
        if point is not None:
            last[point[0]] = max(last.get(point[0], point[1]), point[1])
    return [a for a in avg if (p := curve_point(a["model"])) is None or p[1] == last[p[0]]]


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("plots need matplotlib: pip install matplotlib (or pip install 'refusion[eval]')") from None
    return plt


def plot_accuracy_vs_tps(avg: list[dict], path: str | Path) -> Path:
    """One point per model x decoder (mean accuracy over tasks against throughput), as in the paper:
    colour per model, marker per decoder, named in a legend beside the axes (labels next to the
    points overlap as soon as two runs have similar numbers)."""
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    models = sorted({a["model"] for a in avg})
    decoders = sorted({a["decoder"] for a in avg})
    colours = plt.get_cmap("tab10")
    markers = "osD^vP*Xh<>p"
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for a in avg:
        label = f"{a['model']} · {a['decoder']}" + (" *" if a["mixed"] else "")
        ax.scatter(a["tps"], 100 * a["accuracy"], s=70, color=colours(models.index(a["model"]) % 10),
                   marker=markers[decoders.index(a["decoder"]) % len(markers)], label=label, zorder=3,
                   edgecolors="black", linewidths=0.5)
    tps = [a["tps"] for a in avg]
    lo, hi = min(tps), max(tps)
    if hi > 4 * lo > 0:  # a wide range: log scale, with plain numbers at 1-2-5 steps
        ax.set_xscale("log")
        ax.set_xlim(lo / 1.4, hi * 1.4)
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("throughput (generated tokens / s, log scale)")
    else:
        ax.set_xlim(0, hi * 1.15)
        ax.set_xlabel("throughput (generated tokens / s)")
    top = max(100 * a["accuracy"] for a in avg)
    ax.set_ylim(0, min(100, max(10, math.ceil(top * 1.2 / 10) * 10)))
    ax.set_ylabel("mean accuracy over tasks (%)")
    return _titled_and_saved(plt, fig, ax, avg, "Accuracy against throughput", "model · decoder", path)


def plot_curves(points: list[dict], path: str | Path) -> Path:
    """Mean accuracy against training steps (log2 axis), one line per run x decoder with its 95%
    interval as error bars: colour per run, marker and line style per decoder. Lines are nudged
    sideways a little so that error bars at one step do not hide each other."""
    plt = _pyplot()
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    models = sorted({c["model"] for c in points})
    decoders = sorted({c["decoder"] for c in points})
    lines = sorted({(c["model"], c["decoder"]) for c in points})
    colours = plt.get_cmap("tab10")
    markers = "osD^vP*Xh<>p"
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, (model, decoder) in enumerate(lines):
        pts = [c for c in points if (c["model"], c["decoder"]) == (model, decoder)]
        nudge = 2 ** (0.25 * ((i + 0.5) / len(lines) - 0.5))  # within an eighth of an octave either side
        acc = [100 * c["accuracy"] for c in pts]
        # clipped at 0: at 0% and 100% the interval's end can miss the accuracy by a rounding error
        err = [[max(a - 100 * c["ci95"][0], 0) for a, c in zip(acc, pts)],
               [max(100 * c["ci95"][1] - a, 0) for a, c in zip(acc, pts)]]
        d = decoders.index(decoder)
        label = f"{model} · {decoder}" + (" *" if any(c["mixed"] for c in pts) else "")
        ax.errorbar([c["step"] * nudge for c in pts], acc, yerr=err, color=colours(models.index(model) % 10),
                    marker=markers[d % len(markers)], linestyle=styles[d % len(styles)], markersize=5, capsize=2,
                    elinewidth=0.8, linewidth=1.2, label=label)
    steps = sorted({c["step"] for c in points})
    ax.set_xscale("log", base=2)
    ax.set_xlim(steps[0] / 1.3, steps[-1] * 1.3)
    ax.xaxis.set_major_locator(FixedLocator(steps))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("training steps (log scale)")
    ax.set_ylim(0, 101)
    ax.set_ylabel("mean accuracy over tasks (%), 95% interval")
    return _titled_and_saved(plt, fig, ax, points, "Accuracy against training steps", "run · decoder", path)


def _titled_and_saved(plt, fig, ax, rows: list[dict], title: str, legend_title: str, path: str | Path) -> Path:
    """A plot's title (naming the tasks most rows average over), grid and legend, written to path."""
    tasks = Counter(tuple(r["tasks"]) for r in rows).most_common(1)[0][0]
    ax.set_title(f"{title} (mean over {', '.join(tasks)})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False,
              title=legend_title + ("\n(* other tasks)" if any(r["mixed"] for r in rows) else ""),
              title_fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the legend sits outside the axes: keep it in the file
    plt.close(fig)
    return path


PLOT_NAME, CURVES_NAME = "accuracy_vs_tps.png", "accuracy_vs_steps.png"  # their names in a directory


def plot_file(path: str | Path, name: str) -> Path:
    """Where a plot asked for at `path` goes: into an existing directory under its usual name (a
    path without a suffix would otherwise become PATH.png beside the directory), else at `path`."""
    path = Path(path)
    return path / name if path.is_dir() else path


def report(paths: list[str | Path], out: str | Path | None = None, plot: str | Path | None = None,
           curves_plot: str | Path | None = None) -> str:
    """The markdown report of the summaries under `paths` (written to `out` too); `plot` and
    `curves_plot`: files, or directories to write the plots into under PLOT_NAME and CURVES_NAME."""
    if out is not None and Path(out).is_dir():
        raise ValueError(f"--out {out} is a directory; name the markdown file, e.g. {Path(out) / 'report.md'}")
    rows = load_summaries(paths)
    avg = averages(rows)
    points = curves(rows, avg)
    if curves_plot is not None and not points:
        raise ValueError("--curves-plot needs results of models labelled NAME@STEP (refusion eval --label "
                         "run@4000 on the run's checkpoint-4000); none found")
    text = ("## Per task\n\n" + markdown_table(rows) + "\n\n## Averaged over tasks\n\n" + averages_table(avg)
            + "\n\n## Decoder settings\n\n" + settings_table(rows) + "\n")
    if points:
        text += "\n## Over training steps\n\n" + curves_tables(points) + "\n"
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        write_text(out, text)
    if plot is not None:
        plot_accuracy_vs_tps(last_steps(avg), plot_file(plot, PLOT_NAME))
    if curves_plot is not None:
        plot_curves(points, plot_file(curves_plot, CURVES_NAME))
    return text
