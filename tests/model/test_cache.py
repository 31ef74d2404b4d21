"""Each cache operation on its own, on hand-made tensors, and some through the model."""

import pytest
import torch

from refusion.model.cache import KVCache, RaggedKVCache, SlotKVCache
from refusion.model.config import ModelConfig
from refusion.model.transformer import Transformer
from tests.helpers.reference_cache import ReferenceKVCache


def kv(rows, t, start=0.0, h=2, d=3):
    x = torch.arange(rows * h * t * d, dtype=torch.float32).view(rows, h, t, d) + start
    return x, -x


def fill(cache, rows, t, start=0.0):
    out = []
    for i in range(cache.num_layers):
        k, v = kv(rows, t, start + 1000 * i)
        out.append(cache.update(i, k, v))
    return out


def test_append_returns_everything_and_advances_once_per_forward():
    c = KVCache(2)
    fill(c, 1, 4)
    assert len(c) == 4
    (k0, v0), (k1, v1) = fill(c, 1, 70, start=0.5)  # grows past the initial capacity of 64
    assert len(c) == 74 and k0.shape == (1, 2, 74, 3)
    torch.testing.assert_close(k0[:, :, :4], kv(1, 4)[0])
    torch.testing.assert_close(k1[:, :, 4:], kv(1, 70, 1000.5)[0])
    torch.testing.assert_close(v1[:, :, 4:], kv(1, 70, 1000.5)[1])


def test_crop_then_append_overwrites_the_tail():
    c = KVCache(1)
    fill(c, 1, 5)
    c.crop(2)
    assert len(c) == 2
    (k, _), = fill(c, 1, 1, start=-7.0)
    torch.testing.assert_close(k[:, :, :2], kv(1, 5)[0][:, :, :2])
    torch.testing.assert_close(k[:, :, 2:], kv(1, 1, -7.0)[0])
    with pytest.raises(ValueError, match="crop"):
        c.crop(4)


def test_expand_shares_storage_until_written():
    c = ReferenceKVCache(1)
    fill(c, 1, 3)
    ptr = c.k[0].data_ptr()
    c.expand(4)
    assert c.rows == 4 and c.k[0].data_ptr() == ptr and c.k[0].stride(0) == 0  # no copy
    k_new = torch.stack([torch.full((2, 1, 3), float(r)) for r in range(4)])
    k, _ = c.update(0, k_new, k_new)
    assert k.shape == (4, 2, 4, 3) and k.stride(0) != 0
    for r in range(4):
        torch.testing.assert_close(k[r, :, :3], kv(1, 3)[0][0])  # shared prefix in every row
        assert (k[r, :, 3] == r).all()


def test_select_rows_keeps_order():
    c = ReferenceKVCache(1)
    fill(c, 3, 2)
    c.select([2, 0])
    k, _ = c.layer(0)
    full = kv(3, 2)[0]
    torch.testing.assert_close(k, full[[2, 0]])


def test_merge_rows_appends_each_rows_own_entries_in_row_order():
    c = ReferenceKVCache(1)
    fill(c, 1, 2)  # shared prefix of 2
    c.expand(3)
    own = torch.stack([torch.full((2, 3, 3), 10.0 * (r + 1)) for r in range(3)])
    c.update(0, own, own)
    c.merge_rows(prefix=2, lengths=[3, 1, 2])
    k, v = c.layer(0)
    assert c.rows == 1 and len(c) == 8
    torch.testing.assert_close(k[0, :, :2], kv(1, 2)[0][0])
    assert k[0, :, 2:5].eq(10).all() and k[0, :, 5:6].eq(20).all() and k[0, :, 6:8].eq(30).all()
    with pytest.raises(ValueError):
        c.merge_rows(prefix=2, lengths=[1, 2])  # two lengths for one row


