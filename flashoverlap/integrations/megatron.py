"""Megatron-Core: its row-parallel linear with the collective overlapped with the GEMM.

Megatron-Core builds a GPT model from a layer spec (``ModuleSpec`` trees); the local spec
(``get_gpt_layer_local_spec``, no Transformer Engine) puts
``megatron.core.tensor_parallel.RowParallelLinear`` at the attention output (``linear_proj``)
and the MLP's second linear (``linear_fc2``). :func:`flashoverlap_spec` returns a copy of a spec
with :class:`RowParallelLinear` there instead: Megatron's own class (parameters, initialisation,
checkpoint sharding and the attributes its DDP and optimizer read are unchanged) whose forward
runs ``x @ W^T`` and the all-reduce (with sequence parallelism, the reduce-scatter of the
sequence) as one overlapped call (:func:`flashoverlap.with_gradients`; the plain path on the CPU).

Megatron's own paths stay where there is nothing to overlap or the layer is not Megatron's to
change: an MoE expert's linear (its communication is the token dispatcher's), a CPU-offloading
context. The weight gradient lands in ``weight.grad`` (Megatron's DDP adds it to ``main_grad``)
also where ``gradient_accumulation_fusion`` would have fused it into ``main_grad``.
"""

from __future__ import annotations

import dataclasses

import torch

import flashoverlap

try:
    from megatron.core import tensor_parallel
    from megatron.core.transformer.spec_utils import ModuleSpec
except ImportError as e:
    raise ImportError(
        "flashoverlap.integrations.megatron needs megatron-core: pip install 'flashoverlap[megatron]'"
    ) from e


class RowParallelLinear(tensor_parallel.RowParallelLinear):
    """Megatron-Core's ``RowParallelLinear`` (same arguments, parameters and result: ``(output,
    bias)``, the bias returned unadded with ``skip_bias_add``) with its collective overlapped.
    Input [s, b, in / world] (the last dimension split; with ``input_is_parallel=False`` the full
    input, scattered first as Megatron does); output [s, b, out], or [s / world, b, out] with
    sequence parallelism. ``flashoverlap_config``: the overlapped calls' config (None: the
    registry's for each shape)."""

    flashoverlap_config = None

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.explicit_expert_comm or self.config._cpu_offloading_context is not None:
            return super().forward(input_)
        if not self.input_is_parallel:
            input_ = tensor_parallel.scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        lead, world = input_.shape[:-1], self.tp_group.size()
        collective = "reduce_scatter" if self.sequence_parallel else "all_reduce"
        rows = input_.reshape(-1, input_.shape[-1]).contiguous()
        output = flashoverlap.with_gradients(rows, self.weight, collective, self.tp_group, self.flashoverlap_config)
        shape = (lead[0] // world, *lead[1:]) if self.sequence_parallel else lead
        output = output.view(*shape, self.output_size)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


def flashoverlap_spec(spec: ModuleSpec) -> ModuleSpec:
    """A copy of the Megatron-Core layer spec ``spec`` (e.g. ``get_gpt_layer_local_spec()``) with
    every ``megatron.core.tensor_parallel.RowParallelLinear`` in it replaced by
    :class:`RowParallelLinear`; ``spec`` itself is unchanged. Refuses a spec that has none (a
    Transformer Engine spec: its linears are TE's)."""
    found: list[type] = []
    out = _substituted(spec, found)
    if not found:
        raise ValueError(
            "no megatron.core.tensor_parallel.RowParallelLinear in this spec (a Transformer Engine spec? "
            "flashoverlap replaces the local spec's, e.g. get_gpt_layer_local_spec())"
        )
    return out


def _substituted(obj, found: list[type]):
    if obj is tensor_parallel.RowParallelLinear:
        found.append(obj)
        return RowParallelLinear
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _substituted(getattr(obj, f.name), found) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **fields)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_substituted(item, found) for item in obj)
    if isinstance(obj, dict):
        return {key: _substituted(value, found) for key, value in obj.items()}
    return obj
