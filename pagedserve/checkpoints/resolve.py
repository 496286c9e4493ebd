"""What `--model` names: the built-in `demo` model, the real model `smollm2`, a checkpoint folder
or a GGUF model (a .gguf file, or a folder holding one)."""

from __future__ import annotations

from pathlib import Path

from pagedserve.checkpoints.demo import DEMO_NAME, ensure_demo_model


def resolve_model(model: str) -> Path:
    """Maps `demo` to the built-in checkpoint (built on first use), `smollm2` to the cached real
    model (fetched once), and anything else to an existing checkpoint folder or GGUF model."""
    from pagedserve.checkpoints.gguf_config import is_gguf
    from pagedserve.checkpoints.smollm2 import SMOLLM2_NAME, ensure_smollm2

    if model == DEMO_NAME:
        return ensure_demo_model()
    if model == SMOLLM2_NAME:
        return ensure_smollm2()
    path = Path(model).expanduser()
    if is_gguf(path):
        return path
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{model} is not a checkpoint folder with a config.json nor a GGUF model "
                                f"(use --model demo for the built-in model)")
    return path


def served_model_name(model_path: str | Path) -> str:
    """The name clients use for a checkpoint: `demo` and `smollm2` for those, else its folder or
    file name."""
    from pagedserve.checkpoints.demo import demo_path
    from pagedserve.checkpoints.smollm2 import SMOLLM2_NAME, smollm2_path

    path = Path(model_path).expanduser().resolve()
    for name, known in ((DEMO_NAME, demo_path()), (SMOLLM2_NAME, smollm2_path())):
        if path in (known.expanduser().resolve(), known.parent.expanduser().resolve()):
            return name
    return Path(model_path).name or str(model_path)
