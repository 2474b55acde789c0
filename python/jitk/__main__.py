"""`python -m jitk`: the command line (jitk/cli)."""

import sys

from jitk.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
