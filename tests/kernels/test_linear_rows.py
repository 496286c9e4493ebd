"""The native few-rows bfloat16 linear (kernels/linear/native_rows.py) against F.linear."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.linear import native_rows
from pagedserve.kernels.native import library as native_lib

pytestmark = pytest.mark.skipif(native_lib.compiler() is None or not native_lib.load()
                                or not native_lib.load().linear_rows_available(),
                                reason="needs a C compiler and AVX-512 BF16")


@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("size_out,size_in", [(960, 576), (7, 45), (130, 1536), (4, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_a_float32_product_to_one_rounding(num_rows, size_out, size_in, with_bias):
    generator = torch.Generator().manual_seed(num_rows * 1000 + size_in)
    x = torch.randn(num_rows, size_in, generator=generator).bfloat16()
    weight = (torch.randn(size_out, size_in, generator=generator) / size_in ** 0.5).bfloat16()
    bias = torch.randn(size_out, generator=generator).bfloat16() if with_bias else None
    ours = native_rows.linear_rows(x, weight, bias)
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert ours.shape == (num_rows, size_out) and ours.dtype == torch.bfloat16
    # float32 sums rounded once to bfloat16: within a bfloat16 unit in the last place of the exact value
    assert torch.all((ours.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-5)
    assert torch.allclose(ours.float(), native_rows.linear_rows_ref(x, weight, bias).float(), rtol=2 ** -7,
                          atol=1e-2)


def test_supports_only_few_contiguous_bfloat16_rows():
    weight = torch.randn(8, 32).bfloat16()
    assert native_rows.supports(torch.randn(1, 32).bfloat16(), weight)
    assert not native_rows.supports(torch.randn(native_rows.MAX_ROWS + 1, 32).bfloat16(), weight)
    assert not native_rows.supports(torch.randn(1, 32), weight.float())
    assert not native_rows.supports(torch.randn(32, 2).bfloat16().t(), weight)
    assert not native_rows.supports(torch.randn(0, 32).bfloat16(), weight)
    assert native_rows.supports(torch.randn(8, 32).bfloat16(), weight, max_rows=native_rows.KERNEL_MAX_ROWS)


def test_a_bfloat16_layer_uses_the_path_its_tuning_chose():
    from pagedserve.kernels.linear import panels
    from pagedserve.worker.layers.parallel import ColumnParallelLinear, ShardRange
    from pagedserve.worker.loading.prepacked_weights import prepack_model

    layer = ColumnParallelLinear(64, [ShardRange(96, 0, 96)], bias=False, dtype=torch.bfloat16, device="cpu")
    torch.nn.init.normal_(layer.weight)
    if not prepack_model(layer):
        pytest.skip("neither panels nor oneDNN bfloat16 on this CPU")
    from pagedserve.kernels import ops

    few, many = torch.randn(1, 64).bfloat16(), torch.randn(16, 64).bfloat16()
    if ops.panels_for_few_rows():  # the host's tuning: the panels at every row count
        assert torch.equal(layer(few), panels.panel_linear(few, layer.prepacked_weight, None))
    else:
        assert torch.equal(layer(few), native_rows.linear_rows(few, layer.weight, None))
    if isinstance(layer.prepacked_weight, panels.PanelWeight):
        assert torch.equal(layer(many), panels.panel_linear(many, layer.prepacked_weight, None))
    else:
        assert torch.equal(layer(many), F.linear(many, layer.weight))


@pytest.mark.parametrize("layout,few_rows", [("panels", "rows"), ("panels", "panels"), ("onednn", "rows")])
def test_ops_linear_picks_the_path_by_weight_and_rows(monkeypatch, layout, few_rows):
    """ops.linear, the worker's one entry for linear layers: the native kernel up to MAX_ROWS rows
    beside a prepacked weight, the prepacked copy above (panels or oneDNN's layout, as the host's
    tuning chose; both bit for bit against their own kernel), the panels at every row count where
    the tuning chose them for few rows too, F.linear without a prepacked copy, the quantized kernel
    for a packed weight."""
    from pagedserve.kernels import ops
    from pagedserve.kernels.linear import panels
    from pagedserve.kernels.linear.onednn import prepacked_linear
    from pagedserve.worker.quantization.quantizers import quantize_int8

    lib = native_lib.load()
    monkeypatch.setattr(lib, "_pagedserve_tuning", {**lib._pagedserve_tuning, "linear_bf16_layout": layout,
                                                    "linear_bf16_few_rows": few_rows})
    generator = torch.Generator().manual_seed(5)
    weight = (torch.randn(96, 64, generator=generator) / 8).bfloat16()
    bias = torch.randn(96, generator=generator).bfloat16()
    prepacked = ops.prepack_weight(weight)
    assert isinstance(prepacked, panels.PanelWeight) == (layout == "panels")
    assert prepacked is not None and ops.prepack_weight(weight.float()) is None
    for num_rows in range(1, native_rows.MAX_ROWS + 3):
        x = torch.randn(num_rows, 64, generator=generator).bfloat16()
        chosen = ops.linear(x, weight, bias, prepacked=prepacked)
        if num_rows <= native_rows.MAX_ROWS and few_rows == "rows":
            assert torch.equal(chosen, native_rows.linear_rows(x, weight, bias))
        elif layout == "panels":
            assert torch.equal(chosen, panels.panel_linear(x, prepacked, bias))
        else:
            assert torch.equal(chosen, prepacked_linear(x, prepacked, bias))
        assert torch.equal(ops.linear(x, weight, bias), F.linear(x, weight, bias))
    x = torch.randn(3, 64, generator=generator)
    packed = quantize_int8(weight.float())
    assert torch.equal(ops.linear(x, None, None, packed=packed), ops.quantized_linear(x, packed))
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "reference")
    assert ops.prepack_weight(weight) is None


def test_the_prefetch_distance_changes_no_result():
    lib = native_lib.load()
    before = lib.linear_rows_prefetch()
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(3, 1536, generator=generator).bfloat16()
    weight = torch.randn(577, 1536, generator=generator).bfloat16()
    results = []
    try:
        for distance in (0, 512, 8192):
            lib.linear_rows_set_prefetch(distance)
            assert lib.linear_rows_prefetch() == distance
            results.append(native_rows.linear_rows(x, weight, None, lib))
    finally:
        lib.linear_rows_set_prefetch(before)
    assert all(torch.equal(result, results[0]) for result in results[1:])


def _write_tuning(folder, text: str) -> None:
    """A tuning file of these parameters, measured the current way on the current pages (text
    that is not JSON as it is)."""
    from pagedserve.kernels.native import tuning

    try:
        params = {**json.loads(text), "method": tuning.METHOD, "weight_pages": tuning.weight_pages()}
    except ValueError:
        (folder / tuning.FILE_NAME).write_text(text)
    else:
        (folder / tuning.FILE_NAME).write_text(json.dumps(params))


def test_tuning_measures_once_then_reads_its_file(tmp_path, monkeypatch):
    from pagedserve.kernels.native import block_tuning, tuning

    lib = native_lib.load()
    before, before_blocks, tuned = lib.linear_rows_prefetch(), lib.block_quant_prefetch(), lib._pagedserve_tuning
    before_panels = [lib.panel_linear_prefetch(rows) for rows in range(1, 9)]
    monkeypatch.delenv(tuning.PREFETCH_ENV, raising=False)
    monkeypatch.delenv(tuning.BLOCK_PREFETCH_ENV, raising=False)
    monkeypatch.delenv(tuning.LAYOUT_ENV, raising=False)
    monkeypatch.delenv(tuning.BLOCK_PANEL_ENV, raising=False)
    monkeypatch.setattr(tuning, "WEIGHT_BYTES", 4 << 20)  # a quick measurement; the choice is not checked
    monkeypatch.setattr(tuning, "LAYOUT_ROWS", (4, 32))
    monkeypatch.setattr(block_tuning, "BLOCK_PANEL_ROWS", (40, 48))
    try:
        measured = tuning.apply(lib, tmp_path)
        assert measured["source"] == "measured" and measured["linear_rows_prefetch"] in tuning.CANDIDATES
        assert (measured["method"], measured["weight_pages"]) == (tuning.METHOD, tuning.weight_pages())
        assert set(measured["gb_per_s"]) == {str(distance) for distance in tuning.CANDIDATES}
        assert lib.linear_rows_prefetch() == measured["linear_rows_prefetch"]
        assert measured["block_quant_prefetch"] in tuning.CANDIDATES
        assert set(measured["block_gb_per_s"]) == {str(distance) for distance in tuning.CANDIDATES}
        assert lib.block_quant_prefetch() == measured["block_quant_prefetch"]
        assert measured["block_quant_panel_rows"] in (tuning.BLOCK_PANEL_MIN_ROWS, 40, 48)
        assert tuning.block_panel_rows(lib) == measured["block_quant_panel_rows"]
        if lib.block_quant_rows_bf16_available():  # the ratios measured, up to the first slower by more than noise
            ratios = measured["block_panel_ratios"]
            assert list(ratios) in (["40"], ["40", "48"])
            assert measured["block_quant_panel_rows"] == max([tuning.BLOCK_PANEL_MIN_ROWS] + [
                int(rows) for rows, ratio in ratios.items() if ratio < 1 + tuning.NOISE])
        layout_ms = measured["layout_ms"]
        assert set(layout_ms) == {"4", "32"} and all(set(pair) == set(tuning.LAYOUTS) for pair in layout_ms.values())
        assert measured["linear_bf16_layout"] in tuning.LAYOUTS  # timings decide; the choice is not checked
        assert measured["linear_bf16_few_rows"] == "rows" or measured["linear_bf16_layout"] == "panels"
        assert set(measured.get("few_rows_gb_per_s", {})) <= {"rows", "panels"}
        assert tuning.linear_bf16_layout(lib) == measured["linear_bf16_layout"]
        if measured["linear_bf16_layout"] == "panels":
            distances = measured["panel_prefetch"]
            assert set(distances) == {"1", "2", "4", "8"} and set(distances.values()) <= set(tuning.PANEL_CANDIDATES)
            assert set(measured["panel_gb_per_s"]["8"]) == {str(distance) for distance in tuning.PANEL_CANDIDATES}
            # a block of 3-4 rows takes the distance measured at 4, of 5-8 that measured at 8
            assert [lib.panel_linear_prefetch(rows) for rows in range(1, 9)] == [
                distances[key] for key in ("1", "2", "4", "4", "8", "8", "8", "8")]
        _write_tuning(tmp_path, 
            '{"linear_rows_prefetch": 0, "block_quant_prefetch": 0, "linear_bf16_layout": "panels",'
            ' "linear_bf16_few_rows": "panels", "panel_prefetch": {"1": 512, "2": 1024, "4": 2048, "8": 3072},'
            ' "block_quant_panel_rows": 32, "source": "measured"}')
        assert tuning.apply(lib, tmp_path)["source"] == "measured"
        if lib.panel_linear_available():  # without the panel kernel its distances are not kept
            assert [lib.panel_linear_prefetch(rows) for rows in range(1, 9)] == [512, 1024, 2048, 2048] + [3072] * 4
        _write_tuning(tmp_path, 
            '{"linear_rows_prefetch": 0, "block_quant_prefetch": 0, "linear_bf16_layout": "panels",'
            ' "linear_bf16_few_rows": "panels", "source": "measured"}')
        assert "layout_ms" in tuning.apply(lib, tmp_path)  # panels without their distances: measured anew
        _write_tuning(tmp_path, 
            '{"linear_rows_prefetch": 2048, "block_quant_prefetch": 1024, "linear_bf16_layout": "onednn",'
            ' "linear_bf16_few_rows": "rows", "block_quant_panel_rows": 200, "source": "measured"}')
        assert tuning.apply(lib, tmp_path)["linear_rows_prefetch"] == 2048 and lib.linear_rows_prefetch() == 2048
        kept = json.loads((tmp_path / tuning.FILE_NAME).read_text())
        for stale in ({"method": "fastest passes"}, {"weight_pages": "1 GiB"}, {"method": None}):
            (tmp_path / tuning.FILE_NAME).write_text(json.dumps({**kept, **stale}))
            assert "gb_per_s" in tuning.apply(lib, tmp_path)  # measured another way or on other pages: anew
        _write_tuning(tmp_path, json.dumps({key: kept[key] for key in kept if key not in ("method", "weight_pages")}))
        assert tuning.apply(lib, tmp_path)["linear_rows_prefetch"] == 2048 and lib.linear_rows_prefetch() == 2048
        assert lib.block_quant_prefetch() == 1024
        assert tuning.linear_bf16_layout(lib) == "onednn" and tuning.block_panel_rows(lib) == 200
        without_rows = {key: value for key, value in kept.items() if key != "block_quant_panel_rows"}
        _write_tuning(tmp_path, json.dumps(without_rows))
        assert "block_panel_ratios" in tuning.apply(lib, tmp_path)  # a file without the panels' rows: anew
        _write_tuning(tmp_path, json.dumps(kept))
        monkeypatch.setenv(tuning.BLOCK_PANEL_ENV, "8")  # never below the kernel's own rows
        assert tuning.apply(lib, tmp_path)["source"] == tuning.BLOCK_PANEL_ENV and tuning.block_panel_rows(lib) == 32
        monkeypatch.setenv(tuning.BLOCK_PANEL_ENV, "300")
        assert tuning.apply(lib, tmp_path)["block_quant_panel_rows"] == 300 and tuning.block_panel_rows(lib) == 300
        monkeypatch.delenv(tuning.BLOCK_PANEL_ENV)
        monkeypatch.setenv(tuning.PREFETCH_ENV, "4096")
        assert tuning.apply(lib, tmp_path)["source"] == tuning.PREFETCH_ENV and lib.linear_rows_prefetch() == 4096
        monkeypatch.setenv(tuning.LAYOUT_ENV, "panels")
        assert tuning.apply(lib, tmp_path)["source"] == f"{tuning.PREFETCH_ENV},{tuning.LAYOUT_ENV}"
        assert tuning.linear_bf16_layout(lib) == "panels"
        monkeypatch.setenv(tuning.BLOCK_PREFETCH_ENV, "512")
        assert tuning.apply(lib, tmp_path)["block_quant_prefetch"] == 512 and lib.block_quant_prefetch() == 512
        _write_tuning(tmp_path, 
            '{"linear_rows_prefetch": 2048, "linear_bf16_layout": "onednn", "linear_bf16_few_rows": "rows",'
            ' "source": "measured"}')
        monkeypatch.delenv(tuning.BLOCK_PREFETCH_ENV)
        assert tuning.apply(lib, tmp_path)["source"] == f"{tuning.PREFETCH_ENV},{tuning.LAYOUT_ENV}"
        assert "block_gb_per_s" in lib._pagedserve_tuning  # a file without the block distance is measured anew
        _write_tuning(tmp_path, '{"linear_rows_prefetch": 2048, "source": "measured"}')
        monkeypatch.delenv(tuning.PREFETCH_ENV)
        monkeypatch.delenv(tuning.LAYOUT_ENV)
        assert tuning.apply(lib, tmp_path)["source"] == "measured"  # a file without the layout is measured anew
        _write_tuning(tmp_path, "not json")
        assert tuning.apply(lib, tmp_path)["source"] == "measured"  # an unreadable file is measured anew
    finally:
        lib.linear_rows_set_prefetch(before)
        lib.block_quant_set_prefetch(before_blocks)
        for rows, distance in enumerate(before_panels, start=1):
            lib.panel_linear_set_prefetch(rows, distance)
        lib._pagedserve_tuning = tuned


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_result_does_not_depend_on_the_thread_count(dtype):
    """Each output row is computed by one thread, front to back over K (linear_rows.c): the same bits
    at 1 to 7 threads (more than the cores), whatever output width the split divides."""
    lib = native_lib.load()
    function = lib.linear_rows_bf16 if dtype == torch.bfloat16 else lib.linear_rows_f32
    generator = torch.Generator().manual_seed(11)
    previous = torch.get_num_threads()
    try:
        for num_rows, size_out, size_in in ((1, 3072, 576), (2, 577, 1536), (5, 33, 576), (8, 1000, 64)):
            x = torch.randn(num_rows, size_in, generator=generator).to(dtype)
            weight = torch.randn(size_out, size_in, generator=generator).to(dtype)
            bias = torch.randn(size_out, generator=generator).to(dtype)
            results = []
            for threads in (1, 2, 3, 7):
                torch.set_num_threads(threads)
                y = torch.empty(num_rows, size_out, dtype=dtype)
                function(x.data_ptr(), weight.data_ptr(), bias.data_ptr(), y.data_ptr(), num_rows, size_out, size_in)
                results.append(y)
            assert all(torch.equal(result, results[0]) for result in results[1:]), (num_rows, size_out, size_in)
            reference = F.linear(x.float(), weight.float(), bias.float())
            assert torch.allclose(results[0].float(), reference, rtol=2 ** -6, atol=1e-2 * size_in ** 0.5)
    finally:
        torch.set_num_threads(previous)


def test_the_tunings_weights_are_on_the_pages_the_worker_serves_from():
    """The measurements stream from memory marked MADV_HUGEPAGE where the host gives it (as the
    worker moves its weights there), with the values the measurement wrote."""
    from pagedserve import huge_pages
    from pagedserve.kernels.native import tuning

    weight = tuning._row_weight()[0]
    dense, packed = tuning._projection_weights()[0]
    assert torch.equal(weight, torch.ones_like(weight)) and torch.equal(dense, torch.full_like(dense, 0.5))
    assert tuning.weight_pages() == ("2 MiB" if huge_pages.available() else "4 KiB")
    assert all(huge_pages.is_marked(t) == huge_pages.available() for t in (weight, dense, packed))
