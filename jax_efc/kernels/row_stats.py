"""Reductions an epilogue consumes over N, finished inside a tile that spans the rows (a row
softmax, a row norm: ``KernelProblem.row_stats``); shared by every architecture's kernel.

Before a tile stores anything, the epilogue driver walks its subtiles once a pass
(``EpilogueVisitor.row_passes``: a softmax's max in the first, its sum of exponentials, which
reads the max, in the second), recomputing from the accumulators the values the pass's
reductions fold. The folds are :class:`~jax_efc.kernels.reduction.TileReduction`'s, in
registers; each band of rows then meets as an output's reduction does (lanes by shuffles, warps
through a small shared buffer), and every thread reads its rows' totals back into registers.
The epilogue's own walk takes each total, spread over a subtile's values, in place of the
reduction.
"""

from __future__ import annotations

from typing import Any

from jax_efc.kernels.epilogue_state import ConsumerEpilogue
from jax_efc.kernels.reduction import TileReduction
from jax_efc.kernels.visitor import EpilogueVisitor

__all__ = ["RowStats"]


class RowStats:
    """A kernel's consumed reductions, pass by pass, and the two steps of the epilogue that
    finish and read them. ``first``: the index of the first one in the epilogue's ``red_*``
    lists (they follow the reducing outputs')."""

    def __init__(self, visitor: EpilogueVisitor, epi_tile: tuple[int, int], out_tile: tuple[int, int],
                 threads: int, blocks: int, first: int):
        self.visitor = visitor
        self.first = first
        self.ids = tuple(v for p in visitor.row_passes for v, _ in p)  # value ids, in pass order
        self.reductions = tuple(TileReduction(kind, ("n",), epi_tile, out_tile, threads, blocks)
                                for p in visitor.row_passes for _, kind in p)

    def totals(self, kernel: Any, epi: ConsumerEpilogue, acc, m_idx, n_idx, l_idx, origin: tuple) -> list:
        """The tile's consumed reductions, before anything is stored: per reduction, this
        thread's totals of the rows it holds, one register a position as its lane map places
        them. ``kernel``: the architecture's (its accumulator, coordinate and walk hooks)."""
        totals: list = []
        for p, reductions in enumerate(self.visitor.row_passes):
            at = range(self.first + len(totals), self.first + len(totals) + len(reductions))
            reds = [self.reductions[i - self.first] for i in at]
            running = [r.start(epi.red_lanes[i]) for r, i in zip(reds, at)]
            offset = kernel._walk_offset()
            for s in range(kernel.n_sub):
                coords = kernel._subtile_accumulators(epi, acc, s, m_idx, n_idx, last_read=False)
                if offset is not None:
                    coords = [(m + offset, n + offset) for m, n in coords]
                values = self.visitor.row_values(p, epi.frag.load(), coords, epi.operands, epi.mn_extent, l_idx,
                                                 self.given(epi, totals, s))
                for r, i, value, run in zip(reds, at, values, running):
                    epi.red_frag[i].store(value)
                    r.fold(epi.red_lanes[i], run, epi.red_frag[i], s, coords, origin, epi.mn_extent)
            done = [r.start(epi.red_lanes[i]) for r, i in zip(reds, at)]
            for s in [s for s in range(kernel.n_sub) if reds[0].closes(s)]:
                coords = kernel._tile_coords(epi, s, m_idx, n_idx)
                for r, i, run in zip(reds, at, running):
                    r.publish(epi.red_lanes[i], epi.red_smem[i], run, s, coords, origin, epi.ctid)
                epi.barrier.arrive_and_wait()
                for r, i, total in zip(reds, at, done):
                    r.collect(epi.red_lanes[i], epi.red_smem[i], total, s, coords, origin)
                # read before the next band (or pass) writes the buffers
                epi.barrier.arrive_and_wait()
            totals += done
        return totals

    def given(self, epi: ConsumerEpilogue, totals: list, s: int) -> dict:
        """The reductions in ``totals`` (:meth:`totals`) as the visitor takes them: value id ->
        subtile ``s``'s fragment, each value its row's total."""
        given = {}
        for i, total in enumerate(totals):
            frag, lanes = epi.red_frag[self.first + i], epi.red_lanes[self.first + i]
            for v, j in enumerate(lanes.slot[s]):
                frag[v] = total[j]
            given[self.ids[i]] = frag.load()
        return given
