"""A SASS check for wgmma with its A operand in registers: between an HGMMA group's commit
(the HGMMA marked `gsb0`) and the WARPGROUP.DEPBAR that retires it, nothing may write the
registers that group's HGMMAs read A from, since the tensor cores read them while the group runs.

A group is retired by a `WARPGROUP.DEPBAR.LE gsb0, 0x0` or by the second `... 0x1` after it (the
first one, right after the group, retires the group before). The walk follows branches both ways
(it knows no predicates), so it can report a path that never runs but misses none that does.
Used by tests/test_sm90_register_weights_build.py.
"""
from __future__ import annotations

import re

_INSN = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_GUARD = re.compile(r"^@!?U?P\w+\s+")
# opcodes whose first register operand is not written
_NO_DEST = ("ST", "RED", "BRA", "EXIT", "HGMMA", "WARPGROUP", "BAR", "SYNCS.ARRIVE", "NOP",
            "MEMBAR", "FENCE", "RET", "CALL", "DEPBAR", "WARPSYNC", "NANOSLEEP", "UTMA",
            "ERRBAR", "CCTL", "ELECT")


def _instructions(sass: str):
    return [(int(m.group(1), 16), m.group(2)) for m in map(_INSN.match, sass.splitlines()) if m]


def _written(text: str) -> set:
    body = _GUARD.sub("", text)
    op = body.split()[0]
    if op.startswith(_NO_DEST):
        return set()
    m = re.match(r"R(\d+)", body[len(op):].strip())
    if not m:
        return set()
    width = 4 if ".128" in op else 2 if (".64" in op or op.startswith("IMAD.WIDE")) else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def _branch_target(text: str):
    """The target address of a (possibly predicated) BRA, else None."""
    body = _GUARD.sub("", text)
    return int(re.search(r"0x([0-9a-f]+)", body).group(1), 16) if body.startswith("BRA") else None


def register_a_hazards(sass: str) -> tuple[int, list[str]]:
    """(HGMMA groups found, one line per write to a running group's A registers)."""
    ins = _instructions(sass)
    at = {a: i for i, (a, _) in enumerate(ins)}
    groups, found = 0, []
    for i, (addr, text) in enumerate(ins):
        if not text.startswith("HGMMA") or "gsb0" not in text:
            continue
        groups += 1
        regs, j = set(), i
        while j >= 0 and not (j < i and "gsb0" in ins[j][1]):  # this group's HGMMAs
            m = re.search(r"HGMMA\S* R\d+, R(\d+),", ins[j][1])
            if m:
                regs |= set(range(int(m.group(1)), int(m.group(1)) + 4))
            j -= 1
        stack, seen = [(i + 1, 0)], set()
        while stack:
            k, depbars = stack.pop()
            while k < len(ins) and (k, depbars) not in seen:
                seen.add((k, depbars))
                a2, t2 = ins[k]
                if "WARPGROUP.DEPBAR.LE" in t2:
                    depbars += 1
                    if t2.endswith("0x0") or depbars == 2:
                        break
                hit = _written(t2) & regs
                if hit:
                    found.append(f"group at {addr:#x}: `{t2}` at {a2:#x} writes R{sorted(hit)}")
                target = _branch_target(t2)
                if target is not None:
                    if target in at:
                        stack.append((at[target], depbars))
                    if not t2.startswith("@"):
                        break
                if _GUARD.sub("", t2).startswith("EXIT") and not t2.startswith("@"):
                    break
                k += 1
    return groups, found


def local_memory_in_mma_loops(sass: str) -> list[str]:
    """Local-memory accesses (LDL / STL: spills) inside an innermost loop that issues HGMMAs (a
    backward branch's range holding an HGMMA and no smaller such range): the k-tile loops, where
    a spill costs every k-tile (an outer loop over tiles pays once a tile). One line per
    access."""
    ins = _instructions(sass)
    loops = []  # (start, end) of each backward branch's range that holds an HGMMA
    for addr, text in ins:
        start = _branch_target(text)
        if start is not None and start < addr and any(
                "HGMMA" in t for a, t in ins if start <= a <= addr):
            loops.append((start, addr))
    inner = [(s0, e0) for s0, e0 in loops
             if not any((s1, e1) != (s0, e0) and s0 <= s1 and e1 <= e0 for s1, e1 in loops)]
    found = {f"{a:#06x}: {t}" for s0, e0 in inner for a, t in ins
             if s0 <= a <= e0 and re.match(r"(@!?P\w+\s+)?(LDL|STL)\b", t)}
    return sorted(found)
