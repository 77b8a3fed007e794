"""`python -m latentkv`: the same CLI as the `latentkv` console script."""

import sys

from latentkv.cli import main

if __name__ == "__main__":  # the engine process (spawn) imports this module without running it
    sys.exit(main())
