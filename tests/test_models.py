"""Tests for dpcourse.one_device.models: shapes, deterministic init, masks, and that the
Transformer learns."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader

from dpcourse.one_device import data, models, training


def test_mlp_shape_and_layers():
    model = models.MLP()
    assert model(torch.randn(30, 5)).shape == (30, 2)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(5, 32), (32, 32), (32, 2)]
    assert models.MLP(3, 8, 4)(torch.randn(2, 3)).shape == (2, 4)


def test_models_are_deterministic_under_manual_seed():
    for make in (models.MLP, models.TinyTransformer, models.ConvNetBN):
        torch.manual_seed(0)
        a = make().state_dict()
        torch.manual_seed(0)
        b = make().state_dict()
        torch.manual_seed(1)
        c = make().state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert not all(torch.equal(a[k], c[k]) for k in a)


def _batch(n: int = 8, max_len: int = 5):
    return data.digits_batch(n, seed=0, max_len=max_len)


def test_transformer_output_shape():
    src, tgt_in, _ = _batch()
    model = models.TinyTransformer(max_len=8)
    assert model(src, tgt_in).shape == (8, tgt_in.shape[1], data.VOCAB_SIZE)


def test_transformer_is_causal():
    torch.manual_seed(0)
    model = models.TinyTransformer(max_len=8)
    src, tgt_in, _ = _batch()
    logits = model(src, tgt_in)
    changed = tgt_in.clone()
    changed[:, 3:] = data.NUM_SPECIAL + 5  # rewrite the future from position 3 on
    logits2 = model(src, changed)
    torch.testing.assert_close(logits[:, :3], logits2[:, :3])
    assert not torch.allclose(logits[:, 3:], logits2[:, 3:])


def test_transformer_ignores_padding():
    torch.manual_seed(0)
    model = models.TinyTransformer(max_len=12)
    src, tgt_in, _ = _batch()
    longer = nn.functional.pad(src, (0, 4), value=data.PAD)  # more PAD columns: same meaning
    torch.testing.assert_close(model(src, tgt_in), model(longer, tgt_in), atol=1e-5, rtol=1e-5)


def test_greedy_decode_shape_and_mode():
    torch.manual_seed(0)
    model = models.TinyTransformer(max_len=8)
    src, _, _ = _batch()
    model.train()
    out = model.greedy_decode(src)
    assert model.training  # mode restored
    assert out.dtype == torch.long and out.shape[0] == 8
    assert out.shape[1] <= src.shape[1] + 1
    assert (out[:, 0] == data.BOS).all()


def test_transformer_learns_digits_to_words():
    torch.manual_seed(0)
    train_set = data.DigitsToWords(1000, 1, 4, seed=0)
    test_set = data.DigitsToWords(200, 1, 4, seed=1, exclude=train_set.strings)
    model = models.TinyTransformer(d_model=32, dim_feedforward=64, num_layers=2, max_len=6)
    assert training.translation_accuracy(model, test_set) < 0.1
    loader = DataLoader(
        train_set, batch_size=32, shuffle=True, collate_fn=data.collate_seq2seq,
        generator=torch.Generator().manual_seed(0),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    training.train(model, loader, optimizer, models.sequence_cross_entropy, epochs=3,
                   progress=False)
    assert training.translation_accuracy(model, test_set) > 0.9
    assert training.translate(model, ["2024", "7"]) == ["two zero two four", "seven"]


def test_sequence_cross_entropy_ignores_pad():
    logits = torch.randn(2, 3, data.VOCAB_SIZE)
    target = torch.tensor([[4, 5, data.PAD], [6, data.PAD, data.PAD]])
    expected = nn.functional.cross_entropy(
        torch.stack([logits[0, 0], logits[0, 1], logits[1, 0]]), torch.tensor([4, 5, 6])
    )
    torch.testing.assert_close(models.sequence_cross_entropy(logits, target), expected)


def test_convnet_shapes_and_batchnorm():
    torch.manual_seed(0)
    small, rgb = models.ConvNetBN(), models.ConvNetBN(in_channels=3, num_classes=5)
    assert small(torch.randn(4, 1, 8, 8)).shape == (4, 10)
    assert rgb(torch.randn(4, 3, 16, 16)).shape == (4, 5)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in small.modules()) == 2
    # Training mode normalises with the batch's statistics and updates the running ones.
    x = torch.randn(16, 1, 8, 8) * 3 + 1
    bn = small.features[1]
    before = bn.running_mean.clone()
    small.train()
    small(x)
    assert not torch.equal(before, bn.running_mean)


def test_convnet_learns_random_images():
    torch.manual_seed(0)
    model = models.ConvNetBN()
    loader = DataLoader(data.random_images(512, seed=0), batch_size=64, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    history = training.train(model, loader, optimizer, nn.functional.cross_entropy, epochs=10,
                             progress=False)
    assert history.epoch_losses[-1] < 0.3 * history.epoch_losses[0]
    held_out_x, held_out_y = data.random_images(256, seed=1).tensors
    model.eval()
    accuracy = (model(held_out_x).argmax(1) == held_out_y).float().mean().item()
    assert accuracy > 0.8
