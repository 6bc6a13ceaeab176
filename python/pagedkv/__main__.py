"""`python -m pagedkv`: the command line."""

from pagedkv.cli import main

raise SystemExit(main())
