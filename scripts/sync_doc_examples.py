#!/usr/bin/env python3
"""Copies each docs/examples/<name>.cpp into the ```cpp block of docs/*.md that quotes it.

A block quotes an example when its first line is the example's first line. The test
docs.examples fails when a quote differs from its file; run this after editing an example.
"""
import pathlib
import re
import sys

docs = pathlib.Path(__file__).resolve().parent.parent / "docs"
examples = sorted((docs / "examples").glob("*.cpp"))
changed = 0
for page in sorted(docs.glob("*.md")):
    text = page.read_text()
    new = text
    for example in examples:
        code = example.read_text()
        first = code.splitlines()[0]
        pattern = re.compile(r"```cpp\n" + re.escape(first) + r"\n.*?```", re.S)
        new = pattern.sub(lambda _: "```cpp\n" + code + "```", new)
    if new != text:
        page.write_text(new)
        changed += 1
        print(f"updated {page.relative_to(docs.parent)}")
sys.exit(0)
