"""The base layer: what ``runtime/``, ``passes/`` and the front end all stand on.

* :mod:`~fsdp_compile.base.compat` — every private torch API the library touches;
* :mod:`~fsdp_compile.base.execution_mode` — whether code runs eagerly, traced by
  Dynamo, or in a compiled backward;
* :mod:`~fsdp_compile.base.config` — the compiler options (``fsdp_compile.config``);
* :mod:`~fsdp_compile.base.dumps` — the dump folders ``fsdp_compile.debug.dump`` opens.

It imports nothing of ``fsdp_compile`` outside itself; ``runtime/`` and ``passes/``
import nothing of the front end outside it (``tests/test_import.py`` checks both).
"""
