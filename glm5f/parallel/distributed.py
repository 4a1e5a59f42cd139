"""Several processes: `DistLayout`, the `parallel.Layout` of a rank of an FSDP/DP x CP x EP run, as DTensors and
collectives over the meshes and placements `glm5f.parallel.layout` derives (the process group is up: `glm5f.run.launch`).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from einops import rearrange, repeat
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.nn.functional import all_reduce
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from glm5f.core.params import Region, leaf_kind, map_with_path
from glm5f.parallel.layout import Layout, Spec, cp_positions, mesh_shapes, placements


class DistLayout(Layout):
    """A rank of dp_shard x cp processes (torch.distributed already initialised), with ep expert groups. `on_step`
    is called with each step the train loop finishes (`launch.StallWatch.step_done` watches for a hung rank)."""

    def __init__(self, dp_shard: int, cp: int, ep: int, device: torch.device,
                 on_step: Callable[[int], None] | None = None):
        self.device, self.dp, self.cp, self.ep = device, dp_shard, cp, ep
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.is_main = self.rank == 0
        kind = device.type
        shapes = mesh_shapes(dp_shard, cp, ep)
        self.meshes = {"fsdp": init_device_mesh(kind, shapes["fsdp"], mesh_dim_names=("fsdp",)),
                       "data": init_device_mesh(kind, shapes["data"], mesh_dim_names=("dp", "cp")),
                       "experts": init_device_mesh(kind, shapes["experts"], mesh_dim_names=("edp", "ep"))}
        # A flattened ("edp_ep") view lets DTensor reduce over both expert dims in one all_reduce (the gradient
        # norm of an expert leaf) instead of two in a row, which it warns about on every rank.
        self.meshes["experts"]._flatten("edp_ep")
        self.dp_rank, self.cp_rank = divmod(self.rank, cp)
        self.cp_group = self.meshes["data"].get_group("cp")
        self.ep_group = self.meshes["experts"].get_group("ep")
        self.on_step = on_step

    def step_done(self, step: int) -> None:
        if self.on_step is not None:
            self.on_step(step)

    # ---- parameters
    def param_specs(self, params: dict, prefix: str = "") -> dict:
        """The spec tree: for each leaf of `params` (the subtree at dotted path `prefix`), its Spec (mesh, stored /
        gathered / gradient placements)."""
        return map_with_path(lambda path, _: self._spec(f"{prefix}.{path}" if prefix else path), params)

    def _spec(self, path: str) -> Spec:
        """The Spec of the leaf at dotted `path`, from its logical axes."""
        mesh, stored, gathered, grads = placements(leaf_kind(path).axes)
        return Spec(self.meshes[mesh], stored, gathered, grads)

    def local_params(self, make: Callable[[Region], dict]) -> dict:
        """Params made rank-locally: `make(region)` builds only the part `region(path, shape)` of each leaf (its
        rank's shard: FSDP rows, its EP experts), e.g. `init_params(..., region=region)` or
        `load_hf(..., region=region)`; they become the DTensors `shard_params` would. No rank holds the whole
        model."""
        shapes = {}

        def region(path, shape):
            s = self._spec(path)
            shapes[path] = torch.Size(shape)
            size, offset = compute_local_shape_and_global_offset(shape, s.mesh, s.stored)
            return tuple(slice(o, o + n) for o, n in zip(offset, size))

        def wrap(path, t):
            s = self._spec(path)
            return DTensor.from_local(t, s.mesh, s.stored, run_check=False, shape=shapes[path],
                                      stride=torch.empty(shapes[path], device="meta").stride())
        return map_with_path(wrap, make(region))

    def shard_params(self, params: dict) -> dict:
        return map_with_path(lambda path, t, s: distribute_tensor(t.to(self.device), s.mesh, s.stored),
                             params, self.param_specs(params), is_leaf=lambda x: isinstance(x, Spec))

    def gather(self, tree: dict, prefix: str = "") -> dict:
        def gather(path, t, s):
            return t.redistribute(s.mesh, s.gathered).to_local(grad_placements=s.grads)
        return map_with_path(gather, tree, self.param_specs(tree, prefix), is_leaf=lambda x: isinstance(x, Spec))

    def sum(self, t: torch.Tensor, group=None) -> torch.Tensor:
        t = t.detach().clone()
        dist.all_reduce(t, group=group)
        return t

    def gather_objects(self, obj) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def max(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def seq_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.cp == 1 else self.sum(t, self.cp_group)

    def seq_total(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.cp == 1 else all_reduce(t, group=self.cp_group)

    # ---- data
    def share(self, B: int, S: int) -> tuple[slice, torch.Tensor | None]:
        rows = slice(self.dp_rank * B // self.dp, (self.dp_rank + 1) * B // self.dp)
        return rows, None if self.cp == 1 else cp_positions(S, self.cp, self.cp_rank)

    def keys(self, layer: int, name: str, local: torch.Tensor) -> torch.Tensor:
        """All-gather this rank's keys over the CP group into global sequence order (gradients flow back)."""
        return self._in_order(local)

    def chunks(self, local: torch.Tensor) -> torch.Tensor:
        return self._in_order(local)

    def _in_order(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's [B, S, ...] of the positions `share` gives it, all-gathered over the CP group into the
        [B, S cp, ...] of the whole sequence in order (gradients flow back)."""
        if self.cp == 1:
            return local
        held = torch.cat([cp_positions(local.shape[1] * self.cp, self.cp, r) for r in range(self.cp)])
        parts = funcol.all_gather_single_autograd(local.contiguous(), gather_dim=1, group=self.cp_group)
        return funcol.wait_tensor(parts).index_select(1, torch.argsort(held).to(local.device))

    # ---- experts
    def experts(self, p: dict, x_MxD: torch.Tensor, counts_E: torch.Tensor, ffn: Callable) -> torch.Tensor:
        """Rows sorted by expert go to the rank owning their expert, are computed there grouped, and come back
        in the same order (all-to-all both ways, differentiable)."""
        if self.ep == 1:
            return ffn(p, x_MxD, counts_E)
        ep, group = self.ep, self.ep_group
        # rows for each (destination rank, its local expert) and what every source sends us
        send_counts_RxE = rearrange(counts_E, "(r e) -> r e", r=ep)
        recv_counts_RxE = torch.empty_like(send_counts_RxE)
        dist.all_to_all_single(recv_counts_RxE, send_counts_RxE.contiguous(), group=group)
        send_splits = send_counts_RxE.sum(1).tolist()
        recv_splits = recv_counts_RxE.sum(1).tolist()
        rows = funcol.wait_tensor(funcol.all_to_all_single_autograd(x_MxD.contiguous(), recv_splits, send_splits,
                                                                    group))
        # received rows come grouped by source rank, then by expert: regroup by expert for the grouped GEMM
        local_expert_RxE = repeat(torch.arange(recv_counts_RxE.shape[1], device=rows.device), "e -> r e", r=ep)
        expert_of_row = torch.repeat_interleave(local_expert_RxE.flatten(), recv_counts_RxE.flatten())
        order = torch.argsort(expert_of_row, stable=True)
        y_sorted = ffn(p, rows.index_select(0, order), recv_counts_RxE.sum(0))
        y = torch.zeros_like(y_sorted).index_copy(0, order, y_sorted)
        return funcol.wait_tensor(funcol.all_to_all_single_autograd(y, send_splits, recv_splits, group))
