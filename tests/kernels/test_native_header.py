"""The native library's one C header (kernels/native/pagedserve_cpu.h) against the ctypes side:
library.SIGNATURES and RESTYPES match every prototype, each ctypes Structure in abi.py matches its
C struct in member names, order, types, sizeof and offsets (as the system C compiler lays it out),
and abi.DTYPE_CODES matches the header's enum. The same checks run on deliberately wrong copies,
which they must reject."""

from __future__ import annotations

import ast
import ctypes
import platform
import subprocess
from pathlib import Path

import pytest
import torch
from c_header import (
    HeaderFormatError,
    c_layout,
    parse_header,
    signature_mismatches,
    structure_mismatches,
)

from pagedserve.cpu_features import cpu_flags
from pagedserve.kernels.native import abi
from pagedserve.kernels.native import library as native_lib

HEADER = native_lib.SOURCE_DIR / "pagedserve_cpu.h"
REPO_ROOT = Path(__file__).resolve().parents[2]
ENUM_NAMES = {torch.float32: "DTYPE_F32", torch.bfloat16: "DTYPE_BF16"}


@pytest.fixture(scope="module")
def header():
    return parse_header(HEADER.read_text())


@pytest.fixture(scope="module")
def layouts(header, tmp_path_factory):
    compiler = native_lib.compiler()
    assert compiler is not None, "the layout check needs the C compiler the library build uses"
    return c_layout(HEADER, header, compiler, tmp_path_factory.mktemp("probe"))


def test_the_parser_reads_every_prototype_and_struct(header):
    assert set(header.functions) >= {"add_rms_norm", "decode_layer", "linear_rows_available",
                                      "paged_decode_attention"}
    assert header.functions["linear_rows_available"].params == ()
    assert header.functions["linear_rows_available"].return_type == "int32_t"
    assert header.functions["decode_layer"].params[:2] == ("pointer", "pointer")  # the struct pointers
    assert header.structs["step_rows"].fields[-2:] == (("num_rows", "int64_t"), ("max_blocks", "int64_t"))
    assert header.enums["pagedserve_dtype"] == {"DTYPE_F32": 0, "DTYPE_BF16": 1}


def test_signatures_match_every_prototype(header):
    assert signature_mismatches(header, native_lib.SIGNATURES, native_lib.RESTYPES) == []


def test_structures_match_the_compilers_layout(header, layouts):
    assert set(abi.STRUCTURES) == set(header.structs)
    assert structure_mismatches(header, abi.STRUCTURES, layouts) == []


def test_dtype_codes_are_the_headers_enum(header):
    enum = header.enums["pagedserve_dtype"]
    assert {ENUM_NAMES[dtype]: code for dtype, code in abi.DTYPE_CODES.items()} == enum


