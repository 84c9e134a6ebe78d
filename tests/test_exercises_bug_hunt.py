"""The "find the bugs" checks: the fixes pass; the seed's pieces and half-fixes fail, saying why."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.data import default_collate

from dpcourse.debugging import bug_hunt, bug_hunt_seed
from dpcourse.harness.exercises import registry, run_check
from dpcourse.one_device.data import EOS, PAD
from dpcourse.practice.lr_schedule import noam_lr


def failed(label: str, fn, *phrases: str) -> str:
    result = run_check(label, fn)
    assert result.status == "failed", result
    for phrase in phrases:
        assert phrase in result.message, (phrase, result.message)
    return result.message


def test_the_appendix_registers_its_checks_under_its_own_part():
    labels = [label for label in registry() if label.startswith("ex-bugs-")]
    assert labels == ["ex-bugs-noam", "ex-bugs-batch-first", "ex-bugs-collate", "ex-bugs-step"]
    assert [registry()[label].part for label in labels] == ["bugs"] * 4
    assert [registry()[label].number for label in labels] == [f"Bugs.{k}" for k in range(1, 5)]


def test_noam_check():
    assert run_check("ex-bugs-noam", noam_lr).passed
    seed = lambda step, d, w: d**-0.5 * min(max(step, 1) ** -0.5, step * w**-1.5)  # noqa: E731
    failed("ex-bugs-noam", seed, "step 0", "got 0", "count s from 1")
    clamped = lambda step, d, w: noam_lr(max(step - 1, 0), d, w)  # noqa: E731
    failed("ex-bugs-noam", clamped, "the rate of step 0 again", "one step late")
    no_warmup_power = lambda step, d, w: d**-0.5 * min((step + 1) ** -0.5, (step + 1) * w**-0.5)  # noqa: E731
    failed("ex-bugs-noam", no_warmup_power, "got/expected")


def test_batch_first_check():
    assert run_check("ex-bugs-batch-first", bug_hunt.make_transformer).passed

    def seed(d, h, n, ff):
        return nn.Transformer(d, h, n, n, ff, dropout=0.0)

    failed("ex-bugs-batch-first", seed, "example 0's output changed", "batch_first=True")

    def wrong_size(d, h, n, ff):
        return nn.Transformer(d, h, n, n, dropout=0.0, batch_first=True)  # default 2048 wide

    failed("ex-bugs-batch-first", wrong_size, "dim_feedforward=32", "parameters")

    class TransposedIn(nn.Module):  # transposes the inputs but returns (seq, batch, d)
        def __init__(self, d, h, n, ff):
            super().__init__()
            self.t = nn.Transformer(d, h, n, n, ff, dropout=0.0)

        def forward(self, src, tgt, **kw):
            return self.t(src.transpose(0, 1), tgt.transpose(0, 1), **kw)

    failed("ex-bugs-batch-first", TransposedIn, "example 0's output changed")


def test_collate_check():
    assert run_check("ex-bugs-collate", bug_hunt.pad_collate).passed

    def stacks(samples):
        src, tgt = default_collate(samples)
        return src, tgt[:, :-1], tgt[:, 1:], src == PAD

    failed("ex-bugs-collate", stacks, "raised RuntimeError", "stack expects")

    def to_max_len(samples):  # pads to the data set's maximum, as the seed's data set does
        src = torch.full((len(samples), 7), PAD)
        tgt = torch.full((len(samples), 8), PAD)
        for i, (s, t) in enumerate(samples):
            src[i, : len(s)], tgt[i, : len(t)] = s, t
        return src, tgt[:, :-1], tgt[:, 1:], src == PAD

    failed("ex-bugs-collate", to_max_len, "src: expected shape", "longest sequence of the batch")

    def inverted_mask(samples):
        src, tgt_in, tgt_out, pad = bug_hunt.pad_collate(samples)
        return src, tgt_in, tgt_out, ~pad

    failed("ex-bugs-collate", inverted_mask, "True at the real tokens")

    def pads_with_eos(samples):
        pad = nn.utils.rnn.pad_sequence
        src = pad([s for s, _ in samples], batch_first=True, padding_value=EOS)
        tgt = pad([t for _, t in samples], batch_first=True, padding_value=EOS)
        mask = bug_hunt.pad_collate(samples)[3]
        return src, tgt[:, :-1], tgt[:, 1:], mask

    failed("ex-bugs-collate", pads_with_eos, "the padding holds [2]", "expected PAD (0)")

    def no_mask(samples):
        return bug_hunt.pad_collate(samples)[:3]

    failed("ex-bugs-collate", no_mask, "expected a tuple (src, tgt_in, tgt_out, src_pad)")


def _step(*, cuda_amp=False, counts_pad=False, no_mask=False, clip_first=False, sched=True):
    def step(model, batch, optimizer, scheduler, scaler, max_norm, dtype):
        src, tgt_in, tgt_out, src_pad = batch
        optimizer.zero_grad()
        amp = torch.cuda.amp.autocast() if cuda_amp else torch.autocast("cpu", dtype=dtype)
        with amp:
            logits = model(src, tgt_in, None if no_mask else src_pad)
            if counts_pad:
                loss = nn.functional.cross_entropy(
                    logits.reshape(-1, logits.size(-1)).float(), tgt_out.reshape(-1)
                )
            else:
                loss = bug_hunt.token_loss(logits, tgt_out)
        scaler.scale(loss).backward()
        if clip_first:
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.unscale_(optimizer)
        if not clip_first:
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()
        if sched:
            scheduler.step()
        return loss.item()

    return step


def test_step_check():
    assert run_check("ex-bugs-step", bug_hunt.fixed_step).passed
    assert run_check("ex-bugs-step", _step()).passed
    failed("ex-bugs-step", _step(cuda_amp=True), "torch.cuda.amp", "switch themselves off")
    failed("ex-bugs-step", _step(counts_pad=True), "are PAD", "ignore_index=PAD")
    failed("ex-bugs-step", _step(no_mask=True), "attended to the padding", "src_pad")
    failed("ex-bugs-step", _step(clip_first=True), "clipped the scaled gradients", "unscale_")
    failed("ex-bugs-step", _step(sched=False), "scheduler.step()")


def test_the_seed_pieces_fail_their_checks():
    assert not run_check("ex-bugs-noam", lambda s, d, w: bug_hunt_seed.noam_lambda(s, d, w)).passed


# ------------------------------------------------ the wrong answers students write (issue 43)
def test_batch_first_checks_the_sizes_and_the_mode():
    # the mode the check never used: training, where nn.Transformer's default dropout acts
    failed("ex-bugs-batch-first",
           lambda d, h, n, ff: nn.Transformer(d, h, n, n, ff, batch_first=True),
           "two forwards of the same batch differ", "dropout=0.0")
    # an argument the parameter count cannot see: one head or several have the same weights
    failed("ex-bugs-batch-first",
           lambda d, h, n, ff: nn.Transformer(d, 1, n, n, ff, dropout=0.0, batch_first=True),
           "nhead=2", "has [1] head(s)")


def _step_with(device_type=None, dtype=None):
    def step(model, batch, optimizer, scheduler, scaler, max_norm, given):
        src, tgt_in, tgt_out, src_pad = batch
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type or src.device.type, dtype=dtype or given):
            loss = bug_hunt.token_loss(model(src, tgt_in, src_pad), tgt_out)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        return loss.item()

    return step


def test_step_autocasts_on_the_batch_device_in_the_dtype_given():
    # kind 1: the dtype argument, never varied, ignored for bfloat16
    failed("ex-bugs-step", _step_with(dtype=torch.bfloat16), "with dtype=torch.float16",
           "autocast to the dtype you are given")
    if not torch.cuda.is_available():  # kind 3: 'cuda' hard-coded autocasts nothing on a CPU
        failed("ex-bugs-step", _step_with(device_type="cuda"),
               "did not run under autocast", "src.device.type")
