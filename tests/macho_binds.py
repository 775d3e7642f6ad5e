"""Which library each imported symbol of a 64-bit Mach-O image is bound to (tests/test_mac_build.py).

dyld binds every symbol an image imports to one of the libraries it loads (two-level namespace),
except those left to a flat lookup at load time (``-undefined dynamic_lookup``). Read from the
image's own bind information: the opcode streams of LC_DYLD_INFO(_ONLY) (bind and lazy bind) or
the import table of LC_DYLD_CHAINED_FIXUPS, whichever the linker wrote. Only what the check needs
is decoded: library ordinals and symbol names, not addresses.
"""

from __future__ import annotations

import struct
from typing import Dict, Iterator, List, Tuple

FLAT_LOOKUP = "(flat lookup)"
MH_MAGIC_64 = 0xFEEDFACF
LC_REQ_DYLD = 0x80000000
LC_LOAD_DYLIB, LC_LAZY_LOAD_DYLIB = 0xC, 0x20
LC_LOAD_WEAK_DYLIB, LC_REEXPORT_DYLIB, LC_LOAD_UPWARD_DYLIB = 0x18 | LC_REQ_DYLD, 0x1F | LC_REQ_DYLD, 0x23 | LC_REQ_DYLD
LC_DYLD_INFO, LC_DYLD_INFO_ONLY = 0x22, 0x22 | LC_REQ_DYLD
LC_DYLD_CHAINED_FIXUPS = 0x34 | LC_REQ_DYLD
_DYLIB_COMMANDS = {LC_LOAD_DYLIB, LC_LOAD_WEAK_DYLIB, LC_REEXPORT_DYLIB, LC_LAZY_LOAD_DYLIB, LC_LOAD_UPWARD_DYLIB}
# Special ordinals (BIND_SPECIAL_DYLIB_*): the image itself, the main executable, a flat lookup,
# a weak lookup.
_SPECIAL = {0: "(self)", -1: "(main executable)", -2: FLAT_LOOKUP, -3: "(weak lookup)"}


def _uleb(data: bytes, i: int) -> Tuple[int, int]:
    value = shift = 0
    while True:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return value, i


def _load_commands(data: bytes) -> Iterator[Tuple[int, int]]:
    if len(data) < 32 or struct.unpack_from("<I", data, 0)[0] != MH_MAGIC_64:
        raise ValueError("not a 64-bit little-endian Mach-O image")
    ncmds = struct.unpack_from("<I", data, 16)[0]
    off = 32
    for _ in range(ncmds):
        cmd, size = struct.unpack_from("<II", data, off)
        yield cmd, off
        off += size


def loaded_dylibs(data: bytes) -> List[str]:
    """The install names of the libraries the image loads, in ordinal order (1 is the first)."""
    out = []
    for cmd, off in _load_commands(data):
        if cmd in _DYLIB_COMMANDS:
            name_off = struct.unpack_from("<I", data, off + 8)[0]
            end = data.index(b"\0", off + name_off)
            out.append(data[off + name_off:end].decode())
    return out


# Opcodes (high nibble) that only skip ULEB operands: how many; and those that bind a symbol.
# SET_TYPE_IMM, SET_ADDEND_SLEB, SET_SEGMENT_AND_OFFSET_ULEB, ADD_ADDR_ULEB, DO_BIND,
# DO_BIND_ADD_ADDR_ULEB, DO_BIND_ADD_ADDR_IMM_SCALED, DO_BIND_ULEB_TIMES_SKIPPING_ULEB.
_ULEB_OPERANDS = {0x50: 0, 0x60: 1, 0x70: 1, 0x80: 1, 0x90: 0, 0xA0: 1, 0xB0: 0, 0xC0: 2}
_BINDING = {0x90, 0xA0, 0xB0, 0xC0}


