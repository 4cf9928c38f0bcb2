"""The epilogue visitor: evaluates an :class:`~jax_efc.epilogue.EpilogueIR` on the
accumulator fragment a thread holds for one epilogue subtile.

Shared by every architecture's kernel. The kernel hands over, per subtile, the fp32
accumulator values as a ``TensorSSA`` and, per value, its (m, n) coordinate in the output;
the visitor gathers the operands at those coordinates (TILE at (m, n), ROW at n, COL at m,
SCALAR once), runs the SSA program (after the cheaper equivalent forms of ``rewrite.py``) with
the functions of ``fragment_math.py`` on whole fragments, or paced, a few values at a time in
dependent chains, and returns every output already converted to its storage dtype.

Everything here runs at trace time inside a ``@cute.kernel``: loops are Python loops over
static sizes (fully unrolled), there is no data-dependent Python control flow.
Coordinates past the M/N edge are clamped to the last row/column so partial tiles never read
out of bounds; the TMA store drops those lanes anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import cutlass
import cutlass.cute as cute

from jax_efc.epilogue import EpilogueIR, Role
from jax_efc.kernels.dtypes import cutlass_dtype
from jax_efc.kernels.fragment_math import (BOOL_OPS, FLOAT_OPS, PACE_CHAINS, convert, f32, full, integer_pow,
                                           opaque_zero, round_to, take, tie)
from jax_efc.kernels.rewrite import rewrite

__all__ = ["EpilogueVisitor"]


class EpilogueVisitor:
    """Trace-time evaluator of one epilogue program.

    ``operand_batched[i]`` says whether operand i carries the batch dimension; an operand
    without it is read at batch index 0 for every batch.
    """

    def __init__(self, ir: EpilogueIR, operand_batched: Sequence[bool]):
        self.ir = ir = rewrite(ir)
        self.operand_batched = tuple(operand_batched)
        # outputs stored as tiles, then outputs that reduce (the kernel reduces their fp32 values)
        self.stored = tuple(o for o in ir.outputs if not o.reduce)
        self.reduced = tuple(o for o in ir.outputs if o.reduce)
        self.out_dtypes = tuple(cutlass_dtype(o.dtype) for o in self.stored)
        # stored outputs with a mask (Output.mask): the kernel stores them where it holds
        self.masked = tuple(o for o in self.stored if o.mask is not None)
        self.result_dtypes = (self.out_dtypes + (cutlass.Float32,) * len(self.reduced)
                              + (cutlass.Boolean,) * len(self.masked))
        # an operand no output depends on is never loaded
        self.live = tuple(ir.uses(i + ir.n_acc) for i in range(len(ir.operands)))
        # a paced evaluation hands each group's last arithmetic result on to the next group;
        # None where the program does no arithmetic, so pacing has nothing to spread
        arithmetic = [k for k, ins in enumerate(ir.instrs) if ins.op not in ("const", "convert", "reduce")]
        self.pace_link = len(ir.inputs) + arithmetic[-1] if arithmetic else None
        self.row_passes = _row_passes(ir)
        # the values (and operands) each pass over the tile computes to fold its reductions
        self.pass_needs = tuple(_needed(ir, [ir.instrs[v - len(ir.inputs)].args[0] for v, _ in p])
                                for p in self.row_passes)

    def _gather(self, tensor: cute.Tensor, role: Role, batch, coords: Sequence[tuple],
                extent_mn, like: cute.TensorSSA) -> cute.TensorSSA:
        """Read an (M|1, N|1, L) operand at every fragment coordinate, widened to fp32."""
        frag = cute.make_rmem_tensor(like.shape, cutlass.Float32)
        m_last, n_last = extent_mn[0] - 1, extent_mn[1] - 1
        for i in range(cute.size(frag)):
            m, n = coords[i][0], coords[i][1]
            mi = cutlass.min(m, m_last) if role in (Role.TILE, Role.COL) else 0
            ni = cutlass.min(n, n_last) if role in (Role.TILE, Role.ROW) else 0
            frag[i] = tensor[(mi, ni, batch)].to(cutlass.Float32)
        return frag.load()

    def prefetch_vectors(self, operands: Sequence[cute.Tensor], origin: tuple, tile_mn: tuple,
                         extent_mn, batch, tid) -> None:
        """Pull the tile's slice of every ROW and COL operand into L1, thread ``tid`` one of
        its 128-byte lines, so that each subtile's vector loads hit there. ``origin``: the
        tile's first (m, n)."""
        for i, (inp, tensor) in enumerate(zip(self.ir.operands, operands)):
            if not self.live[i] or inp.role not in (Role.ROW, Role.COL):
                continue
            axis = 1 if inp.role is Role.ROW else 0
            per_line = 128 * 8 // tensor.element_type.width
            lines = tile_mn[axis] // per_line  # tiles span 64 or more values, a line at most 64
            index = cutlass.min(origin[axis] + (tid % lines) * per_line, extent_mn[axis] - 1)
            b = batch if self.operand_batched[i] else 0
            coord = (0, index, b) if axis == 1 else (index, 0, b)
            ptr = tensor.iterator + cute.crd2idx(coord, tensor.layout)
            cute.arch.prefetch(ptr.to_llvm_ptr(), cache_level="L1")

    def _inputs(self, acc, up, coords, operands, extent_mn, batch, preloaded: dict, needed=None) -> list:
        """The program's inputs for one subtile: the accumulators, then each operand a value in
        ``needed`` (default: an output) reads, gathered or ``preloaded``; None for the rest."""
        ir = self.ir
        values: list = [acc] if up is None else [acc, up]
        for i, (inp, tensor) in enumerate(zip(ir.operands, operands)):
            if not (self.live[i] if needed is None else i + ir.n_acc in needed):
                values.append(None)
                continue
            b = batch if self.operand_batched[i] else 0
            if i in preloaded:
                values.append(preloaded[i])
            elif inp.role is Role.SCALAR:
                values.append(full(acc, tensor[(0, 0, b)].to(cutlass.Float32), cutlass.Float32))
            else:
                values.append(self._gather(tensor, inp.role, b, coords, extent_mn, acc))
        return values

    def row_values(self, p: int, acc: cute.TensorSSA, coords: Sequence[tuple], operands: Sequence[cute.Tensor],
                   extent_mn, batch, given: dict) -> list[cute.TensorSSA]:
        """The fp32 values pass ``p`` over the tile folds into its reductions
        (``row_passes[p]``), for one subtile; ``given``: the earlier passes' reductions, value id ->
        fragment of the totals at the subtile's rows."""
        needs = self.pass_needs[p]
        values = self._run(self._inputs(acc, None, coords, operands, extent_mn, batch, {}, needs), given, needs)
        return [f32(values[self.ir.instrs[v - len(self.ir.inputs)].args[0]]) for v, _ in self.row_passes[p]]

    def __call__(self, acc: cute.TensorSSA, coords: Sequence[tuple],
                 operands: Sequence[cute.Tensor], extent_mn, batch,
                 preloaded: dict, paced: bool = False, raw: cute.TensorSSA | None = None,
                 up: cute.TensorSSA | None = None, given: dict | None = None) -> list[cute.TensorSSA]:
        """The outputs for one subtile: each stored output converted to its storage dtype,
        then the fp32 value each reducing output reduces, then each masked output's mask.

        ``acc``: fp32 accumulator fragment; ``coords``: the (m, n) output coordinate of each
        fragment value, in linear index order; ``operands``: the epilogue operand tensors,
        each presented as (M|1, N|1, L|1); ``extent_mn``: (M, N) of the output; ``batch``:
        this tile's batch index; ``preloaded``: operand index -> fp32 fragment the kernel
        already read (TILE operands staged in smem by TMA); ``raw``: with an integer
        accumulator, the accumulator itself, from which outputs that are the bare accumulator
        are stored (exact past fp32's 24 bits); ``up``: a gated program's up-projection
        accumulators at the same coordinates (``acc`` is then the gate's).

        ``paced`` (programs with arithmetic, ``pace_link`` set): evaluate the program
        ``PACE_CHAINS`` values at a time, each group's accumulators tied to the previous
        group's last arithmetic result, so that the fp32 work issues as that many dependent
        chains instead of as densely as the compiler can schedule it. Slower on its own; for
        epilogues that run under another warpgroup's WGMMAs, which dense fp32 issue slows.

        ``given``: every reduction the program consumes (``row_passes``), as :meth:`row_values`
        takes them.
        """
        values = self._inputs(acc, up, coords, operands, extent_mn, batch, preloaded)
        given = given or {}
        if not paced:
            return self._outputs(self._run(values, given), raw)
        size = cute.size(acc.shape)
        assert size % PACE_CHAINS == 0, f"{size} values do not split into {PACE_CHAINS} chains"
        zero = opaque_zero()
        outs = [cute.make_rmem_tensor(acc.shape, dt) for dt in self.result_dtypes]
        link = None
        for start in range(0, size, PACE_CHAINS):
            group = [None if v is None else take(v, start, PACE_CHAINS) for v in values]
            if link is not None:
                group[0] = tie(group[0], link, zero)
            results = self._run(group, {k: take(v, start, PACE_CHAINS) for k, v in given.items()})
            raw_part = None if raw is None else take(raw, start, PACE_CHAINS)
            for out, part in zip(outs, self._outputs(results, raw_part)):
                for k in range(PACE_CHAINS):
                    out[start + k] = part[k]
            link = convert(results[self.pace_link], cutlass.Float32)
        return [out.load() for out in outs]

    def _run(self, values: list, given: dict, needed: frozenset | None = None) -> list:
        """``values`` (the program's inputs) extended by every instruction's result: a
        reduction's from ``given``; None for one not ``needed`` (default: all are)."""
        for ins in self.ir.instrs:
            v = len(values)
            if v in given:
                values.append(given[v])
            elif needed is not None and v not in needed:
                values.append(None)
            else:
                values.append(self._instr(ins, [values[a] for a in ins.args], values[0]))
        return values

    def _outputs(self, values: list, raw: cute.TensorSSA | None = None) -> list[cute.TensorSSA]:
        return ([convert(raw if raw is not None and o.value == 0 else values[o.value], dt)
                 for o, dt in zip(self.stored, self.out_dtypes)]
                + [f32(values[o.value]) for o in self.reduced] + [values[o.mask] for o in self.masked])

    @staticmethod
    def _instr(ins, args, like):
        dtype = cutlass_dtype(ins.dtype)
        if ins.op == "const":
            value = bool(ins.attr) if dtype is cutlass.Boolean else float(ins.attr)
            return full(like, value, dtype)
        if ins.op == "convert":
            return convert(args[0], dtype)
        if ins.op == "select":
            pred, on_false, on_true = args
            return round_to(cute.where(pred, f32(on_true), f32(on_false)), dtype)
        if all(a.dtype is cutlass.Boolean for a in args) and ins.op in BOOL_OPS:
            return BOOL_OPS[ins.op](*args)
        if ins.op == "integer_pow":
            return round_to(integer_pow(f32(args[0]), ins.attr), dtype)
        result = FLOAT_OPS[ins.op](*[f32(a) for a in args])
        return result if dtype is cutlass.Boolean else round_to(result, dtype)


def _row_passes(ir: EpilogueIR) -> tuple[tuple[tuple[int, str], ...], ...]:
    """The reductions the program consumes (over N: ``KernelProblem.row_stats``) as (value id,
    kind), by the pass over the tile that finishes them: pass p those whose value needs p
    earlier reductions (a softmax's max in the first, its sum of exponentials in the second)."""
    n_in, depth = len(ir.inputs), [0] * len(ir.inputs)
    passes: dict[int, list] = {}
    for j, ins in enumerate(ir.instrs):
        d = max((depth[a] for a in ins.args), default=0)
        if ins.op == "reduce":
            passes.setdefault(d, []).append((n_in + j, ins.attr[0]))
            d += 1
        depth.append(d)
    return tuple(tuple(passes[p]) for p in sorted(passes))


def _needed(ir: EpilogueIR, values: Sequence[int]) -> frozenset:
    """``values`` and what they are computed from, up to (and with) the reductions they read."""
    n_in, seen, stack = len(ir.inputs), set(), list(values)
    while stack:
        v = stack.pop()
        if v not in seen:
            seen.add(v)
            if v >= n_in and ir.instrs[v - n_in].op != "reduce":
                stack.extend(ir.instrs[v - n_in].args)
    return frozenset(seen)
