"""`python -m kvshare.server.cli`: the `kvshare` command."""

import sys

from kvshare.server.cli import main

sys.exit(main())
