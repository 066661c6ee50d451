"""Kimi-style tokenizer of eagle-panel's tiny Kimi target (builtin:tiny-kimi).

Copied into the model folder as `tokenization_kimi.py` and named by
`tokenizer_config.json`'s `auto_map`: like the real Kimi-K2.5's tokenizer it
loads only with `trust_remote_code=True` (transformers and vLLM alike). Its
serialization is a `tokenizers` file under a name only this class knows
(`kimi_tokenizer.json`); the folder holds no `tokenizer.json`,
`tokenizer.model` or `tiktoken.model`, any of which transformers' generic
TokenizersBackend would load without the remote code.

Needs only `tokenizers` and transformers >= 5 (TokenizersBackend).
"""

import os

from tokenizers import Tokenizer
from transformers import TokenizersBackend

KIMI_TOKENIZER_FILE = "kimi_tokenizer.json"


class KimiTokenizer(TokenizersBackend):
    """A byte-level BPE with Kimi's special tokens after its base vocabulary."""

    # not "tokenizer_file": transformers hard-wires that key to tokenizer.json
    vocab_files_names = {"kimi_tokenizer_file": KIMI_TOKENIZER_FILE}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, kimi_tokenizer_file=None, tokenizer_object=None, **kwargs):
        if tokenizer_object is None:
            if kimi_tokenizer_file is None or not os.path.isfile(kimi_tokenizer_file):
                raise ValueError(f"KimiTokenizer needs {KIMI_TOKENIZER_FILE} in the model folder")
            tokenizer_object = Tokenizer.from_file(kimi_tokenizer_file)
        super().__init__(tokenizer_object=tokenizer_object, **kwargs)

    def _save_pretrained(self, save_directory, file_names, legacy_format=None, filename_prefix=None):
        # the default writes tokenizer.json, which would make the saved copy load
        # without trust_remote_code (as a generic TokenizersBackend): our own name instead
        name = (filename_prefix + "-" if filename_prefix else "") + KIMI_TOKENIZER_FILE
        path = os.path.join(str(save_directory), name)
        self.backend_tokenizer.save(path)
        return tuple(file_names) + (path,)
