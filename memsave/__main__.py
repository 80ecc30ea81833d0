"""``python -m memsave``: the command line (:mod:`memsave.cli`)."""

import sys

from memsave.cli import main

sys.exit(main())