def _opcode_binds(data: bytes, start: int, size: int) -> Iterator[Tuple[int, str]]:
    """(ordinal, symbol) for each bind of one LC_DYLD_INFO opcode stream."""
    ordinal, symbol, i, end = 0, "", start, start + size
    while i < end:
        byte = data[i]
        i += 1
        op, imm = byte & 0xF0, byte & 0x0F
        if op == 0x00:  # DONE (the lazy stream has one after each symbol)
            continue
        if op in (0x10, 0x20, 0x30):  # SET_DYLIB_ORDINAL_IMM, _ULEB, SET_DYLIB_SPECIAL_IMM
            ordinal, i = (imm, i) if op == 0x10 else _uleb(data, i) if op == 0x20 else (imm - 16 if imm else 0, i)
        elif op == 0x40:  # SET_SYMBOL_TRAILING_FLAGS_IMM
            j = data.index(b"\0", i)
            symbol, i = data[i:j].decode(), j + 1
        elif op in _ULEB_OPERANDS:
            for _ in range(_ULEB_OPERANDS[op]):
                _, i = _uleb(data, i)
            if op in _BINDING:
                yield ordinal, symbol
        elif op == 0xD0:  # THREADED: SET_BIND_ORDINAL_TABLE_SIZE_ULEB (imm 0) or APPLY (imm 1)
            i = _uleb(data, i)[1] if imm == 0 else i
        else:
            raise ValueError(f"bind opcode 0x{byte:02x} at {i - 1}: not one dyld defines")


def _chained_imports(data: bytes, off: int) -> Iterator[Tuple[int, str]]:
    dataoff = struct.unpack_from("<I", data, off + 8)[0]
    _, _, imports_off, symbols_off, count, fmt, _ = struct.unpack_from("<7I", data, dataoff)
    base, syms = dataoff + imports_off, dataoff + symbols_off
    for k in range(count):
        if fmt == 1:  # DYLD_CHAINED_IMPORT: lib_ordinal:8 weak:1 name_offset:23
            raw = struct.unpack_from("<I", data, base + 4 * k)[0]
            ordinal, name_off = raw & 0xFF, raw >> 9
            ordinal = ordinal - 256 if ordinal >= 0xF0 else ordinal
        elif fmt == 2:  # ..._ADDEND: the same and an int32 addend
            raw = struct.unpack_from("<I", data, base + 8 * k)[0]
            ordinal, name_off = raw & 0xFF, raw >> 9
            ordinal = ordinal - 256 if ordinal >= 0xF0 else ordinal
        elif fmt == 3:  # ..._ADDEND64: lib_ordinal:16 weak:1 reserved:15 name_offset:32, addend
            raw = struct.unpack_from("<Q", data, base + 16 * k)[0]
            ordinal, name_off = raw & 0xFFFF, raw >> 32
            ordinal = ordinal - 65536 if ordinal >= 0xFFF0 else ordinal
        else:
            raise ValueError(f"chained fixups import format {fmt}: not one dyld defines")
        end = data.index(b"\0", syms + name_off)
        yield ordinal, data[syms + name_off:end].decode()


def bound_symbols(path: str) -> Dict[str, str]:
    """symbol -> the install name of the library dyld binds it to, or FLAT_LOOKUP."""
    with open(path, "rb") as f:
        data = f.read()
    libs = loaded_dylibs(data)
    pairs: List[Tuple[int, str]] = []
    for cmd, off in _load_commands(data):
        if cmd in (LC_DYLD_INFO, LC_DYLD_INFO_ONLY):
            fields = struct.unpack_from("<10I", data, off + 8)
            # bind and lazy bind; weak bind only coalesces weak definitions by name (no library).
            for start, size in ((fields[2], fields[3]), (fields[6], fields[7])):
                pairs.extend(_opcode_binds(data, start, size))
        elif cmd == LC_DYLD_CHAINED_FIXUPS:
            pairs.extend(_chained_imports(data, off))
    out: Dict[str, str] = {}
    for ordinal, symbol in pairs:
        if ordinal in _SPECIAL:
            out[symbol] = _SPECIAL[ordinal]
        elif 1 <= ordinal <= len(libs):
            out[symbol] = libs[ordinal - 1]
        else:
            raise ValueError(f"{symbol}: library ordinal {ordinal}, but the image loads {len(libs)}")
    return out
