"""The ``python -m dpcourse.bench`` entry point.

Chapter 0: the course-wide measurement rigs.
"""

import sys

from dpcourse.bench import main

sys.exit(main())