def test_dtype_codes_are_defined_once():
    """Only abi.py assigns DTYPE_CODES; every kernel wrapper imports it."""
    assigning = []
    for folder in ("kernels", "worker", "pagedserve"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
                if any(isinstance(target, ast.Name) and target.id == "DTYPE_CODES" for target in targets):
                    assigning.append(path.relative_to(REPO_ROOT).as_posix())
    assert assigning == ["kernels/native/abi.py"]


def test_the_library_builds_against_the_header():
    """Every .c includes the header (the compiler then checks each definition against its prototype)."""
    for source in native_lib.sources():
        assert '#include "pagedserve_cpu.h"' in source.read_text(), source.name


@pytest.mark.parametrize("march", ["x86-64-v2", "x86-64-v3"])
def test_the_library_builds_for_a_cpu_without_avx512(tmp_path, march, monkeypatch):
    """The sources compile, with the library's flags, for an x86 CPU without AVX-512 (SSE4.2, then
    AVX2): the kernels that need AVX-512 then report themselves unavailable (with AVX2 the block
    kernel's float32 paths remain, checked numerically where this host runs AVX2) and the rest still
    serve. The library built for this host links the same sources, so a definition kept on both
    sides of an #if would only fail on such a CPU."""
    compiler = native_lib.compiler()
    if compiler is None:
        pytest.skip("needs a C compiler")
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs an x86-64 host")
    flags = [flag if flag != "-march=native" else f"-march={march}" for flag in native_lib.CFLAGS]
    target = tmp_path / "libpagedserve_cpu.so"
    result = subprocess.run([compiler, *flags, "-Werror", "-I", str(native_lib.SOURCE_DIR),
                             *map(str, native_lib.sources()), "-o", str(target), "-lm"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lib = ctypes.CDLL(str(target))
    has_avx2 = march == "x86-64-v3"  # AVX2, FMA and F16C: the block kernel's float32 paths (block_quant_rows_avx2.c)
    assert (lib.linear_rows_available(), lib.panel_linear_available(), lib.block_quant_rows_available(),
            lib.block_quant_rows_bf16_available(), lib.prefill_attention_available(),
            lib.linear_rows_f32_available()) == (0, 0, int(has_avx2), 0, 0, int(has_avx2))
    if has_avx2 and {"avx2", "fma", "f16c"} <= cpu_flags():
        _check_avx2_kernels(lib)
        _check_avx2_decode_attention(lib, monkeypatch)


def _check_avx2_decode_attention(lib, monkeypatch) -> None:
    """The AVX2 build's decode attention (8-lane loops for head sizes that are multiples of 8, the
    scalar ones for the rest), through ops.paged_attention, against paged_attention_ref."""
    from tests.kernels.conftest import build_paged_batch

    from pagedserve.kernels import ops
    from pagedserve.kernels.attention.reference import paged_attention_ref

    native_lib.bind_signatures(lib)
    monkeypatch.setattr(native_lib, "load", lambda: lib)
    seqs = [(40, 1), (0, 1), (130, 1), (300, 1)]  # 300: runs of 128 positions merged
    for dtype, (num_heads, num_kv_heads, head_size) in ((torch.float32, (9, 3, 64)), (torch.bfloat16, (9, 3, 64)),
                                                        (torch.float32, (8, 1, 24)), (torch.float32, (4, 2, 20))):
        batch = build_paged_batch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                                  block_size=16, dtype=dtype, device=torch.device("cpu"), seed=head_size)
        scale = head_size ** -0.5
        expected = paged_attention_ref(*batch.args(), scale, None, 1.0, 1.0)
        actual = ops.paged_attention(*batch.args(), scale, None, 1.0, 1.0, {})
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(actual.float(), expected.float(), rtol=tolerance, atol=tolerance), (dtype, head_size)


def _check_avx2_kernels(lib) -> None:
    """The AVX2 build's block kernel and float32 row kernel, run on this host, against the exact
    product (the library built for an AVX-512 host never runs this code, so it is checked here on
    every x86 host)."""
    from test_block_quant import TYPES, _gguf_weight

    native_lib.bind_signatures(lib)
    for num_rows, size_out, size_in in ((1, 70, 576), (3, 33, 45), (8, 17, 1544)):
        generator = torch.Generator().manual_seed(size_in)
        x, weight = torch.randn(num_rows, size_in, generator=generator), torch.randn(size_out, size_in, generator=generator)
        bias = torch.randn(size_out, generator=generator)
        y = torch.full((num_rows, size_out), float("nan"))
        lib.linear_rows_f32(x.data_ptr(), weight.data_ptr(), bias.data_ptr(), y.data_ptr(), num_rows, size_out, size_in)
        exact = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
        assert float((y.double() - exact).abs().max() / exact.abs().max()) < 1e-5, (num_rows, size_in)
    for tensor_type in TYPES:
        weight, _ = _gguf_weight(tensor_type, 75, 320, seed=5)
        mins = weight.mins.data_ptr() if weight.mins is not None else None
        for num_rows in (1, 2, 3, 4, 5, 32):
            x = torch.randn(num_rows, 320, generator=torch.Generator().manual_seed(num_rows))
            y = torch.empty(num_rows, 75)
            lib.block_quant_rows(x.data_ptr(), weight.qs.data_ptr(), weight.scales.data_ptr(), mins, y.data_ptr(),
                                 num_rows, 75, 320, weight.bits)
            exact = torch.nn.functional.linear(x.double(), weight.dequantize().double())
            assert float((y.double() - exact).abs().max() / exact.abs().max()) < 1e-6, (tensor_type, num_rows)
        out = torch.full((75, 320), float("nan"))
        assert lib.block_quant_dequantize(weight.qs.data_ptr(), weight.scales.data_ptr(), mins, out.data_ptr(),
                                          75, 320, weight.bits, abi.DTYPE_CODES[torch.float32]) == 1
        assert torch.equal(out, weight.dequantize())
        assert lib.block_quant_dequantize(weight.qs.data_ptr(), weight.scales.data_ptr(), mins, out.data_ptr(),
                                          75, 320, weight.bits, abi.DTYPE_CODES[torch.bfloat16]) == 0


# --- the checks reject wrong copies ---------------------------------------------------------------

def test_a_wrong_signature_is_named(header):
    P, I32, I64, F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
    wrong = dict(native_lib.SIGNATURES)
    wrong["silu_mul"] = (P, P, I64, I64, I32, I32)  # stride int32, not int64
    wrong["add_rms_norm"] = native_lib.SIGNATURES["add_rms_norm"][:-1]  # has_residual dropped
    del wrong["linear_rows_f32"]
    wrong["linear_rows_int8"] = (P, P, P, P, I64, I64, I64)  # a function the header does not declare
    problems = signature_mismatches(header, wrong, {**native_lib.RESTYPES, "decode_layer": F32})
    assert problems == [
        "linear_rows_f32: in the header, not in SIGNATURES",
        "linear_rows_int8: in SIGNATURES, not in the header",
        "add_rms_norm: 9 arguments in the header, 8 in SIGNATURES",
        "silu_mul: argument 4 is int64_t in the header, c_int in SIGNATURES",
        "decode_layer: returns void in the header, c_float in RESTYPES",
    ]
    assert signature_mismatches(header, native_lib.SIGNATURES, {"linear_rows_available": I32,
                                                                "linear_rows_f32_available": I32,
                                                                "linear_rows_prefetch": I64,
                                                                "panel_linear_available": I32,
                                                                "panel_linear_prefetch": I64,
                                                                "block_quant_rows_available": I32,
                                                                "block_quant_dequantize": I32,
                                                                "block_quant_prefetch": I64,
                                                                "decode_step": I32,
                                                                "decode_layers_overlapped": I64,
                                                                "decode_run_steps": I64,
                                                                "prefill_attention_available": I32,
                                                                "paged_prefill_attention": I32}) == [
        "block_quant_rows_bf16_available: returns int32_t in the header, void in RESTYPES"]


def test_a_wrong_structure_is_named(header, layouts):
    rows, weights = list(abi.StepRows._fields_), list(abi.LayerWeights._fields_)

    class Swapped(ctypes.Structure):  # two members in the wrong order
        _fields_ = [rows[1], rows[0], *rows[2:]]

    class Widened(ctypes.Structure):  # eps a double: the members after it move
        _fields_ = [*weights[:19], ("eps", ctypes.c_double), *weights[20:]]

    class Packed(ctypes.Structure):  # the right members packed: no padding before the block pointers
        _pack_ = 1
        _fields_ = weights

    def check(**structures):
        return structure_mismatches(header, {**abi.STRUCTURES, **structures}, layouts)

    assert check(step_rows=Swapped) == [
        f"struct step_rows: members {[name for name, _ in rows]} in the header, "
        f"{[name for name, _ in Swapped._fields_]} in Swapped",
        "struct step_rows.positions: offset 8 in C, 0 in Swapped",
        "struct step_rows.cos_sin: offset 0 in C, 8 in Swapped"]
    assert check(layer_weights=Widened) == [
        "struct layer_weights.eps: float in the header, c_double in Widened",
        "struct layer_weights.scale: offset 156 in C, 160 in Widened",
        "struct layer_weights.cache_dtype: offset 160 in C, 164 in Widened",
        "struct layer_weights.sliding_window: offset 164 in C, 168 in Widened",
        "struct layer_weights.dtype: offset 168 in C, 172 in Widened"]  # the pointers after it align to 176
    assert check(layer_weights=Packed) == [
        *[f"struct layer_weights.{name}: offset {176 + 8 * i} in C, {172 + 8 * i} in Packed"
          for i, name in enumerate(("qkv_blocks", "o_blocks", "gate_up_blocks", "down_blocks",
                                    "qkv_panels", "o_panels", "gate_up_panels", "down_panels"))],
        "struct layer_weights: sizeof 240 in C, 236 in Packed"]
    assert structure_mismatches(header, {"step_rows": abi.StepRows}, layouts) == [
        "struct block_linear: in the header, no ctypes Structure",
        "struct layer_weights: in the header, no ctypes Structure",
        "struct decode_run: in the header, no ctypes Structure"]


def test_a_wrong_header_is_caught_or_refused(tmp_path):
    text = HEADER.read_text()
    edited = parse_header(text.replace("int64_t stride, int32_t dtype);", "int32_t stride, int32_t dtype);"))
    assert signature_mismatches(edited, native_lib.SIGNATURES, native_lib.RESTYPES) == [
        "silu_mul: argument 4 is int32_t in the header, c_long in SIGNATURES"]
    with pytest.raises(HeaderFormatError, match="double"):
        parse_header(text.replace("float eps, scale;", "double eps, scale;"))
    with pytest.raises(HeaderFormatError, match="struct missing"):
        parse_header(text.replace("void *scratch);", "struct missing *scratch);"))
    moved = text.replace("    int64_t num_rows, max_blocks;", "    int32_t pad;\n    int64_t num_rows, max_blocks;")
    (tmp_path / HEADER.name).write_text(moved)
    header = parse_header(moved)
    layouts = c_layout(tmp_path / HEADER.name, header, native_lib.compiler(), tmp_path)
    assert structure_mismatches(header, abi.STRUCTURES, layouts)[0].startswith("struct step_rows: members")
