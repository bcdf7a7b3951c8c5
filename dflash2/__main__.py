"""`python -m dflash2`: the project's commands."""

import sys

from dflash2.errors import COMMANDS, EXIT_USER_ERROR

if __name__ == "__main__":
    if sys.argv[1:] in ([], ["--help"], ["-h"]):
        print(COMMANDS, end="")
        sys.exit(0)
    print(f"error: python -m dflash2 runs nothing; the commands are:\n{COMMANDS}", file=sys.stderr, end="")
    sys.exit(EXIT_USER_ERROR)
