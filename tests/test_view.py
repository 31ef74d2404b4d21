"""The terminal view: undecoded positions as dots, the latest commit highlighted, redrawn in place."""

import io

from refusion.view import DIM, HIGHLIGHT, RESET, SlotView, _strip_ansi


class Pieces:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i) for i in ids)


def test_out_of_order_commits_render_with_gaps_then_fill():
    out = io.StringIO()
    v = SlotView(Pieces(), prompt_len=3, gen_length=8, out=out)
    v.on_commit(0, [7, 8], [4, 5])  # a later slot first
    assert _strip_ansi(v.render()) == "····ef"
    assert f"{HIGHLIGHT}e{RESET}" in v.render() and f"{DIM}·{RESET}" in v.render()
    v.on_commit(1, [3], [0])  # another row's commit is ignored
    v.on_commit(0, [3, 4, 5, 6], [0, 1, 2, 3])
    assert _strip_ansi(v.render()) == "abcdef"
    assert f"{HIGHLIGHT}e" not in v.render()  # only the latest commit is highlighted
    frames = out.getvalue()
    assert frames.count("\x1b[1F\x1b[J") == 1  # the second frame replaced the first (one line)
    v.close()
    assert HIGHLIGHT not in out.getvalue().rsplit("\x1b[J", 1)[1]
