"""`python -m fuser.server PATH [...]`: the same as `fuser serve PATH [...]`."""

from fuser.server.cli import main

raise SystemExit(main())
