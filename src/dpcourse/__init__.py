"""Data Parallelism from Scratch: the package that every chapter of the course imports.

One module per concept, each naming its chapter on the last line of its docstring (the module
map is in ``CONTRIBUTING.md`` at the top of the repository): ``runtime`` and ``launch`` run code
on N ranks (chapter 0); ``data``, ``models``, ``training`` and ``memory`` serve chapter 1; later
chapters add replication, averaging, collectives, DDP and ZeRO.

Chapter 0: the package of the whole course.
"""

# The one place the version is written: pyproject.toml reads it (setuptools' attr, without
# importing the package), and CHANGELOG.md and CITATION.cff name it for each release.
__version__ = "0.2.0"
