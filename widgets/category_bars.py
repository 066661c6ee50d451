"""Acceptance length per category (MT-bench's eight, or a JSONL's own), one
bar each on a fixed scale from 1 to 1 + the draft tokens: where a draft is
weak shows at a glance beside the training curves."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static


def bars(per_category: dict[str, float], k: int, width: int) -> Text:
    """Lines `math        ███████▌    2.41`; the lowest in red."""
    t = Text("acceptance per category", style="bold")
    if not per_category:
        return t
    name_w = min(12, max(len(c) for c in per_category))
    bar_w = max(4, width - name_w - 7)
    low = min(per_category.values())
    for cat, al in sorted(per_category.items(), key=lambda kv: kv[1]):
        share = min(1.0, max(0.0, (al - 1.0) / max(k, 1)))
        eighths = round(share * bar_w * 8)
        full, part = divmod(eighths, 8)
        bar = "█" * full + (" ▏▎▍▌▋▊▉"[part] if part else "")
        t.append(f"\n{cat[:name_w]:<{name_w}} ")
        t.append(f"{bar:<{bar_w}}", style="red" if al == low and len(per_category) > 1
                 else "green")
        t.append(f" {al:.2f}")
    return t


class CategoryBars(Static):
    """Fed the evaluate summary's per-category figures; hidden without any."""

    DEFAULT_CSS = "CategoryBars { width: 34; height: auto; padding: 0 1; }"

    def update_from(self, per_category: dict[str, float] | None, k: int) -> None:
        self.display = bool(per_category)
        if per_category:
            self.update(bars(per_category, k, max(16, self.size.width - 2 or 32)))
