"""List the GPU code embedded in a CUDA build of marcache._C: one line per
fat-binary entry, e.g. "ELF sm_80", "ELF sm_90", "PTX compute_90".

A stand-in for `cuobjdump --list-elf --list-ptx` where the toolkit has no
cuobjdump (the CI image). It reads the ELF's .nv_fatbin section: fat binaries
{u32 magic 0xBA55ED50, u16 version, u16 header size, u64 size} holding entries
{u16 kind (1 PTX, 2 ELF), u16, u32 header size, u64 payload size, ..., u32 arch
at byte 28 (major * 10 + minor)}. The layout is not documented by NVIDIA; the
check that each ELF payload starts with an ELF header guards the reading.

    python tools/cuda_fatbin_list.py [path/to/_C.so]   (default: the imported one)
"""
import struct
import sys

FATBIN_MAGIC = 0xBA55ED50


def fatbin_entries(path):
    """[(kind, arch, compressed)] with kind "ELF" or "PTX", arch an int (80, 90)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("%s: not a 64-bit ELF file" % path)
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(i):
        name, _, _, _, off, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        return name, off, size

    _, strtab, _ = section(shstrndx)
    entries = []
    for i in range(shnum):
        name, off, size = section(i)
        if data[strtab + name:data.index(b"\0", strtab + name)] != b".nv_fatbin":
            continue
        pos, end = off, off + size
        while pos + 16 <= end:
            magic, _, hsize, fsize = struct.unpack_from("<IHHQ", data, pos)
            if magic != FATBIN_MAGIC:
                pos += 8  # fat binaries are 8-byte aligned inside the section
                continue
            e, e_end = pos + hsize, pos + hsize + fsize
            while e < e_end:
                kind, _, ehsize, psize = struct.unpack_from("<HHIQ", data, e)
                arch, = struct.unpack_from("<I", data, e + 28)
                payload = data[e + ehsize:e + ehsize + 4]
                compressed = payload == b"\x28\xb5\x2f\xfd"  # zstd frame
                if kind == 2 and not compressed and payload != b"\x7fELF":
                    raise ValueError("%s: fat binary ELF entry without an ELF header" % path)
                entries.append(({1: "PTX", 2: "ELF"}.get(kind, str(kind)), arch, compressed))
                e += ehsize + psize
            pos = e_end
    return entries


def main(argv):
    if len(argv) > 1:
        path = argv[1]
    else:
        from marcache import _C
        path = _C.__file__
    for kind, arch, compressed in sorted(set(fatbin_entries(path))):
        print("%s %s_%d%s" % (kind, "sm" if kind == "ELF" else "compute", arch,
                              " (compressed)" if compressed else ""))


if __name__ == "__main__":
    main(sys.argv)
