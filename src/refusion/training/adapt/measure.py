"""The adapter measured on held-out prompts of each domain, and its best decoding settings chosen.

Held-out sets (never training prompts): the chat requests written for this project (tasks/chat.py),
GSM8K test, HumanEval and MBPP test (refusion.tasks' copies; `refusion data` downloads them once).
Each candidate setting decodes every prompt at batch 1 and is compared, output by output, with the
base's greedy AR output, timed in the same run. `choose` picks the setting written into the adapter's
decoding.json: among those that kept every output the base's, the fastest is the one whose slowest
domain is fastest (speed over AR); the ones within 3% of it on every domain tie with it on the machine,
and of them the one with the most tokens per forward wins, since a forward's cost grows less with its
width on an accelerator than on a CPU.

The setting chosen is then run at batch 8 (eight sequences at once, as a server runs them: decode_all)
beside the base's AR there; one slower than AR at that batch gives way to the next best that decodes
such a batch otherwise (on a CPU, settings that differ only in forks and width prices decode a batch of
several rows alike: choose_at_batch). Rows are written to a JSON file as they finish; a rerun measures
only the rows it lacks, and a domain's rows at a batch are all timed by one process (to_time).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path

HELD_OUT = ("chat", "gsm8k", "humaneval", "mbpp")
_POLICY = {"fork": False, "width_price": 1.0}  # every candidate names its policy whole (decoding.json changes none)
CANDIDATES: dict[str, dict] = {
    "speculative": {**_POLICY, "lookup": False},
    "speculative +lookup": {**_POLICY, "lookup": True},
    "speculative +lookup +fork": {**_POLICY, "lookup": True, "fork": True},
    **{f"speculative +lookup +fork price {share}": {"lookup": True, "fork": True, "width_price": share}
       for share in (0.25, 0.05, 0.02)},
}
QUICK_CANDIDATES = ("speculative", "speculative +lookup")
TIE = 0.97
GROUP = 8  # decode_all's progress: prompts are decoded GROUP x batch_size at a time


def held_out_examples(domain: str, n: int, seed: int = 0, last: bool = False) -> list:
    """n prompts of a held-out set (refusion.tasks Examples): the first n of its order shuffled by `seed`
    (refusion.tasks.common.subset), or with `last` the last n. The measurement that chooses an adapter's
    settings takes the last ones, so that a benchmark's first ones (benchmarks/adapt.py) are others."""
    if domain not in HELD_OUT:
        raise ValueError(f"unknown held-out set {domain!r}; sets: {', '.join(HELD_OUT)}")
    if domain == "chat":
        from refusion.tasks.chat import load_chat as load
    else:
        from refusion.tasks import get_task

        load = get_task(domain).load
    every = load("test", n=10**9, seed=seed)  # (the whole set, in the seeded order)
    return every[len(every) - n:] if last else every[:n]


def summarize(rows: list[dict], reference: tuple[int, int] | None = None) -> list[dict]:
    """Per (threads, batch, setting, domain): outputs identical to the base AR's (at the same threads and
    batch, or at the (threads, batch) `reference`), TPF, TPS and TPS / AR (at the same threads and batch)."""
    key = {(r["threads"], r["batch_size"], r["name"], r["bench"]): r for r in rows}
    out = []
    for r in rows:
        ar = key.get((r["threads"], r["batch_size"], "base ar", r["bench"]))
        ref = key.get((*reference, "base ar", r["bench"])) if reference else ar
        tokens = sum(map(len, r["outputs"]))
        tps = tokens / r["seconds"] if r["seconds"] else 0.0
        ar_tps = sum(map(len, ar["outputs"])) / ar["seconds"] if ar and ar["seconds"] else None
        out.append(dict(threads=r["threads"], batch_size=r["batch_size"], name=r["name"], bench=r["bench"],
                        n=len(r["outputs"]),
                        identical=sum(a == b for a, b in zip(r["outputs"], ref["outputs"], strict=True)) if ref else None,
                        tokens=tokens, tpf=tokens / max(r["forwards"], 1), tps=tps,
                        tps_vs_ar=tps / ar_tps if ar_tps else None))
    return out


def decode_all(model, prompts: list[list[int]], decoder: str | None, batch_size: int, max_tokens: int,
               eos: list[int], params: dict | None = None, done: Callable[[int], None] | None = None) -> dict:
    """Every prompt decoded, `batch_size` sequences at a time as a server runs them (decode()'s batch_size:
    a finished one's row goes to the next prompt): dict(outputs, forwards, seconds of decoding). `done` is
    called with the number of prompts finished, every GROUP batches' worth (a group's last rows run on
    alone before the next group starts, so a group is many batches)."""
    from refusion.decoding import decode

    outputs, forwards, seconds = [], 0, 0.0
    for lo in range(0, len(prompts), GROUP * batch_size):
        t = time.perf_counter()
        res = decode(model, prompts[lo:lo + GROUP * batch_size], decoder, eos_ids=eos, gen_length=max_tokens,
                     batch_size=batch_size, **(params or {}))
        seconds += time.perf_counter() - t
        outputs += [r.tokens for r in res]
        forwards += sum(r.forwards for r in res)
        if done is not None:
            done(len(res))
    return dict(outputs=outputs, forwards=forwards, seconds=seconds)


