"""A slow, literal, batch-1 plan-and-infill (REFUSION.md section 4, with the named defects fixed).

Written to be read next to the spec's step list, not to be fast: one sequence, the row-based
`KVCache` (crop, and expand / select / merge_rows from reference_cache.py), plain full-vocabulary softmax, greedy drafts only.
The fast batched decoder in `refusion.decoding.refusion` is tested against it token for token and
forward for forward.

Besides tokens / positions / forwards it returns tokens_fed, finished, `commits` (every commit in
order, as (positions, tokens), the same shape as the decoder's on_commit events) and `trace` (which
branch each step took), so that tests can check which code paths a case reached.
"""

from __future__ import annotations

import torch

from tests.helpers.reference_cache import ReferenceKVCache


def _softmax_rows(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.float(), dim=-1)


@torch.no_grad()
def reference_refusion(model, prompt: list[int], gen_length: int, slot_size: int, serial_blocks: int,
                       slot_threshold: float, token_threshold: float, eos_ids: set[int],
                       recompute_kv: bool = False, left_to_right: bool = False, cache=None) -> dict:
    """cache: an empty cache with the row operations (default: a ReferenceKVCache for `model`)."""
    s = slot_size
    L = gen_length
    assert L % (s * serial_blocks) == 0, "gen_length must be a multiple of slot_size * serial_blocks"
    mask_id = model.config.mask_token_id
    assert mask_id is not None
    eos_ids = set(eos_ids)
    P = len(prompt)

    # ---- state --------------------------------------------------------------------------------
    cache = cache if cache is not None else ReferenceKVCache(model.config.num_layers)
    committed_len = 0  # cache entries that belong to committed tokens (prompt + response)
    prompt_fed = False
    response: dict[int, int] = {}  # position -> committed token
    commits: list[tuple[list[int], list[int]]] = []
    trace: list[tuple] = []
    forwards = 0
    tokens_fed = 0
    eos_pos = None  # smallest position of a committed EOS

    def forward(ids_rows: list[list[int]], pos_rows: list[list[int]]) -> torch.Tensor:
        """One model call on top of `cache`: causal in feed order. Returns float logits [rows, T, V]."""
        nonlocal forwards, tokens_fed
        forwards += 1
        ids = torch.tensor(ids_rows, dtype=torch.long)
        tokens_fed += ids.numel()
        pos = torch.tensor(pos_rows, dtype=torch.long)
        return model(ids, pos, cache=cache).float()

    def commit(positions: list[int], tokens: list[int]) -> None:
        nonlocal eos_pos
        assert len(positions) == len(tokens)
        for q, t in zip(positions, tokens, strict=True):
            assert q not in response, f"position {q} committed twice"
            response[q] = t
            if t in eos_ids and (eos_pos is None or q < eos_pos):
                eos_pos = q
        commits.append((list(positions), list(tokens)))

    # ---- blocks of slots ------------------------------------------------------------------------
    per_block = L // serial_blocks
    blocks = []
    for b in range(serial_blocks):
        start = P + b * per_block
        blocks.append([start + i * s for i in range(per_block // s)])

    for block in blocks:
        undecoded = list(block)  # slot start positions, ascending

        while undecoded:
            # ======== 1. plan ========
            plan_slots = [undecoded[0]] if left_to_right else list(undecoded)
            ids, pos = [], []
            if not prompt_fed:
                ids += list(prompt)
                pos += list(range(P))
            for st in plan_slots:
                ids += [mask_id] * s
                pos += list(range(st, st + s))
            logits = forward([ids], [pos])[0]
            if not prompt_fed:
                committed_len = P  # the prompt's KV is kept
                prompt_fed = True
            mask_logits = logits[len(ids) - len(plan_slots) * s:]  # at each mask's own index
            probs = _softmax_rows(mask_logits)
            drafts, scores = [], []
            for i, st in enumerate(plan_slots):
                row_tokens = []
                for j in range(s):
                    row_tokens.append(int(torch.argmax(probs[i * s + j]).item()))
                drafts.append(row_tokens)
                scores.append(float(probs[i * s, row_tokens[0]].item()))  # prob of the first token
            if left_to_right:
                chosen_idx = [0]
            else:
                chosen_idx = [i for i in range(len(plan_slots)) if scores[i] > slot_threshold]
                if not chosen_idx:
                    best = 0
                    for i in range(len(plan_slots)):
                        if scores[i] > scores[best]:
                            best = i
                    chosen_idx = [best]
            chosen = [plan_slots[i] for i in chosen_idx]  # plan_slots ascending -> chosen ascending
            chosen_drafts = [list(drafts[i]) for i in chosen_idx]
            trace.append(("plan", list(plan_slots), list(chosen)))
            cache.crop(committed_len)  # the masks' KV is discarded

            # ======== 2. global verification ========
            flat_tokens = [t for row in chosen_drafts for t in row]
            flat_pos = [st + j for st in chosen for j in range(s)]
            logits = forward([flat_tokens], [flat_pos])[0]
            probs = _softmax_rows(logits)
            accepted = []
            for i in range(len(flat_tokens)):
                if i % s == 0:
                    accepted.append(True)  # token 0 of a slot keeps its draft and is accepted
                else:
                    p = float(probs[i - 1, flat_tokens[i]].item())
                    accepted.append(p > token_threshold)
            n_prefix = 0
            while n_prefix < len(accepted) and accepted[n_prefix]:
                n_prefix += 1
            eos_at = None
            for i in range(n_prefix):
                if flat_tokens[i] in eos_ids:
                    eos_at = i
                    break

            if eos_at is not None:
                keep = eos_at + 1
                commit(flat_pos[:keep], flat_tokens[:keep])
                cache.crop(committed_len + keep)  # keep the verify KV of exactly the committed tokens
                committed_len += keep
                eos_slot = eos_at // s
                for st in chosen[: eos_slot + 1]:
                    undecoded.remove(st)
                trace.append(("verify_eos", flat_pos[eos_at]))
            elif n_prefix >= s:
                whole = n_prefix // s
                keep = whole * s
                commit(flat_pos[:keep], flat_tokens[:keep])
                cache.crop(committed_len + keep)
                committed_len += keep
                for st in chosen[:whole]:
                    undecoded.remove(st)
                trace.append(("verify_whole", whole, len(chosen)))
            else:
                # ======== 3. parallel autoregressive infill ========
                cache.crop(committed_len)
                n_acc = []  # accepted prefix length of each row
                for r in range(len(chosen)):
                    n = 0
                    while n < s and accepted[r * s + n]:
                        n += 1
                    n_acc.append(n)
                trace.append(("verify_partial", list(n_acc)))
                rows = list(chosen)
                row_tokens = [list(d) for d in chosen_drafts]
                eos_row = None  # (row index, offset of its first EOS)
                k = len(rows)
                cache.expand(k)
                a = 0
                rounds = 0
                for _ in range(s):
                    if all(n == s for n in n_acc):
                        break
                    rounds += 1
                    # -- draft: unaccepted tokens as masks, argmax at their own index, KV discarded
                    ids = []
                    pos = []
                    for r, st in enumerate(rows):
                        ids.append([row_tokens[r][j] if j < n_acc[r] else mask_id for j in range(a, s)])
                        pos.append([st + j for j in range(a, s)])
                    logits = forward(ids, pos)
                    for r in range(len(rows)):
                        for j in range(n_acc[r], s):
                            row_tokens[r][j] = int(torch.argmax(logits[r, j - a]).item())
                    cache.crop(committed_len + a)
                    # -- verify: completed tokens from offset a on, KV kept
                    ids = [[row_tokens[r][j] for j in range(a, s)] for r in range(len(rows))]
                    pos = [[st + j for j in range(a, s)] for st in rows]
                    logits = forward(ids, pos)
                    probs = _softmax_rows(logits)
                    for r in range(len(rows)):
                        old = n_acc[r]
                        flags = [j < old for j in range(s)]  # accepted before this round
                        new_flags = list(flags)
                        for j in range(a, s):
                            if j == a or flags[j - 1]:
                                new_flags[j] = True
                            else:
                                p = float(probs[r, j - 1 - a, row_tokens[r][j]].item())
                                if p > token_threshold:
                                    new_flags[j] = True
                        n = 0
                        while n < s and new_flags[n]:  # cumulative product
                            n += 1
                        n_acc[r] = n
                    # -- EOS among the accepted tokens (every row's whole accepted prefix, row order)
                    first_eos_row = None
                    for r in range(len(rows)):
                        if any(t in eos_ids for t in row_tokens[r][: n_acc[r]]):
                            first_eos_row = r
                            break
                    if first_eos_row is not None:
                        r = first_eos_row
                        if len(rows) > r + 1:
                            cache.select(list(range(r + 1)))
                        rows = rows[: r + 1]
                        row_tokens = row_tokens[: r + 1]
                        n_acc = n_acc[: r + 1]
                        n_acc[r] = s
                        j = next(j for j in range(s) if row_tokens[r][j] in eos_ids)
                        eos_row = (r, j)
                        trace.append(("infill_eos", r, rows[r], rows[r] + j))
                    m = min(n - a for n in n_acc)
                    if any(n < s for n in n_acc):
                        a += m - 1  # feed the last accepted token again so it can verify the next
                    else:
                        a += m
                    cache.crop(committed_len + a)
                assert all(n == s for n in n_acc), "infill did not finish in slot_size rounds"
                trace.append(("infill_done", rounds, len(rows)))

                # ======== 4. KV reuse (or recompute) ========
                lengths = []
                tokens_out, pos_out = [], []
                for r, st in enumerate(rows):
                    n = s
                    if eos_row is not None and r == eos_row[0]:
                        assert r == len(rows) - 1
                        n = eos_row[1] + 1
                    lengths.append(n)
                    tokens_out += row_tokens[r][:n]
                    pos_out += [st + j for j in range(n)]
                if recompute_kv:
                    cache.crop(committed_len)
                    if cache.rows > 1:
                        cache.select([0])
                    forward([tokens_out], [pos_out])
                else:
                    cache.merge_rows(committed_len, lengths)
                committed_len += sum(lengths)
                assert cache.length == committed_len
                commit(pos_out, tokens_out)
                for st in rows:
                    undecoded.remove(st)

            assert cache.length == committed_len and cache.rows == 1
            # after any commit: undecoded slots after the first EOS (by position) are dropped
            if eos_pos is not None:
                undecoded = [st for st in undecoded if st < eos_pos]

        if eos_pos is not None:
            break  # stop after the block in which an EOS was committed

    # ---- output ---------------------------------------------------------------------------------
    positions = sorted(response)
    if eos_pos is not None:
        positions = [q for q in positions if q <= eos_pos]
    assert positions == list(range(P, P + len(positions))), f"holes in the output: {positions}"
    return dict(tokens=[response[q] for q in positions], positions=positions, forwards=forwards,
                tokens_fed=tokens_fed, finished=eos_pos is not None, commits=commits, trace=trace)
