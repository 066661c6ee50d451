"""The embedded default: a tiny target model and a conversation dataset."""

from pathlib import Path

HERE = Path(__file__).resolve().parent


def conversations_path() -> Path:
    return HERE / "conversations.jsonl"


def broken_conversations_path() -> Path:
    return HERE / "conversations_broken.jsonl"
