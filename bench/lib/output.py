"""What every benchmark prints and writes: aligned console and Markdown tables, and a JSON report (with its PNG
plot, when there is one) under bench/results/, named by kind and UTC time."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"

Column = str | tuple[str, str | Callable[[dict], object]]  # key, or (title, key or row -> value)


def timestamp() -> str:
    """UTC time as it appears in result file names: 20261122T182454Z."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def print_table(rows: list[dict], columns: list[Column] | None = None, *, title: str | None = None,
                float_format: str = ",.1f") -> None:
    """Right-aligned columns; `columns` defaults to the keys of the first row; missing values print
    empty."""
    if not rows:
        return
    columns = [(column, column) if isinstance(column, str) else column for column in (columns or list(rows[0]))]

    def cell(row: dict, get) -> str:
        value = get(row) if callable(get) else row.get(get, "")
        return format(value, float_format) if isinstance(value, float) else str(value)

    cells = [[cell(row, get) for _, get in columns] for row in rows]
    widths = [max(len(name), *(len(line[i]) for line in cells)) for i, (name, _) in enumerate(columns)]
    if title:
        print(title)
    print("  ".join(name.rjust(width) for (name, _), width in zip(columns, widths)))
    for line in cells:
        print("  ".join(value.rjust(width) for value, width in zip(line, widths)))
    print()


def markdown_table(headers: list[str], rows: list[list], float_format: str = ",.1f") -> str:
    """A Markdown table with padded columns (text left, values right); floats use float_format."""
    cells = [[format(value, float_format) if isinstance(value, float) else str(value) for value in row]
             for row in rows]
    widths = [max(len(headers[column]), *(len(row[column]) for row in cells)) for column in range(len(headers))]
    lines = ["| " + " | ".join(header.ljust(width) for header, width in zip(headers, widths)) + " |",
             "|" + "|".join("-" * (width + 2) for width in widths) + "|"]
    lines += ["| " + " | ".join(cell.rjust(width) for cell, width in zip(row, widths)) + " |" for row in cells]
    return "\n".join(lines)


def save_figure(figure, path: Path) -> None:
    """Writes a matplotlib figure as the PNG beside a report, and frees it."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def save_report(name: str, report: dict, plot: Callable[[dict, Path], None] | None = None) -> list[Path]:
    """Writes RESULTS_DIR/{name}.json, and {name}.png drawn by plot(report, path) when given;
    returns the paths written."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    json_path = RESULTS_DIR / f"{name}.json"
    json_path.write_text(json.dumps(report, indent=2))
    paths = [json_path]
    if plot is not None:
        png_path = RESULTS_DIR / f"{name}.png"
        plot(report, png_path)
        paths.append(png_path)
    return paths
