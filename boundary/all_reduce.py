"""BoundaryAllReduce: owns the TP group, the workspace and the kernels; picks the path once."""

from __future__ import annotations

import enum
import itertools
import logging
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from boundary import checks, mhc, reference
from boundary.backend import BACKENDS, kernel_arch
from boundary.types import Fp8GroupActivation, MixWeights, QuantizedActivation, check_fp8_out, check_mxfp8_out
from boundary.workspace import Workspace, peers_can_map, ranks_on_each_device
from cute_kernels import native
from cute_kernels.allreduce.protocol import (
    ERROR_MISSING,
    ERROR_MOE_INDEX,
    ERROR_MOE_ROW,
    MAX_WORLD,
    PEER_WORLD_SIZES,
    PROTOCOLS,
)
from cute_kernels.boundary import api as boundary_api
from cute_kernels.boundary.args import BoundaryVariant
from cute_kernels.boundary.own_pre import MIX_PARAMS
from cute_kernels.compile import lazy_module_loading, warmup
from cute_kernels.hardware import MAX_DEVICE_CONNECTIONS, device_connections

log = logging.getLogger("boundary")

BF16 = torch.bfloat16
F32 = torch.float32
# A peer later than this is taken for gone (CONTRACT §7): long enough for any host-side skew between
# ranks (a Python pause, a first-call load), short enough that a dead rank surfaces as an error.
DEFAULT_TIMEOUT_US = 10_000_000
MAX_TIMEOUT_US = 2**31 - 1
INF = math.inf
# The custom ops (boundary.ops) name a BoundaryAllReduce by an int key: weak, so a handle outlives nothing. A dict of
# weak references (each removes its key when its object goes) rather than a WeakValueDictionary, whose lookup is
# Python code: this runs on every op call.
_REGISTRY: dict[int, weakref.ref[BoundaryAllReduce]] = {}
_HANDLES = itertools.count(1)


def from_handle(handle: int) -> BoundaryAllReduce:
    """The BoundaryAllReduce whose `handle` is `handle` (the custom ops' per-rank state)."""
    ref = _REGISTRY.get(handle)
    ar = None if ref is None else ref()
    if ar is None:
        raise ValueError(
            f"handle {handle!r} names no live BoundaryAllReduce: pass all_reduce.handle, and keep the "
            "BoundaryAllReduce alive while anything calls an op with it"
        )
    return ar


def _register(ar: BoundaryAllReduce) -> int:
    """A new handle for `ar`, dropped from the registry when `ar` goes."""
    handle = next(_HANDLES)
    _REGISTRY[handle] = weakref.ref(ar, lambda _, handle=handle: _REGISTRY.pop(handle, None))
    return handle


class BoundaryPath(str, enum.Enum):
    """How a BoundaryAllReduce computes its boundaries, chosen once at construction (CONTRACT §7); equal to its name
    as a string ("kernel", "peer", "nccl+kernel", "reference")."""

    KERNEL = "kernel"  # W = 1 on sm_90a / sm_100a: the fused kernel
    PEER = "peer"  # W > 1, every rank maps every other's memory: the fused kernel with the all-reduce inside
    NCCL_KERNEL = "nccl+kernel"  # W > 1 otherwise: an NCCL all-reduce, then the one-rank kernel
    REFERENCE = "reference"  # the CPU, or backend="reference": torch.distributed and the torch epilogue

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def multi_rank_path(world_size: int, peers_map: Callable[[], tuple[bool, str]]) -> tuple[BoundaryPath, str]:
    """The path of a W > 1 rank on a supported GPU, and why it is not "peer": "peer" where the peer protocol serves
    W and every rank maps every other's memory (`peers_map()`: whether, and why not; a collective, so it runs only
    where W is served, which every rank of the group decides alike), else "nccl+kernel"."""
    if world_size not in PEER_WORLD_SIZES:
        return BoundaryPath.NCCL_KERNEL, f"the peer protocol is built for {PEER_WORLD_SIZES} ranks, not {world_size}"
    can_map, why = peers_map()
    return (BoundaryPath.PEER, "") if can_map else (BoundaryPath.NCCL_KERNEL, f"peers cannot map each other: {why}")


