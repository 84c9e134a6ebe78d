"""Seeded synthetic data sets, generated on the spot, and the sharding helper.

The course has two running examples, both introduced in chapter 1:

* :func:`random_regression`: 100 samples of 5 features with 2 targets, the MLP's data;
* :class:`DigitsToWords`: "123" -> "one two three", the tiny Transformer's data.

Nothing is downloaded: every data set comes from a seeded ``torch.Generator``, so the same seed
gives the same tensors on every machine, in every process, whatever the global RNG state.
:func:`shard_indices` splits a data set between ranks (chapters 3, 4 and 7).

Chapter 1: training on one device (the data sets every chapter uses).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch.utils.data import Dataset, TensorDataset

__all__ = [
    "random_regression",
    "random_images",
    "PAD",
    "BOS",
    "EOS",
    "NUM_SPECIAL",
    "VOCAB_SIZE",
    "DIGITS",
    "SRC_VOCAB",
    "TGT_VOCAB",
    "encode_digits",
    "encode_words",
    "decode_digits",
    "decode_words",
    "digits_to_words",
    "DigitsToWords",
    "collate_seq2seq",
    "shard_indices",
]


# ----------------------------------------------------------------------- regression example
def random_regression(
    num_samples: int = 100, num_features: int = 5, num_outputs: int = 2, seed: int = 0
) -> TensorDataset:
    """The course's first running example: ``(x, y)`` pairs from a fixed random "teacher".

    ``x`` has shape ``(num_samples, num_features)`` drawn from N(0, 1); ``y`` has shape
    ``(num_samples, num_outputs)`` and is ``teacher(x) + noise``, where the teacher is a random
    one-hidden-layer tanh network fixed by ``seed`` and the noise has standard deviation 0.05.
    The teacher is nonlinear, so a linear model cannot fit it but the course's MLP can, and the
    noise is small, so the loss of a good fit falls far below the loss at initialisation.
    All tensors are float32 on the CPU. Used in chapter 1 and by every later chapter's MLP runs.
    """
    if num_samples < 1 or num_features < 1 or num_outputs < 1:
        raise ValueError("num_samples, num_features and num_outputs must all be at least 1")
    g = torch.Generator().manual_seed(seed)
    hidden = 16
    w1 = torch.randn(num_features, hidden, generator=g) / num_features**0.5
    b1 = 0.5 * torch.randn(hidden, generator=g)
    w2 = torch.randn(hidden, num_outputs, generator=g) / hidden**0.5
    x = torch.randn(num_samples, num_features, generator=g)
    y = torch.tanh(2.0 * (x @ w1 + b1)) @ w2
    y = y + 0.05 * torch.randn(num_samples, num_outputs, generator=g)
    return TensorDataset(x, y)


def random_images(
    num_samples: int = 256,
    channels: int = 1,
    size: int = 8,
    num_classes: int = 10,
    noise: float = 0.5,
    seed: int = 0,
    template_seed: int = 0,
) -> TensorDataset:
    """Labelled images for :class:`dpcourse.one_device.models.ConvNetBN`: ``x`` ``(N, C, size,
    size)``, ``y``
    ``(N,)``.

    Each class has a random template image fixed by ``template_seed``; a sample is its class's
    template plus Gaussian noise of standard deviation ``noise``, so the classes are learnable but
    not trivially so. ``seed`` draws the labels (uniform, int64) and the noise: sets with
    different ``seed`` and the same ``template_seed`` are a training and a held-out set of one
    task. Float32 on the CPU. Used by the BatchNorm examples of chapter 8.
    """
    if min(num_samples, channels, size, num_classes) < 1:
        raise ValueError("num_samples, channels, size and num_classes must all be at least 1")
    g = torch.Generator().manual_seed(template_seed)
    templates = torch.randn(num_classes, channels, size, size, generator=g)
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, num_classes, (num_samples,), generator=g)
    x = templates[y] + noise * torch.randn(num_samples, channels, size, size, generator=g)
    return TensorDataset(x, y)


# --------------------------------------------------------------------- digits-to-words example
# One id space for both sides keeps the model simple: ids 0-2 are the special tokens, and
# ids 3-12 are the digits "0".."9" on the source side and the words "zero".."nine" on the target
# side, so digit d and its word share the id NUM_SPECIAL + d.
PAD, BOS, EOS = 0, 1, 2
NUM_SPECIAL = 3
DIGITS = tuple("0123456789")
_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SRC_VOCAB = ("<pad>", "<bos>", "<eos>") + DIGITS
TGT_VOCAB = ("<pad>", "<bos>", "<eos>") + _WORDS
VOCAB_SIZE = len(SRC_VOCAB)


def encode_digits(digits: str) -> torch.Tensor:
    """``"123"`` -> ``tensor([4, 5, 6, EOS])``: a source sequence for the Transformer (int64)."""
    if not digits or not digits.isdigit() or not digits.isascii():
        raise ValueError(f"expected a non-empty string of digits 0-9, got {digits!r}")
    return torch.tensor([NUM_SPECIAL + int(c) for c in digits] + [EOS], dtype=torch.long)


def encode_words(words: str) -> torch.Tensor:
    """``"one two three"`` -> ``tensor([BOS, 4, 5, 6, EOS])``: a target sequence (int64)."""
    try:
        ids = [NUM_SPECIAL + _WORDS.index(w) for w in words.split()]
    except ValueError:
        raise ValueError(f"expected words among {_WORDS}, got {words!r}") from None
    if not ids:
        raise ValueError("expected at least one word")
    return torch.tensor([BOS] + ids + [EOS], dtype=torch.long)


def _decode(ids: Iterable[int] | torch.Tensor, vocab: Sequence[str]) -> list[str]:
    """Tokens up to the first EOS, skipping PAD and BOS."""
    out = []
    for i in torch.as_tensor(ids).flatten().tolist():
        if i == EOS:
            break
        if i >= NUM_SPECIAL:
            out.append(vocab[i])
    return out


def decode_digits(ids: Iterable[int] | torch.Tensor) -> str:
    """Source ids back to text: ``[4, 5, 6, EOS, PAD]`` -> ``"123"``."""
    return "".join(_decode(ids, SRC_VOCAB))


def decode_words(ids: Iterable[int] | torch.Tensor) -> str:
    """Target ids back to text: ``[BOS, 4, 5, 6, EOS, PAD]`` -> ``"one two three"``."""
    return " ".join(_decode(ids, TGT_VOCAB))


def digits_to_words(digits: str) -> str:
    """The task itself, written by hand: ``"123"`` -> ``"one two three"``."""
    return " ".join(_WORDS[int(c)] for c in digits)


class DigitsToWords(Dataset):
    """Random digit strings and their spelled-out words: the course's sequence-to-sequence task.

    Item ``i`` is ``(src, tgt)``: ``src`` has shape ``(max_len + 1,)`` (digits, EOS, then PAD) and
    ``tgt`` has shape ``(max_len + 2,)`` (BOS, words, EOS, then PAD), both int64 on the CPU. The
    whole set is generated at construction from ``seed``; lengths are uniform in
    ``[min_len, max_len]`` and strings may repeat. Strings in ``exclude`` are never drawn, which is
    how a held-out set is made disjoint from the training set. ``strings`` holds the digit
    strings. Used in chapter 1 (and as the Transformer example of later chapters).
    """

    def __init__(
        self,
        num_samples: int,
        min_len: int = 1,
        max_len: int = 8,
        seed: int = 0,
        exclude: Iterable[str] = (),
    ) -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
        excluded = set(exclude)
        available = sum(10**n for n in range(min_len, max_len + 1)) - len(excluded)
        if available < 1 and num_samples > 0:
            # Strings are drawn with replacement, but with none left to draw we would loop for ever.
            raise ValueError("every string of the requested lengths is excluded")
        g = torch.Generator().manual_seed(seed)
        self.min_len, self.max_len = min_len, max_len
        self.strings: list[str] = []
        while len(self.strings) < num_samples:
            n = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
            s = "".join(str(d) for d in torch.randint(0, 10, (n,), generator=g).tolist())
            if s not in excluded:
                self.strings.append(s)
        self.src = torch.full((num_samples, max_len + 1), PAD, dtype=torch.long)
        self.tgt = torch.full((num_samples, max_len + 2), PAD, dtype=torch.long)
        for i, s in enumerate(self.strings):
            self.src[i, : len(s) + 1] = encode_digits(s)
            self.tgt[i, : len(s) + 2] = encode_words(digits_to_words(s))

    def __len__(self) -> int:
        return len(self.strings)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.src[i], self.tgt[i]


def collate_seq2seq(
    samples: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch ``(src, tgt)`` pairs for teacher forcing: returns ``(src, tgt_in, tgt_out)``.

    ``tgt_in = tgt[:, :-1]`` (BOS w1 .. wn) is what the decoder reads and ``tgt_out = tgt[:, 1:]``
    (w1 .. wn EOS) is what it must predict, one position ahead. The result fits the course's batch
    convention "inputs..., target" (see :func:`dpcourse.one_device.training.train_step`). Pass it as
    ``DataLoader(..., collate_fn=collate_seq2seq)``. Sequences of different lengths are padded
    with PAD at the end to the longest of the batch (the find-the-bugs appendix needs that).
    """
    pad = torch.nn.utils.rnn.pad_sequence
    src = pad([s for s, _ in samples], batch_first=True, padding_value=PAD)
    tgt = pad([t for _, t in samples], batch_first=True, padding_value=PAD)
    return src, tgt[:, :-1], tgt[:, 1:]


