"""`python -m recover` is the `recover` command."""

import sys

from recover.app.cli import main

sys.exit(main())
