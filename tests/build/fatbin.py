"""The GPU architectures held by the CUDA fat binaries inside ELF files.

cuobjdump is not part of the CUDA toolkit installed here, and Debian's main
archive has none, so this reads the `.nv_fatbin` section itself. What it relies on:

- The section holds fat binaries one after another (one per CUDA translation
  unit once linked), each a 16-byte header, `<I H H Q>`: magic 0xBA55ED50
  (`FATBIN_MAGIC` beside `fatbinary_section.h`'s wrapper magic 0x466243B1),
  version 1, header size 16, then the byte count of the entries that follow.
- Each entry: u16 kind at 0 (1 PTX, 2 ELF cubin), u32 header size at 4, u64
  payload size at 8 (header and payload are back to back), u32 SM number at
  28 (90, 100, 120), u64 flags at 40: bit 0x8000 compressed payload, bit
  0x100000 an arch-specific target (sm_90a, compute_90a), bit 0x200000 a
  family target (sm_100f).
- An uncompressed cubin payload is an ELF whose e_flags carry the SM number in
  bits 8-15 (CUDA ELF ABI version 8 and later), checked against the header's.

The layout is not published by NVIDIA; it is the one reverse-engineered
descriptions of the format give, and the flag bits are what nvcc 13.0 writes
for the same kernel built as sm_90, sm_90a, sm_100a, sm_100f, sm_120a and
compute_90. test_fatbins.py compiles those with the build's nvcc and checks
that this module names each one correctly before it trusts it on the build.

Usage: python3 tests/build/fatbin.py FILE...  (prints each file's architectures)
"""

import struct
import sys

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX = 1
KIND_ELF = 2
FLAG_COMPRESSED = 0x8000
FLAG_ARCH_SPECIFIC = 0x100000
FLAG_FAMILY = 0x200000
ENTRY_MIN_HEADER = 64


class FatbinError(ValueError):
    pass


def elf_section(data, name):
    """The bytes of section `name` of a 64-bit little-endian ELF file, or None."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise FatbinError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i):
        base = shoff + i * shentsize
        sh_name, = struct.unpack_from("<I", data, base)
        sh_offset, sh_size = struct.unpack_from("<QQ", data, base + 24)
        return sh_name, sh_offset, sh_size

    _, str_off, str_size = header(shstrndx)
    names = data[str_off:str_off + str_size]
    for i in range(shnum):
        sh_name, off, size = header(i)
        end = names.index(b"\0", sh_name)
        if names[sh_name:end].decode() == name:
            return data[off:off + size]
    return None


def entry_name(kind, sm, flags):
    suffix = "a" if flags & FLAG_ARCH_SPECIFIC else "f" if flags & FLAG_FAMILY else ""
    if kind == KIND_PTX:
        return f"compute_{sm}{suffix}"
    if kind == KIND_ELF:
        return f"sm_{sm}{suffix}"
    raise FatbinError(f"entry of unknown kind {kind} (sm {sm})")


def cubin_sm(payload):
    """The SM number in a cubin's e_flags, or None where the ABI predates that field."""
    if payload[:4] != b"\x7fELF" or payload[8] < 8:
        return None
    e_flags, = struct.unpack_from("<I", payload, 48)
    return (e_flags >> 8) & 0xFF


def parse_container(data, off):
    """The entries' names of the fat binary at `off`, and the offset past it."""
    magic, version, header_size, size = struct.unpack_from("<IHHQ", data, off)
    if magic != FATBIN_MAGIC or version != 1 or header_size != 16:
        raise FatbinError(f"no fat binary header at offset {off}")
    pos, end = off + header_size, off + header_size + size
    if end > len(data):
        raise FatbinError(f"fat binary at {off} runs past the section ({end} > {len(data)})")
    names = []
    while pos < end:
        kind, = struct.unpack_from("<H", data, pos)
        entry_header, = struct.unpack_from("<I", data, pos + 4)
        payload_size, = struct.unpack_from("<Q", data, pos + 8)
        sm, = struct.unpack_from("<I", data, pos + 28)
        flags, = struct.unpack_from("<Q", data, pos + 40)
        if entry_header < ENTRY_MIN_HEADER:
            raise FatbinError(f"entry at {pos}: header of {entry_header} bytes")
        name = entry_name(kind, sm, flags)
        payload = data[pos + entry_header:pos + entry_header + payload_size]
        if kind == KIND_ELF and not flags & FLAG_COMPRESSED:
            elf_sm = cubin_sm(payload)
            if elf_sm is not None and elf_sm != sm:
                raise FatbinError(f"{name} entry at {pos}: its cubin says sm_{elf_sm}")
        names.append(name)
        pos += entry_header + payload_size
    if pos != end:
        raise FatbinError(f"fat binary at {off}: entries end at {pos}, not {end}")
    return names, end


def fatbins(path):
    """Per fat binary in `path`'s .nv_fatbin section, the sorted names of its
    entries ("sm_90a", "compute_90", ...); [] where the file has no section."""
    with open(path, "rb") as f:
        data = f.read()
    section = elf_section(data, ".nv_fatbin")
    if section is None:
        return []
    magic = struct.pack("<I", FATBIN_MAGIC)
    out, off = [], section.find(magic)
    while off >= 0:
        names, off = parse_container(section, off)
        out.append(sorted(names))
        off = section.find(magic, off)  # the next one, past alignment padding
    return out


def main(argv):
    for path in argv:
        bins = fatbins(path)
        kinds = sorted({" ".join(b) for b in bins})
        print(f"{path}: {len(bins)} fat binaries; " + " | ".join(kinds))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
