"""Tests for dpcourse.one_device.data: seeded data sets, the digits-to-words vocabulary,
sharding."""

from __future__ import annotations

import pytest
import torch

from dpcourse.one_device import data


# ----------------------------------------------------------------------- random_regression
def test_random_regression_shapes_and_dtype():
    ds = data.random_regression()
    x, y = ds.tensors
    assert len(ds) == 100
    assert x.shape == (100, 5) and y.shape == (100, 2)
    assert x.dtype == y.dtype == torch.float32


def test_random_regression_is_determined_by_seed():
    a = data.random_regression(seed=3).tensors
    b = data.random_regression(seed=3).tensors
    c = data.random_regression(seed=4).tensors
    torch.manual_seed(123)  # the global RNG must not matter
    d = data.random_regression(seed=3).tensors
    assert all(torch.equal(s, t) for s, t in zip(a, b, strict=True))
    assert all(torch.equal(s, t) for s, t in zip(a, d, strict=True))
    assert not torch.equal(a[1], c[1])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_regression_is_not_linear(seed):
    # The teacher is nonlinear: the best affine fit leaves far more error than the noise (0.05^2).
    x, y = data.random_regression(seed=seed).tensors
    features = torch.cat([x, torch.ones(len(x), 1)], dim=1)
    w = torch.linalg.lstsq(features, y).solution
    residual = ((features @ w - y) ** 2).mean().item()
    assert residual > 10 * 0.05**2


def test_random_regression_other_sizes_and_errors():
    x, y = data.random_regression(7, 3, 4).tensors
    assert x.shape == (7, 3) and y.shape == (7, 4)
    with pytest.raises(ValueError):
        data.random_regression(0)


def test_random_images():
    x, y = data.random_images(50, channels=3, size=16, num_classes=4, seed=1).tensors
    assert x.shape == (50, 3, 16, 16) and y.shape == (50,) and y.dtype == torch.long
    assert set(y.tolist()) <= {0, 1, 2, 3}
    assert torch.equal(x, data.random_images(50, 3, 16, 4, seed=1).tensors[0])
    # Another seed draws new samples of the same classes: the class means agree.
    x2, y2 = data.random_images(2000, 1, 8, 2, seed=2).tensors
    x3, y3 = data.random_images(2000, 1, 8, 2, seed=3).tensors
    assert not torch.equal(x2[:10], x3[:10])
    torch.testing.assert_close(x2[y2 == 0].mean(0), x3[y3 == 0].mean(0), atol=0.1, rtol=0)


# --------------------------------------------------------------------------- digits to words
def test_vocabulary_layout():
    assert data.VOCAB_SIZE == len(data.SRC_VOCAB) == len(data.TGT_VOCAB) == 13
    assert {data.PAD, data.BOS, data.EOS} == {0, 1, 2}
    assert data.SRC_VOCAB[data.NUM_SPECIAL + 7] == "7"
    assert data.TGT_VOCAB[data.NUM_SPECIAL + 7] == "seven"


def test_encode_and_decode():
    assert data.encode_digits("123").tolist() == [4, 5, 6, data.EOS]
    assert data.encode_words("one two three").tolist() == [data.BOS, 4, 5, 6, data.EOS]
    assert data.decode_words([data.BOS, 4, 5, 6, data.EOS, data.PAD]) == "one two three"
    assert data.decode_words(torch.tensor([data.BOS, 4, data.EOS, 5])) == "one"  # stops at EOS
    assert data.decode_digits(data.encode_digits("90210")) == "90210"
    assert data.digits_to_words("907") == "nine zero seven"
    for bad in ["", "12a", "-1", "١٢"]:  # the last one is Arabic-Indic digits
        with pytest.raises(ValueError):
            data.encode_digits(bad)
    with pytest.raises(ValueError):
        data.encode_words("one eleven")


