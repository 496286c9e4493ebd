"""What `--model` names: the built-in `demo` model, or a checkpoint folder."""

from __future__ import annotations

from pathlib import Path

from pagedserve.models.demo import DEMO_NAME, ensure_demo_model


def resolve_model(model: str) -> Path:
    """Maps `demo` to the built-in checkpoint (built on first use) and anything else to an existing
    checkpoint folder."""
    if model == DEMO_NAME:
        return ensure_demo_model()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{model} is not a checkpoint folder with a config.json "
                                f"(use --model demo for the built-in model)")
    return path


def served_model_name(model_path: str | Path) -> str:
    """The name clients use for a checkpoint: `demo` for the demo model, else its folder name."""
    from pagedserve.models.demo import demo_path

    path = Path(model_path)
    if path.expanduser().resolve() == demo_path().expanduser().resolve():
        return DEMO_NAME
    return path.name or str(path)
