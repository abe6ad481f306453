#!/usr/bin/env python3
"""Stands in for ``ssh`` when a launcher (MPICH's Hydra) starts processes on namespace hosts:
``_netns_ssh.py [OPTIONS] HOST COMMAND...`` runs the command in network namespace HOST."""

import os
import sys

args = sys.argv[1:]
while args and args[0].startswith("-"):
    args = args[2:] if args[0] in ("-p", "-o", "-l") else args[1:]
host, command_line = args[0], " ".join(args[1:])
os.execvp("ip", ["ip", "netns", "exec", host, "sh", "-c", command_line])
