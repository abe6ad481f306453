"""Stands in for ``ssh`` in the launcher tests: ``fake_ssh.py [-p PORT] HOST COMMAND_LINE``.

Drops the options and the host and runs the command line through ``sh -c`` here, as
sshd would run it through the login shell on HOST. Each call is logged (host first)
to ``$RR_FAKE_SSH_LOG`` when set, so a test can see which hosts were "reached".
"""

import os
import sys

args = sys.argv[1:]
while args and args[0].startswith("-"):
    args = args[2:] if args[0] in ("-p", "-o") else args[1:]
host, command_line = args[0], " ".join(args[1:])
log = os.environ.get("RR_FAKE_SSH_LOG")
if log:
    with open(log, "a") as f:
        f.write(f"{host}\n")
os.execvp("sh", ["sh", "-c", command_line])
