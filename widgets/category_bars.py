"""What vLLM measured of the chosen draft, as bars: the acceptance length per
category (MT-bench's eight, or a JSONL's own) on a fixed scale from 1 to 1 +
the draft tokens, and the accept rate per draft position on 0..1 — where a
draft is weak shows at a glance beside the acceptance per checkpoint."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich.text import Text
from textual.widgets import Static

from widgets.bars import bar


def bars(per_category: Mapping[str, float], k: int, width: int,
         per_position: Sequence[float] = ()) -> Text:
    """Lines `math        ███████▌    2.41` (the lowest in red), then
    `position 1  ████████▌  0.93` per draft position."""
    t = Text("acceptance per category" if per_category else "", style="bold")
    name_w = min(12, max([len(c) for c in per_category] + [len(f"position {len(per_position)}")]))
    bar_w = max(4, width - name_w - 7)
    low = min(per_category.values()) if per_category else None
    for cat, al in sorted(per_category.items(), key=lambda kv: kv[1]):
        t.append(f"\n{cat[:name_w]:<{name_w}} ")
        t.append_text(bar((al - 1.0) / max(k, 1), bar_w,
                          "red" if al == low and len(per_category) > 1 else "green"))
        t.append(f" {al:.2f}")
    if per_position:
        t.append(("\n" if per_category else "") + "accept rate per position", style="bold")
        for i, rate in enumerate(per_position):
            t.append(f"\n{f'position {i + 1}':<{name_w}} ")
            t.append_text(bar(rate, bar_w, "cyan"))
            t.append(f" {rate:.2f}")
    return t


class CategoryBars(Static):
    """Fed the evaluate summary's per-category and per-position figures;
    hidden without any. Drawn at its laid-out width (render), not the width
    it had when the figures came: the first ones come before layout."""

    DEFAULT_CSS = "CategoryBars { width: 34; height: auto; padding: 0 1; }"

    def __init__(self, **kw):
        super().__init__(**kw)
        self._figures: tuple = ({}, 3, ())

    def update_from(self, per_category: Mapping[str, float] | None, k: int,
                    per_position: Sequence[float] = ()) -> None:
        self.display = bool(per_category or per_position)
        figures = (dict(per_category or {}), k, tuple(per_position))
        if figures != self._figures:
            self._figures = figures
            self.refresh(layout=True)

    def render(self) -> Text:
        per_category, k, per_position = self._figures
        return bars(per_category, k, max(16, self.content_size.width or 32), per_position)
