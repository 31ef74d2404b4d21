"""The stages of `refusion adapt`, in order; each is skipped when its record says done, and each
resumes from its own files when cut off (run.py lists them):

    base      the model: a directory or a name as it is; a GGUF file imported into DIR/base once
    prompts   DIR/prompts.jsonl: the mix of domains (prompts.py), the model's user turns and function
              requests sampled into DIR/user_turns.jsonl and DIR/code_*.jsonl, near-repeats of held-out
              requests dropped
    data      DIR/data.jsonl: the model's own greedy answers (training/self_generate.py, batched); for
              SmolLM2 it starts from the answers kept in configs/smollm2-refusion-data.jsonl.gz
    train     DIR/train: the mask-only recipe (recipe.py), from its last checkpoint
    sampler   DIR/sampler: the masks' sampler (training/mask_sampler.py), kept where its drafts hold
              longer than the masks' argmax on held-out answers
    export    DIR/adapter: the adapter, the sampler where it pays, the answers as a lookup corpus
    measure   DIR/measure.json: held-out prompts per domain (measure.py); the best exact setting is
              written into DIR/adapter/decoding.json
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shlex
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from refusion.bundled import ADAPTER_CONFIG, ASSETS, SMOLLM2, adapter_names, resolve_model
from refusion.files import write_text
from refusion.training.adapt.prompts import DOMAINS, choose_prompts, user_prompts
from refusion.training.adapt.recipe import Budget, Options, budget, estimate_seconds, train_overrides
from refusion.training.adapt.run import RunDir, fingerprint
from refusion.training.self_generate import Prompt

if TYPE_CHECKING:
    from refusion.model.tokenizer import Tokenizer
    from refusion.model.transformer import Transformer

STAGES = ("base", "prompts", "data", "train", "sampler", "export", "measure")
# answers a model wrote in an earlier run of this recipe, by model name: the data stage answers only
# what they lack (present in a checkout of the repository, not in an installed package)
KEPT_ANSWERS = {SMOLLM2: Path(__file__).parents[4] / "configs" / "smollm2-refusion-data.jsonl.gz"}
# what an adapter directory may hold (model/mask_adapter.py, mask_sampler.py, decoding/corpus.py, model_settings.py)
ADAPTER_FILES = (ADAPTER_CONFIG, "mask_adapter.safetensors", "mask_sampler.safetensors", "lookup_corpus.safetensors",
                 "decoding.json", "train_config.json")


def base_of(model: str) -> tuple[str, Path | None]:
    """(how the adapter names its base, the model directory, or None for a GGUF file not imported yet);
    a ValueError for what cannot be adapted."""
    path = Path(model)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return str(path.resolve()), None
    if (path / ADAPTER_CONFIG).is_file() or (not path.exists() and model in adapter_names()):
        where = path if path.exists() else ASSETS / model
        base = json.loads((where / ADAPTER_CONFIG).read_text()).get("base")
        raise ValueError(f"{model} is a mask adapter already: adapt its base ({base}) instead")
    model_dir = resolve_model(model)
    check_causal(model_dir)
    return (model if not path.exists() else str(path.resolve())), model_dir


def check_causal(model_dir: Path) -> None:
    from refusion.model.checkpoint import load_config

    cfg = load_config(model_dir)
    if cfg.bidirectional or cfg.training_objective in ("mdm", "refusion") or cfg.mask_adapter is not None:
        kind = "a masked-diffusion model" if cfg.bidirectional or cfg.training_objective == "mdm" else \
            "a ReFusion model already (its masks draft)"
        raise ValueError(f"{model_dir} is {kind}, not a causal LM: `refusion adapt` teaches a causal LM's "
                         "<|mask|> rows to draft")
    if not (model_dir / "tokenizer.json").is_file():
        raise ValueError(f"{model_dir} has no tokenizer.json: the model's own answers need its tokenizer")


class Pipeline:
    def __init__(self, model: str, out: str | Path, opts: Options, hours: float | None = None,
                 threads: int | None = None, progress: bool = True, export: str | Path | None = None) -> None:
        if hours is not None and not (hours > 0 and math.isfinite(hours)):
            raise ValueError(f"--hours {hours}: give a positive number of hours")
        if opts.prompts_file is not None:
            self.user = user_prompts(opts.prompts_file)  # a bad file fails before anything runs
            sha = hashlib.sha256("\n".join(self.user).encode()).hexdigest()[:16]
        else:
            self.user, sha = [], None
        self.model, self.opts, self.hours, self.threads, self.progress = model, opts, hours, threads, progress
        self.export_to = Path(export) if export is not None else None
        self.init, self.model_dir = base_of(model)
        gguf = self.model_dir is None
        ident = {"model": model, "init": self.init,
                 "fingerprint": fingerprint(Path(self.init) if gguf else self.model_dir)}
        self.run = RunDir(out, quiet=not progress)
        self.run.open(ident, opts.defining(sha))
        if gguf:
            self.init = str((self.run / "base").resolve())
        self.t0 = time.time()
        self._model = self._tok = None

    # ---- the base -------------------------------------------------------------------------------

    def base(self) -> None:
        if self.model_dir is None:
            target = self.run / "base"
            if not (target / "config.json").is_file():
                from refusion.model.gguf import import_gguf

                self.run.log(f"base: importing {self.model} -> {target}")
                shutil.rmtree(target, ignore_errors=True)
                import_gguf(self.model, target)
            self.model_dir = target
            check_causal(target)
        if not self.run.done("base"):
            params = sum(p.numel() for p in self.base_model().parameters())
            self.run.finish("base", time.time(), parameters=params, directory=str(self.model_dir))
            self.run.log(f"base: {self.model} ({params:,} parameters)")

    def base_model(self) -> Transformer:
        if self._model is None:
            from refusion.model.checkpoint import load_model
            from refusion.model.tokenizer import Tokenizer
            from refusion.runtime import set_threads

            self._model, self._tok = load_model(self.model_dir), Tokenizer.from_dir(self.model_dir)
            set_threads(self.threads)
        return self._model

    def tokenizer(self) -> Tokenizer:
        self.base_model()
        return self._tok

    @property
    def parameters(self) -> int:
        return self.run.state["stages"]["base"]["parameters"]

    @property
    def budget(self) -> Budget:
        return budget(self.opts, self.run.state["stages"].get("train", {}).get("steps"))

    # ---- prompts --------------------------------------------------------------------------------

    def prompts(self) -> None:
        if self.run.done("prompts"):
            return
        started = time.time()
        room = min(1024, self.base_model().config.max_position_embeddings)
        chosen, stats = choose_prompts(self.base_model(), self.tokenizer(), self.opts, self.user, room,
                                       self.run.path, self.budget.gen_batch, self.run.log,
                                       self.parameters, self.progress)
        tmp = self.run / "prompts.jsonl.tmp"
        tmp.write_text("".join(json.dumps({"domain": p.source, "query": p.query}) + "\n" for p in chosen),
                       encoding="utf-8")
        tmp.replace(self.run / "prompts.jsonl")
        per = {d: sum(p.source == d for p in chosen) for d in (*DOMAINS, "user")}
        self.run.finish("prompts", started, count=len(chosen), domains=per, **stats)
        self.run.log(f"prompts: {len(chosen)} ({', '.join(f'{d} {n}' for d, n in per.items() if n)}); dropped: "
                     f"{stats['held_out_repeats_dropped']} that nearly repeat a held-out request, "
                     f"{stats['too_long_dropped']} too long for {room} tokens with an answer")

    # ---- data -----------------------------------------------------------------------------------

    def data(self) -> None:
        if self.run.done("data"):
            return
        started = time.time()  # (a stage's wall time: its imports too)
        from refusion.training.self_generate import done_queries, self_generate

        prompts = [Prompt(r["domain"], r["query"]) for r in map(json.loads, (self.run / "prompts.jsonl").read_text(
            encoding="utf-8").splitlines())]
        out = self.run / "data.jsonl"
        kept = KEPT_ANSWERS.get(self.model)
        if kept is not None and kept.is_file() and not out.exists() and not self.opts.quick:
            self._start_from(kept, prompts, out)
        todo = len(prompts) - len(done_queries(out) & {p.query for p in prompts})
        self.run.log(f"data: answering {todo} prompts with the model's greedy output, {self.opts.max_tokens} tokens at "
                     f"most (first guess {estimate_seconds('answer', todo, self.parameters) / 60:.0f} min) -> {out}")
        c = self_generate(self.base_model(), self.tokenizer(), prompts, out, self.opts.max_tokens,
                          self.budget.gen_batch, progress=self.progress)
        # the prompts' order, whatever order the answers finished in: training does not depend on it
        lines = {json.loads(x)["query"]: x for x in out.read_text(encoding="utf-8").splitlines()}
        write_text(out, "".join(lines[p.query] + "\n" for p in prompts))
        self.run.finish("data", started, answers=len(prompts))
        self.run.log(f"data: {c['written']} answers written, {c['skipped']} already there")

    def _start_from(self, kept: Path, prompts: list[Prompt], out: Path) -> None:
        import gzip

        want = {p.query: p.source for p in prompts}
        recs = []
        with gzip.open(kept, "rt", encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                if r["query"] in want:
                    recs.append(dict(r, source=want[r["query"]]))
        tmp = out.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
        tmp.replace(out)
        self.run.log(f"data: starting from {len(recs)} answers kept in {kept}")

    # ---- train ----------------------------------------------------------------------------------

    def train(self) -> None:
        if self.run.done("train"):
            return
        started = time.time()  # (a stage's wall time: its imports too)
        from refusion.training.config import load_train_config
        from refusion.training.run_dir import latest_checkpoint
        from refusion.training.trainer import train

        rec = self.run.state["stages"].get("train", {})
        out = self.run / "train"
        if "steps" not in rec:
            steps = self._steps_for_budget() if self.hours is not None else budget(self.opts).steps
            self.run.record("train", steps=steps)
        b = self.budget
        pos = self.base_model().config.max_position_embeddings
        cfg = load_train_config(None, train_overrides(self.init, str(self.run / "data.jsonl"), str(out), pos, b))
        last = latest_checkpoint(out)
        self.run.log(f"train: {b.steps} steps of {b.batch_size} answers"
                     + (f", from step {last.name.split('-')[-1]}" if last else "")
                     + f" (first guess {estimate_seconds('step', b.steps, self.parameters) / 60:.0f} min) -> {out}")
        self._free()
        # (a run resumed on another machine may train in another dtype: train_dtype is the machine's)
        train(cfg, resume=True, progress=self.progress, allow_changed=["max_steps", "dtype"], threads=self.threads)
        self.run.finish("train", started)
        self.run.log(f"train: done -> {out / 'adapter'}")

    def _steps_for_budget(self) -> int:
        """--hours: the steps that fit in what is left of it after the stages to come, at the pace of a few
        steps timed here (the run's first steps, kept)."""
        from refusion.training.config import load_train_config
        from refusion.training.trainer import train

        full = budget(self.opts)
        probe = min(5, full.steps)
        out = self.run / "train"
        pos = self.base_model().config.max_position_embeddings
        overrides = train_overrides(self.init, str(self.run / "data.jsonl"), str(out), pos, full)
        self._free()
        train(load_train_config(None, overrides + [f"stop_after={probe}"]), progress=self.progress,
              threads=self.threads)
        secs = [json.loads(x)["seconds"] for x in (out / "metrics.jsonl").read_text().splitlines()]
        pace = sum(secs[1:]) / max(len(secs) - 1, 1) if len(secs) > 1 else secs[0]
        n = min(self.run.state["stages"]["prompts"]["count"], full.sampler_examples)
        after = (estimate_seconds("sampler example", n, self.parameters)
                 + estimate_seconds("measured prompt", 4 * full.measure_prompts * 5, self.parameters))
        left = self.hours * 3600 - (time.time() - self.t0) - after
        steps = max(probe, min(full.steps, int(left / pace)))
        self.run.log(f"train: --hours {self.hours:g}: {pace:.1f} s a step, {left / 60:.0f} min left for training: "
                     f"{steps} steps")
        return steps

    def _free(self) -> None:
        self._model = self._tok = None  # (training loads its own copy)

    # ---- the sampler, the export ----------------------------------------------------------------

    def sampler(self) -> None:
        if self.run.done("sampler"):
            return
        started = time.time()  # (a stage's wall time: its imports too)
        from refusion.model.checkpoint import load_model
        from refusion.model.mask_sampler import save_sampler
        from refusion.model.tokenizer import Tokenizer
        from refusion.runtime import set_threads
        from refusion.training.data import encode_records, load_records
        from refusion.training.mask_sampler import SamplerTraining, sampler_features, train_sampler

        b = self.budget
        model_dir = resolve_model(str(self.run / "train" / "adapter"))
        model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
        set_threads(self.threads)
        records = load_records(self.run / "data.jsonl")
        if len(records) > b.sampler_examples:  # a seeded sample across the domains (data.jsonl is in their order)
            keep = sorted(random.Random(self.opts.seed).sample(range(len(records)), b.sampler_examples))
            records = [records[i] for i in keep]
        out = self.run / "sampler"
        out.mkdir(exist_ok=True)
        self.run.log(f"sampler: the masks' drafts behind {b.sampler_cuts} prefixes of {len(records)} answers (first "
                     f"guess {estimate_seconds('sampler example', len(records), self.parameters) / 60:.0f} min), then "
                     f"{b.sampler_steps} steps")
        cfg = SamplerTraining(cuts=b.sampler_cuts, steps=b.sampler_steps, check_every=b.sampler_check_every)
        features = sampler_features(model, encode_records(records, tok), cfg, out / "features.pt",
                                    progress=self.progress)
        sampler, record = train_sampler(model, features, cfg, progress=self.progress)
        pays = record["best_chain"] > record["argmax_chain"]
        (out / "sampler.json").write_text(json.dumps(record, indent=1))
        if pays:
            save_sampler(sampler, out)
        self.run.finish("sampler", started, pays=pays, best_chain=record["best_chain"],
                        argmax_chain=record["argmax_chain"])
        self.run.log(f"sampler: held-out drafts hold {record['best_chain']:.2f} tokens in a row against the argmax's "
                     f"{record['argmax_chain']:.2f}: " + ("kept" if pays else "not kept (it does not pay)"))

    def export(self) -> None:
        if self.run.done("export"):
            return
        started = time.time()  # (a stage's wall time: its imports too)
        from refusion.decoding.corpus import write_corpus
        from refusion.model.mask_adapter import ADAPTER_WEIGHTS
        from refusion.model.mask_sampler import MASK_SAMPLER
        from refusion.training.data import load_records

        final = self.run / "adapter"
        tmp = self.run / ".adapter.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        trained = self.run / "train" / "adapter"
        for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            shutil.copyfile(trained / f, tmp / f)
        shutil.copyfile(self.run / "train" / "train_config.json", tmp / "train_config.json")
        if (self.run / "sampler" / MASK_SAMPLER).is_file():
            shutil.copyfile(self.run / "sampler" / MASK_SAMPLER, tmp / MASK_SAMPLER)
        # the base's own answers beside the adapter: lookup drafts what it usually writes next from them
        tok = self.tokenizer()
        answers = []
        for r in load_records(self.run / "data.jsonl"):
            ids = tok.encode(r["response"], parse_special=False)  # text is text: no control token from an answer
            if r.get("finished") and tok.eos_id is not None:  # the answer ended there: its end is drafted too
                ids.append(tok.eos_id)
            answers.append(ids)
        write_corpus(tmp, answers)
        shutil.rmtree(final, ignore_errors=True)
        tmp.replace(final)
        size = sum(p.stat().st_size for p in final.iterdir())
        self.run.finish("export", started, bytes=size)
        self.run.log(f"export: {final} ({size / 2**20:.1f} MiB): `--model {final}`")

    # ---- measure --------------------------------------------------------------------------------

    def measure(self) -> None:
        if self.run.done("measure"):
            return
        started = time.time()  # (a stage's wall time: its imports too)
        from refusion.training.adapt.measure import measure

        self._free()
        b = self.budget
        # one thread: the setting chosen is the one a single request runs best with
        self.run.log(f"measure: {b.measure_prompts} held-out prompts per domain, one thread, the base's AR and the "
                     f"candidate settings (first guess "
                     f"{estimate_seconds('measured prompt', 4 * b.measure_prompts * 5, self.parameters) / 60:.0f} min)")
        chosen = measure(self.run / "adapter", self.model_dir, self.run / "measure.json", b.measure_prompts,
                         b.measure_tokens, quick=self.opts.quick, threads=1, seed=self.opts.seed,
                         progress=self.progress, log=self.run.log, command=self.command(), batch=b.measure_batch)
        self.run.finish("measure", started, decoding=chosen)

    def command(self) -> str:
        """The command line that makes this run's adapter (decoding.json's measured_by)."""
        o, d = self.opts, Options()
        parts = ["refusion adapt", shlex.quote(self.model), "--out", shlex.quote(str(self.run.path))]
        if o.quick:
            parts.append("--quick")
        if not o.quick and o.prompts != d.prompts:
            parts += ["--prompts", str(o.prompts)]
        if o.mix != d.mix:
            parts += ["--mix", ",".join(f"{k}={v:g}" for k, v in o.mix.items())]
        if o.prompts_file:
            parts += ["--prompts-file", shlex.quote(o.prompts_file)]
        return " ".join(parts)

    # ---- all of it ------------------------------------------------------------------------------

    def __call__(self, stages: tuple[str, ...] = STAGES) -> Path:
        self.run.log(f"{'resuming' if self.run.state['stages'] else 'starting'} {self.model} -> {self.run.path} "
                     f"(log {self.run / 'log'})")
        for stage in stages:
            started = time.time()
            try:
                getattr(self, stage)()
            except BaseException:
                self.run.stopped(stage, started)
                raise
        final = self.run / "adapter"
        if self.export_to is not None:
            self._copy(final, self.export_to)
        self.run.log(f"done: {final}")
        return final

    def _copy(self, final: Path, dest: Path) -> None:
        """The adapter's files into `dest`, each replaced whole; an adapter file `final` lacks (a sampler that
        did not pay this time) is removed, so that what `dest` holds is this adapter."""
        dest.mkdir(parents=True, exist_ok=True)
        for p in final.iterdir():
            shutil.copyfile(p, dest / f".{p.name}.tmp")
            (dest / f".{p.name}.tmp").replace(dest / p.name)
        for name in ADAPTER_FILES:
            if not (final / name).exists():
                (dest / name).unlink(missing_ok=True)
        self.run.log(f"copied {final} -> {dest}")

