"""What a fused-GEMM kernel's epilogue works with, as trace-time containers: a launch's
tensors after A and B, the global and shared tensors a kernel hands its epilogue groups, and
one consumer group's epilogue machinery (``gemm_base.FusedGemmBase`` builds and reads them)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import cutlass.cute as cute
import cutlass.pipeline as pipeline

__all__ = ["CallArguments", "ConsumerEpilogue", "EpilogueTensors"]


class CallArguments(NamedTuple):
    """A launch's tensors after A and B, in the order the ffi passes them."""

    operands: tuple  # the epilogue operands, (M|1, N|1, L|1)
    flags: object  # stream-K: one int32 flag per CTA; else None
    stamps: tuple  # a timeline build's (stamps,); else ()
    outputs: tuple  # the tile outputs, (M, N, L)
    partials: tuple  # per reducing output, its per-tile fp32 partials (or its result: Output.atomic)
    workspace: object  # stream-K: one fp32 partial tile per CTA; else None


class EpilogueTensors(NamedTuple):
    """What a kernel hands its epilogue groups: the global tensors, the TMA atoms and the shared
    memory of the outputs (D), the TILE operands (C) and the reductions."""

    operands: tuple
    mD: tuple  # TMA tensors of the outputs
    sD: list
    tma_d: tuple
    mC: tuple  # TMA tensors of the TILE operands
    sC: list
    tma_c: tuple
    c_bar: object  # the TILE-operand buffers' "full" mbarriers (None without TILE operands)
    red_smem: list
    mP: tuple  # the reductions' per-tile partials


@dataclasses.dataclass(frozen=True)
class ConsumerEpilogue:
    """One consumer group's epilogue machinery, built at trace time before its tile loop.
    Frozen, so the DSL's loops read it rather than carry it as loop state."""

    operands: tuple  # the epilogue operand tensors, (M|1, N|1, L|1)
    mn_extent: tuple  # (M, N) of the outputs
    # per output: smem buffers, (bM, bN, RestM, RestN, RestL) global tiles, TMA-store atom,
    # register->smem copy and its smem partition, and the converted register fragment
    sD: list
    gD: list
    tma_d: tuple
    r2s: list
    tRS_sD: list
    frag_out: list
    # per TILE operand: the same the other way, plus the "full" mbarriers of its buffers
    sC: list
    gC: list
    tma_c: tuple
    s2r: list
    tSR_sC: list
    tSR_rC: list
    frag_c: list
    c_bar: object
    # the CTA's last tile: the A/B ring (its TILE operands' and outputs' subtiles have
    # slots there; () where they have none) and this thread's smem-copy slices
    ring: tuple
    thr_s2r: list
    thr_r2s: list
    frag: cute.Tensor  # fp32 accumulator values of one subtile (a gated GEMM's gate)
    frag_raw: object  # with an integer accumulator, the same values in its own dtype; else None
    # (m, n) within the tile of each accumulator value this thread holds (Hopper: registers) or
    # reads (Blackwell: tensor memory), and per subtile the index in tCcT behind each `frag` value
    tCcT: cute.Tensor
    acc_index: list
    barrier: pipeline.NamedBarrier  # the group's epilogue threads
    store_pipe: pipeline.PipelineTmaStore
    is_store_warp: object  # this warp issues the group's TMA stores and TILE-operand loads
    ctid: object  # this thread's index in its group
    # per reducing output: its smem buffer (where warps meet), its global partials, the fp32
    # register fragment its values are folded from and where its threads' values meet
    red_smem: tuple = ()
    red_out: tuple = ()
    red_frag: tuple = ()
    red_lanes: tuple = ()
    frag_up: object = None  # a gated GEMM's up-projection accumulators of the subtile; else None
    outputs: tuple = ()  # a grouped GEMM's outputs as global tensors (a group's last tile stores by predicate)
