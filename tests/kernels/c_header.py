"""A parser for the restricted C of kernels/native/pagedserve_cpu.h (its opening comment states the
format) and the checks of the ctypes side against it:

    header = parse_header(text)                                # enums, structs, prototypes
    signature_mismatches(header, SIGNATURES, RESTYPES)         # [] when every prototype matches
    structure_mismatches(header, STRUCTURES, c_layout(...))    # [] when names, types, sizes, offsets match

c_layout compiles a probe that includes the header with the system C compiler and prints each
struct's sizeof and each member's offsetof, so the comparison is with the compiler's layout, not
with one computed here. Anything outside the format raises HeaderFormatError rather than being
skipped.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

SCALARS = ("float", "int32_t", "int64_t", "uint8_t", "uint16_t")
POINTER = "pointer"
CTYPE_OF = {POINTER: ctypes.c_void_p, "float": ctypes.c_float, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
            "uint8_t": ctypes.c_uint8, "uint16_t": ctypes.c_uint16, "void": None}


class HeaderFormatError(ValueError):
    pass


@dataclass(frozen=True)
class CFunction:
    name: str
    return_type: str  # "void", a scalar or POINTER
    params: tuple[str, ...]  # scalars or POINTER


@dataclass(frozen=True)
class CStruct:
    name: str
    fields: tuple[tuple[str, str], ...]  # (member, scalar or POINTER), in order


@dataclass(frozen=True)
class CHeader:
    enums: dict[str, dict[str, int]]  # enum name -> constant -> value
    structs: dict[str, CStruct]
    functions: dict[str, CFunction]


def _type(base: str, stars: str, structs: set[str], where: str) -> str:
    words = [word for word in base.split() if word != "const"]
    if len(words) == 2 and words[0] == "struct":
        if words[1] not in structs or not stars:
            raise HeaderFormatError(f"{where}: struct {words[1]} must be a struct of the header, passed by pointer")
        return POINTER
    if len(words) != 1 or words[0] not in (*SCALARS, "void"):
        raise HeaderFormatError(f"{where}: type {base!r} is not one of void, {', '.join(SCALARS)} or a struct")
    if stars:
        return POINTER
    return words[0]


_DECLARATOR = re.compile(r"^(?P<base>[\w ]*?)\s*(?P<stars>\**)\s*(?P<name>\w+)$")


def _declaration(text: str, structs: set[str], where: str) -> list[tuple[str, str]]:
    """`type *a, *b` -> [(a, type), (b, type)]."""
    first, *rest = [part.strip() for part in text.split(",")]
    match = _DECLARATOR.match(first)
    if match is None or not match["base"]:
        raise HeaderFormatError(f"{where}: cannot read the declaration {text!r}")
    base = match["base"]
    found = [(match["name"], _type(base, match["stars"], structs, where))]
    for part in rest:
        more = re.fullmatch(r"(\**)\s*(\w+)", part)
        if more is None:
            raise HeaderFormatError(f"{where}: cannot read the declarator {part!r}")
        found.append((more[2], _type(base, more[1], structs, where)))
    return found


def parse_header(text: str) -> CHeader:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    enums = {}
    for match in re.finditer(r"\benum\s+(\w+)\s*\{([^}]*)\}\s*;", text):
        constants = {}
        for item in filter(None, (item.strip() for item in match[2].split(","))):
            constant = re.fullmatch(r"(\w+)\s*=\s*(-?\d+)", item)
            if constant is None:
                raise HeaderFormatError(f"enum {match[1]}: {item!r} is not NAME = value")
            constants[constant[1]] = int(constant[2])
        enums[match[1]] = constants
    text = re.sub(r"\benum\s+\w+\s*\{[^}]*\}\s*;", " ", text)
    struct_bodies = {match[1]: match[2] for match in re.finditer(r"\bstruct\s+(\w+)\s*\{([^}]*)\}\s*;", text)}
    structs = {}
    for name, body in struct_bodies.items():
        fields = []
        for declaration in filter(None, (part.strip() for part in body.split(";"))):
            fields += _declaration(" ".join(declaration.split()), set(struct_bodies), f"struct {name}")
        structs[name] = CStruct(name, tuple(fields))
    text = re.sub(r"\bstruct\s+\w+\s*\{[^}]*\}\s*;", " ", text)
    functions = {}
    for statement in filter(None, (" ".join(part.split()) for part in text.split(";"))):
        match = re.fullmatch(r"(?P<head>[\w *]+?)\s*\((?P<params>[^()]*)\)", statement)
        if match is None:
            raise HeaderFormatError(f"not a prototype: {statement!r}")
        [(name, return_type)] = _declaration(match["head"], set(structs), "a prototype")
        params = () if match["params"].strip() == "void" else tuple(
            _declaration(param.strip(), set(structs), name)[0][1] for param in match["params"].split(","))
        functions[name] = CFunction(name, return_type, params)
    return CHeader(enums, structs, functions)


def _ctype_name(ctype) -> str:
    return "void" if ctype is None else ctype.__name__


def signature_mismatches(header: CHeader, signatures: dict[str, tuple], restypes: dict[str, object]) -> list[str]:
    """Every prototype against its ctypes argument types and return type, and the names both ways."""
    problems = [f"{name}: in the header, not in SIGNATURES" for name in header.functions if name not in signatures]
    problems += [f"{name}: in SIGNATURES, not in the header" for name in signatures if name not in header.functions]
    problems += [f"{name}: RESTYPES names a function the header lacks" for name in restypes
                 if name not in header.functions]
    for name, function in header.functions.items():
        if name not in signatures:
            continue
        argtypes = tuple(signatures[name])
        if len(argtypes) != len(function.params):
            problems.append(f"{name}: {len(function.params)} arguments in the header, {len(argtypes)} in SIGNATURES")
        for index, (c_type, argtype) in enumerate(zip(function.params, argtypes)):
            if CTYPE_OF[c_type] is not argtype:
                problems.append(f"{name}: argument {index} is {c_type} in the header, {_ctype_name(argtype)} in "
                                f"SIGNATURES")
        if CTYPE_OF[function.return_type] is not restypes.get(name):
            problems.append(f"{name}: returns {function.return_type} in the header, "
                            f"{_ctype_name(restypes.get(name))} in RESTYPES")
    return problems


@dataclass(frozen=True)
class CLayout:
    size: int
    offsets: dict[str, int]


def c_layout(header_path: Path, header: CHeader, compiler: str, work_dir: Path) -> dict[str, CLayout]:
    """sizeof and offsetof of every struct of the header, as the C compiler lays them out."""
    lines = ["#include <stddef.h>", "#include <stdio.h>", f'#include "{header_path.name}"', "int main(void) {"]
    for struct in header.structs.values():
        lines.append(f'    printf("%s %zu\\n", "{struct.name}", sizeof(struct {struct.name}));')
        for member, _ in struct.fields:
            lines.append(f'    printf("%s.%s %zu\\n", "{struct.name}", "{member}", '
                         f'offsetof(struct {struct.name}, {member}));')
    lines += ["    return 0;", "}"]
    source, binary = work_dir / "layout_probe.c", work_dir / "layout_probe"
    source.write_text("\n".join(lines) + "\n")
    subprocess.run([compiler, "-std=c11", "-I", str(header_path.parent), str(source), "-o", str(binary)],
                   check=True, capture_output=True, text=True, timeout=120)
    output = subprocess.run([str(binary)], check=True, capture_output=True, text=True, timeout=60).stdout
    values = dict(line.split() for line in output.splitlines())
    return {name: CLayout(int(values[name]), {member: int(values[f"{name}.{member}"]) for member, _ in struct.fields})
            for name, struct in header.structs.items()}


def structure_mismatches(header: CHeader, structures: dict[str, type], layouts: dict[str, CLayout]) -> list[str]:
    """Every C struct against its ctypes Structure: member names and order, types, sizeof, offsets."""
    problems = [f"struct {name}: in the header, no ctypes Structure" for name in header.structs
                if name not in structures]
    problems += [f"struct {name}: a ctypes Structure, not in the header" for name in structures
                 if name not in header.structs]
    for name, struct in header.structs.items():
        structure = structures.get(name)
        if structure is None:
            continue
        c_names = [member for member, _ in struct.fields]
        py_fields = [(field[0], field[1]) for field in structure._fields_]
        if c_names != [member for member, _ in py_fields]:
            problems.append(f"struct {name}: members {c_names} in the header, {[m for m, _ in py_fields]} in "
                            f"{structure.__name__}")
        c_types = dict(struct.fields)
        for member, ctype in py_fields:
            if member in c_types and CTYPE_OF[c_types[member]] is not ctype:
                problems.append(f"struct {name}.{member}: {c_types[member]} in the header, {ctype.__name__} in "
                                f"{structure.__name__}")
            if member in layouts[name].offsets and getattr(structure, member).offset != layouts[name].offsets[member]:
                problems.append(f"struct {name}.{member}: offset {layouts[name].offsets[member]} in C, "
                                f"{getattr(structure, member).offset} in {structure.__name__}")
        if ctypes.sizeof(structure) != layouts[name].size:
            problems.append(f"struct {name}: sizeof {layouts[name].size} in C, {ctypes.sizeof(structure)} in "
                            f"{structure.__name__}")
    return problems
