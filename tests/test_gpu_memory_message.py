"""What a rank says when its GPU has no memory left for it while it joins the process group
(dpcourse.harness.launch.worker.out_of_memory_message): the H200 run of 2026-11-26 got only torch's
"CUDA out of memory" there, with 4 notebooks and 6 test workers on one GPU.

Chapter 0: the course-wide launcher's plumbing.
"""

from __future__ import annotations

from dpcourse.harness.launch.worker import out_of_memory_message

ORIGINAL = RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be reported later")


def test_names_the_rank_its_gpu_and_the_ranks_that_share_it():
    text = out_of_memory_message(ORIGINAL, rank=5, local_rank=1, local_world_size=4, gpus=1,
                                 memory=(300 * 2**20, 140 * 2**30))
    assert "rank 5 (local rank 1 of 4)" in text
    assert "Local ranks 0, 1, 2, 3 of this pool share cuda:0 (1 GPU(s)" in text
    assert "0.3 GiB free of 140.0 GiB" in text


def test_ranks_share_the_gpus_round_robin():
    text = out_of_memory_message(ORIGINAL, rank=3, local_rank=3, local_world_size=8, gpus=2)
    assert "on cuda:1 while" in text
    assert "Local ranks 1, 3, 5, 7 of this pool share cuda:1 (2 GPU(s)" in text
    assert "GiB free" not in text  # memory could not be read


def test_says_what_to_do_and_keeps_the_original_error():
    text = out_of_memory_message(ORIGINAL, rank=0, local_rank=0, local_world_size=2, gpus=2)
    assert "Local ranks 0 of this pool share cuda:0" in text
    for advice in ("fewer notebooks or test workers", "DPCOURSE_KEEP_RANKS", "close other kernels"):
        assert advice in text
    assert text.endswith("RuntimeError: CUDA error: out of memory\n"
                         "CUDA kernel errors might be reported later")
