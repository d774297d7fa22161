"""`python -m rsclip_ds ...`: the form the `deepspeed --module` launcher starts."""

import sys

from rsclip_ds.cli import main

sys.exit(main())