def test_merged_infill_cache_equals_packed_forward():
    """Rows decoded in parallel on a shared prefix, merged, then a query on top: the same logits as
    one packed pass where each slot sees only the prefix and itself (exact KV reuse)."""
    m = Transformer(ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2,
                                num_heads=4, num_kv_heads=2)).init_weights(seed=3).eval()
    prefix, pos0 = torch.tensor([[1, 2, 3, 4]]), torch.arange(4)[None]
    slots = torch.tensor([[7, 8], [9, 10]])
    spos = torch.tensor([[8, 9], [4, 5]])
    q, qpos = torch.tensor([[11]]), torch.tensor([[6]])
    with torch.no_grad():
        c = ReferenceKVCache(m.config.num_layers)
        m(prefix, pos0, cache=c)
        c.expand(2)
        m(slots, spos, cache=c)
        c.merge_rows(4, [2, 2])
        got = m(q, qpos, cache=c)
        mask = torch.ones(9, 9, dtype=torch.bool).tril()
        mask[6:8, 4:6] = False
        ids = torch.cat([prefix, slots.view(1, -1), q], 1)
        pos = torch.cat([pos0, spos.view(1, -1), qpos], 1)
        ref = m(ids, pos, attn_mask=mask)[:, -1:]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_ragged_cache_grows_and_moves_rows_keeping_entries():
    c = RaggedKVCache(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu", rows=2, capacity=3)
    k = torch.randn(2, 2, 3, 4)
    v = torch.randn(2, 2, 3, 4)
    write = c.at(torch.tensor([[0, 1, 2], [0, 1, 2]]), keys=3)
    for i in range(2):
        kk, vv = write.update(i, k, v)
        assert torch.equal(kk, k) and torch.equal(vv, v)
    c.reserve(5, 10)
    assert c.rows >= 5 and c.capacity >= 10
    ks, vs = c.row(1, 3)
    assert torch.equal(ks[0], k[1]) and torch.equal(vs[1], v[1])
    c.move_row(1, 3, 2)
    ks, _ = c.row(3, 2)
    assert torch.equal(ks[1], k[1, :, :2])
    # a forward over rows 3..4 writing at different columns per row reads back its own rows only
    new = torch.randn(2, 2, 1, 4)
    kk, _ = c.at(torch.tensor([[2], [0]]), keys=3, row0=3).update(0, new, new)
    assert torch.equal(kk[0, :, 2], new[0, :, 0]) and torch.equal(kk[0, :, :2], k[1, :, :2])
    assert torch.equal(kk[1, :, 0], new[1, :, 0])


def test_a_ragged_write_told_its_first_column_stores_what_the_scatter_stores():
    """`first` (a one-row step's columns are one run): a block copy, the same entries as the scatter."""
    k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    caches = []
    for first in (None, 5):
        c = RaggedKVCache(num_layers=1, kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu", rows=3, capacity=9)
        kk, vv = c.at(torch.tensor([[5, 6, 7]]), keys=8, row0=1, first=first).update(0, k, v)
        assert kk.shape == (1, 2, 8, 4) and torch.equal(kk[0, :, 5:8], k[0]) and torch.equal(vv[0, :, 5:8], v[0])
        caches.append(c)
    assert torch.equal(caches[0].k[0], caches[1].k[0]) and torch.equal(caches[0].v[0], caches[1].v[0])
    assert not caches[1].k[0][[0, 2]].any()  # (the other rows untouched)


def test_a_ragged_write_at_its_kept_indices_stores_what_the_scatter_stores():
    """`index` (write_index: a decoder stepping rows of one token each keeps it, one column on per
    step): every element where the scatter puts it, whole reads and sliced ones."""
    k, v = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)
    for row0, rows in ((0, 3), (1, 5)):
        caches = []
        for kept in (False, True):
            c = RaggedKVCache(num_layers=1, kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu", rows=rows,
                              capacity=9)
            cols = torch.tensor([[4], [1], [7]])
            index = c.write_index(cols - 1, row0) + c.head_dim if kept else None  # (a step later)
            kk, vv = c.at(cols, keys=8, row0=row0, index=index).update(0, k, v)
            assert kk.shape == (3, 2, 8, 4) and torch.equal(kk[torch.arange(3), :, cols[:, 0]], k[:, :, 0])
            caches.append(c)
        assert torch.equal(caches[0].k[0], caches[1].k[0]) and torch.equal(caches[0].v[0], caches[1].v[0])


def test_ragged_cache_growth_stops_at_its_limits_but_never_below_what_is_asked():
    c = RaggedKVCache(num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu", rows=3,
                      capacity=300, max_capacity=450)
    assert (c.rows, c.capacity) == (3, 450)  # rounded up to 512 without the limit
    entries = torch.randn(3, 1, 5, 2)
    c.at(torch.arange(5).expand(3, 5), keys=5).update(0, entries, entries)
    c.reserve(4, 460, max_rows=5, max_capacity=470)
    assert (c.rows, c.capacity) == (5, 470)  # geometric growth (6 rows, 1024 columns) cut at the limits
    assert torch.equal(c.row(2, 5)[0][0], entries[2])
    c.reserve(7, 900, max_rows=5, max_capacity=470)
    assert (c.rows, c.capacity) == (7, 900)  # what is asked is always given
    c.reserve(8, 901)
    assert (c.rows, c.capacity) == (14, 2048)  # no limits: doubled, capacity in whole steps


def test_slot_cache_writes_and_reads_the_rows_it_is_told():
    c = SlotKVCache(num_layers=1, rows=3, capacity=4, kv_heads=2, head_dim=3, dtype=torch.float32, device="cpu")
    k, v = kv(3, 2)
    c.at(torch.tensor([[0, 1]] * 3), keys=2).update(0, k, v)  # every row, in order
    new = torch.full((2, 2, 1, 3), 7.0)
    kk, vv = c.at(torch.tensor([[3], [2]]), keys=4, rows=torch.tensor([2, 0])).update(0, new, -new)
    assert kk.shape == (2, 2, 4, 3)  # batch row 0 is cache row 2, batch row 1 cache row 0
    assert torch.equal(kk[0, :, :2], k[2]) and torch.equal(kk[0, :, 3], new[0, :, 0]) and kk[0, :, 2].eq(0).all()
    assert torch.equal(kk[1, :, :2], k[0]) and torch.equal(kk[1, :, 2], new[1, :, 0]) and torch.equal(vv[1, :, 2], -new[1, :, 0])
    assert c.k[0][1, :, 2:].eq(0).all()  # row 1 untouched


def test_default_masks_are_causal_in_feed_and_in_column_order():
    c = KVCache(1)
    assert c.default_mask(3, "cpu") is None  # nothing cached: SDPA's is_causal
    fill(c, 1, 2)
    assert c.default_mask(1, "cpu") is None  # one token sees everything
    assert torch.equal(c.default_mask(2, "cpu"), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool))
    slots = SlotKVCache(num_layers=1, rows=1, capacity=4, kv_heads=2, head_dim=3, dtype=torch.float32, device="cpu")
    mask = slots.at(torch.tensor([[3, 1]]), keys=4).default_mask(2, "cpu")
    assert torch.equal(mask[0, 0], torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool))


def test_a_placed_forward_equals_an_appending_one():
    """The model through SlotKVCache.at, columns in feed order, gives the KVCache run's logits and keys."""
    m = Transformer(ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2,
                                num_heads=4, num_kv_heads=2)).init_weights(seed=3).eval()
    ids, pos = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]), torch.tensor([[0, 2, 1, 3, 4]] * 2)
    kvc = m.new_cache()
    slots = SlotKVCache(2, 2, 8, 2, m.config.head_dim, torch.float32, "cpu")
    with torch.no_grad():
        want = [m(ids[:, :3], pos[:, :3], cache=kvc), m(ids[:, 3:], pos[:, 3:], cache=kvc)]
        got = [m(ids[:, :3], pos[:, :3], cache=slots.at(torch.arange(3).expand(2, 3), keys=3)),
               m(ids[:, 3:], pos[:, 3:], cache=slots.at(torch.arange(3, 5).expand(2, 2), keys=5))]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    torch.testing.assert_close(slots.k[1][:, :, :5], kvc.k[1][:, :, :5], atol=1e-6, rtol=0)
