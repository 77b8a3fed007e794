"""`python -m latentkv`: the same CLI as the `latentkv` console script."""

import sys

from latentkv.cli import main

sys.exit(main())
