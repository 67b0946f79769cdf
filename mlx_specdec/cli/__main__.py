"""`python -m mlx_specdec.cli ...` (the tests run the CLI this way)."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
