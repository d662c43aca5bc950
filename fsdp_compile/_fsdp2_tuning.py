"""FSDP2's ``FSDPModule`` methods that tune FSDP2's own machinery (streams, buffers,
custom collectives, pipelining hints): accepted here and changing no result, each
docstring says why, or raising where the feature cannot exist here (custom
collectives). A mixin of :class:`~fsdp_compile.FSDPModule`, so code written against
FSDP2 runs unchanged."""

from __future__ import annotations


class GradientReductionHandle:
    """Returned by ``finalize_backward(async_op=True)``; the reductions have already completed."""

    def wait(self) -> None:
        return None


class FSDP2TuningMethods:
    """The methods (see the module docstring); mixed into ``FSDPModule``."""

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 compatibility; changes nothing. FSDP2 uses it to skip waiting on
        gradient reductions at the end of a backward that is not the last of a step
        (pipelining); here every backward finishes its reductions (compiled: inside its
        graph; eager: when it ends), so gradients are complete after each one."""

    def set_post_optim_event(self, event) -> None:
        """Accepted for FSDP2 compatibility; changes nothing. FSDP2 makes its all-gather
        stream wait on ``event``; here all-gathers run in program order after the
        optimizer step (compiled graphs and eager code alike use no side streams)."""

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Accepted for FSDP2 compatibility; changes nothing: backward re-gathers only the
        parameters its computation reads (compiled: what the backward graph uses; eager:
        the weights autograd saved), so a unit whose backward needs none (an embedding)
        re-gathers nothing either way."""

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted for FSDP2 compatibility; changes nothing: collective buffers come from
        the ordinary allocator (compiled: planned by Inductor)."""

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """Accepted for FSDP2 compatibility (``max_input_buffers >= 1``); changes nothing here:
        how many reduce-scatters are in flight is ``fsdp_compile.config.reduce_scatter_depth``."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"set_reduce_scatter_max_input_buffers({max_input_buffers!r}): max_input_buffers must be an int, "
                f"got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"set_reduce_scatter_max_input_buffers({max_input_buffers}): must be >= 1")

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce this unit's gradients with sums only, as FSDP2 does (NCCL's zero-copy
        transfers; gloo has no ``PREMUL_SUM``): the average or the divide factor is then
        a division of the reduced gradient (in float16, half of it before the sum), with
        FSDP2's rounding (:func:`fsdp_compile.runtime.collectives.gradient_reduction`)."""
        self._fsdp_unit.update(force_sum_reduction_for_comms=bool(enable))

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Accepted for FSDP2 compatibility; changes nothing: reduce-scatters and all-gathers
        share the data-parallel group, and the compiled schedule orders them."""

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Accepted for FSDP2 compatibility; changes nothing (NCCL symmetric-memory buffers
        are not used: collective buffers come from the ordinary allocator)."""

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Accepted for FSDP2 compatibility (torch 2.15); changes nothing: gathered
        parameters are fresh tensors each step (compiled: buffers planned by Inductor),
        freed when resharded."""

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Accepted for FSDP2 compatibility (torch 2.15) on the root unit: every backward
        here finishes its own gradient reductions, so there is nothing left for
        :meth:`finalize_backward` to do."""
        if not self._fsdp_unit.is_root:
            raise RuntimeError(
                f"set_manual_backward_finalization: call it on the root sharded module, not on {type(self).__name__}"
            )

    def finalize_backward(self, *, async_op: bool = False) -> "GradientReductionHandle | None":
        """FSDP2's (torch 2.15): finish the backward's gradient reductions. Each backward
        has already finished its own; what is left are gradients accumulated with sync off
        when sync is on now (``torch.distributed.pipelining``'s order: every micro-batch
        without sync, then sync on and ``finalize_backward``): reduced now, one
        reduce-scatter per bucket, as FSDP2's. Returns a handle whose ``wait()`` returns at
        once when ``async_op``."""
        from fsdp_compile._fsdp2_state_view import finish_gradient_accumulation
        from fsdp_compile._fully_shard import units_in

        for unit in units_in(self):
            finish_gradient_accumulation(unit)
        return GradientReductionHandle() if async_op else None

    def set_custom_all_gather(self, comm) -> None:
        """Not supported: our all-gathers are functional collectives that the compiled graph
        buckets and schedules; a custom one could not be traced."""
        raise NotImplementedError(
            f"set_custom_all_gather on {type(self).__name__}: custom all-gather implementations are not "
            "supported by fsdp_compile (its all-gathers are traced functional collectives)"
        )

    def set_custom_reduce_scatter(self, comm) -> None:
        """Not supported (see :meth:`set_custom_all_gather`)."""
        raise NotImplementedError(
            f"set_custom_reduce_scatter on {type(self).__name__}: custom reduce-scatter implementations are "
            "not supported by fsdp_compile (its reduce-scatters are traced functional collectives)"
        )
