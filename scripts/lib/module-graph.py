#!/usr/bin/env python3
"""The import graph of src/: which top-level module (a folder of src/, or a
ground-floor file) uses which, from the `crate::` paths in its files, and
any circle among them. Also the circles between the files of one folder.
Exits 1 when there is a circle.

    python3 scripts/lib/module-graph.py [--edges]
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "src")
USE = re.compile(r"\bcrate::(\w+)(?:::(\w+))?")


def files():
    for dirpath, _, names in os.walk(ROOT):
        for name in names:
            if name.endswith(".rs") and name not in ("lib.rs", "main.rs") and "bin" not in dirpath.split(os.sep):
                yield os.path.relpath(os.path.join(dirpath, name), ROOT)


def top_of(rel):
    first = rel.split(os.sep)[0]
    return first[:-3] if first.endswith(".rs") else first


def sub_of(rel):
    parts = rel.split(os.sep)
    if len(parts) < 2:
        return None
    name = parts[1]
    return name[:-3] if name.endswith(".rs") else name


def strip_comments(text):
    return "\n".join(line.split("//")[0] for line in text.splitlines())


def cycles(graph):
    found, state = [], {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


top, inner = {}, {}
for rel in files():
    text = strip_comments(open(os.path.join(ROOT, rel)).read())
    me, mine = top_of(rel), sub_of(rel)
    for m in USE.finditer(text):
        other, other_sub = m.group(1), m.group(2)
        if other in ("Lsn",):
            other = "lsn"
        if other != me:
            top.setdefault(me, set()).add(other)
        elif mine and other_sub and other_sub != mine:
            inner.setdefault(me, {}).setdefault(mine, set()).add(other_sub)
    top.setdefault(me, set())

if "--edges" in sys.argv:
    for node in sorted(top):
        print(f"{node:10} -> {', '.join(sorted(top[node])) or '-'}")
bad = cycles(top)
for folder, graph in sorted(inner.items()):
    bad += [[f"{folder}::{n}" for n in c] for c in cycles(graph)]
for c in bad:
    print("circle: " + " -> ".join(c))
if not bad:
    print("no circle between the top-level modules of src/, nor between the files of one folder")
sys.exit(1 if bad else 0)