def test_digits_to_words_dataset():
    ds = data.DigitsToWords(200, min_len=2, max_len=5, seed=0)
    src, tgt = ds[0]
    assert len(ds) == 200
    assert src.shape == (6,) and tgt.shape == (7,)
    assert src.dtype == tgt.dtype == torch.long
    lengths = {len(s) for s in ds.strings}
    assert lengths == {2, 3, 4, 5}
    for i, s in enumerate(ds.strings):
        src, tgt = ds[i]
        assert data.decode_digits(src) == s
        assert data.decode_words(tgt) == data.digits_to_words(s)
        assert tgt[0] == data.BOS and src[len(s)] == data.EOS and tgt[len(s) + 1] == data.EOS
        assert (src[len(s) + 1 :] == data.PAD).all() and (tgt[len(s) + 2 :] == data.PAD).all()


def test_digits_to_words_seed_and_exclude():
    a = data.DigitsToWords(100, 1, 3, seed=5)
    b = data.DigitsToWords(100, 1, 3, seed=5)
    c = data.DigitsToWords(100, 1, 3, seed=6)
    assert a.strings == b.strings and torch.equal(a.src, b.src)
    assert a.strings != c.strings
    held_out = data.DigitsToWords(100, 1, 3, seed=6, exclude=a.strings)
    assert not set(held_out.strings) & set(a.strings)
    assert len(data.DigitsToWords(30, 1, 1, seed=0)) == 30  # drawn with replacement
    with pytest.raises(ValueError):
        data.DigitsToWords(3, 1, 1, exclude=data.DIGITS)  # nothing left to draw
    with pytest.raises(ValueError):
        data.DigitsToWords(5, 3, 2)


def test_collate_seq2seq_shifts_the_target():
    ds = data.DigitsToWords(4, 1, 3, seed=0)
    src, tgt_in, tgt_out = data.collate_seq2seq([ds[i] for i in range(4)])
    assert torch.equal(src, ds.src[:4])
    assert torch.equal(tgt_in, ds.tgt[:4, :-1]) and torch.equal(tgt_out, ds.tgt[:4, 1:])
    assert (tgt_in[:, 0] == data.BOS).all()


# ---------------------------------------------------------------------------------- sharding
def test_shard_indices_example():
    assert [data.shard_indices(10, r, 3) for r in range(3)] == [
        [0, 1, 2, 3],
        [4, 5, 6],
        [7, 8, 9],
    ]


@pytest.mark.parametrize("num_samples", [0, 1, 2, 5, 7, 10, 31, 100, 1001])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 8, 16])
def test_shard_indices_cover_every_index_once(num_samples, world_size):
    shards = [data.shard_indices(num_samples, r, world_size) for r in range(world_size)]
    assert [i for shard in shards for i in shard] == list(range(num_samples))
    sizes = [len(s) for s in shards]
    extra = num_samples % world_size
    assert sizes == [num_samples // world_size + (r < extra) for r in range(world_size)]
    assert all(s == list(range(s[0], s[0] + len(s))) for s in shards if s)  # contiguous


@pytest.mark.parametrize(
    "args", [(10, 0, 0), (10, -1, 2), (10, 2, 2), (10, 5, 3), (-1, 0, 1)]
)
def test_shard_indices_rejects_bad_input(args):
    with pytest.raises(ValueError):
        data.shard_indices(*args)


def test_digits_batch_is_a_collated_draw_of_its_seed():
    src, tgt_in, tgt_out = data.digits_batch(6, seed=3, max_len=4)
    ds = data.DigitsToWords(6, 1, 4, seed=3)
    want = data.collate_seq2seq([ds[i] for i in range(6)])
    for got, expected in zip((src, tgt_in, tgt_out), want, strict=True):
        assert torch.equal(got, expected)
    assert src.shape == (6, 5) and tgt_in.shape == tgt_out.shape == (6, 5)
    assert not torch.equal(data.digits_batch(6, seed=4, max_len=4)[0], src)
