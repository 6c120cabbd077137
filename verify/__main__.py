"""``python -m verify``: see :mod:`verify.cli`."""
import sys

from verify.cli import main

if __name__ == "__main__":
    sys.exit(main())
