"""Tables and plots from `refusion eval` summaries.

    refusion report results/ --out results/report.md --plot results/accuracy_vs_tps.png
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def load_summaries(paths: list[str | Path]) -> list[dict]:
    """Every summary JSON under the given files / directories (records .jsonl files are skipped)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.rglob("*.json"))
        elif p.exists():
            files.append(p)
        else:
            raise ValueError(f"{p}: no such file or directory")
    out = []
    for f in files:
        d = json.loads(f.read_text())
        if isinstance(d, dict) and {"model", "task", "decoder", "accuracy", "tps"} <= set(d):
            out.append(d)
    if not out:
        raise ValueError(f"no eval summaries found in {', '.join(map(str, paths))} (run `refusion eval` first)")
    return out


def markdown_table(rows: list[dict]) -> str:
    lines = ["| model | task | decoder | n | accuracy (95% CI) | TPS | TPF | latency p50 (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["task"], r["model"], r["decoder"])):
        lo, hi = r["ci95"]
        lines.append(f"| {r['model']} | {r['task']} | {r['decoder']} | {r['n']} | {100 * r['accuracy']:.1f} "
                     f"({100 * lo:.1f}-{100 * hi:.1f}) | {r['tps']:.1f} | {r['tpf']:.2f} | {r['latency_p50']:.3f} |")
    return "\n".join(lines)


def averages(rows: list[dict]) -> list[dict]:
    """Per (model, decoder): accuracy averaged over tasks, TPS = all tokens / all seconds."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["model"], r["decoder"])].append(r)
    out = []
    for (model, decoder), rs in sorted(groups.items()):
        out.append({"model": model, "decoder": decoder, "tasks": len(rs),
                    "accuracy": sum(r["accuracy"] for r in rs) / len(rs),
                    "tps": sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs),
                    "tpf": sum(r["tokens"] for r in rs) / max(sum(r["forwards"] for r in rs), 1)})
    return out


def averages_table(avg: list[dict]) -> str:
    lines = ["| model | decoder | tasks | mean accuracy | TPS | TPF |", "|---|---|---|---|---|---|"]
    for a in avg:
        lines.append(f"| {a['model']} | {a['decoder']} | {a['tasks']} | {100 * a['accuracy']:.1f} | {a['tps']:.1f} "
                     f"| {a['tpf']:.2f} |")
    return "\n".join(lines)


def plot_accuracy_vs_tps(avg: list[dict], path: str | Path) -> Path:
    """One point per model x decoder (mean accuracy over tasks against throughput), as in the paper."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("plots need matplotlib: pip install matplotlib (or pip install 'refusion[eval]')") from None
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for a in avg:
        ax.scatter(a["tps"], 100 * a["accuracy"], s=60)
        ax.annotate(f"{a['model']} / {a['decoder']}", (a["tps"], 100 * a["accuracy"]), textcoords="offset points",
                    xytext=(5, 5), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("throughput (generated tokens / s, log scale)")
    ax.set_ylabel("mean accuracy over tasks (%)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def report(paths: list[str | Path], out: str | Path | None = None, plot: str | Path | None = None) -> str:
    rows = load_summaries(paths)
    avg = averages(rows)
    text = "## Per task\n\n" + markdown_table(rows) + "\n\n## Averaged over tasks\n\n" + averages_table(avg) + "\n"
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    if plot is not None:
        plot_accuracy_vs_tps(avg, plot)
    return text
