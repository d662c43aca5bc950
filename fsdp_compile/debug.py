"""See every stage of a compiled sharded step.

    import fsdp_compile.debug

    with fsdp_compile.debug.dump("dump_dir"):
        loss = torch.compile(model)(batch).sum(); loss.backward()

or ``FSDP_COMPILE_DUMP=dump_dir python train.py``. Per rank (``dump_dir/rank0``...):

* ``depyf/`` — depyf's decompiled Dynamo bytecode and graphs;
* ``joint_<k>.md`` — the joint graph's all-gather chains and the recompute
  decision the reshard pass took for each;
* ``graph_<k>_<forward|backward>/`` — the post-grad graph as Inductor handed
  it to us (``0_input.py``), after each of our passes (``1_bucketing.py``,
  ``2_reordering.py``, ``3_pinned.py``), Inductor's ``output_code.py``, a
  ``collectives.md`` report (one row per collective: kind, unit, parameters,
  dtype, bytes, bucket, issue and wait positions, compute between them,
  estimated time and overlap on ``fsdp_compile.config.hardware_profile``), and
  the simulated schedule as ``timeline.json`` (Chrome trace: open in Perfetto
  or chrome://tracing) and ``timeline.svg``.

``TORCH_LOGS="+fsdp_compile"`` prints each pass's decisions (buckets made,
collectives moved, why one was not overlapped).
"""

from fsdp_compile.base.dumps import dump, dump_dir

__all__ = ["dump", "dump_dir"]
