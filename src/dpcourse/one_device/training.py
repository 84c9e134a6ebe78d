"""The single-device training loop of chapter 1, written to be read next to the chapter.

A batch is a tuple ``(inputs..., target)``: the model gets the inputs, the loss function compares
the model's output with the target. ``(x, y)`` from
:func:`dpcourse.one_device.data.random_regression` and
``(src, tgt_in, tgt_out)`` from :func:`dpcourse.one_device.data.collate_seq2seq` both fit. One
step::

    *inputs, target = batch
    loss = loss_fn(model(*inputs), target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

Everything else here is bookkeeping around that step: the loss history, the wall time, a
progress bar, and a throughput measurement. Later chapters (3, 7, 8) reuse :func:`train_step` and
compare their data-parallel runs with :func:`train`.

Chapter 1: the single-device training loop.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TextIO

import torch
from torch import nn

from dpcourse.one_device.data import PAD, DigitsToWords, decode_words, encode_digits
from dpcourse.runtime import synchronize

__all__ = [
    "History",
    "ProgressBar",
    "to_device",
    "train_step",
    "train",
    "evaluate",
    "translate",
    "translation_accuracy",
    "measure_throughput",
]

Batch = Sequence[torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class History:
    """What :func:`train` records.

    ``step_losses[i]`` is the loss of step ``i`` (computed before that step's update);
    ``epoch_losses[e]`` the mean loss per sample over epoch ``e``, and ``epoch_ends[e]`` the number
    of steps taken when epoch ``e`` ended; ``wall_time`` the seconds the whole loop took;
    ``num_samples`` how many samples it processed; ``samples_per_s`` their ratio.
    """

    step_losses: list[float] = field(default_factory=list)
    epoch_losses: list[float] = field(default_factory=list)
    epoch_ends: list[int] = field(default_factory=list)
    wall_time: float = 0.0
    num_samples: int = 0

    @property
    def samples_per_s(self) -> float:
        return self.num_samples / self.wall_time if self.wall_time > 0 else float("nan")

    @property
    def steps(self) -> int:
        return len(self.step_losses)


# ------------------------------------------------------------------------------ progress bar
def _notebook_shell() -> bool:
    """True inside a Jupyter kernel (a live notebook, or nbclient building the book)."""
    try:
        # import here: optional, absent outside Jupyter
        from IPython import get_ipython  # noqa: PLC0415
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class ProgressBar:
    """A one-line progress bar without tqdm or widgets: ``prefix |█████▌    | suffix``.

    In a Jupyter kernel it is a display that is updated in place (``display_id``), so a live
    notebook shows it moving and an executed notebook (the static website) keeps only its final
    state. In a terminal it rewrites one line of stderr with a carriage return; where stderr is not
    a terminal (a log file, CI) it writes the final line only. Redraws at most every
    ``min_interval`` seconds, and always at the end.
    """

    _EIGHTHS = " ▏▎▍▌▋▊▉█"

    def __init__(
        self,
        total: int,
        width: int = 24,
        min_interval: float = 0.1,
        enabled: bool = True,
        file: TextIO | None = None,
    ) -> None:
        self.total, self.width, self.enabled = total, width, enabled
        self.min_interval = min_interval
        self.file = sys.stderr if file is None else file
        self.notebook = _notebook_shell()
        self._handle = None
        self._last_draw = -float("inf")
        self._last_len = 0
        self.text = ""

    def render(self, done: int, prefix: str = "", suffix: str = "") -> str:
        """The bar as text, ``done`` out of ``total`` filled (in eighths of a character)."""
        frac = min(max(done / self.total, 0.0), 1.0) if self.total > 0 else 1.0
        eighths = round(frac * self.width * 8)
        full, part = divmod(eighths, 8)
        bar = "█" * full + (self._EIGHTHS[part] if part else "")
        return f"{prefix} |{bar.ljust(self.width)}| {suffix}".strip()

    def update(self, done: int, prefix: str = "", suffix: str = "") -> None:
        """Show ``done`` out of ``total``, with text before and after the bar."""
        self.text = self.render(done, prefix, suffix)
        now = time.perf_counter()
        if done >= self.total or now - self._last_draw >= self.min_interval:
            self._last_draw = now
            self._draw(final=False)

    def close(self) -> None:
        """Draw the final state and end the line."""
        self._draw(final=True)

    def _draw(self, final: bool) -> None:
        if not self.enabled or not self.text:
            return
        if self.notebook:
            # import here: optional, absent outside Jupyter
            from IPython.display import (  # noqa: PLC0415
                Pretty,
                display,
            )

            if self._handle is None:
                self._handle = display(Pretty(self.text), display_id=True)
            else:
                self._handle.update(Pretty(self.text))
        elif self.file.isatty():
            padding = " " * max(self._last_len - len(self.text), 0)
            self.file.write("\r" + self.text + padding + ("\n" if final else ""))
            self.file.flush()
            self._last_len = len(self.text)
        elif final:
            print(self.text, file=self.file, flush=True)


# -------------------------------------------------------------------------------- the loop
def to_device(batch: Batch, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """Move every tensor of a batch to ``device`` (a no-op for tensors already there)."""
    return tuple(t.to(device, non_blocking=True) for t in batch)


def train_step(
    model: nn.Module, batch: Batch, optimizer: torch.optim.Optimizer, loss_fn: LossFn
) -> float:
    """One step of gradient descent on one batch ``(inputs..., target)``; returns the loss.

    The batch must already be on the model's device. The loss is the one computed before the
    update. Used by :func:`train` and :func:`measure_throughput`, and by chapters 3 and 7 as the
    single-device reference.
    """
    *inputs, target = batch
    loss = loss_fn(model(*inputs), target)
    # set_to_none frees the gradient tensors between steps instead of filling them with zeros.
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    # .item() copies the loss to the CPU, which waits for the GPU: fine for small models.
    return loss.item()


def train(
    model: nn.Module,
    loader: Iterable[Batch],
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    epochs: int = 1,
    steps: int | None = None,
    device: torch.device | str | None = None,
    progress: bool = True,
) -> History:
    """Train ``model`` on the batches of ``loader`` for ``epochs`` passes (or exactly ``steps``
    steps, looping over the loader as often as needed). Returns a :class:`History`.

    Counting epochs needs ``len(loader)``; with ``steps`` any re-iterable loader works.

    ``device`` (default: where the model's parameters are) is where the model is moved and every
    batch is sent. ``progress`` shows a :class:`ProgressBar`. The model is left in training mode.
    Chapter 1 trains the MLP and the Transformer with it.
    """
    device = next(model.parameters()).device if device is None else torch.device(device)
    model.to(device)
    model.train()
    total_steps = epochs * len(loader) if steps is None else steps  # type: ignore[arg-type]
    bar = ProgressBar(total_steps, enabled=progress)
    history = History()
    start = time.perf_counter()
    epoch = 0
    while history.steps < total_steps:
        epoch += 1
        loss_sum, seen = 0.0, 0
        for batch in loader:
            batch = to_device(batch, device)
            loss = train_step(model, batch, optimizer, loss_fn)
            n = len(batch[0])
            history.step_losses.append(loss)
            history.num_samples += n
            loss_sum, seen = loss_sum + loss * n, seen + n
            elapsed = time.perf_counter() - start
            where = f"step {history.steps}/{steps}" if steps else f"epoch {epoch}/{epochs}"
            speed = f"{history.num_samples / elapsed:,.0f} samples/s" if elapsed > 0 else ""
            bar.update(history.steps, where, f"loss {loss_sum / seen:.4g}  {speed}")
            if history.steps == total_steps:
                break
        if seen == 0:
            raise ValueError("the loader yielded no batches")
        history.epoch_losses.append(loss_sum / seen)
        history.epoch_ends.append(history.steps)
    history.wall_time = time.perf_counter() - start
    bar.close()
    return history


# ------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable[Batch],
    loss_fn: LossFn,
    device: torch.device | str | None = None,
) -> float:
    """Mean loss per sample over ``loader``, without gradients and in eval mode (restored after).

    Batches are weighted by their size, so a short last batch counts for what it holds.
    """
    device = next(model.parameters()).device if device is None else torch.device(device)
    was_training = model.training
    model.eval()
    total, seen = 0.0, 0
    for batch in loader:
        *inputs, target = to_device(batch, device)
        total += loss_fn(model(*inputs), target).item() * len(target)
        seen += len(target)
    model.train(was_training)
    return total / seen


def translate(model: nn.Module, digit_strings: Sequence[str]) -> list[str]:
    """Greedy translations by a :class:`~dpcourse.one_device.models.TinyTransformer`: ``["12"]`` ->
    ``["one two"]`` once it has learnt. Runs on the model's device (chapter 1)."""
    device = next(model.parameters()).device
    encoded = [encode_digits(s) for s in digit_strings]
    src = torch.nn.utils.rnn.pad_sequence(encoded, batch_first=True, padding_value=PAD)
    out = model.greedy_decode(src.to(device))
    return [decode_words(row) for row in out.cpu()]


def translation_accuracy(model: nn.Module, dataset: DigitsToWords, batch_size: int = 1024) -> float:
    """Fraction of ``dataset``'s strings that greedy decoding translates exactly right.

    A translation counts only if every word and the final EOS are right (exact match): a stricter
    test than per-token accuracy. Chapter 1 asserts it on held-out strings.
    """
    device = next(model.parameters()).device
    correct = 0
    for i in range(0, len(dataset), batch_size):
        src = dataset.src[i : i + batch_size].to(device)
        tgt = dataset.tgt[i : i + batch_size].to(device)
        pred = model.greedy_decode(src)
        width = max(pred.shape[1], tgt.shape[1])
        pred = nn.functional.pad(pred, (0, width - pred.shape[1]), value=PAD)
        tgt = nn.functional.pad(tgt, (0, width - tgt.shape[1]), value=PAD)
        correct += int((pred == tgt).all(dim=1).sum())
    return correct / len(dataset)


# ------------------------------------------------------------------------------ throughput
def measure_throughput(
    model: nn.Module,
    make_batch: Callable[[int], Batch],
    batch_sizes: Iterable[int],
    loss_fn: LossFn,
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    steps: int = 10,
    warmup: int = 3,
    device: torch.device | str | None = None,
) -> list[tuple[int, float]]:
    """Training throughput in samples per second for each batch size: ``[(batch_size, samples/s)]``.

    For each size, a fresh copy of ``model`` (the original is not trained) and a fresh optimizer
    from ``make_optimizer(params)`` take ``warmup`` untimed steps, then ``steps`` timed ones on the
    same batch ``make_batch(batch_size)``, so data loading is not measured. The rate is
    ``batch_size / median step time``: the median ignores the odd step slowed by something else
    the machine was doing. Chapter 1 plots it against batch size.
    """
    device = next(model.parameters()).device if device is None else torch.device(device)
    results = []
    for batch_size in batch_sizes:
        replica = copy.deepcopy(model).to(device)
        optimizer = make_optimizer(replica.parameters())
        batch = to_device(make_batch(batch_size), device)
        for _ in range(warmup):
            train_step(replica, batch, optimizer, loss_fn)
        times = []
        for _ in range(steps):
            synchronize(device)
            t0 = time.perf_counter()
            train_step(replica, batch, optimizer, loss_fn)
            synchronize(device)
            times.append(time.perf_counter() - t0)
        results.append((batch_size, batch_size / statistics.median(times)))
    return results
