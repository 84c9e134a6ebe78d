"""Data Parallelism from Scratch: the package every chapter of the course imports, one folder per
part.

A reader of chapter N finds its code in the folder of its part: ``one_device`` (chapter 1),
``replicas`` (chapters 2-4), ``collectives`` (5-6), ``cost`` (the cost models and hardware figures,
5-10), ``ddp`` (7), ``practice`` (8), ``sharding`` (9), ``debugging`` (the appendices), ``plots``
(the figures); ``runtime``, ``stand_in``, ``shared_gpu`` and ``timing`` are what every rank runs in,
and ``listing`` shows the package's own code on the page. ``harness`` is the machinery that runs and
checks the course (the launcher, the emulated cluster, the device audit, benchmarks, exercise checks
and grading): lesson code never imports it. CONTRIBUTING.md's map is written from the modules'
docstrings (``python -m dpcourse.harness.package_map``).

Chapter 0: the package of the whole course.
"""

# The one place the version is written: pyproject.toml reads it (setuptools' attr, without
# importing the package), and CHANGELOG.md and CITATION.cff name it for each release.
__version__ = "0.2.0"
