"""`python -m fuser.server PATH [...]`: the same as `fuser serve PATH [...]`."""

import sys

from fuser.cli import main

raise SystemExit(main(["serve", *sys.argv[1:]]))
