"""Find the CUDA cubins embedded in an exported object file and read their SASS.

CuTeDSL's `export_to_c` writes a host `.o` that carries each kernel's cubin
inside its own data blob, not in a `.nv_fatbin` section, so `cuobjdump` cannot
see it in the `.o` or in the linked `.so`.  A cubin is a complete ELF image of
its own, so we scan the bytes for ELF headers whose machine is CUDA (190), work
out each image's size from its header tables, and cut it out.

Pure Python (stdlib only); used by the sm90 and sm100 build tests.
"""

import glob
import os
import shutil
import struct
import subprocess
from dataclasses import dataclass
from typing import List, Optional

ELF_MAGIC = b"\x7fELF"
EM_CUDA = 190
_SHT_NOBITS = 8


@dataclass(frozen=True)
class Cubin:
    offset: int  # where the image starts in the containing file
    data: bytes
    sm: Optional[int]  # e.g. 100 for sm_100a, when the header says

    def write(self, path: str) -> str:
        with open(path, "wb") as f:
            f.write(self.data)
        return path


def _image_size(buf: bytes, off: int) -> Optional[int]:
    """Size of the 64-bit little-endian ELF image at `off`, or None if invalid."""
    if len(buf) - off < 64 or buf[off + 4] != 2 or buf[off + 5] != 1:
        return None  # not ELFCLASS64 little-endian: cubins always are
    (e_phoff, e_shoff) = struct.unpack_from("<QQ", buf, off + 0x20)
    (e_phentsize, e_phnum, e_shentsize, e_shnum) = struct.unpack_from("<HHHH", buf, off + 0x36)
    end = 64
    if e_phnum:
        end = max(end, e_phoff + e_phnum * e_phentsize)
    if e_shnum:
        end = max(end, e_shoff + e_shnum * e_shentsize)
        # Section contents normally precede the header table, but take them
        # into account in case a producer orders them differently.
        for i in range(e_shnum):
            sh = off + e_shoff + i * e_shentsize
            if sh + 64 > len(buf):
                return None
            sh_type = struct.unpack_from("<I", buf, sh + 4)[0]
            sh_offset, sh_size = struct.unpack_from("<QQ", buf, sh + 0x18)
            if sh_type != _SHT_NOBITS:
                end = max(end, sh_offset + sh_size)
    if off + end > len(buf):
        return None
    return end


def _sm_of(image: bytes) -> Optional[int]:
    """SM number from e_flags: bits 8-15 in the CUDA 12.8+ ELF ABI (version 8,
    e.g. 0x6400 = sm_100), the low byte in older ones; None if implausible."""
    flags = struct.unpack_from("<I", image, 0x30)[0]
    abi_version = image[8]
    sm = (flags >> 8) & 0xFF if abi_version >= 8 else flags & 0xFF
    return sm if 50 <= sm <= 200 else None


def find_cubins(buf: bytes) -> List[Cubin]:
    """Every CUDA ELF image inside `buf` (bytes of a .o, .so or .cubin)."""
    found = []
    pos = buf.find(ELF_MAGIC)
    while pos != -1:
        next_from = pos + 4
        if len(buf) - pos >= 20 and struct.unpack_from("<H", buf, pos + 18)[0] == EM_CUDA:
            size = _image_size(buf, pos)
            if size:
                image = bytes(buf[pos:pos + size])
                found.append(Cubin(pos, image, _sm_of(image)))
                next_from = pos + size
        pos = buf.find(ELF_MAGIC, next_from)
    return found


def find_cubins_in_file(path: str) -> List[Cubin]:
    with open(path, "rb") as f:
        return find_cubins(f.read())


def _pip_tool(name: str) -> Optional[str]:
    """A CUDA tool installed by pip (`nvidia-cuda-cuobjdump`, `nvidia-cuda-nvdisasm`):
    the wheels put it under site-packages/nvidia/<cuXX or pkg>/bin/."""
    try:
        import nvidia  # namespace package of the NVIDIA wheels
    except ImportError:
        return None
    for base in list(getattr(nvidia, "__path__", [])):
        for cand in sorted(glob.glob(os.path.join(base, "*", "bin", name)), reverse=True):
            if os.access(cand, os.X_OK):
                return cand
    return None


def _tool(name: str) -> Optional[str]:
    """`name` from PATH, the pip wheels, or a CUDA toolkit, in that order."""
    exe = shutil.which(name) or _pip_tool(name)
    if exe:
        return exe
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", name), os.X_OK):
            return os.path.join(root, "bin", name)
    return None


def cuobjdump_path() -> Optional[str]:
    return _tool("cuobjdump")


def nvdisasm_dir() -> Optional[str]:
    """Directory holding nvdisasm (cuobjdump --dump-sass runs it from PATH)."""
    exe = _tool("nvdisasm")
    return os.path.dirname(exe) if exe else None


def sass_tools_missing() -> Optional[str]:
    """None when SASS can be dumped here, else a sentence saying what is missing."""
    if cuobjdump_path() is None:
        return "cuobjdump not found (pip install nvidia-cuda-cuobjdump)"
    if nvdisasm_dir() is None:
        return "nvdisasm not found (pip install nvidia-cuda-nvdisasm)"
    return None


def dump_sass(cubin_path: str) -> str:
    """`cuobjdump --dump-sass` of one cubin file."""
    missing = sass_tools_missing()
    if missing:
        raise RuntimeError(missing)
    env = dict(os.environ)
    env["PATH"] = nvdisasm_dir() + os.pathsep + env.get("PATH", "")
    res = subprocess.run([cuobjdump_path(), "--dump-sass", cubin_path],
                         capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"cuobjdump failed on {cubin_path}: {res.stderr.strip()}")
    return res.stdout


def sass_of_object(obj_path: str, work_dir: str) -> List[str]:
    """Extract every cubin from `obj_path` into `work_dir`; return their SASS."""
    os.makedirs(work_dir, exist_ok=True)
    base = os.path.splitext(os.path.basename(obj_path))[0]
    out = []
    for i, cub in enumerate(find_cubins_in_file(obj_path)):
        out.append(dump_sass(cub.write(os.path.join(work_dir, f"{base}.{i}.cubin"))))
    return out


def opcodes(sass: str) -> set:
    """The set of opcodes (with modifiers, e.g. 'UTCOMMA.4X') in a SASS dump."""
    ops = set()
    for line in sass.splitlines():
        # Instruction lines look like: /*0090*/   UTCQMMA.2CTA gdesc[UR4], ... ;
        s = line.strip()
        if not s.startswith("/*") or "*/" not in s:
            continue
        body = s.split("*/", 1)[1].strip()
        if not body or body.startswith("/*"):
            continue
        tok = body.split()[0]
        if tok.startswith("@"):  # predicate guard
            parts = body.split()
            if len(parts) < 2:
                continue
            tok = parts[1]
        ops.add(tok.rstrip(";"))
    return ops