class BoundaryAllReduce:
    """The fused boundary of one TP rank: all-reduce, mHC post, delayed collapse, RMSNorm, MXFP8.

    Paths, chosen once here and logged (CONTRACT §7):
    - "kernel" (W = 1 on sm_90a / sm_100a): the fused CuTe DSL kernel, one launch per boundary.
    - "peer" (W > 1, every rank can map every other's memory): the same kernel with the all-reduce
      inside, through symmetric receive slots (one-shot or two-shot by payload), one launch.
    - "nccl+kernel" (W > 1 otherwise: other hosts, no peer access, a world size other than 2, 4, 8): an fp32
      NCCL all-reduce of the partial, then the one-rank kernel (y within 1 bf16 ulp of the rank-order sum).
    - "reference": the partials all-gathered through torch.distributed and summed in rank order, then
      the torch epilogue (the CPU path and the oracle).
    `backend="auto"` takes the kernels on a supported GPU and the reference on the CPU; on any other GPU
    it raises, naming the GPU, and `backend="reference"` is the way out.
    `early_loads=True`: every kernel launch issues its first row's streams and coefficients before waiting for the
    previous kernel (PDL), on the caller's promise that they are complete before that kernel starts (CONTRACT §7).
    """

    _warned_lazy = False  # simulated() has said that CUDA loads kernels lazily in this process
    _warned_connections = False  # simulated() has said that the ranks' streams may share hardware queues

    def __init__(
        self,
        hidden_size: int,
        *,
        group: Any = None,
        max_rows: int = 512,
        hc_mult: int = 4,
        device: Any = None,
        backend: str = "auto",
        timeout_us: int = DEFAULT_TIMEOUT_US,
        protocol: str | None = None,
        early_loads: bool = False,
    ) -> None:
        if group is not None and not dist.is_initialized():
            raise ValueError("group was given but torch.distributed is not initialised")
        rank = dist.get_rank(group) if group is not None else 0
        world = dist.get_world_size(group) if group is not None else 1
        self._setup(hidden_size, max_rows, hc_mult, device, backend, timeout_us, rank, world, group)
        self.protocol = protocol
        self._early_loads = checks.flag("early_loads", early_loads)
        # The checked values (plain ints: a numpy int would key its own compile cache entries).
        hidden_size, max_rows, timeout_us = self.hidden_size, self.max_rows, self.timeout_us
        why = ""
        self.path: BoundaryPath
        if self.arch is None:
            self.path = BoundaryPath.REFERENCE
            self.workspace = Workspace(hidden_size, max_rows, self.device)
        elif self.world_size == 1:
            self.path = BoundaryPath.KERNEL
            self.workspace = Workspace(hidden_size, max_rows, self.device)
        else:
            self.path, why = multi_rank_path(self.world_size, lambda: peers_can_map(group, self.device))
            if self.path == BoundaryPath.PEER:
                sharing = ranks_on_each_device(group, self.device)
                launch = boundary_api.peer_launch_shape(hidden_size, self.arch, sharing, self.world_size)
                if sharing > 1:  # processes sharing a GPU: CUDA IPC (symmetric memory takes one rank per GPU)
                    self.workspace = Workspace.ipc(
                        hidden_size, max_rows, self.device, group, timeout_us, launch, sharing
                    )
                else:
                    self.workspace = Workspace.symmetric(hidden_size, max_rows, self.device, group, timeout_us, launch)
            else:
                self.workspace = Workspace(hidden_size, max_rows, self.device)
        self._log_path(why)

    def _setup(
        self,
        hidden_size: Any,
        max_rows: Any,
        hc_mult: Any,
        device: Any,
        backend: Any,
        timeout_us: Any,
        rank: int,
        world: int,
        group: Any,
    ) -> None:
        """Check the construction arguments once and set what every path shares (the arch: None on the reference)."""
        hidden_size = checks.positive_int("hidden_size", hidden_size)
        if hidden_size % 256:
            raise ValueError(f"hidden_size must be a multiple of 256, got {hidden_size}")
        max_rows = checks.positive_int("max_rows", max_rows)
        hc_mult = checks.integer("hc_mult", hc_mult)
        if hc_mult != 4:
            raise ValueError(f"hc_mult must be 4 (the mHC models this boundary serves), got {hc_mult!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        timeout_us = checks.positive_int("timeout_us", timeout_us)
        if world > MAX_WORLD:
            raise ValueError(f"the TP group has {world} ranks; the peer boundary serves at most {MAX_WORLD}")
        if timeout_us > MAX_TIMEOUT_US:
            raise ValueError(f"timeout_us must be at most {MAX_TIMEOUT_US}, got {timeout_us}")
        self.hidden_size = hidden_size
        self.max_rows = max_rows
        self.handle = _register(self)
        self.hc_mult = hc_mult
        self.group = group
        self.rank = rank
        self.world_size = world
        self.timeout_us = timeout_us
        self.simulated_ranks = False
        self._peer_args: boundary_api.PeerArgs | None = None
        # The variant and one-rank kernel of each call form this boundary has launched, by its flags: decided once.
        self._launches: dict[tuple, tuple[BoundaryVariant, Callable[..., Any] | None]] = {}
        # The launch of each plain call form (ready x; no shared, aux, FP8 1x128 or own pre) by (rows, no pre, no
        # MXFP8), kept after its first launch: the protocol and staging follow from the rows, and a peer kernel is
        # marked loaded only once it has launched.
        self._ready: dict[tuple[int, bool, bool], Callable[..., tuple]] = {}
        self._protocol: str | None = None
        self.stream: torch.cuda.Stream | None = None
        self.device = checks.device("device", device)
        self._cuda_index = self.device.index if self.device.type == "cuda" else None  # checks.fits' device
        self._device_index = -1 if self._cuda_index is None else self._cuda_index  # Tensor.get_device()'s
        self.arch = kernel_arch(self.device, backend)  # raises on GPUs without the kernels
        # Checked where the path is not known yet: with the receive slots wherever the peer path may run, and for
        # simulated ranks (no group) every rank's buffers on the one GPU, once.
        if group is not None or rank == 0:
            checks.workspace_capacity(
                hidden_size,
                max_rows,
                world,
                self.device,
                slots=world in PEER_WORLD_SIZES and self.arch is not None,
                ranks=world if group is None else 1,
            )

    def _log_path(self, why: str) -> None:
        how = {
            BoundaryPath.KERNEL: f"the fused CuTe DSL kernel ({self.arch}), one launch per boundary",
            BoundaryPath.PEER: f"the fused kernel with the peer all-reduce inside ({self.arch}), one launch per "
            "boundary" + (", simulated ranks sharing one GPU" if self.simulated_ranks else ""),
            BoundaryPath.NCCL_KERNEL: f"an NCCL all-reduce, then the fused kernel ({self.arch}): {why}",
            BoundaryPath.REFERENCE: "all-gather through torch.distributed, rank-order sum, torch epilogue",
        }[self.path]
        # The NCCL path is the fused one's fallback: said where a default logging setup shows it.
        level = logging.WARNING if self.path == BoundaryPath.NCCL_KERNEL else logging.INFO
        log.log(
            level,
            "BoundaryAllReduce rank %d/%d on %s, H=%d: %s path: %s",
            self.rank,
            self.world_size,
            self.device,
            self.hidden_size,
            self.path,
            how,
        )

    @property
    def protocol(self) -> str | None:
        """The protocol every peer call takes: "oneshot", "twoshot", or None (the switch's choice by rows, the
        default). Set it on every rank alike, and warm up after setting it."""
        return self._protocol

    @protocol.setter
    def protocol(self, value: str | None) -> None:
        if value is not None and value not in PROTOCOLS:
            raise ValueError(f"protocol must be None (the switch's choice) or one of {PROTOCOLS}, got {value!r}")
        self._protocol = value
        self._peer_args = None
        self._ready = {}

    @property
    def early_loads(self) -> bool:
        """Whether this boundary's kernels load the first row before the PDL wait (set at construction, CONTRACT §7)."""
        return self._early_loads

    @classmethod
    def simulated(
        cls,
        hidden_size: int,
        world_size: int,
        *,
        max_rows: int = 512,
        device: Any = None,
        timeout_us: int = DEFAULT_TIMEOUT_US,
        protocol: str | None = None,
        early_loads: bool = False,
    ) -> list[BoundaryAllReduce]:
        """W ranks inside this process on one GPU (CONTRACT §5): separate receive slots, one object and one
        stream per rank, the "peer" path. Their timings are "simulated": the ranks share one GPU's SMs and
        HBM, never NVLink. Issue every rank's call before waiting for any: `run_simulated`."""
        world_size = checks.positive_int("world_size", world_size)
        if world_size not in PEER_WORLD_SIZES:
            raise ValueError(
                f"simulated ranks run the peer protocol: world_size must be one of {PEER_WORLD_SIZES}, got {world_size}"
            )
        need = "simulated ranks need a CUDA GPU (sm_90a / sm_100a): they run the peer kernels side by side on one GPU"
        if not torch.cuda.is_available():
            raise ValueError(f"{need}, and none is available here")
        if checks.device("device", device).type != "cuda":
            raise ValueError(f"{need}, got device={device!r}")
        ranks = []
        for rank in range(world_size):
            ar = cls.__new__(cls)
            ar._setup(hidden_size, max_rows, 4, device, "kernel", timeout_us, rank, world_size, None)
            ar.simulated_ranks = True
            ar.path = BoundaryPath.PEER
            ar.protocol = protocol
            ar._early_loads = checks.flag("early_loads", early_loads)
            ar.stream = torch.cuda.Stream(ar.device)
            ranks.append(ar)
        if lazy_module_loading() and not BoundaryAllReduce._warned_lazy:
            BoundaryAllReduce._warned_lazy = True  # once per process
            log.warning(
                "simulated ranks share one CUDA context, and CUDA loads kernels lazily here: a kernel launched for the "
                "first time (torch's, cuBLAS's or yours) while a boundary spins can stall every rank to timeout_us. "
                "Set CUDA_MODULE_LOADING=EAGER before CUDA initialises, and call warmup() (CONTRACT §7)"
            )
        connections = device_connections()
        if connections < MAX_DEVICE_CONNECTIONS and not BoundaryAllReduce._warned_connections:
            BoundaryAllReduce._warned_connections = True  # once per process
            log.warning(
                "simulated ranks share one CUDA context, whose streams CUDA maps onto CUDA_DEVICE_MAX_CONNECTIONS=%d "
                "hardware queues: with more streams than that (the ranks' own, their side streams, the caller's), a "
                "rank's kernel can queue behind a peer's spinning boundary and every rank stalls to timeout_us. Set "
                "CUDA_DEVICE_MAX_CONNECTIONS=%d before CUDA initialises, and use at most that many streams in all "
                "(CONTRACT §7)",
                connections,
                MAX_DEVICE_CONNECTIONS,
            )
        spaces = Workspace.simulated(hidden_size, world_size, max_rows, ranks[0].device, timeout_us)
        for ar, ws in zip(ranks, spaces):
            ar.workspace = ws
            ar._log_path("")
        return ranks

    @staticmethod
    def run_simulated(
        ranks: Sequence[BoundaryAllReduce], calls: Sequence[Callable[[BoundaryAllReduce], Any]]
    ) -> list[Any]:
        """calls[r](ranks[r]) for every simulated rank, each on its own stream forked from the current one
        and joined back into it, all issued before any is waited for; returns their results in rank order."""
        if len(calls) != len(ranks) or not ranks or not all(r.simulated_ranks for r in ranks):
            raise ValueError("run_simulated takes the ranks of BoundaryAllReduce.simulated and one call per rank")
        main = torch.cuda.current_stream(ranks[0].device)
        for ar in ranks:
            ar.stream.wait_stream(main)
        results = []
        for ar, call in zip(ranks, calls):
            with torch.cuda.stream(ar.stream):
                results.append(call(ar))
        for ar in ranks:
            main.wait_stream(ar.stream)
        return results

    def mailbox(self, rows: int) -> Tensor:
        """The [rows, H] bf16 view of this rank's buffer that a GEMM may write its partial into."""
        self._check_rows(rows)
        return self.workspace.mailbox[:rows]

    def __call__(
        self,
        x: Tensor,
        residual: Tensor,
        post: Tensor,
        comb: Tensor,
        pre: Tensor | None,
        norm_weight: Tensor | None,
        norm_eps: float,
        mxfp8_out: QuantizedActivation | None,
        *,
        shared_output: Tensor | None = None,
        aux_out: Tensor | None = None,
        fp8_out: Fp8GroupActivation | None = None,
        mix: MixWeights | None = None,
        pre_out: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The boundary on a bf16 partial `x`: (new residual, layer input or None when pre is None).

        With `shared_output` the rank's partial is bf16(x + shared_output) (a combined MoE output). `fp8_out` takes
        the FP8 1x128 form of the layer input (CONTRACT §4b), beside or instead of `mxfp8_out`. With `mix`
        (DeepSeek-V4, CONTRACT §4d; pre=None) the pre is computed from the new streams in the same launch, with
        those weights (`boundary.mhc.mix_weights`), and written to `pre_out` ([T, 4] fp32) where one is given.
        """
        if shared_output is None and aux_out is None and fp8_out is None and mix is None and pre_out is None:
            # The common call. A call form launched before at this row count takes its kept launch (the rows are
            # then within max_rows); its first call takes _kernel once `_fits` passes. What this tests, or `_fits`,
            # leaves out, the compiled kernel's TVM-FFI entry checks before it launches; where it refuses, the full
            # checks below name the fault (and where they pass, the launch failed for another reason: the checked
            # call makes it again, and its error is the caller's).
            try:
                rows = residual.shape[0]
                post2 = post
                if post.dim() == 3 and post.shape[0] == rows and post.shape[2] == 1:  # [T, hc, 1], the module's
                    post2 = post.view(rows, post.shape[1])  # the kernel takes [T, hc]; other shapes: the checks
                launch = self._ready.get((rows, pre is None, mxfp8_out is None))
                if launch is None:
                    if self._fused and self._fits(residual, post2, pre, norm_weight, norm_eps, mxfp8_out):
                        return self._kernel(
                            residual, post2, comb, pre, norm_weight, norm_eps, mxfp8_out, None, None, x=x
                        )
                elif residual.get_device() == self._device_index and type(norm_eps) is float and 0.0 <= norm_eps < INF:
                    # The outputs are made like residual and x (the layer input [T, H] bf16 as x, or the entry
                    # refuses x).
                    if mxfp8_out is None:
                        return launch(residual, post2, comb, pre, norm_weight, x, None, None, norm_eps)
                    data, scale = mxfp8_out.data, mxfp8_out.scale
                    if type(mxfp8_out) is QuantizedActivation and scale.shape[0] == self._scale_bytes(rows):
                        return launch(residual, post2, comb, pre, norm_weight, x, data, scale, norm_eps)
            except Exception:  # noqa: BLE001, S110 - the checked call below raises what is wrong
                pass
        residual = self._check_residual(residual)
        rows = residual.shape[0]
        a16 = self._align(16)
        checks.tensor("x", x, dtype=BF16, shape=(rows, self.hidden_size), device=self.device, align=a16)
        if shared_output is not None:
            checks.tensor(
                "shared_output",
                shared_output,
                dtype=BF16,
                shape=(rows, self.hidden_size),
                device=self.device,
                align=a16,
            )
        pre = self._check_mix(rows, mix, pre, pre_out)
        args = self._check_epilogue(rows, post, comb, pre, norm_weight, norm_eps, mxfp8_out, aux_out, fp8_out)
        if self._fused:
            return self._kernel(residual, *args, x=x, shared=shared_output, mix=mix)
        y = self._reduce(reference.add_shared(x, shared_output))
        return self._epilogue(y, residual, *args, mix=mix)

    def finalize(
        self,
        gemm2_permuted: Tensor,
        expert_weights: Tensor,
        expanded_idx_to_permuted_idx: Tensor,
        shared_output: Tensor | None,
        residual: Tensor,
        post: Tensor,
        comb: Tensor,
        pre: Tensor | None,
        norm_weight: Tensor | None,
        norm_eps: float,
        mxfp8_out: QuantizedActivation | None,
        *,
        aux_out: Tensor | None = None,
        fp8_out: Fp8GroupActivation | None = None,
        mix: MixWeights | None = None,
        pre_out: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The boundary on an unfinalized MoE output: the top-k combine + shared add, then as __call__."""
        residual = self._check_residual(residual)
        rows = residual.shape[0]
        dev, hidden, a16 = self.device, self.hidden_size, self._align(16)
        checks.tensor("gemm2_permuted", gemm2_permuted, dtype=BF16, shape=(None, hidden), device=dev, align=a16)
        checks.tensor("expert_weights", expert_weights, dtype=F32, shape=(rows, None), device=dev)
        top_k = expert_weights.shape[1]
        if top_k < 1:
            shape = list(expert_weights.shape)
            raise checks._error(
                ValueError, "expert_weights", f"must have at least one column (top_k >= 1), got {shape}"
            )
        checks.tensor(
            "expanded_idx_to_permuted_idx",
            expanded_idx_to_permuted_idx,
            dtype=torch.int32,
            shape=(rows, top_k),
            device=dev,
        )
        checks.optional_tensor("shared_output", shared_output, dtype=BF16, shape=(rows, hidden), device=dev, align=a16)
        pre = self._check_mix(rows, mix, pre, pre_out)
        args = self._check_epilogue(rows, post, comb, pre, norm_weight, norm_eps, mxfp8_out, aux_out, fp8_out)
        if self._fused:
            moe = (gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx)
            return self._kernel(residual, *args, moe=moe, shared=shared_output, mix=mix)
        partial = reference.moe_finalize(
            gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx, shared_output, self.workspace.error
        )
        y = self._reduce(partial)
        return self._epilogue(y, residual, *args, mix=mix)

    def warmup(
        self,
        max_rows: int | None = None,
        *,
        quantize: Sequence[str] | None = tuple(boundary_api.QUANTIZE_FORMS),
        unnormed_layer_input: bool = False,
        own_pre: bool = False,
        sinkhorn_repeat: int = 20,
        progress: bool = True,
    ) -> None:
        """Compile every kernel variant this boundary (and the scheduler's mHC ops) will launch, and load it.

        `quantize` names the layer-input forms the engine asks for beside bf16 (the scheduler's `quantize=`
        values; every form by default; None or () for bf16 only): an engine that writes one form warms up
        that one only, in about two thirds of the time. `unnormed_layer_input`: the coefficients' layer input
        without a norm weight too (`mhc_pre_delayed(..., norm_weight=None)`; the scheduler never asks for it).
        `own_pre`: DeepSeek-V4's kernels too, its own-pre layer input in the `quantize` forms and hc_head's weights,
        and the boundary kernels that compute their own pre (`mix=`; `V4Boundaries.warmup` sets it).
        `sinkhorn_repeat`: the layers' Sinkhorn iterations (`hc_sinkhorn_iters`, compiled into the coefficients
        kernels; 20 in the V4 models).
        Call it before CUDA-graph capture: nothing can compile or allocate a workspace inside a capture.
        Compiled kernels are cached on disk, so later processes only load them.
        """
        rows = self.max_rows if max_rows is None else checks.positive_int("max_rows", max_rows)
        if rows > self.max_rows:
            raise ValueError(f"max_rows ({rows}) exceeds this boundary's capacity, its max_rows={self.max_rows}")
        quantize = () if quantize is None else quantize
        checks.flag("unnormed_layer_input", unnormed_layer_input)
        checks.flag("own_pre", own_pre)
        sinkhorn_repeat = checks.positive_int("sinkhorn_repeat", sinkhorn_repeat)
        if not isinstance(quantize, (tuple, list)) or not all(q in boundary_api.QUANTIZE_FORMS for q in quantize):
            raise ValueError(
                f"quantize must be a sequence of {tuple(boundary_api.QUANTIZE_FORMS)} (the forms written beside bf16), "
                f"got {quantize!r}"
            )
        if self.arch is None:
            log.info("BoundaryAllReduce.warmup: the %s path has nothing to compile", self.path)
            return
        world = self.world_size if self.path == BoundaryPath.PEER else 1
        protocols = boundary_api.warmup_protocols(world, self.hidden_size, rows, self._protocol) if world > 1 else ()
        jobs = boundary_api.warmup_jobs(
            self.hidden_size,
            arch=self.arch,
            world_size=world,
            ranks_per_device=self.workspace.ranks_per_device,
            variants=boundary_api.early(
                boundary_api.engine_variants(tuple(quantize))
                + (boundary_api.own_pre_variants(tuple(quantize)) if own_pre else ()),
                self._early_loads,
            ),
            protocols=protocols,
        ) + mhc.warmup_jobs(
            self.hidden_size,
            self.arch,
            rows,
            sinkhorn_repeat=sinkhorn_repeat,
            unnormed=unnormed_layer_input,
            own_pre=own_pre,
            quantized=tuple(quantize),
        )
        mhc.prepare_workspace(self.hidden_size, rows, self.device, self.rank if self.simulated_ranks else None)
        warmup(jobs, progress=progress, desc=f"mHC kernels H={self.hidden_size} {self.arch}", device=self.device)
        native.available()  # builds the kept launches' C entry now, not at the first call (or warns why not)

    def check(self) -> None:
        """Raise if a boundary of this rank gave up waiting for a peer or met a MoE index outside [-1, P).

        Synchronises the device (every stream: a step may have run on a stream of the engine's own, which the
        stream this is called on does not wait for), then reads the device error word: call it off the hot path
        (e.g. once per step). A wait that gave up leaves the exchange out of step: every rank must `reset()` before
        the next boundary. A bad MoE index is reported once (the word is cleared) and leaves the rest intact.
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        word = self.workspace.error.tolist()
        missing = [r for r in range(self.world_size) if word[ERROR_MISSING] >> r & 1]
        if missing:
            raise RuntimeError(
                f"rank {self.rank}: the boundary gave up waiting for rank(s) {missing} after timeout_us="
                f"{self.timeout_us}; the outputs of that boundary and every one since are wrong, on every rank "
                "(a peer may have used this rank's unfinished sum). Call reset() on every rank before the next boundary"
            )
        if word[ERROR_MOE_ROW]:
            self.workspace.error[ERROR_MOE_ROW : ERROR_MOE_INDEX + 1].zero_()
            # The row is the last one flagged; the index is one of the flagged ones (usually that row's).
            raise ValueError(
                f"rank {self.rank}: expanded_idx_to_permuted_idx held {word[ERROR_MOE_INDEX]} in row "
                f"{word[ERROR_MOE_ROW] - 1}, outside [-1, P): that expert was treated as none"
            )

    def reset(self) -> None:
        """Re-arm this rank's exchange after a wait gave up (collective on a real TP group: every rank calls it;
        simulated ranks: call it on each). Waits for this rank's device work first."""
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            torch.cuda.synchronize(self.device)
        if self.group is not None:
            dist.barrier(self.group)  # every rank's kernels are done: no late push can land after the re-arm
        self.workspace.arm()
        if on_gpu:
            torch.cuda.synchronize(self.device)
        if self.group is not None:
            dist.barrier(self.group)  # every rank is re-armed before any rank's next push

    @property
    def _fused(self) -> bool:
        """Whether this boundary's calls are the fused kernel's single launch (the "kernel" and "peer" paths)."""
        return self.path is BoundaryPath.KERNEL or self.path is BoundaryPath.PEER

    def _scale_bytes(self, rows: int) -> int:
        """The bytes of a `rows`-row MXFP8 layer input's swizzled scales at this hidden size."""
        return reference.mxfp8_scale_bytes(rows, self.hidden_size)

    def _align(self, nbytes: int) -> int:
        """The byte boundary a buffer the kernel accesses `nbytes` at a time must start on: 1 on the torch path."""
        return nbytes if self.arch is not None else 1

    def _fits(
        self, residual: object, post: object, pre: object, norm_weight: object, norm_eps: object, mxfp8_out: object
    ) -> bool:
        """Whether a call form's first call on a ready partial may go to _kernel unchecked (its later calls take the
        kept launch, which tests the device, the eps and the MXFP8 scales only): what the kernel's TVM-FFI entry cannot
        check is as the full checks want it (the streams' row count within max_rows and their device this
        boundary's; a 2-D post, since fused_boundary views any other as [T, hc]; a float eps; the layer-input
        arguments given together, an MXFP8 buffer whole). The rest of every tensor argument the entry checks, from
        the argument spec the kernel was compiled against (`boundary_api.fake_args`: dtypes, the shapes with one row
        count, row-major strides, alignment, one device for all). False sends the call through the full checks,
        which name what is wrong."""
        if type(residual) is not Tensor or residual.dim() != 3 or type(post) is not Tensor or post.dim() != 2:
            return False
        if not (
            0 < residual.shape[0] <= self.max_rows
            and residual.get_device() == self._device_index
            and type(norm_eps) is float
            and 0.0 <= norm_eps < math.inf
        ):
            return False
        if pre is None:
            return norm_weight is None and mxfp8_out is None
        if norm_weight is None:
            return False
        rows, hidden, index = residual.shape[0], self.hidden_size, self._cuda_index
        return mxfp8_out is None or (
            type(mxfp8_out) is QuantizedActivation
            and checks.fits(mxfp8_out.data, torch.float8_e4m3fn, (rows, hidden), index, self._align(16))
            and checks.fits(
                mxfp8_out.scale, torch.uint8, (reference.mxfp8_scale_bytes(rows, hidden),), index, self._align(4)
            )
        )

    def _check_rows(self, rows: int) -> None:
        checks.positive_int("rows", rows)
        if rows > self.max_rows:
            raise ValueError(f"rows ({rows}) exceed this boundary's capacity max_rows={self.max_rows}")

    def _check_mix(self, rows: int, mix: object, pre: object, pre_out: object) -> object:
        """The pre the epilogue takes: `pre` as given without `mix`; with it, where the kernel writes its own pre
        (`pre_out`, or a new [T, 4] fp32 tensor)."""
        if mix is None:
            if pre_out is not None:
                raise ValueError("pre_out takes the pre a boundary computes from its new streams: it needs mix")
            return pre
        if not isinstance(mix, MixWeights):
            raise TypeError(f"mix must be a MixWeights (boundary.mhc.mix_weights), got {type(mix).__name__}")
        if pre is not None:
            raise ValueError("with mix the boundary computes the pre itself: pass pre=None (pre_out receives it)")
        hc, hidden, dev = self.hc_mult, self.hidden_size, self.device
        checks.tensor("mix.fn", mix.fn, dtype=F32, shape=(hc, hc * hidden), device=dev, align=self._align(16))
        if not mix.fn.is_contiguous():
            raise ValueError("mix.fn must be contiguous")
        checks.tensor("mix.params", mix.params, dtype=F32, shape=(MIX_PARAMS,), device=dev)
        if pre_out is None:
            return torch.empty(rows, hc, dtype=F32, device=dev)
        checks.tensor("pre_out", pre_out, dtype=F32, shape=(rows, hc), device=dev)
        if not pre_out.is_contiguous():
            raise ValueError("pre_out must be contiguous")
        return pre_out

    def _check_residual(self, residual: object) -> Tensor:
        residual = checks.tensor(
            "residual",
            residual,
            dtype=BF16,
            shape=(None, self.hc_mult, self.hidden_size),
            device=self.device,
            align=self._align(16),
        )
        self._check_rows(residual.shape[0])
        return residual

    def _check_epilogue(
        self,
        rows: int,
        post: object,
        comb: object,
        pre: object,
        norm_weight: object,
        norm_eps: object,
        mxfp8_out: object,
        aux_out: object,
        fp8_out: object,
    ) -> tuple[
        Tensor,
        Tensor,
        Tensor | None,
        Tensor | None,
        float,
        QuantizedActivation | None,
        Tensor | None,
        Fp8GroupActivation | None,
    ]:
        dev, hidden, a16 = self.device, self.hidden_size, self._align(16)
        post, comb, pre = checks.coefficients(rows, self.hc_mult, dev, post, comb, pre)
        if pre is None:
            if norm_weight is not None or mxfp8_out is not None or fp8_out is not None:
                raise ValueError(
                    "the residual-only boundary (pre=None) takes no norm_weight, no mxfp8_out and no fp8_out"
                )
        else:
            checks.tensor("norm_weight", norm_weight, dtype=BF16, shape=(hidden,), device=dev, align=a16)
        norm_eps = checks.finite_float("norm_eps", norm_eps, minimum=0.0)
        if mxfp8_out is not None:
            check_mxfp8_out("mxfp8_out", mxfp8_out, rows, hidden, dev, a16)
        checks.optional_tensor("aux_out", aux_out, dtype=BF16, shape=(rows, hidden), device=dev, align=a16)
        if fp8_out is not None:
            check_fp8_out("fp8_out", fp8_out, rows, hidden, dev, a16)
        return post, comb, pre, norm_weight, norm_eps, mxfp8_out, aux_out, fp8_out  # type: ignore[return-value]

    def _kernel(
        self,
        residual: Tensor,
        post: Tensor,
        comb: Tensor,
        pre: Tensor | None,
        norm_weight: Tensor | None,
        norm_eps: float,
        mxfp8_out: QuantizedActivation | None,
        aux_out: Tensor | None,
        fp8_out: Fp8GroupActivation | None,
        *,
        x: Tensor | None = None,
        moe: tuple[Tensor, Tensor, Tensor] | None = None,
        shared: Tensor | None = None,
        mix: MixWeights | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The fused kernel (with the peer all-reduce on the "peer" path); the arguments were checked by the caller
        (with `mix`, `pre` is where the kernel writes its own pre)."""
        rows = residual.shape[0]
        new_residual = torch.empty_like(residual)
        out = None if pre is None else torch.empty(rows, self.hidden_size, dtype=BF16, device=self.device)
        # The call's variant, decided once here, where it entered; nothing below derives it again. The flags key a
        # cache of (variant, compiled kernel): a plain tuple costs less host time per call than the NamedTuple.
        flags = (
            moe is None,
            shared is not None,
            pre is not None,
            mxfp8_out is not None,
            aux_out is not None,
            None if fp8_out is None else fp8_out.ue8m0,
            mix is not None,
        )
        launch = self._launches.get(flags)
        if launch is None:
            variant = BoundaryVariant(
                "x" if moe is None else "moe",
                *flags[1:5],
                None if fp8_out is None else ("fp8_1x128_ue8m0" if fp8_out.ue8m0 else "fp8_1x128"),
                flags[6],
                self._early_loads,
            )
            compiled = None
            if self.path is not BoundaryPath.PEER:
                compiled = boundary_api.compiled_boundary(self.hidden_size, variant, arch=self.arch)
            launch = self._launches[flags] = (variant, compiled)
        variant, compiled = launch
        peer = None
        if self.path is BoundaryPath.PEER:
            peer = self._peer_args
            if peer is None:  # made once: this runs ~100 times per decode step
                ws = self.workspace
                peer = self._peer_args = boundary_api.PeerArgs(
                    ws.slots,
                    ws.peers,
                    ws.state,
                    self.world_size,
                    self._protocol,
                    ws.ranks_per_device,
                    ws.shared_context,
                )
        fn = boundary_api.fused_boundary(
            variant,
            residual=residual,
            post=post,
            comb=comb,
            pre=pre,
            norm_weight=norm_weight,
            norm_eps=norm_eps,
            x=x,
            shared=shared,
            moe=moe,
            new_residual=new_residual,
            out=out,
            mxfp8_data=None if mxfp8_out is None else mxfp8_out.data,
            mxfp8_scale=None if mxfp8_out is None else mxfp8_out.scale,
            fp8_data=None if fp8_out is None else fp8_out.data,
            fp8_scale=None if fp8_out is None else fp8_out.scale,
            aux=aux_out,
            error=self.workspace.error,
            mix_fn=None if mix is None else mix.fn,
            mix_params=None if mix is None else mix.params,
            peer=peer,
            compiled=compiled,
            arch=self.arch,
        )
        plain = moe is None and shared is None and aux_out is None and fp8_out is None and mix is None
        if plain and fn is not None and self._fused:
            held = (peer.slots, peer.peers, peer.state, self.workspace.error) if peer else (None, None, None, None)
            self._ready[(rows, pre is None, mxfp8_out is None)] = boundary_api.ready_launch(
                fn, *held, layer_input=pre is not None
            )
        return new_residual, out

    def _reduce(self, x: Tensor) -> Tensor:
        """y of the "nccl+kernel" and "reference" paths from this rank's partial `x`."""
        if self.world_size == 1:
            return x
        if self.path == BoundaryPath.NCCL_KERNEL:
            # fp32 on the wire: NCCL's order is its own, but only the final bf16 rounding is ours.
            y32 = x.to(F32)
            dist.all_reduce(y32, group=self.group)
            return y32.to(BF16)
        # Gathered as int32 words (bf16 pairs) so that the bits travel untouched whatever the backend does with bf16.
        parts = [
            torch.empty(x.shape[0], x.shape[1] // 2, dtype=torch.int32, device=x.device) for _ in range(self.world_size)
        ]
        dist.all_gather(parts, reference.bf16_words(x), group=self.group)
        return reference.rank_sum([p.view(BF16) for p in parts])

    def _epilogue(
        self,
        y: Tensor,
        residual: Tensor,
        post: Tensor,
        comb: Tensor,
        pre: Tensor | None,
        norm_weight: Tensor | None,
        norm_eps: float,
        mxfp8_out: QuantizedActivation | None,
        aux_out: Tensor | None,
        fp8_out: Fp8GroupActivation | None,
        *,
        mix: MixWeights | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        if self.path == BoundaryPath.NCCL_KERNEL:
            return self._kernel(
                residual, post, comb, pre, norm_weight, norm_eps, mxfp8_out, aux_out, fp8_out, x=y, mix=mix
            )
        if mix is not None:  # the own pre (CONTRACT §4d): from the new streams, into `pre`, before the collapse
            streams = reference.mhc_post(y, residual, post, comb)
            pre.copy_(reference.hc_head_mix(streams, mix.fn, mix.scale, mix.base, mix.rms_eps, mix.eps))
        result = reference.boundary(
            y,
            residual,
            post,
            comb,
            pre,
            norm_weight,
            norm_eps,
            mxfp8=mxfp8_out is not None,
            aux=aux_out is not None,
            fp8_group=fp8_out is not None,
            ue8m0=fp8_out is not None and fp8_out.ue8m0,
        )
        if mxfp8_out is not None:
            mxfp8_out.data.copy_(result.mxfp8[0])
            mxfp8_out.scale.copy_(result.mxfp8[1])
        if fp8_out is not None:
            fp8_out.data.copy_(result.fp8_group[0])
            fp8_out.scale.copy_(result.fp8_group[1])
        if aux_out is not None:
            aux_out.copy_(result.aux)
        return result.residual, result.layer_input
