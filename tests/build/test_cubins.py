"""tests/support/cubins.py: finding cubins inside exported objects, parsing SASS.

Pure Python, no DSL or GPU: runs in CI with the base test dependencies.
"""

import struct

import cubins as _cubins


def _fake_cubin(sm: int, payload: bytes = b"\xab" * 40) -> bytes:
    """A minimal valid ELF64 image with e_machine CUDA and one section header."""
    ehdr_size, shent = 64, 64
    shoff = ehdr_size + len(payload)
    ident = b"\x7fELF" + bytes([2, 1, 1, 0x41, 8]) + b"\0" * 7
    hdr = ident + struct.pack("<HHIQQQIHHHHHH", 2, _cubins.EM_CUDA, 1, 0, 0, shoff,
                              sm << 8, ehdr_size, 0, 0, shent, 1, 0)
    sh = struct.pack("<IIQQQQIIQQ", 0, 1, 0, 0, ehdr_size, len(payload), 0, 0, 1, 0)
    return hdr + payload + sh


def test_find_cubins_in_a_host_object():
    one, two = _fake_cubin(100), _fake_cubin(103, b"\xcd" * 100)
    host_elf = b"\x7fELF" + bytes([2, 1, 1]) + b"\0" * 11 + struct.pack("<H", 62) + b"\0" * 50
    blob = host_elf + b"junk" * 10 + one + b"\0" * 7 + two + b"tail"
    found = _cubins.find_cubins(blob)
    assert [c.data for c in found] == [one, two]
    assert [c.sm for c in found] == [100, 103]
    assert found[0].offset == blob.index(one)


def test_truncated_cubin_is_ignored():
    img = _fake_cubin(100)
    assert _cubins.find_cubins(img[:-10]) == []


def test_opcode_parser():
    sass = """
        /*0090*/                   UTCQMMA.2CTA gdesc[UR4], gdesc[UR6], tmem[UR8], tmem[UR10], idesc[UR11], UPT ;  /* 0x... */
        /*00a0*/              @!P0 LDTM.x32 R4, tmem[UR4] ;
        /*00b0*/                   UTCCP.T.S.4x32dp128bit tmem[UR4], gdesc[UR6] ;
                                                                      /* 0x000fe2000800000c */
    """
    assert _cubins.opcodes(sass) == {"UTCQMMA.2CTA", "LDTM.x32", "UTCCP.T.S.4x32dp128bit"}
