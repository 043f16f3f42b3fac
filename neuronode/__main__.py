"""`python -m neuronode`: the `neuronode` command, so `torchrun ... -m neuronode start ...` works."""

import os
import sys

from neuronode.cli import main

if __name__ == "__main__":
    code = main()
    if "neuronode.node.member" in sys.modules and sys.modules["neuronode.node.member"].launched():
        # A rank of a member, done: its checkpoint and logs are written. Skip the interpreter's
        # teardown (it frees torch's heap piece by piece: seconds), which the launcher and the
        # member's other ranks would wait for.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
