"""The machinery that runs and checks the course; lesson code never imports it.

* :mod:`.launch`: run a function on N ranks from a notebook or a script (``run_ranks``,
  ``RankPool``) and under ``torchrun``;
* :mod:`.cluster` and :mod:`.netns`: the emulated cluster (nodes as network namespaces);
* :mod:`.device_audit`: run on a CPU as if the ranks had GPUs, and fail where they would;
* :mod:`.patching`: replace torch.distributed's functions for a while;
* :mod:`.runs`: the book's multi-rank runs (a lesson's rank function started on N ranks);
* :mod:`.bench`: ``python -m dpcourse.harness.bench``, measurements against PyTorch;
* :mod:`.exercises`: the checks, the student edition and grading.

Chapter 0: the course-wide machinery.
"""
