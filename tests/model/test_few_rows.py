"""The few-row kernel (model/few_rows.py): F.linear's values, each row's bits the same alone or
beside others and on any thread count, its build cached and its absence handled, and a streamed
model's products taking it for the row counts the probe gave it."""

from __future__ import annotations

import os
import stat

import pytest
import torch
import torch.nn.functional as F

from refusion.model import few_rows, packed
from refusion.model.transformer import linear


def test_the_kernel_is_built_on_this_machine():
    """CI installs a C++ compiler, so the kernel's tests below run on it (and a machine without one is
    tested by test_without_a_compiler_or_when_disabled_the_library_paths_stay)."""
    assert few_rows.compiler() is not None and few_rows.available()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(40, 24), (37, 77), (1536, 576), (3, 16), (5, 1)])
def test_the_kernel_is_f_linear_and_each_row_is_the_same_bits_whatever_rows_or_threads(shape, bias):
    """Values within float32 rounding of F.linear for 0 to 17 rows (with AVX-512, tiles of 4 weight rows
    by 4 input rows up to 4 rows and of 2 by 8 from 5 on, and every remainder of either; K off the vector
    width), [B, T, in] and strided inputs; row r of any product is the same bits as row r alone, on 1, 2
    or 3 threads."""
    out, K = shape
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out, K, generator=g)
    b = torch.randn(out, generator=g) if bias else None
    x = torch.randn(17, K, generator=g)
    alone = torch.stack([few_rows.linear(x[r:r + 1], w, b)[0] for r in range(17)])
    torch.testing.assert_close(alone, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    n = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for R in (0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 14, 15, 16, 17):
                got = few_rows.linear(x[:R], w, b)
                assert got.shape == (R, out)
                assert torch.equal(got, alone[:R]), (threads, R)
            assert torch.equal(few_rows.linear(x[:6].view(2, 3, K), w, b), alone[:6].view(2, 3, out))
            assert torch.equal(few_rows.linear(x.t().contiguous().t()[:5], w, b), alone[:5])
    finally:
        torch.set_num_threads(n)


def test_the_kernel_refuses_what_it_does_not_compute():
    w = torch.randn(8, 16)
    with pytest.raises(TypeError, match="float32 CPU"):
        few_rows.linear(torch.randn(2, 16, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="x has 15 features, the weight 16"):
        few_rows.linear(torch.randn(2, 15), w)


def test_the_build_is_kept_and_reused_and_a_failed_one_says_why(tmp_path, monkeypatch):
    """build(): one file per source, compiler and CPU, made once; a compiler that fails raises with
    its own message and leaves no file behind."""
    cxx = few_rows.compiler()
    first = few_rows.build(cxx, tmp_path)
    made = first.stat().st_mtime_ns
    assert few_rows.build(cxx, tmp_path) == first and first.stat().st_mtime_ns == made
    assert [p.name for p in tmp_path.iterdir()] == [first.name]
    bad = tmp_path / "bin" / "c++"
    bad.parent.mkdir()
    bad.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo broken 1.0; exit 0; fi\n"
                   "echo 'few_rows.cpp:1: error: no vectors here' >&2; exit 1\n")
    bad.chmod(bad.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "other"
    with pytest.raises(RuntimeError, match="failed on few_rows.cpp: few_rows.cpp:1: error: no vectors here"):
        few_rows.build(str(bad), out)
    assert list(out.iterdir()) == []


def test_without_a_compiler_or_when_disabled_the_library_paths_stay(monkeypatch, tmp_path):
    """No compiler: a warning that says what to do, and a streamed model's products take the library
    paths (kernel_rows empty); REFUSION_NO_KERNEL=1 likewise, silently."""
    monkeypatch.setattr(few_rows, "compiler", lambda: None)
    few_rows.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no C.. compiler .set CXX, or install g..."):
            assert not few_rows.available()
        assert packed.kernel_rows(torch.float32) == range(0)
        few_rows.library.cache_clear()
        monkeypatch.setenv(few_rows.DISABLE, "1")
        monkeypatch.setattr(few_rows, "compiler", lambda: pytest.fail("not asked"))
        assert not few_rows.available()
    finally:
        monkeypatch.undo()
        few_rows.library.cache_clear()
    assert few_rows.available()


def test_a_streamed_product_takes_the_kernel_for_the_counts_the_probe_gave_it(monkeypatch):
    """packed_linear: the row counts in kernel_rows go to the kernel (its bits), others to the packed
    weight; bfloat16 and without_kernel() never go to it."""
    calls = []
    real = few_rows.linear
    monkeypatch.setattr(few_rows, "linear", lambda x, w, b=None: calls.append(x.numel() // x.shape[-1]) or real(x, w, b))
    monkeypatch.setattr(packed, "_probe", lambda threads, dtype: packed.Choices((1, 2, 3), False, range(2, 9)))
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(64, 40)
    x = torch.randn(12, 64, generator=g)
    with torch.no_grad():
        for R in (1, 2, 5, 8, 9, 12):
            got = linear(lin, x[:R], streamed=True)
            torch.testing.assert_close(got, lin(x[:R]), atol=1e-5, rtol=1e-5)
            if 2 <= R <= 8:
                assert torch.equal(got, real(x[:R], lin.weight, lin.bias))
        assert calls == [2, 5, 8]
        with packed.without_kernel():
            linear(lin, x[:4], streamed=True)
        lin16 = torch.nn.Linear(64, 40).to(torch.bfloat16)
        linear(lin16, x[:4].bfloat16(), streamed=True)
    assert calls == [2, 5, 8]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_streamed_model_on_the_kernel_decodes_as_ar(monkeypatch, threads):
    """Every product of 1 to 16 rows on the kernel (the rest on the packed weights): logits within
    float32 rounding of F.linear's, and greedy speculative decoding gives AR's output."""
    from refusion.decoding import ARParams, SpeculativeParams, generate_speculative
    from tests.helpers.reference_ar import generate_ar
    from tests.model.test_fast_forward import logits, model

    monkeypatch.setattr(packed, "_probe", lambda t, dtype: packed.Choices((1, 2, 3), False, range(1, 17)))
    calls = []
    real = few_rows.linear
    monkeypatch.setattr(few_rows, "linear", lambda x, w, b=None: calls.append(1) or real(x, w, b))
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        m = model()
        g = torch.Generator().manual_seed(0)
        for T in (1, 3, 16, 17):
            ids = torch.randint(0, 49, (1, T), generator=g)
            m.set_streamed(False)
            want = logits(m, ids.tolist())
            m.set_streamed(True)
            calls.clear()
            torch.testing.assert_close(logits(m, ids.tolist()), want, atol=1e-5, rtol=1e-5)
            assert len(calls) == (4 * 2 + 1 if T <= 16 else 0), T
        prompts = [[3, 4, 5], [6, 7, 8, 9, 10]]
        ar = generate_ar(m, prompts, ARParams(gen_length=20), eos_ids=[1])
        spec = generate_speculative(m, prompts, SpeculativeParams(gen_length=20, draft_length=6, widths="fixed"),
                                    eos_ids=[1])
        assert [r.tokens for r in spec] == [r.tokens for r in ar] and calls
    finally:
        torch.set_num_threads(n)
