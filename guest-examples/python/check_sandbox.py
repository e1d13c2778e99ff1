"""What a handler cannot do in onceq's sandbox, named before a run finds it.

`make check` runs it on src/*.py (the SDK aside). A component has no files,
no network and no processes: open() or a socket import builds, then traps
on the first message that reaches it. Read rows through ctx.get/scan and
reach other systems with ctx.intent, delivered through the outbox after the
commit.
"""

import ast
import pathlib
import sys

NETWORK = {"socket", "ssl", "urllib", "urllib3", "http", "requests", "httpx", "aiohttp", "ftplib", "smtplib"}
PROCESSES = {"subprocess", "multiprocessing"}
FIX_NETWORK = "the sandbox has no network: emit ctx.intent(connector, key, payload), delivered through the outbox after the commit"
FIX_FILES = "the sandbox has no files: read rows with ctx.get/scan, keep data in the tables of schema.sql"


def problems(path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from module(node, alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield from module(node, node.module)
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id == "open":
                yield node.lineno, f"open(): {FIX_FILES}"
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (f.value.id, f.attr) in {
                ("io", "open"),
                ("os", "open"),
                ("os", "system"),
                ("os", "popen"),
                ("pathlib", "Path"),
            }:
                yield node.lineno, f"{f.value.id}.{f.attr}(): {FIX_FILES}"


def module(node, name):
    root = name.split(".")[0]
    if root in NETWORK:
        yield node.lineno, f"import {name}: {FIX_NETWORK}"
    elif root in PROCESSES:
        yield node.lineno, f"import {name}: the sandbox runs no processes"


def main():
    found = 0
    for path in sorted(pathlib.Path("src").glob("*.py")):
        if path.name == "onceq_guest.py":
            continue
        for line, what in problems(path):
            print(f"{path}:{line}: {what}")
            found += 1
    if found:
        print(f"{found} use(s) of what the sandbox does not offer", file=sys.stderr)
        sys.exit(1)


main()
