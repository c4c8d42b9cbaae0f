"""`python -m recover` is the `recover` command."""

import sys

from recover.cli import main

sys.exit(main())
