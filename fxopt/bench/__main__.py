"""``python -m fxopt.bench``: see :func:`fxopt.bench.main`."""
import sys

from fxopt.bench import main

if __name__ == "__main__":
    sys.exit(main())
