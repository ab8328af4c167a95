"""The environment the benchmarks run in, set (as defaults) when this module is imported: no model
hub, no datasets hub, no W&B, no tokenizer thread pool. A script imports it first, before any
library that reads these variables at import time::

    from benchmarks.lib import offline  # noqa: F401  (before torch, transformers, ...)
"""

from __future__ import annotations

import os

DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "disabled",
}

for _key, _value in DEFAULTS.items():
    os.environ.setdefault(_key, _value)
