"""The ``python -m dpcourse.harness.bench`` entry point.

Chapter 0: the course-wide measurement rigs.
"""

import sys

from dpcourse.harness.bench import main

sys.exit(main())
