"""Named barrier ids of the Hopper kernels (0 is __syncthreads; the hardware has 16)."""
import enum


class FwdBarrier(enum.IntEnum):
    EPILOGUE = 1  # consumer warpgroups: the O staging buffer is free / holds this tile's O
    SCHED0 = 2  # + consumer warpgroup - 1: its turn on the tensor cores (ping-pong)


class BwdBarrier(enum.IntEnum):
    PDS = 1  # the dS tile of both MMA warp groups is in shared memory
    DQ_FULL = 2  # + warp group: its dQ part is in shared memory (MMA warp group -> dQ warp)
    DQ_EMPTY = 4  # + warp group: its dQ buffer may be overwritten (dQ warp -> MMA warp group)
    EPILOGUE = 6  # MMA warp groups: the tiles are free for / hold the staged dK, dV
    DS_READY = 7  # + 3 * warp group + dS buffer, staggered: that group's dS is in the buffer
    DQ_MEET = 13  # the two dQ warps, every step: group 1's part waits for group 0's (dq_warps_meet)
