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
