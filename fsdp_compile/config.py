"""``fsdp_compile.config``: every knob of how the compiler schedules sharded collectives.

The options live in :mod:`fsdp_compile.base.config` (the base layer ``runtime/`` and
``passes/`` read them from); this name is the same module object, so
``import fsdp_compile.config as fsdp_config; fsdp_config.bucket_mode = "cap"`` and
``fsdp_config.patch(...)`` set what the passes read.
"""

import sys

from fsdp_compile.base import config as _config

sys.modules[__name__] = _config
