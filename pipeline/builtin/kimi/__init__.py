"""Files the built-in `builtin:tiny-kimi` target ships into its model folder:
the tokenizer's remote code (`tokenization_kimi.py`, copied as is; nothing
here imports it) and the chat template (`chat_template.jinja`)."""
