"""lm-evaluation-harness adapter: `--model refusion`.

    lm_eval --model refusion --model_args pretrained=DIR,decoder=refusion,slot_size=8 --tasks ...
    python -m refusion.evaluation.lm_eval --model refusion ...     (the same, no hook needed)

How lm-eval finds the model: lm-eval (0.4.x, read in lm_eval/api/registry.py and
lm_eval/models/__init__.py) scans no entry points for models; its registry holds its own
MODEL_MAPPING plus whatever `register_model` ran in the process. So this module must be imported
inside lm-eval's process before the model is looked up. `python -m refusion.evaluation.lm_eval ARGS`
does that and then runs lm-eval's own, unmodified command line. For the plain `lm_eval` command,
`python -m refusion.evaluation.lm_eval --install-hook` writes a one-line .pth file into
site-packages that registers "refusion" (lazily, as "module:class") the moment lm-eval's registry
is imported (evaluation/lm_eval_hook.py); `--uninstall-hook` removes it. scripts/setup.sh installs it.

Requests:
- generate_until: batched through `decode()` with the chosen decoder and its parameters
  (model_args), greedy unless the task samples; output cut at the first stop string (`until`) and
  at max_gen_toks tokens.
- loglikelihood / loglikelihood_rolling: causal scoring, see `score`.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from refusion.decoding import decode, model_settings, registry
from refusion.decoding.params import check_seed
from refusion.model.checkpoint import load_model
from refusion.model.tokenizer import Tokenizer
from refusion.model.transformer import Transformer


@torch.inference_mode()
def score(model: Transformer, pairs: list[tuple[list[int], list[int]]], batch_size: int = 16,
          ) -> list[tuple[float, bool]]:
    """(log P(continuation | context), would greedy decoding produce it) for each (context ids,
    continuation ids) pair, under the model's autoregressive factorisation.

    This is the distribution the `ar` decoder samples from, and `speculative` reproduces exactly.
    On a ReFusion model (one with a mask token) the first continuation token is read from a
    <|mask|> fed at its position, as `ar` reads it: the ReFusion objective trains every token but
    the first of a slot causally, from the token before it, and the first from a mask; nothing
    trains the context's last token to predict the next one. The later tokens are scored causally.
    All of it is one forward per batch: the mask sits after the context and is hidden from the
    continuation tokens fed after it (which attend to the context and to each other, causally).

    Why not a diffusion likelihood: the probability a slot-parallel decoder assigns to a text
    depends on the order it fills the slots in, which is a decoding choice, not part of the model;
    summing over orders is intractable. The causal factorisation is exact, cheap, and the one the
    model's exact decoders (ar, speculative) decode from.
    """
    mask_id = model.config.mask_token_id
    device = model.embed_tokens.weight.device
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    out: list[tuple[float, bool] | None] = [None] * len(pairs)
    order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
    for lo in range(0, len(order), batch_size):
        idx = order[lo: lo + batch_size]
        rows = []
        for i in idx:
            ctx, cont = pairs[i]
            if not ctx or not cont:
                raise ValueError("scoring needs a non-empty context and continuation")
            P, n = len(ctx), len(cont)
            if mask_id is not None:  # rows P .. P+n-1 predict cont[0 .. n-1]
                ids, pos, hide = ctx + [mask_id] + cont[:-1], list(range(P)) + [P] + list(range(P, P + n - 1)), P
            else:  # rows P-1 .. P+n-2 predict cont[0 .. n-1]
                ids, pos, hide = ctx + cont[:-1], list(range(P + n - 1)), None
            rows.append((ids, pos, hide, cont))
        T = max(len(r[0]) for r in rows)
        N = max(len(r[3]) for r in rows)
        B = len(rows)
        ids_t = torch.full((B, T), pad, dtype=torch.long)
        pos_t = torch.zeros((B, T), dtype=torch.long)
        mask = torch.ones(T, T, dtype=torch.bool).tril().repeat(B, 1, 1)
        for b, (ids, pos, hide, _) in enumerate(rows):
            off = T - len(ids)  # left padding: every row's scored rows are its last ones
            ids_t[b, off:] = torch.tensor(ids)
            pos_t[b, off:] = torch.tensor(pos)
            mask[b, :, :off] = False
            if hide is not None:
                mask[b, off + hide + 1:, off + hide] = False
        mask |= torch.eye(T, dtype=torch.bool)  # padded rows attend to themselves (no empty rows)
        logits = model(ids_t.to(device), pos_t.to(device), attn_mask=mask[:, None].to(device), num_logits=N)
        logp = logits.float().log_softmax(-1)
        for b, (i, (_, _, _, cont)) in enumerate(zip(idx, rows)):
            lp = logp[b, N - len(cont):]
            target = torch.tensor(cont, device=device)
            total = float(lp.gather(-1, target[:, None]).sum())
            greedy = bool((lp.argmax(-1) == target).all())
            out[i] = (total, greedy)
    return out  # type: ignore[return-value]


class ModelArgsError(ValueError):
    """model_args that refusion refuses (an unknown decoder, a parameter it does not take, a model that
    is not there): printed as one line by `python -m refusion.evaluation.lm_eval` and, through
    `one_line_in_the_lm_eval_command`, by the plain `lm_eval` command."""


def _error_line(e: Exception) -> str:
    return f"refusion: error: {' '.join(str(e).split())}"


def one_line_in_the_lm_eval_command() -> None:
    """The plain `lm_eval` command lets what a model's constructor raises end the process with a
    traceback; there (and only there: a script of the user's keeps its tracebacks), a ModelArgsError
    is printed as one line instead, and the process exits with 2."""
    if Path(sys.argv[0]).name not in ("lm_eval", "lm-eval") or getattr(sys.excepthook, "refusion", False):
        return
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        if not isinstance(value, ModelArgsError):
            return previous(kind, value, tb)
        print(_error_line(value), file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)  # sys.exit inside an excepthook would itself be reported as an error

    excepthook.refusion = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook


one_line_in_the_lm_eval_command()


class ReFusionLM(LM):
    """model_args: pretrained (a model directory, or a name refusion.bundled resolves; default: the
    bundled model), decoder (default: speculative on a model with a mask token, else ar), the
    decoder's parameters (slot_size,
    serial_blocks, slot_threshold, token_threshold, block_length, steps, threshold, draft_length,
    ...), gen_length (fixed generation length; default: each request's max_gen_toks, rounded up to
    what the decoder needs), seed, dtype, max_length (default: the model's context)."""

    def __init__(self, pretrained: str | None = None, decoder: str | None = None, batch_size: int | str = 16,
                 device: str | None = None, dtype: str | None = None, seed: int = 0, gen_length: int | None = None,
                 max_length: int | None = None, max_batch_size: int | None = None, **decoder_params: Any) -> None:
        super().__init__()
        try:
            check_seed(seed)
            self._load(pretrained, decoder, device, dtype, decoder_params)
        except ValueError as e:
            raise ModelArgsError(f"--model_args: {e}") from None
        cfg = self.model.config
        self.batch_size = 16 if str(batch_size).startswith("auto") else int(batch_size)
        self.seed, self.fixed_gen_length = seed, gen_length
        self._max_length = max_length or cfg.max_position_embeddings
        self.eos_ids = self.tok.stop_ids(cfg.eos_ids)
        # the token a document is conditioned on when it has no context (lm-eval's convention)
        self.prefix_id = self.tok.bos_id if self.tok.bos_id is not None else self.eos_ids[0]

    def _load(self, pretrained: str | None, decoder: str | None, device: str | None, dtype: str | None,
              decoder_params: dict[str, Any]) -> None:
        from refusion.bundled import resolve_model

        self.path = resolve_model(pretrained)
        if decoder is not None:  # a name that is no decoder fails before the weights are read
            registry.get(decoder)
        # lm-eval's command line asks for "cuda" unless told otherwise; on a CPU-only machine that
        # would only fail, so fall back to the CPU (as lm-eval's own HF model does)
        if not device or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            device = "cpu"
        self.model = load_model(self.path, dtype=dtype, device=device)
        self.tok = Tokenizer.from_dir(self.path)
        # the model's decoding.json names the decoder and its settings unless model_args do
        self.decoder = model_settings.choose(model_settings.of_model(self.model), self.model.config, decoder)
        # what the decoder takes, less what each request sets (gen_length, temperature); the
        # Python-only policy comes from the model's decoding.json, not from model_args
        self.fields = {o.name for o in registry.options(self.decoder)}
        allowed = sorted(self.fields - {"gen_length", "temperature"})
        bad = sorted(set(decoder_params) - set(allowed))
        if bad:
            raise ValueError(registry.refusal(self.decoder, bad, allowed))
        self.params = decoder_params

    # ---- what lm-eval asks about the model -------------------------------------------------------

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(self.path).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tok.config.get("chat_template") if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tok.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt)

    # ---- loglikelihood ------------------------------------------------------------------------

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        # lm-eval's convention: trailing spaces of the context belong to the continuation, and the
        # continuation's ids are those of the joined text after the context's (so tokens that merge
        # across the boundary are tokenized as in running text)
        n = len(context) - len(context.rstrip(" "))
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        if not context:
            return [self.prefix_id], self.tok.encode(continuation)
        whole, ctx = self.tok.encode(context + continuation), self.tok.encode(context)
        return ctx, whole[len(ctx):]

    def _fit(self, ctx: list[int], cont: list[int]) -> tuple[list[int], list[int]]:
        room = self.max_length - len(cont)  # a mask model feeds len(ctx) + len(cont) tokens
        if room < 1:
            raise ValueError(f"a continuation of {len(cont)} tokens does not fit in {self.max_length}")
        return ctx[-room:], cont

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._fit(*self._pair(*r.args)) for r in requests]
        results = score(self.model, pairs, self.batch_size)
        for r, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", r.args, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        # windows of max_length - 1 predicted tokens: on a mask model the mask takes one feed slot
        out = []
        for r in requests:
            (text,) = r.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok.encode(text), prefix_token=self.prefix_id, max_seq_len=self.max_length - 1,
                context_len=1)]
            total = sum(lp for lp, _ in score(self.model, windows, self.batch_size)) if windows else 0.0
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    # ---- generation ---------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = defaultdict(list)
        for i, r in enumerate(requests):
            groups[json.dumps(r.args[1], sort_keys=True, default=str)].append(i)
        for idxs in groups.values():
            kw = dict(requests[idxs[0]].args[1])
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_gen = int(kw.pop("max_gen_toks", kw.pop("max_new_tokens", kw.pop("max_tokens", 256))))
            temperature = float(kw.pop("temperature", 0.0) or 0.0) if kw.pop("do_sample", False) else 0.0
            params = self._params(max_gen, temperature, kw)
            room = self.max_length - params["gen_length"]
            if room < 1:
                raise ValueError(f"generating {params['gen_length']} tokens leaves no room for a prompt "
                                 f"in {self.max_length}")
            prompts = [self.tok.encode(requests[i].args[0])[-room:] or [self.prefix_id] for i in idxs]
            # batch_size rows at once: `ar` and `speculative` as a continuous batch, each request with a
            # seed of its own (seed + its index: lm-eval's repeats of one request, for pass@k or a
            # majority vote, are then different samples), others in groups
            seed = [self.seed + i for i in idxs] if registry.get(self.decoder).batch is not None else self.seed
            results = decode(self.model, prompts, self.decoder, eos_ids=self.eos_ids, seed=seed,
                             batch_size=self.batch_size, **params)
            for i, res in zip(idxs, results, strict=True):
                text = self.tok.decode(res.tokens[:max_gen])
                cuts = [text.find(s) for s in until if s and s in text]
                out[i] = text[: min(cuts)] if cuts else text
                self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out  # type: ignore[return-value]

    def _params(self, max_gen: int, temperature: float, extra: dict) -> dict:
        p = dict(self.params)
        for k, v in extra.items():  # sampling knobs a task sets (top_p, top_k) where the decoder has them
            if k in self.fields and v is not None:
                p[k] = v
        if temperature > 0:
            p["temperature"] = temperature
        # max_gen_toks rounded up to a length the decoder takes (whole slots, whole blocks)
        p["gen_length"] = self.fixed_gen_length or registry.round_gen_length(self.decoder, max_gen, **p)
        return p


if __name__ != "__main__":  # run as a script, main() imports this module by name, which registers it
    register_model("refusion")(ReFusionLM)


# ---- the .pth hook for the plain `lm_eval` command -----------------------------------------------

HOOK_FILE = "refusion_lm_eval.pth"
# a .pth line runs at interpreter start; guarded so that a removed refusion never breaks Python
HOOK_LINE = 'import sys; exec("try:\\n import refusion.evaluation.lm_eval_hook\\nexcept Exception:\\n pass")\n'


def hook_path() -> Path:
    import sysconfig

    return Path(sysconfig.get_paths()["purelib"]) / HOOK_FILE


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--install-hook"]:
        hook_path().write_text(HOOK_LINE)
        print(f"wrote {hook_path()}: `lm_eval --model refusion` now works in this environment")
        return
    if argv[:1] == ["--uninstall-hook"]:
        hook_path().unlink(missing_ok=True)
        print(f"removed {hook_path()}")
        return
    # registers --model refusion (run as a script, this file is __main__, not the module lm-eval uses)
    import refusion.evaluation.lm_eval as adapter
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *argv]
    try:
        cli_evaluate()
    except adapter.ModelArgsError as e:
        print(adapter._error_line(e), file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
