"""GPU timing as the benchmarks report it: CUDA-graph replays on rotating inputs, L2 flushed."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

L2_FLUSH_BYTES = 256 << 20  # several times the H100/H200/B200 L2


def marginal_us(t_short: float, short: int, t_long: float, long: int) -> float:
    """us per call added by each call beyond `short`: from per-call times of a `short`- and a `long`-call graph."""
    return (t_long * long - t_short * short) / (long - short)


def event_us(call: Callable[[], object], flush: torch.Tensor | None = None) -> float:
    """GPU time of `call` on the current stream in us, by CUDA events recorded around it; `flush` zeroed first (an L2
    flush) where given."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if flush is not None:
        flush.zero_()
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


class GraphTimer:
    """Times closures as GPU time per call: one graph of back-to-back calls, replayed after an L2 flush."""

    def __init__(self, device: torch.device, replays: int = 7) -> None:
        self.device = device
        self.replays = replays
        self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
        self.stream = torch.cuda.Stream(device)

    def per_call_us(self, calls: Sequence[Callable[[], object]], calls_each: int = 1) -> float:
        """Median over replays of (graph time / number of calls), in microseconds; each closure makes
        `calls_each` calls."""
        with torch.cuda.stream(self.stream):
            for call in calls:  # compile, allocate, settle
                call()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            for call in calls:
                call()
        samples = [event_us(graph.replay, self.flush) / (len(calls) * calls_each) for _ in range(self.replays + 1)]
        del graph
        return statistics.median(samples[1:])

    def steady_per_call_us(
        self, make: Callable[[int], Sequence[Callable[[], object]]], short: int, long: int
    ) -> tuple[float, float]:
        """(marginal us per call from a `short`- to a `long`-call graph, us per call of the `short` graph): `make(n)`
        gives closures making n calls in all. The marginal leaves out what a graph costs once (its launch, the
        fork into rank streams, the first call after the L2 flush), as a model-length decode graph would."""
        t_short = self.per_call_us(make(short), short)
        t_long = self.per_call_us(make(long), long)
        return marginal_us(t_short, short, t_long, long), t_short

    def copy_bandwidth(self, nbytes: int = 2 << 30) -> float:
        """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written), median of 10."""
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=self.device).random_()
        dst = torch.empty_like(src)
        dst.copy_(src)
        samples = [event_us(lambda: dst.copy_(src)) * 1e-6 for _ in range(10)]
        return nbytes / statistics.median(samples)


def host_us_per_call(call: Callable[[], object], n: int = 300) -> float:
    """Eager host cost of one call (Python + launch), median of 5 runs of n calls, in microseconds."""
    return host_us_interleaved({"call": call}, n, rounds=5)["call"]


def host_us_interleaved(calls: dict[str, Callable[[], object]], n: int = 300, rounds: int = 7) -> dict[str, float]:
    """Eager host cost of each call (Python + launch) in microseconds: the median over `rounds` rounds, each timing n
    calls of every form back to back, so that a slow phase of the host weighs on every form alike."""
    for call in calls.values():
        for _ in range(20):
            call()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            samples[name].append((time.perf_counter() - t0) * 1e6 / n)
            torch.cuda.synchronize()
    return {name: statistics.median(times) for name, times in samples.items()}


def on_streams(streams: Sequence[torch.cuda.Stream], work: Sequence[Callable[[], Any]]) -> None:
    """work[i]() on streams[i], every stream forked once from the current one and joined back once."""
    main = torch.cuda.current_stream()
    for stream in streams:
        stream.wait_stream(main)
    for stream, fn in zip(streams, work):
        with torch.cuda.stream(stream):
            fn()
    for stream in streams:
        main.wait_stream(stream)
