import sys

from dpcourse.bench import main

sys.exit(main())
