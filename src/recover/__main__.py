"""`python -m recover` is the `recover` command."""

import sys

from recover.app.entry import main

sys.exit(main())
