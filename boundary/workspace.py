"""A rank's buffers, made once per BoundaryAllReduce: the mailbox, the device error word and, with peers,
the receive slots, the peers' slot addresses and the per-call state (CONTRACT §7).

Everything a call changes (the call counter, the slots' sentinels) lives in device memory, so a
CUDA graph replays the boundary with no host work.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from cute_kernels.allreduce.protocol import (
    ERROR_WORDS,
    GENERATIONS,
    SENTINEL_INT32,
    STATE_CALLS,
    STATE_RANK,
    STATE_TIMEOUT_US,
    STATE_WORDS,
    slot_elements,
)
from cute_kernels.hardware import SM_COUNT_ENV

log = logging.getLogger("boundary")
MULTICAST_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"


@dataclass
class Workspace:
    """One rank's buffers; `slots`, `peers` and `state` are set only where the rank exchanges with peers."""

    hidden_size: int
    max_rows: int
    device: torch.device
    world_size: int = 1
    rank: int = 0
    timeout_us: int = 0
    slots: Tensor | None = None  # [generations, W + 1, max_rows, H] bf16: what the peers push into
    peers: Tensor | None = None  # [W] int64: every rank's slot base address (this rank's included)
    state: Tensor | None = None  # [3] int32: call counter, rank, timeout (us)
    ranks_per_device: int = 1  # > 1: ranks sharing one GPU (simulated, or processes through CUDA IPC)
    shared_context: bool = False  # the ranks share this process's CUDA context (simulated ranks)

    # Built outside inference mode (a BoundaryAllReduce made under torch.inference_mode() serves calls outside it too:
    # an inference tensor refuses the in-place updates that arm() and check() make).
    @torch.inference_mode(False)
    def __post_init__(self) -> None:
        self.mailbox = torch.zeros(self.max_rows, self.hidden_size, dtype=torch.bfloat16, device=self.device)
        # The device error word (CONTRACT §7): a mask of the ranks a wait gave up on, 1 + a bad MoE row, its index.
        self.error = torch.zeros(ERROR_WORDS, dtype=torch.int32, device=self.device)

    def arm(self) -> None:
        """Put every slot back to the sentinel and the call counter to 0 (this rank's part of a reset)."""
        if self.slots is not None:
            self.slots.view(torch.int32).fill_(SENTINEL_INT32)
            self.state.copy_(self._initial_state())
        self.error.zero_()

    def _initial_state(self) -> Tensor:
        state = torch.zeros(STATE_WORDS, dtype=torch.int32)
        state[STATE_CALLS] = 0
        state[STATE_RANK] = self.rank
        state[STATE_TIMEOUT_US] = self.timeout_us
        return state.to(self.device)

    @torch.inference_mode(False)
    def _attach(self, slots: Tensor, peers: list[int]) -> None:
        self.slots = slots.view(GENERATIONS, self.world_size + 1, self.max_rows, self.hidden_size)
        self.peers = torch.tensor(peers, dtype=torch.int64, device=self.device)
        self.state = torch.empty(STATE_WORDS, dtype=torch.int32, device=self.device)
        self.arm()

    @classmethod
    @torch.inference_mode(False)
    def simulated(
        cls, hidden_size: int, world_size: int, max_rows: int, device: torch.device, timeout_us: int
    ) -> list[Workspace]:
        """W ranks' buffers on one GPU: plain allocations that address each other directly."""
        n = slot_elements(world_size, max_rows, hidden_size)
        buffers = [torch.empty(n, dtype=torch.bfloat16, device=device) for _ in range(world_size)]
        peers = [b.data_ptr() for b in buffers]
        spaces = []
        for rank, buf in enumerate(buffers):
            ws = cls(
                hidden_size,
                max_rows,
                device,
                world_size,
                rank,
                timeout_us,
                ranks_per_device=world_size,
                shared_context=True,
            )
            ws._attach(buf, peers)
            ws._handle = buffers  # the peers' slots too: a rank kept alone must not push into freed memory
            spaces.append(ws)
        torch.cuda.synchronize(device)
        return spaces

    @classmethod
    @torch.inference_mode(False)
    def symmetric(
        cls, hidden_size: int, max_rows: int, device: torch.device, group: Any, timeout_us: int, launch: tuple[int, ...]
    ) -> Workspace:
        """This rank's buffers in symmetric memory of the TP group (unicast only): collective. `launch`: the
        kernel's launch shape (CTAs per row, threads, cluster cap), which every rank must share (a call's
        cluster count decides the two-shot owners)."""
        import torch.distributed._symmetric_memory as symm_mem

        unicast_only()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        _same_everywhere(group, hidden_size, max_rows, timeout_us, launch)
        buf = symm_mem.empty(slot_elements(world, max_rows, hidden_size), dtype=torch.bfloat16, device=device)
        handle = symm_mem.rendezvous(buf, group)
        # Where this tensor starts in its symmetric allocation; a pooling allocator may differ by rank.
        offsets: list[Any] = [None] * world
        dist.all_gather_object(offsets, buf.data_ptr() - handle.buffer_ptrs[handle.rank], group=group)
        ws = cls(hidden_size, max_rows, device, world, rank, timeout_us)
        ws._attach(buf, [handle.buffer_ptrs[p] + offsets[p] for p in range(world)])
        ws._handle = handle  # keeps the mapping alive
        torch.cuda.synchronize(device)
        dist.barrier(group)  # no peer pushes before every rank has armed its slots
        return ws

    @classmethod
    @torch.inference_mode(False)
    def ipc(
        cls,
        hidden_size: int,
        max_rows: int,
        device: torch.device,
        group: Any,
        timeout_us: int,
        launch: tuple[int, ...],
        ranks_per_device: int,
    ) -> Workspace:
        """This rank's buffers for a TP group whose processes share GPUs (torch's symmetric memory refuses several
        ranks on one device): plain allocations whose CUDA IPC handles travel through the group; collective."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        _same_everywhere(group, hidden_size, max_rows, timeout_us, launch)
        buf = torch.empty(slot_elements(world, max_rows, hidden_size), dtype=torch.bfloat16, device=device)
        handles: list[Any] = [None] * world
        dist.all_gather_object(handles, buf.untyped_storage()._share_cuda_(), group=group)
        opened = {p: torch.UntypedStorage._new_shared_cuda(*handles[p]) for p in range(world) if p != rank}
        ws = cls(hidden_size, max_rows, device, world, rank, timeout_us, ranks_per_device=ranks_per_device)
        ws._attach(buf, [buf.data_ptr() if p == rank else opened[p].data_ptr() for p in range(world)])
        ws._handle = (buf, opened)  # keeps this rank's buffer and the peers' mappings alive
        torch.cuda.synchronize(device)
        dist.barrier(group)  # no peer pushes before every rank has armed its slots
        return ws


def _same_everywhere(group: Any, hidden_size: int, max_rows: int, timeout_us: int, launch: tuple[int, ...]) -> None:
    """Raise unless every rank of `group` builds its workspace alike (collective)."""
    shapes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shapes, (hidden_size, max_rows, timeout_us, tuple(launch)), group=group)
    if len(set(shapes)) > 1:
        raise ValueError(
            f"every rank must build its BoundaryAllReduce with the same hidden_size, max_rows and "
            f"timeout_us, on GPUs with the same launch shape (CTAs per row, threads, cluster cap: "
            f"the SM count, or ${SM_COUNT_ENV}); the ranks gave {shapes}"
        )


def ranks_on_each_device(group: Any, device: torch.device) -> int:
    """How many ranks of `group` share a GPU, the most on any one (1: a GPU each); collective."""
    everyone = _placements(group, device)
    return max(everyone.count(who) for who in everyone)


def _placements(group: Any, device: torch.device) -> list[Any]:
    """Every rank's (host, PCI bus id of its GPU); collective. A failing probe is caught, so that no rank leaves
    the collective and hangs the others."""
    try:
        me: Any = (socket.gethostname(), _pci_bus_id(device))
    except Exception as exc:
        me = (socket.gethostname(), f"unknown ({type(exc).__name__}: {exc})")
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, me, group=group)
    return everyone


def unicast_only() -> None:
    """Keep torch's symmetric memory from making multicast objects (the slots take plain peer stores, and
    NVLink multicast stays off): set $TORCH_SYMM_MEM_DISABLE_MULTICAST=1, or raise where it is set otherwise."""
    value = os.environ.setdefault(MULTICAST_ENV, "1")
    if value != "1":
        raise ValueError(
            f"the peer workspace is unicast only, but ${MULTICAST_ENV}={value!r} would let torch make "
            f"NVLink multicast objects for it: unset it or set it to 1"
        )


def peers_can_map(group: Any, device: torch.device) -> tuple[bool, str]:
    """Whether every rank of `group` can map every other's memory (same host, CUDA peer access); collective.

    Every rank gets the same answer, and the reason when it is no.
    """
    # Every local probe is caught, so that no rank leaves the two collectives and hangs the others.
    everyone = _placements(group, device)
    hosts = {host for host, _ in everyone}
    try:
        if len(hosts) > 1:
            verdict = (False, f"the TP group spans {len(hosts)} hosts")
        else:
            visible = {_pci_bus_id(torch.device("cuda", i)): i for i in range(torch.cuda.device_count())}
            missing = [b for _, b in everyone if b not in visible]
            if missing:
                verdict = (False, f"this process cannot see the peers' GPUs {missing} to check peer access")
            else:
                blocked = [
                    b
                    for _, b in everyone
                    if visible[b] != device.index and not torch.cuda.can_device_access_peer(device.index, visible[b])
                ]
                verdict = (not blocked, f"no CUDA peer access to {blocked}" if blocked else "")
    except Exception as exc:
        verdict = (False, f"the peer-access probe failed: {type(exc).__name__}: {exc}")
    votes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(votes, verdict, group=group)
    reasons = [why for ok, why in votes if not ok]
    return (not reasons, "; ".join(sorted(set(reasons))))


def _pci_bus_id(device: torch.device) -> str:
    """The PCI bus id of a CUDA device, as the driver names it (e.g. 0000:19:00.0)."""
    from cuda.bindings import runtime

    err, bus = runtime.cudaDeviceGetPCIBusId(32, device.index)
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaDeviceGetPCIBusId({device.index}) failed: {err}")
    return bus.decode().rstrip("\x00").lower() if isinstance(bus, bytes) else str(bus).lower()


def workspace_bytes(hidden_size: int, max_rows: int, world_size: int = 1, *, slots: bool = False) -> int:
    """The device bytes of one rank's Workspace: the mailbox and the error word, and with `slots` the receive
    slots, the peers' addresses and the state."""
    nbytes = max_rows * hidden_size * 2 + ERROR_WORDS * 4
    if slots:
        nbytes += slot_elements(world_size, max_rows, hidden_size) * 2 + world_size * 8 + STATE_WORDS * 4
    return nbytes