def choose(summary: list[dict], threads: int, names: set[str] | None = None) -> str | None:
    """The setting for decoding.json (module docstring), among the rows at batch 1 and `threads` of the
    settings in `names` (default: every one but base ar); None when none kept every output."""
    by_name: dict[str, list[dict]] = {}
    for s in summary:
        if (s["threads"] == threads and s["batch_size"] == 1 and s["tps_vs_ar"] and s["name"] != "base ar"
                and (names is None or s["name"] in names)):
            by_name.setdefault(s["name"], []).append(s)
    kept = {n: rs for n, rs in by_name.items() if all(s["identical"] == s["n"] for s in rs)}
    if not kept:
        return None
    speed = {n: {s["bench"]: s["tps_vs_ar"] for s in rs} for n, rs in kept.items()}
    fastest = max(kept, key=lambda n: min(speed[n].values()))
    # tied: within noise of the fastest on every domain (as fast on its slowest domain but slower on another is slower)
    tied = [n for n in kept if all(speed[n].get(d, 0.0) >= TIE * v for d, v in speed[fastest].items())]
    return max(tied, key=lambda n: min(s["tpf"] for s in kept[n]))


def note(summary: list[dict], name: str, threads: int) -> str:
    rows = [s for s in summary if s["name"] == name and s["threads"] == threads]
    figures = ", ".join(f"{s['bench']} TPF {s['tpf']:.2f} at {s['tps_vs_ar']:.2f}x AR" for s in rows
                        if s["batch_size"] == 1)
    wide = {s["batch_size"] for s in rows} - {1}
    more = "".join(f"; batch {b}: " + ", ".join(f"{s['bench']} {s['tps_vs_ar']:.2f}x AR" for s in rows
                                                 if s["batch_size"] == b) for b in sorted(wide))
    return f"{name!r}: {figures} (batch 1, {threads} thread(s), every output the base's){more}"


def measure(adapter_dir: Path, base_dir: Path, out: Path, n: int, max_tokens: int, quick: bool = False,
            threads: int | None = None, seed: int = 0, progress: bool = True,
            log: Callable[[str], None] = print, command: str = "refusion adapt", batch: int = 8) -> str | None:
    """Measure the candidates on the held-out sets (chat only with `quick`, which needs no download) at
    batch 1, and the one chosen (module docstring) at `batch` beside the base's AR there: one slower than
    AR at that batch gives way to the next (choose_at_batch). Writes it into adapter_dir/decoding.json;
    its name (None: none kept every output)."""
    import torch

    from refusion.bundled import resolve_model
    from refusion.decoding import model_settings
    from refusion.model.checkpoint import LOOKUP_CORPUS, load_model
    from refusion.model.tokenizer import Tokenizer

    if threads is not None:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    names = list(QUICK_CANDIDATES if quick else CANDIDATES)
    domains = ("chat",) if quick else HELD_OUT
    state = json.loads(out.read_text()) if out.is_file() else {}
    if state.get("key") != [n, max_tokens, seed, list(domains)]:
        state = {"key": [n, max_tokens, seed, list(domains)], "rows": []}
    base, adapted = load_model(base_dir), load_model(resolve_model(str(adapter_dir)))
    tok = Tokenizer.from_dir(base_dir)
    rows = _Rows(state, out, base, adapted, tok, domains, n, seed, max_tokens, threads, progress)
    rows.run([(1, name, d) for d in domains for name in ["base ar", *names]])
    summary = summarize(state["rows"])
    for s in summary:
        if s["name"] != "base ar":
            log(f"measure: {s['name']:<36} {s['bench']:<9} identical {s['identical']}/{s['n']} TPF {s['tpf']:.2f} "
                f"{s['tps_vs_ar']:.2f}x AR")
    cpu = next(adapted.parameters()).device.type == "cpu"

    def at_batch(pick: str) -> list[dict]:
        nonlocal summary
        rows.run([(batch, name, d) for d in domains for name in ("base ar", pick)])
        summary = summarize(state["rows"])
        return [s for s in summary if s["name"] == pick and s["batch_size"] == batch and s["threads"] == threads]

    best = choose_at_batch(summary, set(names), threads, batch, at_batch, alike=cpu and batch > 1, log=log)
    state["summary"] = summary
    _write(out, state)
    if best is None:
        log("measure: no setting kept every output the base's: no decoding.json written (the decoder's defaults hold)")
        return None
    settings = model_settings.ModelSettings("speculative", CANDIDATES[best], measured_by=command,
                                            note=note(summary, best, threads))
    model_settings.write(adapter_dir, settings)
    log(f"measure: decoding.json <- {settings.note}")
    if not CANDIDATES[best]["lookup"] and (adapter_dir / LOOKUP_CORPUS).is_file():
        (adapter_dir / LOOKUP_CORPUS).unlink()  # its answers draft only with lookup, which did not pay
        log(f"measure: {LOOKUP_CORPUS} removed from {adapter_dir} (lookup drafts did not pay)")
    return best


