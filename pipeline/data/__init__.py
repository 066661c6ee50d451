"""The stages' input rows: where they come from (rows) and the
assistant-only loss masks of a chat template (chat_mask)."""
