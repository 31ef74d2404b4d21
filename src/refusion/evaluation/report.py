"""Tables and plots from `refusion eval` summaries.

    refusion report results/ --out results/report.md --plot results/accuracy_vs_tps.png

Rows are grouped by model, decoder and decoder parameters: one decoder run with two parameter
settings gives two rows (refusion#1, refusion#2, each listed with its settings), never one average
of both. Averages over tasks are only comparable between rows that cover the same tasks; rows whose
task set differs from the most common one are marked, in the table and in the plot.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path

REQUIRED = {"model", "task", "decoder", "accuracy", "tps"}


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
    for r in sorted(rows, key=lambda r: (r["task"], r["model"], r["run"])):
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
    for (model, run), rs in sorted(groups.items()):
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


def plot_accuracy_vs_tps(avg: list[dict], path: str | Path) -> Path:
    """One point per model x decoder (mean accuracy over tasks against throughput), as in the paper:
    colour per model, marker per decoder, named in a legend beside the axes (labels next to the
    points overlap as soon as two runs have similar numbers)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator
    except ImportError:
        raise ValueError("plots need matplotlib: pip install matplotlib (or pip install 'refusion[eval]')") from None
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
    tasks = Counter(tuple(a["tasks"]) for a in avg).most_common(1)[0][0]
    ax.set_title(f"Accuracy against throughput (mean over {', '.join(tasks)})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False,
              title="model · decoder" + ("\n(* other tasks)" if any(a["mixed"] for a in avg) else ""),
              title_fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the legend sits outside the axes: keep it in the file
    plt.close(fig)
    return path


def report(paths: list[str | Path], out: str | Path | None = None, plot: str | Path | None = None) -> str:
    rows = load_summaries(paths)
    avg = averages(rows)
    text = ("## Per task\n\n" + markdown_table(rows) + "\n\n## Averaged over tasks\n\n" + averages_table(avg)
            + "\n\n## Decoder settings\n\n" + settings_table(rows) + "\n")
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    if plot is not None:
        plot_accuracy_vs_tps(avg, plot)
    return text
