"""``python -m lmcache_nvme_backend`` runs the ``lmcache-nvme`` command line."""

import sys

from .cli import main

sys.exit(main())
