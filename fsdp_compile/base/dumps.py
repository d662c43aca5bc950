"""Where a compiled step's stages are written: the dump folders behind
:func:`fsdp_compile.debug.dump` (the user's entry point, documented there) and the
hooks our passes call to write into them (:func:`begin_graph`, :func:`record_graph`,
:func:`next_joint_file`). Nothing is written unless a dump is on."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from pathlib import Path
from typing import Iterator

import torch.fx as fx

log = logging.getLogger("fsdp_compile")

_state = {"dir": None, "graph_dir": None}
_graph_ids = itertools.count()
_joint_ids = itertools.count()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def dump_dir() -> Path | None:
    """This rank's dump directory, when dumping is on."""
    root = _state["dir"]
    if root is None:
        return None
    path = Path(root) / f"rank{_rank()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def dump(path: str | os.PathLike) -> Iterator[Path]:
    """Write every stage of each graph compiled inside the context under ``path``.

    Inductor's graph caches are off inside it: a graph found in a cache skips our passes
    and Inductor's code generation, so it would have no stage to write. Compiled kernels
    are still taken from Inductor's cache."""
    import depyf

    from fsdp_compile.base.compat import graph_caches_off, output_code_hook

    previous = _state["dir"]
    _state["dir"] = str(path)
    here = dump_dir()
    try:
        with (
            graph_caches_off(),
            depyf.prepare_debug(str(here / "depyf")),
            output_code_hook(_save_output_code),
        ):
            yield here
    finally:
        _state["dir"] = previous


def _save_output_code(code: str) -> None:
    graph_dir = _state["graph_dir"]
    root = dump_dir()
    if root is None:
        return
    target = Path(graph_dir) if graph_dir else root / f"cached_{next(_graph_ids)}"
    target.mkdir(parents=True, exist_ok=True)
    (target / "output_code.py").write_text(code)
    _state["graph_dir"] = None


# ------------------------------------------------------------- pass-side hooks
# Called by fsdp_compile.passes (which writes the reports); this module imports no pass.


def begin_graph(kind: str) -> Path | None:
    """Called by our post-grad pass for each graph; returns its dump folder (or None)."""
    root = dump_dir()
    if root is None:
        return None
    folder = root / f"graph_{next(_graph_ids)}_{kind}"
    folder.mkdir(parents=True, exist_ok=True)
    _state["graph_dir"] = str(folder)
    return folder


def record_graph(folder: Path | None, name: str, graph: fx.Graph) -> None:
    if folder is None:
        return
    code = graph.python_code("self").src
    (folder / f"{name}.py").write_text(code)


def next_joint_file() -> Path | None:
    """Where the next joint graph's record goes (``joint_<k>.md``), when dumping."""
    root = dump_dir()
    return None if root is None else root / f"joint_{next(_joint_ids)}.md"


def dump_from_environment() -> None:
    """``FSDP_COMPILE_DUMP=DIR``: dump for the life of the process (from the first ``fully_shard``)."""
    path = os.environ.get("FSDP_COMPILE_DUMP")
    if path:
        ctx = dump(path)
        ctx.__enter__()  # for the life of the process
        _state["env_context"] = ctx
