"""Whether CUDA has loaded each fused-boundary kernel onto the GPU, asked of the driver (cuFuncIsLoaded), in a
fresh process with lazy module loading (CUDA's default), before and after BoundaryAllReduce.warmup().

`python -m tests.module_loading_case` prints one JSON line: the loading state of torch's sleep kernel captured
into a CUDA graph before it ever launched (the probe's control: "unloaded"), of two variants whose first call is
captured (that call initialises the kernel's library, which loads it), and of three variants captured after warmup()
(the claim: "loaded"). A captured call records its launches and runs nothing.
"""

from __future__ import annotations

import json
import os
import sys


def kernel_loading_states(graph_handle: int) -> list[str]:
    """The loading state of the function of every kernel node of a CUDA graph, in the current context."""
    from cuda.bindings import driver

    def ok(result):
        err, *rest = result
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver call failed: {err}")
        return rest[0] if len(rest) == 1 else rest

    graph = driver.CUgraph(graph_handle)
    _, count = ok(driver.cuGraphGetNodes(graph, 0))
    nodes, count = ok(driver.cuGraphGetNodes(graph, count))
    states = []
    for node in nodes[:count]:
        if ok(driver.cuGraphNodeGetType(node)) != driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            continue
        params = ok(driver.cuGraphKernelNodeGetParams(node))
        func = params.func
        if int(params.kern) != 0:  # a library kernel: its function in this context
            func = ok(driver.cuKernelGetFunction(params.kern))
        state = ok(driver.cuFuncIsLoaded(func))
        states.append("loaded" if state == driver.CUfunctionLoadingState.CU_FUNCTION_LOADING_STATE_LOADED
                      else "unloaded")  # fmt: skip
    return states


def main() -> int:
    os.environ["CUDA_MODULE_LOADING"] = "LAZY"
    import torch

    from boundary import BoundaryAllReduce, empty_fp8_group_layer_input, empty_quantized_layer_input
    from cute_kernels.compile import lazy_module_loading

    hidden, rows = 4096, 4
    ar = BoundaryAllReduce(hidden, max_rows=64, device="cuda")
    assert lazy_module_loading()
    g = torch.Generator(device="cuda").manual_seed(0)
    residual = torch.randn(rows, 4, hidden, generator=g, device="cuda").to(torch.bfloat16)
    post = torch.rand(rows, 4, generator=g, device="cuda")
    comb = torch.softmax(torch.randn(rows, 4, 4, generator=g, device="cuda"), -1)
    pre = torch.rand(rows, 4, generator=g, device="cuda")
    w = torch.ones(hidden, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(rows, hidden, generator=g, device="cuda").to(torch.bfloat16)
    calls = {
        "pre": lambda: ar(x, residual, post, comb, pre, w, 1e-6, None),
        "residual-only": lambda: ar(x, residual, post, comb, None, None, 1e-6, None),
        "mxfp8": lambda: ar(x, residual, post, comb, pre, w, 1e-6, empty_quantized_layer_input(rows, hidden, "cuda")),
        "shared": lambda: ar(x, residual, post, comb, pre, w, 1e-6, None, shared_output=x),
        "fp8_1x128": lambda: ar(x, residual, post, comb, pre, w, 1e-6, None,
                                fp8_out=empty_fp8_group_layer_input(rows, hidden, "cuda")),  # fmt: skip
    }

    def captured_states(call) -> list[str]:
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        side = torch.cuda.Stream()
        with torch.cuda.graph(graph, stream=side, capture_error_mode="relaxed"):
            call()
        return kernel_loading_states(graph.raw_cuda_graph())

    # The probe's control: torch's sleep kernel, never launched in this process, is not loaded (lazy loading).
    control = captured_states(lambda: torch.cuda._sleep(1000))
    # Ours: a variant's first call loads its library and sets its kernel's attributes, which loads the kernel; the
    # hazard was that first call while a peer spins. warmup() makes every first call.
    first_call = {name: captured_states(calls[name]) for name in ("pre", "residual-only")}
    ar.warmup(progress=False)
    after = {name: captured_states(calls[name]) for name in ("mxfp8", "shared", "fp8_1x128")}
    print(json.dumps({"control_never_launched": control, "at_first_call": first_call, "after_warmup": after}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