def choose_at_batch(summary: list[dict], names: set[str], threads: int, batch: int,
                    at_batch: Callable[[str], list[dict]], alike: bool, log: Callable[[str], None]) -> str | None:
    """The setting `choose` picks at batch 1 that is not slower than AR at `batch` on any domain
    (at_batch(name): its summary rows there, timed beside AR). One that is gives way to the next best;
    with `alike` (a CPU batch) so does every setting that decodes that batch alike (as_cpu_batch: they
    differ in forks and width prices, which such a batch does not use), since timing it again would
    only measure the machine's noise. If none holds, the first pick is kept; None if none kept every
    output at batch 1."""
    from refusion.decoding.speculative_policy import as_cpu_batch

    left, first = set(names), None
    while (pick := choose(summary, threads, left)) is not None:
        first = first or pick
        at = at_batch(pick)
        shown = ", ".join(f"{s['bench']} {s['tps_vs_ar']:.2f}x AR" for s in at)
        if all(s["tps_vs_ar"] >= 1.0 for s in at):
            log(f"measure: {pick!r} at batch {batch}: {shown}")
            return pick
        alike_there = sorted(n for n in left - {pick} if as_cpu_batch(CANDIDATES[n]) == as_cpu_batch(CANDIDATES[pick])
                             ) if alike else []
        left -= {pick, *alike_there}
        also = f" (and {', '.join(map(repr, alike_there))}, alike there)" if alike_there else ""
        log(f"measure: {pick!r}{also} is slower than AR at batch {batch} ({shown}): "
            + ("the next setting is tried" if choose(summary, threads, left) else f"{first!r} is kept"))
    return first


def to_time(rows: list[dict], wanted: list[tuple[int, str, str]], threads: int,
            process: str) -> tuple[list[dict], list[tuple[int, str, str]]]:
    """(the rows kept, the (batch, setting, domain) rows to time now, in `wanted`'s order). A batch's
    rows of one domain are compared with each other (speed over AR), so they are timed by one process
    on one machine: where one of them is missing, those an earlier process timed are timed again."""
    def key(bs: int, name: str, d: str) -> tuple:
        return threads, bs, name, d

    have = {(r["threads"], r["batch_size"], r["name"], r["bench"]): r for r in rows}
    groups: dict[tuple[int, str], list[str]] = {}
    for bs, name, d in wanted:
        groups.setdefault((bs, d), []).append(name)
    again: set[tuple] = set()
    for (bs, d), names in groups.items():
        if any(key(bs, n, d) not in have for n in names):
            earlier = [key(bs, n, d) for n in names if key(bs, n, d) in have]
            again |= {k for k in earlier if have[k].get("process") != process}
    kept = [r for r in rows if (r["threads"], r["batch_size"], r["name"], r["bench"]) not in again]
    return kept, [(bs, n, d) for bs, n, d in wanted if key(bs, n, d) in again or key(bs, n, d) not in have]


class _Rows:
    """The measurement's rows (threads, batch, setting, domain), each run once: kept in state["rows"] and
    written to `out` as they finish."""

    def __init__(self, state: dict, out: Path, base, adapted, tok, domains, n: int, seed: int, max_tokens: int,
                 threads: int, progress: bool) -> None:
        self.state, self.out, self.base, self.adapted, self.threads = state, out, base, adapted, threads
        self.max_tokens, self.progress, self.warm = max_tokens, progress, False
        self.process = uuid.uuid4().hex  # (to_time: the rows this process timed)
        self.eos = tok.stop_ids(base.config.eos_ids)
        self.prompts = {d: [tok.chat_prompt_ids(e.prompt) for e in held_out_examples(d, n, seed, last=True)]
                        for d in domains}

    def run(self, wanted: list[tuple[int, str, str]]) -> None:
        from refusion.decoding import decode

        self.state["rows"], todo = to_time(self.state["rows"], wanted, self.threads, self.process)
        if not todo:
            return
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(len(self.prompts[d]) for _, _, d in todo), desc="measure", unit="prompt",
                       dynamic_ncols=True)
        if not self.warm:  # first calls allocate and pick kernels
            first = next(iter(self.prompts.values()))[:1]
            decode(self.base, first, "ar", gen_length=8)
            decode(self.adapted, first, "speculative", gen_length=8, **CANDIDATES["speculative +lookup"])
            self.warm = True
        for bs, name, d in todo:
            model, decoder, params = ((self.base, "ar", {}) if name == "base ar"
                                      else (self.adapted, "speculative", CANDIDATES[name]))
            row = decode_all(model, self.prompts[d], decoder, bs, self.max_tokens, self.eos, params,
                             bar.update if bar is not None else None)
            self.state["rows"].append(dict(threads=self.threads, batch_size=bs, name=name, bench=d,
                                           process=self.process, **row))
            _write(self.out, self.state)
        if bar is not None:
            bar.close()


def _write(path: Path, state: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(path)
