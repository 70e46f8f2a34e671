#!/usr/bin/env python3
"""Prints the path of the test executable named NAME from cargo's JSON
messages on standard input (`cargo test --no-run --message-format=json`),
so that a script can run it without cargo, which holds the build
directory's lock for as long as its tests run.

    cargo test --no-run --message-format=json | scripts/test-exe.py chaos
"""

import json
import sys

name = sys.argv[1]
found = None
for line in sys.stdin:
    try:
        message = json.loads(line)
    except ValueError:
        continue
    if (message.get("reason") == "compiler-artifact" and message["target"]["name"] == name
            and message.get("executable") and message["profile"].get("test")):
        found = message["executable"]
if not found:
    sys.exit(f"cargo built no test executable named {name}")
print(found)
