"""``python -m numba_flash``: the numba-flash command (see numba_flash.cli)."""
import sys

from numba_flash.cli import main

if __name__ == "__main__":
    sys.exit(main())
