"""A compiled whole-slice step called through its executable, past jit's per-call checks.

jit's C++ dispatch checks every argument's signature and layout before it runs the executable
(it must: any call may bring new shapes). A stage's decode step of one shape brings the same
parameter arrays every time, and 455 of a SmolLM2 Q4_K_M step's 518 arguments are those:
calling the executable with the flat arguments went from ~1.25 to ~1.0 ms of the main thread
per step (measured beside the jit call, same process). The executable is the one jit compiled
(the lowering and compilation come from jit's caches), so every bit of the step is the same.

Only on the CPU, only for the params tree it was built with (`Steps` drops every DirectStep
when a step brings another), and only where this JAX has the executable's pieces it needs;
otherwise `build` returns None and jit runs the shape.

A step's small host inputs (ids or activations, positions, lanes) go to the device the same way
(`HostPut`): jax.device_put makes a sharding, walks the tuple and abstracts each array before the
one call that copies it (`batched_device_put`); a stage's main thread does that between a step's
logits and the next step's dispatch, on the token's critical path, right after the step streamed
the weights through the caches. HostPut makes that call itself: SmolLM2 `Q4_K_M`, 1-row decode
after 512 tokens, alternating step by step in one process (2-core EPYC Zen 4), 9.17-9.51 ms a step
with jax.device_put against 8.83-9.25 with HostPut (three runs).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

try:   # the call jax.device_put ends in for a host array (jax 0.10.2); absent: device_put does it all
    from jax._src.core import ShapedArray
    from jax._src.interpreters.pxla import batched_device_put
except ImportError:   # pragma: no cover
    ShapedArray = batched_device_put = None


class DirectStep:
    """forward_jit's executable for one (inputs shape, attention length, output), called as
    forward_jit is; `params` must be the tree it was built for (its flat leaves are kept)."""

    def __init__(self, executable: Any, kept: list[int], out_tree: Any, params: Any):
        self.executable, self.kept, self.out_tree = executable, kept, out_tree
        self.params, self.leaves = params, jax.tree.leaves(params)

    def __call__(self, params: Any, kv: Any, *inputs: jax.Array, **static: Any) -> Any:
        flat = self.leaves + jax.tree.leaves(kv) + list(inputs)
        results = self.executable.execute_sharded([flat[i] for i in self.kept])
        return jax.tree.unflatten(self.out_tree, [a[0] for a in results.disassemble_into_single_device_arrays()])


class Steps:
    """A runner's whole-slice (`jitted`) and layer-by-layer (`layered`) steps: each fused shape runs
    through jit once, then through its DirectStep where `build` makes one."""

    def __init__(self, jitted: Any, layered: Any):
        self.jitted, self.layered = jitted, layered
        self.direct: dict[tuple, DirectStep | None] = {}
        self.params: Any = None   # the tree every DirectStep in `direct` was built for

    def adopt(self, shape: tuple, step: DirectStep, params: Any) -> None:
        """Use `step` (built for `params`) for `shape` from now on: one model/exec_cache.py loaded,
        so that the shape's first run neither traces nor lowers."""
        if params is not self.params:
            self.direct, self.params = {}, params
        self.direct[shape] = step

    def run(self, shape: tuple, fused: bool, params: Any, kv: Any, args: tuple[jax.Array, ...],
            static: dict[str, Any]) -> Any:
        """One step of `shape` (runner's (inputs shape, attention length, output) key): as jitted(params,
        kv, *args, **static) or layered(...) returns it."""
        if not fused:
            return self.layered(params, kv, *args, **static)
        if params is not self.params:   # a tool swapped the weights: jit checks the new ones, the old go
            self.direct, self.params = {}, params
        result = (self.direct.get(shape) or self.jitted)(params, kv, *args, **static)
        if shape not in self.direct:   # after its first run: jit's caches hold its executable
            self.direct[shape] = build(self.jitted, params, result[1], args, **static)
        return result


def build(jitted: Any, params: Any, kv: Any, inputs: tuple[jax.Array, ...], **static: Any) -> DirectStep | None:
    """The DirectStep of `jitted` (forward_jit) for these arguments' shapes, or None where it cannot
    be built here (not a CPU, or this JAX's compiled object lacks what it needs)."""
    if any(d.platform != "cpu" for d in inputs[0].devices()):
        return None
    try:
        compiled = jitted.lower(params, kv, *inputs, **static).compile()   # jit's caches: no new compile
    except (AttributeError, TypeError, NotImplementedError):
        return None
    return from_compiled(compiled, params, kv, inputs)


def from_compiled(compiled: Any, params: Any, kv: Any, inputs: tuple[jax.Array, ...]) -> DirectStep | None:
    """The DirectStep of a compiled forward_jit (jit's, or one model/exec_cache.py loaded) for these
    arguments, or None where its executable's pieces are not the ones DirectStep calls."""
    if any(d.platform != "cpu" for d in inputs[0].devices()):
        return None
    try:
        mesh = compiled._executable
        executable, kept = mesh.xla_extension_executable(), sorted(mesh._kept_var_idx)
        args = jax.tree.leaves((params, kv, inputs))
        if compiled.in_tree != jax.tree.structure(((params, kv, *inputs), {})) or kept[-1] >= len(args) or \
                len(executable.get_parameter_layouts()) != len(kept):
            return None   # (consts passed as extra arguments, or another flattening)
    except (AttributeError, TypeError, NotImplementedError):
        return None
    return DirectStep(executable, kept, compiled.out_tree, params)


class HostPut:
    """Host numpy arrays to committed arrays on one device, as jax.device_put(arrays, device) makes
    them (the same call copies them, with the same abstract value and sharding), past its per-call
    work (module docstring). On the CPU, for C-contiguous arrays of a dtype JAX keeps as it is;
    anything else goes through jax.device_put."""

    def __init__(self, device: Any):
        self.device, self.sharding = device, jax.sharding.SingleDeviceSharding(device)
        self.fast = batched_device_put is not None and device.platform == "cpu"

    def __call__(self, arrays: tuple[np.ndarray, ...]) -> tuple[jax.Array, ...]:
        if self.fast and all(type(a) is np.ndarray and a.flags.c_contiguous and
                             jax.dtypes.canonicalize_dtype(a.dtype) == a.dtype for a in arrays):
            return tuple(batched_device_put(ShapedArray(a.shape, a.dtype), self.sharding, [a], [self.device])
                         for a in arrays)
        return jax.device_put(arrays, self.device)
