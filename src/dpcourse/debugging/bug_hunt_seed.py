"""The seed script of the "find the bugs" appendix, kept as it was written, bugs and all.

A small Transformer trains on the course's digits-to-words task with DDP, mixed precision,
gradient clipping and the Noam learning-rate schedule. It runs without an error on 2 CPU ranks,
yet it has several bugs; the appendix page shows the source of this module, runs it, and asks
for the fixes, which live in :mod:`dpcourse.debugging.bug_hunt`.
Do not copy from here. Run :func:`seed_main` on every rank (``run_ranks(seed_main, 2)``); it
returns what it logged.

Appendix: find the bugs (the seed script, unfixed).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from dpcourse import runtime
from dpcourse.one_device.data import VOCAB_SIZE, DigitsToWords

__all__ = ["SeedModel", "noam_lambda", "seed_main"]


class SeedModel(nn.Module):
    """Embeddings, sinusoidal positions, ``nn.Transformer`` and a projection
    to the vocabulary, written after PyTorch's seq2seq tutorial."""

    def __init__(
        self, d_model: int = 32, nhead: int = 2, layers: int = 1, ff: int = 64
    ) -> None:
        super().__init__()
        self.d_model = d_model
        self.embed = nn.Embedding(VOCAB_SIZE, d_model)
        self.transformer = nn.Transformer(
            d_model, nhead, layers, layers, ff, dropout=0.0
        )
        self.out = nn.Linear(d_model, VOCAB_SIZE)
        pos = torch.arange(64).unsqueeze(1)
        scale = -math.log(10000.0) / d_model
        freq = torch.exp(torch.arange(0, d_model, 2) * scale)
        pe = torch.zeros(64, 1, d_model)
        pe[:, 0, 0::2] = torch.sin(pos * freq)
        pe[:, 0, 1::2] = torch.cos(pos * freq)
        self.register_buffer("pe", pe)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        x = self.embed(src) * math.sqrt(self.d_model)
        y = self.embed(tgt) * math.sqrt(self.d_model)
        x, y = x + self.pe[: x.size(0)], y + self.pe[: y.size(0)]
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.size(0))
        return self.out(self.transformer(x, y, tgt_mask=mask.to(src.device)))


def noam_lambda(step: int, d_model: int = 32, warmup: int = 4) -> float:
    """The Noam schedule, as a multiplier for ``LambdaLR``."""
    return d_model**-0.5 * min(max(step, 1) ** -0.5, step * warmup**-1.5)


def seed_main(
    epochs: int = 2, batch_size: int = 8, samples: int = 48
) -> dict[str, list]:
    """Train for ``epochs`` on every rank; returns per step the learning rate
    and this rank's loss, and per epoch the first source sequence this rank
    saw (lists of numbers)."""
    rank = dist.get_rank()
    device = runtime.device()
    torch.manual_seed(0)

    dataset = DigitsToWords(samples, min_len=1, max_len=6, seed=0)
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)

    model = SeedModel().to(device)
    ids = [device] if device.type == "cuda" else None
    model = DistributedDataParallel(model, device_ids=ids)
    params = model.parameters()
    optimizer = torch.optim.Adam(params, lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, noam_lambda)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss()

    log = {"lr": [], "loss": [], "first_batch": []}
    for epoch in range(epochs):
        for i, (src, tgt) in enumerate(loader):
            if i == 0:
                log["first_batch"].append(src[0].tolist())
            src, tgt = src.to(device), tgt.to(device)
            tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
            optimizer.zero_grad()
            with torch.cuda.amp.autocast():
                logits = model(src, tgt_in).reshape(-1, VOCAB_SIZE)
                loss = criterion(logits, tgt_out.reshape(-1))
            scaler.scale(loss).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            log["lr"].append(optimizer.param_groups[0]["lr"])
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            log["loss"].append(loss.item())
            if rank == 0:
                print(f"epoch {epoch} step {i} loss {loss.item():.3f}")
    return log
