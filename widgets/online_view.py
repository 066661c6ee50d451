"""Online training's producer/consumer figures as two lines of text."""

from __future__ import annotations

from rich.text import Text

from pipeline.fmt import nbytes


def online_text(ev: dict) -> Text:
    """Online training in two lines: the producers (vLLM) beside the
    consumer (the trainer), and who waits for whom."""
    def share(x):
        return "-" if x is None else f"{x:.0%}"

    def gpus(ds):
        return ",".join(map(str, ds)) if ds else "CPU"
    kv = ev.get("kv_usage_perc")
    t = Text()
    t.append(f"vLLM[{gpus(ev.get('server_devices'))}] ", style="bold")
    t.append(f"{ev.get('produced_tokens_per_s') or 0:,.0f} tok/s  run {ev.get('running', 0)} "
             f"wait {ev.get('waiting', 0)}  KV {share(kv)}  idle "
             f"{share(ev.get('server_idle_share'))}  ")
    t.append(f"trainer[{gpus(ev.get('trainer_devices'))}] ", style="bold")
    t.append(f"{ev.get('consumed_tokens_per_s') or 0:,.0f} tok/s  waits "
             f"{share(ev.get('trainer_wait_share'))}  buffer {nbytes(ev.get('buffer_bytes'))} "
             f"(peak {nbytes(ev.get('buffer_peak_bytes'))})\n")
    starved = not ev.get("verdict", "").startswith("balanced")
    t.append(ev.get("verdict", ""), style="bold yellow" if starved else "green")
    return t
