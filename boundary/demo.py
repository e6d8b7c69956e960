"""`python -m boundary.demo`: a few toy decode steps through the scheduler and written plainly.

Runs on whatever it finds (the CPU, one GPU, or `--tp N` processes), says whether the two
implementations agree and how long a step took, and exits non-zero when they do not agree.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from boundary import Boundaries, BoundaryAllReduce, DecodeStep
from boundary.backend import BACKENDS
from boundary.toy import (
    ToyConfig,
    ToyModel,
    compare,
    decode_step,
    decode_step_plain,
    decode_step_v4,
    decode_step_v4_plain,
    random_tokens,
    sharded_widths,
    world_sizes,
)
from boundary.v4 import V4Boundaries
from cute_kernels.allreduce.protocol import MAX_WORLD
from cute_kernels.compile import UnsupportedGPUError, arch_for_device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The demo's command line, checked before anything runs (`--device auto` is resolved here)."""
    p = argparse.ArgumentParser(prog="python -m boundary.demo", description=__doc__.splitlines()[0])
    p.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="where to run (auto: a GPU if present)"
    )
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel ranks, one process each (gloo on CPU, NCCL on GPUs)"
    )
    p.add_argument("--hidden", type=int, default=5120, help="hidden size H (a multiple of 256)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (layer 1 is an Engram layer)")
    p.add_argument("--rows", type=int, default=4, help="decode rows per step")
    p.add_argument("--steps", type=int, default=3, help="decode steps to run")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="BoundaryAllReduce backend")
    p.add_argument(
        "--scheme",
        choices=("v4.1", "v4"),
        default="v4.1",
        help="the mHC scheme: v4.1 (delayed pre, Boundaries) or v4 (own pre and hc_head, V4Boundaries)",
    )
    args = p.parse_args(argv)
    for name in ("tp", "hidden", "layers", "rows", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be positive")
    if args.hidden % 256:
        p.error("--hidden must be a multiple of 256")
    sizes = world_sizes(config(args), MAX_WORLD)
    if args.tp not in sizes:
        widths = ", ".join(f"{k}={v}" for k, v in sharded_widths(config(args)).items())
        p.error(
            f"--tp must be one of {', '.join(map(str, sizes))} (a divisor of the toy's sharded widths {widths}, "
            f"and at most {MAX_WORLD} ranks in a TP group), got {args.tp}"
        )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "auto":
        args.device = "cuda" if gpus >= args.tp else "cpu"
    if args.device == "cuda" and gpus == 0:
        p.error("--device cuda: no CUDA GPU is available here")
    if args.device == "cuda" and gpus < args.tp:
        p.error(f"--tp {args.tp} on --device cuda needs {args.tp} GPUs; this machine has {gpus}")
    if args.backend == "kernel" and args.device != "cuda":
        p.error(
            "--backend kernel needs a CUDA GPU (sm_90a / sm_100a) and none is used here; "
            "--backend auto or reference runs the reference path on the CPU"
        )
    if args.device == "cuda" and args.backend != "reference":
        try:
            arch_for_device(0)
        except UnsupportedGPUError as exc:
            p.error(f"{exc}")
    return args


def config(args: argparse.Namespace) -> ToyConfig:
    """The toy model of the command line."""
    return ToyConfig(hidden_size=args.hidden, num_layers=args.layers)


def _device(args: argparse.Namespace, rank: int) -> torch.device:
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace, rank: int = 0, group: Any = None) -> bool:
    """Run the steps on this rank; rank 0 prints. Returns whether every step agreed on every rank."""
    device = _device(args, rank)
    world = args.tp
    model = ToyModel(config(args), rank=rank, world_size=world, device=device)
    all_reduce = BoundaryAllReduce(
        args.hidden, group=group, max_rows=max(args.rows, 1), device=device, backend=args.backend
    )
    if args.scheme == "v4":  # no side stream: a V4 boundary's coefficients are on its critical path
        boundaries: Any = V4Boundaries(all_reduce)
        step = DecodeStep(rows=args.rows, side_stream=False)
        run_step, plain_step = decode_step_v4, decode_step_v4_plain
    else:
        boundaries = Boundaries(all_reduce)
        step = DecodeStep.for_rows(args.rows)
        run_step, plain_step = decode_step, decode_step_plain  # type: ignore[assignment]
    say = print if rank == 0 else (lambda *a, **k: None)
    engram = tuple(layer.index for layer in model.layers if layer.engram)
    say(
        f"toy DeepSeek-{args.scheme.upper()}-like decode: H={args.hidden}, {args.layers} layer{'s' if args.layers > 1 else ''} "
        f"({f'Engram at {engram}' if engram else 'no Engram layer'}), "
        f"{args.rows} rows, TP={world}, device={device}, boundary path={all_reduce.path}, "
        f"side streams={'on' if step.side_stream and device.type == 'cuda' else 'off'}"
    )
    if device.type != "cuda" or all_reduce.path == "reference":
        say(
            "note: the fused CuTe DSL kernels need an sm_90a (H100/H200) or sm_100a (B200) GPU; "
            "this run used the reference path (torch)."
        )
    all_reduce.warmup(args.rows)
    ok = True
    for index in range(args.steps + 1):
        tokens = random_tokens(model, args.rows, index)
        _sync(device)
        start = time.perf_counter()
        out = run_step(model, boundaries, tokens, step)
        _sync(device)
        elapsed = time.perf_counter() - start
        plain = plain_step(model, tokens, group=group)
        diff = compare(out, plain)
        # The reference path must match bit for bit; kernels may differ by bf16 ulps that compound.
        agree = diff["bitwise"] or (all_reduce.path != "reference" and diff["max_rel"] < 5e-2)
        ok &= agree
        label = "warm-up" if index == 0 else f"step {index}"
        how = "bitwise equal" if diff["bitwise"] else f"max |diff| {diff['max_abs']:.3g} (rel {diff['max_rel']:.3g})"
        say(f"  {label}: scheduler {elapsed * 1e3:8.2f} ms/step   vs plain: {how}   {'agree' if agree else 'DISAGREE'}")
    all_reduce.check()
    if group is not None:
        flag = torch.tensor([int(ok)], dtype=torch.int32, device=device if dist.get_backend(group) == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        ok = bool(flag.item())
    say("result: the scheduler and the plain implementation " + ("agree" if ok else "DISAGREE"))
    return ok


@contextlib.contextmanager
def file_rendezvous() -> Iterator[str]:
    """A fresh `file://` rendezvous for the process group of ranks spawned here (a free TCP port chosen first can be
    taken by someone else before the group binds it)."""
    with tempfile.TemporaryDirectory(prefix="mhc-rendezvous-") as folder:
        yield f"file://{Path(folder) / 'rendezvous'}"


def _worker(rank: int, args: argparse.Namespace, rendezvous: str) -> None:
    use_nccl = args.device == "cuda"
    dist.init_process_group("nccl" if use_nccl else "gloo", init_method=rendezvous, rank=rank, world_size=args.tp)
    try:
        ok = run(args, rank, dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> int:
    """Entry point: 0 when the two implementations agree."""
    args = parse_args(argv)
    if args.tp == 1:
        return 0 if run(args) else 1
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch.multiprocessing as mp

    try:
        with file_rendezvous() as rendezvous:
            mp.spawn(_worker, args=(args, rendezvous), nprocs=args.tp, join=True)
    except mp.ProcessExitedException as exc:
        print(f"a rank failed: {exc}", file=sys.stderr)
        return 1
    except mp.ProcessRaisedException as exc:  # its message is the rank's traceback: its last line is the error
        print(f"rank {exc.error_index} failed: {str(exc).strip().splitlines()[-1]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
