"""The launcher's private plumbing, behind :mod:`dpcourse.launch` (whose API learners use).

``process``: the rank processes (spawning, pipes, output, killing, stack dumps on a timeout);
``worker``: the program each rank runs (``python -m dpcourse._launch.worker FD``); ``errors``:
``RankError``, ``RankDiedError``, ``RankTimeoutError`` and how they read; ``torchrun``:
:func:`~dpcourse._launch.torchrun.run_torchrun`, a script or module under ``torchrun``.

Chapter 0: the course-wide runtime and launcher.
"""
