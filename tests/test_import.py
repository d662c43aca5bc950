"""Importing the package changes nothing in torch: a process that imports fsdp_compile
and shards nothing compiles exactly as without it. What we install into torch's compile
pipeline (our graph passes, the FX-graph cache-key correction, the Dynamo frame-compile
callbacks, the ``TORCH_LOGS`` alias, ``FSDP_COMPILE_DUMP``) arrives with the first
``fully_shard``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SNAPSHOT = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.fx.node
    import torch._dynamo.config, torch._functorch.config, torch._inductor.config
    from torch._dynamo.callback import callback_handler
    from torch._inductor.codecache import FxGraphCachePickler
    from torch._logging import _internal as logs

    def snapshot():
        ours = lambda f: "fsdp_compile" in repr(f)
        return {
            "inductor": repr(sorted(torch._inductor.config.get_config_copy().items())),
            "functorch": repr(sorted(torch._functorch.config.get_config_copy().items())),
            "dynamo": repr(sorted(torch._dynamo.config.get_config_copy().items())),
            "cache_pickler_init": repr(FxGraphCachePickler.__init__),
            "dynamo_callbacks": [len(callback_handler.start_callbacks), len(callback_handler.end_callbacks)],
            "log_aliases": sorted(logs.log_registry.log_alias_to_log_qnames),
            # Our own ops may be marked side-effectful (they are ours); nothing else may change.
            "side_effectful": sorted(repr(f) for f in torch.fx.node._side_effectful_functions if not ours(f)),
        }

    before = snapshot()
    import fsdp_compile, fsdp_compile.config, fsdp_compile.debug, fsdp_compile.passes, fsdp_compile.runtime
    after_import = snapshot()
    dumped = os.path.exists(os.environ["FSDP_COMPILE_DUMP"])
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    fsdp_compile.fully_shard(torch.nn.Linear(4, 4))
    after_shard = snapshot()
    dist.destroy_process_group()
    print(json.dumps({"before": before, "after_import": after_import, "after_shard": after_shard, "dumped": dumped}))
    """
)


def test_import_changes_no_torch_global(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    env["FSDP_COMPILE_DUMP"] = str(tmp_path / "dump")
    port = str(29000 + os.getpid() % 1000)
    out = subprocess.run([sys.executable, "-c", SNAPSHOT, port], env=env, capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    before, after_import, after_shard = result["before"], result["after_import"], result["after_shard"]
    changed = [key for key in before if before[key] != after_import[key]]
    assert changed == [], f"import fsdp_compile changed torch's {changed}"
    assert not result["dumped"], "FSDP_COMPILE_DUMP took effect at import"
    # The first fully_shard installs them (so the check above can fail).
    installed = {key for key in before if before[key] != after_shard[key]}
    assert {"inductor", "functorch", "cache_pickler_init", "dynamo_callbacks", "log_aliases"} <= installed, installed


def _fsdp_compile_imports(path) -> set[str]:
    """The ``fsdp_compile`` modules a source file imports (at any depth of the file)."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fsdp_compile"):
            base = node.module
            names |= {f"{base}.{a.name}" if base in ("fsdp_compile", "fsdp_compile.base") else base for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("fsdp_compile")}
    return names


def test_layers_import_only_what_is_below_them():
    """``fsdp_compile.base`` imports nothing of ours outside itself; ``runtime/`` imports
    only the base and itself; ``passes/`` only the base, the runtime and itself. So each
    layer can be read, and tested, without the front end above it."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    allowed = {
        "fsdp_compile/base": ("fsdp_compile.base",),
        "runtime": ("fsdp_compile.base", "fsdp_compile.runtime"),
        "passes": ("fsdp_compile.base", "fsdp_compile.runtime", "fsdp_compile.passes"),
    }
    wrong = {}
    for folder, prefixes in allowed.items():
        for path in sorted((root / folder).glob("*.py")):
            bad = sorted(m for m in _fsdp_compile_imports(path) if not any(m == p or m.startswith(p + ".") for p in prefixes))
            if bad:
                wrong[f"{folder}/{path.name}"] = bad
    assert wrong == {}, wrong
    assert len(list((root / "runtime").glob("*.py"))) > 3 and len(list((root / "passes").glob("*.py"))) > 3


def test_public_modules_are_attributes_of_the_package():
    """``import fsdp_compile`` alone gives ``fsdp_compile.config`` (the one options module the
    passes read, also as ``import fsdp_compile.config``) and ``fsdp_compile.debug``."""
    code = (
        "import fsdp_compile, sys\n"
        "import fsdp_compile.base.config as base\n"
        "assert fsdp_compile.config is base is sys.modules['fsdp_compile.config'], fsdp_compile.config\n"
        "import fsdp_compile.config as c\n"
        "assert c is base\n"
        "assert callable(fsdp_compile.debug.dump)\n"
    )
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)


def test_no_library_function_is_longer_than_60_lines():
    """The library stays readable one function at a time (FSDP2's layout, smaller pieces)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    long = []
    for folder in ("fsdp_compile", "runtime", "passes"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                    long.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == [], long
