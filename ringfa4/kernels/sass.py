"""The SASS of a compiled kernel, compared by its main loops.

ptxas schedules a kernel's main loop from the whole function: an edit outside the loop (one
division in the prologue computed another way) can reorder the same loop's instructions and
change its speed by several percent (bench/RESULTS.md, 2026-11-27: 5-9% at the hdim 64
non-causal backward from an identical loop's PTX). So a kernel change is checked offline before
it is timed: does every variant's loop come out of ptxas as it did before?

The loop region is the span from a kernel's first to its last wgmma (HGMMA): every MMA step,
with what ptxas interleaves between them. Registers, predicates and constants are normalized
away, so only the order and kind of instructions compare.
"""
import difflib
import re

_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;")
_NAMES = re.compile(r"\b(?:U?R\d+|U?P\d+|B\d+|0x[0-9a-f]+)\b")


def instructions(sass: str) -> list:
    """The instructions of nvdisasm's text (``nvdisasm -c``), in order."""
    return [m.group(1) for m in _INSTRUCTION.finditer(sass)]


def main_loop(sass: str) -> list:
    """The normalized instructions from the first to the last HGMMA ([] without any)."""
    code = instructions(sass)
    mma = [i for i, ins in enumerate(code) if "HGMMA" in ins]
    if not mma:
        return []
    return [_NAMES.sub("_", ins) for ins in code[mma[0]:mma[-1] + 1]]


def moved(before: list, after: list) -> int:
    """How many instructions of ``after`` are not where ``before`` had them (0: same schedule)."""
    ops = difflib.SequenceMatcher(a=before, b=after, autojunk=False).get_opcodes()
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")
