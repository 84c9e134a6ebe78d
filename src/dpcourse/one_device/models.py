"""Small models used across the course, small enough to train on a laptop CPU in seconds.

* :class:`MLP`: 5 features -> 2 outputs, three Linear layers; the running example of every chapter;
* :class:`TinyTransformer`: an encoder-decoder ``nn.Transformer`` for :class:`DigitsToWords`;
* :class:`ConvNetBN`: a tiny CNN with BatchNorm, whose running statistics make chapter 8's
  SyncBatchNorm discussion concrete;
* :class:`Branchy` and :class:`Tricky`: what real models do to DDP (chapter 7 and its tests): a
  layer used on some steps only; frozen parameters, a weight shared by two layers, a buffer.

None of them seeds anything: their initial weights come from the global RNG, so
``torch.manual_seed(s)`` before construction makes them reproducible (every rank of a
data-parallel job calls it with the same ``s`` to start from the same model).

Chapter 1: training on one device (the models every chapter uses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpcourse.one_device.data import BOS, EOS, PAD, VOCAB_SIZE

__all__ = ["MLP", "TinyTransformer", "sequence_cross_entropy", "ConvNetBN", "Branchy", "Tricky"]


class MLP(nn.Module):
    """``Linear -> ReLU -> Linear -> ReLU -> Linear``: ``(batch, in_features)`` to
    ``(batch, out_features)``. The defaults fit :func:`dpcourse.one_device.data.random_regression`.
    Used from chapter 1 on."""

    def __init__(self, in_features: int = 5, hidden: int = 32, out_features: int = 2) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, out_features)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.fc1(x))
        x = self.act(self.fc2(x))
        return self.fc3(x)


class TinyTransformer(nn.Module):
    """A small encoder-decoder Transformer (``nn.Transformer``, batch first) for seq2seq tasks.

    Token embeddings plus learned position embeddings feed ``nn.Transformer``; a Linear layer
    maps the decoder's output to logits over the vocabulary. ``forward(src, tgt_in)`` takes int64
    ids of shapes ``(B, S)`` and ``(B, T)`` (with ``S, T <= max_len``) and returns logits
    ``(B, T, vocab_size)``; position ``t`` may only look at ``tgt_in[:, :t+1]`` (causal mask) and
    PAD tokens are masked out of every attention. Dropout is off by default so that training is
    deterministic. Used in chapter 1 with :class:`dpcourse.one_device.data.DigitsToWords`.
    """

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        d_model: int = 64,
        nhead: int = 4,
        num_layers: int = 2,
        dim_feedforward: int = 128,
        max_len: int = 32,
        dropout: float = 0.0,
        pad_id: int = PAD,
    ) -> None:
        super().__init__()
        self.pad_id, self.max_len = pad_id, max_len
        self.src_embed = nn.Embedding(vocab_size, d_model)
        self.tgt_embed = nn.Embedding(vocab_size, d_model)
        self.pos_embed = nn.Embedding(max_len, d_model)
        self.transformer = nn.Transformer(
            d_model=d_model,
            nhead=nhead,
            num_encoder_layers=num_layers,
            num_decoder_layers=num_layers,
            dim_feedforward=dim_feedforward,
            dropout=dropout,
            batch_first=True,
        )
        # In eval mode the encoder would pack padded batches into (prototype) nested tensors,
        # with a warning; the saving is nothing at this size.
        self.transformer.encoder.enable_nested_tensor = False
        self.transformer.encoder.use_nested_tensor = False
        self.head = nn.Linear(d_model, vocab_size)

    def _embed(self, ids: torch.Tensor, table: nn.Embedding) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return table(ids) + self.pos_embed(positions)

    def encode(self, src: torch.Tensor) -> torch.Tensor:
        """Encoder output ``(B, S, d_model)`` for source ids ``(B, S)``."""
        return self.transformer.encoder(
            self._embed(src, self.src_embed), src_key_padding_mask=src == self.pad_id
        )

    def decode(self, memory: torch.Tensor, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` for decoder input ids ``(B, T)`` given the encoder output."""
        t = tgt_in.shape[1]
        # Boolean masks everywhere: True means "may not attend". Mixing bool and float masks
        # makes PyTorch warn and convert.
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=tgt_in.device), diagonal=1)
        out = self.transformer.decoder(
            self._embed(tgt_in, self.tgt_embed),
            memory,
            tgt_mask=causal,
            tgt_is_causal=True,  # saves PyTorch checking the mask, which fails on "meta"
            tgt_key_padding_mask=tgt_in == self.pad_id,
            memory_key_padding_mask=src == self.pad_id,
        )
        return self.head(out)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(src), src, tgt_in)

    @torch.no_grad()
    def greedy_decode(self, src: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
        """Translate ``src`` ``(B, S)`` one token at a time, always taking the likeliest token.

        Returns ids ``(B, L)`` that start with BOS; after a sequence's EOS come PAD tokens.
        ``max_len`` bounds the number of tokens after BOS; the default ``S`` allows one word per
        source token, which for digits-then-EOS sources is every word plus the EOS. Runs in eval
        mode and restores the previous mode afterwards.
        """
        was_training = self.training
        self.eval()
        try:
            max_len = src.shape[1] if max_len is None else max_len
            max_len = min(max_len, self.max_len - 1)
            memory = self.encode(src)
            out = torch.full((src.shape[0], 1), BOS, dtype=torch.long, device=src.device)
            done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
            for _ in range(max_len):
                next_id = self.decode(memory, src, out)[:, -1].argmax(-1)
                next_id = next_id.masked_fill(done, self.pad_id)
                out = torch.cat([out, next_id[:, None]], dim=1)
                done |= next_id == EOS
                if bool(done.all()):
                    break
            return out
        finally:
            self.train(was_training)


def sequence_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, pad_id: int = PAD
) -> torch.Tensor:
    """Mean cross-entropy over the non-PAD tokens: logits ``(B, T, V)``, target ids ``(B, T)``.

    The loss function for :class:`TinyTransformer` with batches from
    :func:`dpcourse.one_device.data.collate_seq2seq` (chapter 1)."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=pad_id
    )


class ConvNetBN(nn.Module):
    """A tiny CNN with BatchNorm: images ``(B, C, H, W)`` to class logits ``(B, num_classes)``.

    Two ``conv 3x3 -> BatchNorm -> ReLU`` blocks (8 then 16 channels, a 2x2 max-pool between),
    global average pooling and a Linear layer; any ``H, W >= 2`` works (e.g. 1x8x8 or 3x16x16).
    BatchNorm normalises with the statistics of the batch a rank sees, which is why chapter 8
    needs SyncBatchNorm; :func:`dpcourse.one_device.data.random_images` makes data for it.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 8) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


class Branchy(nn.Module):
    """5 features -> 2 outputs, with a layer ``extra`` used only when ``forward(x, use_extra)``
    is asked to: on some steps, on some ranks, or on none. ``extra`` is registered last, so it
    lands in DDP's first bucket (chapter 7: every rank must still send that bucket)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.extra = nn.Linear(5, 8), nn.Linear(8, 2), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.b(h + torch.tanh(self.extra(h)) if use_extra else h)


class Tricky(nn.Module):
    """5 features -> 2 outputs with what real models have: a frozen layer, a frozen bias, a
    weight shared by two layers (one Parameter registered twice) and a buffer ``scale`` (set
    differently on every rank, until DDP broadcasts rank 0's). Chapter 7's tests use it."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.mid = nn.Linear(8, 8)
        self.mid.bias.requires_grad_(False)
        self.tied = nn.Linear(8, 8, bias=False)
        self.tied.weight = self.mid.weight  # the same Parameter, registered twice
        self.out = nn.Linear(8, 2)
        self.register_buffer("scale", torch.full((5,), scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x * self.scale))
        h = torch.tanh(self.frozen(h))
        h = torch.tanh(self.tied(torch.tanh(self.mid(h))))
        return self.out(h)
