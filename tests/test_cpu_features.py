"""`--dtype auto` on CPU: bfloat16 only where the cores compute it natively."""

from pagedserve import cpu_features
from pagedserve.cpu_features import cpu_auto_dtype, has_native_bfloat16
from pagedserve.checkpoints.model_config import ModelInfo
from pagedserve.launch.serve_preflight import Deployment, _dtype_bytes


def test_native_bfloat16_flags():
    assert cpu_auto_dtype(frozenset({"avx512f", "avx512_bf16"})) == "bfloat16"
    assert cpu_auto_dtype(frozenset({"amx_tile", "amx_bf16"})) == "bfloat16"
    assert cpu_auto_dtype(frozenset({"avx2", "avx512f", "avx512_vnni"})) == "float32"
    assert cpu_auto_dtype(frozenset()) == "float32"


def test_flags_read_from_cpuinfo(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: test\nflags\t\t: fpu sse avx512f amx_bf16 amx_tile\n\n"
                       "processor\t: 1\nflags\t\t: fpu\n")
    monkeypatch.setattr(cpu_features, "CPUINFO", cpuinfo)
    cpu_features.cpu_flags.cache_clear()
    try:
        assert cpu_features.cpu_flags() == frozenset({"fpu", "sse", "avx512f", "amx_bf16", "amx_tile"})
        assert has_native_bfloat16()
        monkeypatch.setattr(cpu_features, "CPUINFO", tmp_path / "missing")
        cpu_features.cpu_flags.cache_clear()
        assert cpu_features.cpu_flags() == frozenset() and not has_native_bfloat16()
    finally:
        cpu_features.cpu_flags.cache_clear()


def test_preflight_counts_the_cpu_auto_dtype():
    model = ModelInfo(name="m", path=None, architecture="LlamaForCausalLM", vocab_size=64, max_position_embeddings=64,
                      num_layers=2, num_heads=2, num_kv_heads=1, head_size=8, hidden_size=16, torch_dtype="float32")
    running, stored = _dtype_bytes(model, Deployment(device="cpu", dtype="auto"))
    assert stored == 4 and running == (2 if has_native_bfloat16() else 4)
    assert _dtype_bytes(model, Deployment(device="cpu", dtype="float32")) == (4, 4)
