"""``python -m gradlens``: the ``gradlens`` command line (see :mod:`gradlens.cli`)."""

import sys

from gradlens.cli import main

if __name__ == "__main__":
    sys.exit(main())