def digits_batch(
    batch_size: int, seed: int = 0, min_len: int = 1, max_len: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fresh batch of the digits task, ``(src, tgt_in, tgt_out)`` as :func:`collate_seq2seq`
    returns it, drawn from ``seed``: the same seed gives the same batch. The benchmarks and
    chapters 1 and 9 feed the Transformer with it (``seed=1000 * step + rank`` gives every
    rank its own samples at every step)."""
    samples = DigitsToWords(batch_size, min_len, max_len, seed=seed)
    return collate_seq2seq([samples[i] for i in range(batch_size)])


# ---------------------------------------------------------------------------------- sharding
def shard_indices(num_samples: int, rank: int, world_size: int) -> list[int]:
    """The indices of rank ``rank``'s shard of a data set of ``num_samples`` samples.

    Shards are contiguous and as equal as possible: the first ``num_samples % world_size`` ranks
    get one sample more than the others, so ``shard_indices(10, r, 3)`` is ``[0..3]``, ``[4..6]``
    and ``[7..9]``. Together the shards cover every index exactly once (a shard may be empty
    when there are fewer samples than ranks). Used in chapters 3, 4 and 7.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if num_samples < 0:
        raise ValueError(f"num_samples must be non-negative, got {num_samples}")
    base, extra = divmod(num_samples, world_size)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    return list(range(start, stop))
