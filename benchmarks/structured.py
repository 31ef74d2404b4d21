"""Structured outputs: JSON extraction under a schema, constrained speculative vs constrained AR vs
unconstrained speculative, and what the grammar costs.

    python benchmarks/structured.py                   # 50 prompts, SmolLM2 with its adapter
    python benchmarks/structured.py --quick           # 5 prompts: a check that runs in well under a minute
    python benchmarks/structured.py --grammar-cost    # per-token mask cost: llguidance vs xgrammar (pip install xgrammar)

Prompts: benchmarks/data/json_extraction.jsonl (a short text each and the name of its schema in
json_extraction_schemas.json: a person, a product, an event, a book, an order), asked through the
chat template, decoded greedily one prompt at a time with the model's own settings (decoding.json):

    speculative constrained     `speculative` with the schema as a grammar (decoding/controls.py)
    ar constrained              `ar` with the same grammar: the reference the first must equal
    speculative unconstrained   `speculative` with no grammar, the same prompts

Per setting: valid (outputs that parse as JSON and validate against their schema: the `jsonschema`
package), identical (token for token equal to ar constrained), TPF (tokens / forwards, summed over
the prompts), TPS (tokens / decoding seconds), and for the constrained ones the grammar's host time
per token in ms (the matcher's mask fills, advances and forced tokens: controlled.RowControl) and the
controls' share of the decode (that, plus applying the masks to the logits). TPF does not depend on
the machine's load; TPS and the costs do: time them on an idle machine. Writes JSON
(benchmarks/results/structured.json unless --out) and prints a markdown table.

--grammar-cost: for one JSON schema and one regex, on the model's vocabulary, the time to fill the
next-token bitmask and accept the token, per token of a valid text, for llguidance (through
decoding/grammar.py, as the decoder calls it) and xgrammar (its own matcher); and each library's
time to compile the grammar (a new schema: what a server pays per request that brings one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from refusion.bundled import resolve_model
from refusion.decoding import Controls, controlled, decode, grammar
from refusion.files import write_text
from refusion.model.checkpoint import load_model
from refusion.model.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parent / "data"
RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = ("speculative constrained", "ar constrained", "speculative unconstrained")


def load_prompts(tok: Tokenizer, n: int | None) -> tuple[list[dict], list[list[int]], dict]:
    schemas = json.loads((DATA / "json_extraction_schemas.json").read_text())
    rows = [json.loads(line) for line in (DATA / "json_extraction.jsonl").read_text().splitlines() if line.strip()]
    if n is not None:  # (every schema, in turn)
        by = {}
        for r in rows:
            by.setdefault(r["schema"], []).append(r)
        rows = [r for i in range(max(map(len, by.values()))) for v in by.values() if i < len(v) for r in [v[i]]][:n]
    prompts = [tok.chat_prompt_ids(f"Extract the {r['schema']} from this text as a JSON object with the keys "
                                   f"{', '.join(schemas[r['schema']]['properties'])}. Reply with the JSON only.\n\n"
                                   f"Text: {r['text']}")
               for r in rows]
    return rows, prompts, schemas


class Timer:
    """Wall seconds spent in the controls' host work (RowControl: fill runs inside controlled.apply,
    prepare and commit outside it) and in controlled.apply."""

    def __init__(self) -> None:
        self.fill = self.outside = self.apply = 0.0
        self._undo = []

    def __enter__(self) -> Timer:
        def wrap(owner, name, field):
            fn = getattr(owner, name)

            def timed(*a, **kw):
                t = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    setattr(self, field, getattr(self, field) + time.perf_counter() - t)
            setattr(owner, name, timed)
            self._undo.append((owner, name, fn))

        wrap(controlled.RowControl, "prepare", "outside")
        wrap(controlled.RowControl, "fill", "fill")
        wrap(controlled.RowControl, "commit", "outside")
        wrap(controlled, "apply", "apply")
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in reversed(self._undo):
            setattr(owner, name, fn)


def run(model, tok, rows, prompts, schemas, gen_length: int) -> dict[str, dict]:
    import jsonschema

    out = {}
    for name in SETTINGS:
        decoder = name.split()[0]
        results, seconds = [], 0.0
        with Timer() as timer:
            for r, p in zip(rows, prompts, strict=True):
                c = Controls(grammar=grammar.json_schema(tok, schemas[r["schema"]])) if "unconstrained" not in name \
                    else None
                t = time.perf_counter()
                (res,) = decode(model, [p], decoder, gen_length=gen_length, controls=c)
                seconds += time.perf_counter() - t
                results.append(res)
        valid = 0
        for r, res in zip(rows, results, strict=True):
            try:
                jsonschema.validate(json.loads(tok.decode(res.tokens)), schemas[r["schema"]])
                valid += 1
            except (json.JSONDecodeError, jsonschema.ValidationError):
                pass
        tokens = sum(len(res.tokens) for res in results)
        ruled = "unconstrained" not in name
        grammar_s, controls_s = timer.fill + timer.outside, timer.apply + timer.outside
        out[name] = dict(valid=valid, n=len(rows), tokens=tokens, forwards=sum(res.forwards for res in results),
                         tpf=tokens / max(1, sum(res.forwards for res in results)),
                         tpf_per_prompt=[res.tpf for res in results], tps=tokens / seconds,
                         seconds=seconds, grammar_ms_per_token=1e3 * grammar_s / tokens if ruled else None,
                         controls_share=controls_s / seconds if ruled else None,
                         outputs=[res.tokens for res in results],
                         texts=[tok.decode(res.tokens) for res in results])
    ref = out["ar constrained"]["outputs"]
    for v in out.values():
        v["identical"] = sum(a == b for a, b in zip(v["outputs"], ref, strict=True))
    return out


def table(out: dict[str, dict]) -> str:
    """TPF: all tokens / all forwards (long answers weigh more); per prompt: the median of each
    prompt's TPF ratio to unconstrained speculative's on that prompt."""
    free = out["speculative unconstrained"]
    lines = ["| setting | valid | identical to ar constrained | TPF | TPF / unconstrained | per prompt (median) | TPS "
             "| grammar ms/token | controls' share |", "|---|---|---|---|---|---|---|---|---|"]
    for name, v in out.items():
        g = f"{v['grammar_ms_per_token']:.3f}" if v["grammar_ms_per_token"] is not None else "-"
        s = f"{100 * v['controls_share']:.1f}%" if v["controls_share"] is not None else "-"
        ratio = statistics.median(a / b for a, b in zip(v["tpf_per_prompt"], free["tpf_per_prompt"], strict=True))
        lines.append(f"| {name} | {v['valid']}/{v['n']} | {v['identical']}/{v['n']} | {v['tpf']:.2f} | "
                     f"{v['tpf'] / free['tpf']:.2f}x | {ratio:.2f}x | {v['tps']:.1f} | {g} | {s} |")
    return "\n".join(lines)


# ---- --grammar-cost ------------------------------------------------------------------------------

COST_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "pattern": "^[a-z.]+@[a-z]+\\.[a-z]{2,3}$"},
    "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "minItems": 1, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False}
COST_JSON = ('{"name": "Maria Lopez Fernandez", "age": 34, "email": "maria.lopez@example.com", "tags": ["admin", "user"], '
             '"address": {"city": "Madrid", "zip": "28013"}}')
COST_REGEX = r"(19|20)[0-9]{2}-[0-9]{2}-[0-9]{2}: [A-Z][a-z]+( [a-z]+){2,20}\."
COST_REGEX_TEXT = "2025-04-12: The spring music festival opens in the old town square with free entry for everyone."


def grammar_cost(tok: Tokenizer, vocab: int, repeats: int) -> dict:
    cases = {"json schema": (COST_JSON, lambda: grammar.json_schema(tok, COST_SCHEMA)),
             "regex": (COST_REGEX_TEXT, lambda: grammar.regex(tok, COST_REGEX))}
    out = {}
    words = (vocab + 31) // 32
    eos = np.array([tok.eos_id])
    grammar.regex(tok, "a")  # (llguidance's view of the vocabulary, built once per tokenizer: not timed)
    for case, (text, make) in cases.items():
        ids = tok.encode(text)
        grammar._GRAMMARS.pop(tok, None)  # (a new spec: compile it)
        t = time.perf_counter()
        g = make()
        compile_s = time.perf_counter() - t
        per = []
        for _ in range(repeats):
            m = g.matcher()
            row = np.zeros(words, dtype=np.int32)
            t = time.perf_counter()
            for tid in ids:
                m.fill(row, eos)
                assert row[tid >> 5] >> (tid & 31) & 1, f"llguidance refused token {tid}"
                assert m.accept(tid)
            per.append((time.perf_counter() - t) / len(ids))
        out[f"llguidance {case}"] = dict(ms_per_token=1e3 * statistics.median(per), compile_ms=1e3 * compile_s,
                                         tokens=len(ids))
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        print("xgrammar is not installed (pip install xgrammar): only llguidance measured")
        return out
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok.tok), vocab_size=vocab,
                                              stop_token_ids=[tok.eos_id])
    for case, (text, _) in cases.items():
        ids = tok.encode(text)
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        t = time.perf_counter()
        cg = (compiler.compile_json_schema(json.dumps(COST_SCHEMA), any_whitespace=False, separators=(", ", ": "))
              if case == "json schema" else compiler.compile_regex(COST_REGEX))
        compile_s = time.perf_counter() - t
        per = []
        for _ in range(repeats):
            m = xgr.GrammarMatcher(cg)
            bitmask = xgr.allocate_token_bitmask(1, vocab)
            t = time.perf_counter()
            for tid in ids:
                m.fill_next_token_bitmask(bitmask)
                assert m.accept_token(tid), f"xgrammar refused token {tid}"
            per.append((time.perf_counter() - t) / len(ids))
        out[f"xgrammar {case}"] = dict(ms_per_token=1e3 * statistics.median(per), compile_ms=1e3 * compile_s,
                                       tokens=len(ids))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-refusion")
    ap.add_argument("--quick", action="store_true", help="5 prompts")
    ap.add_argument("--n", type=int, help="the first N prompts (every schema in turn)")
    ap.add_argument("--gen-length", type=int, default=160)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--grammar-cost", action="store_true", help="measure the libraries' per-token mask cost only")
    ap.add_argument("--repeats", type=int, default=5, help="--grammar-cost: rounds (the median is reported)")
    ap.add_argument("--out", help="JSON path (default: benchmarks/results/structured[_grammar_cost][_quick].json)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    tok = Tokenizer.from_dir(model_dir)
    suffix = ("_grammar_cost" if args.grammar_cost else "") + ("_quick" if args.quick else "")
    path = Path(args.out) if args.out else RESULTS / f"structured{suffix}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if args.grammar_cost:
        config = json.loads((model_dir / "config.json").read_text())
        res = grammar_cost(tok, config["vocab_size"], args.repeats)
        write_text(path, json.dumps(dict(model=args.model, vocab=config["vocab_size"], results=res), indent=1))
        print("| library, grammar | ms per token (fill + accept) | compile ms | tokens |\n|---|---|---|---|")
        for k, v in res.items():
            print(f"| {k} | {v['ms_per_token']:.3f} | {v['compile_ms']:.1f} | {v['tokens']} |")
        return
    model = load_model(model_dir)
    rows, prompts, schemas = load_prompts(tok, 5 if args.quick else args.n)
    decode(model, prompts[:1], "ar", gen_length=8)  # warm-up: first calls allocate and pick kernels
    out = run(model, tok, rows, prompts, schemas, args.gen_length)
    write_text(path, json.dumps(dict(model=args.model, gen_length=args.gen_length, threads=args.threads,
                                    n=len(rows), settings=out), indent=1))
    print(table(out))
    print(f"(written to {path})")


if __name__ == "__main__":
    main()
