"""PTX of every shipped kernel variant, for proving that a refactor of cute_kernels/ changes no kernel.

    python -m bench.experiments.ptx_snapshot --out DIR [--arch sm_90a sm_100a] [--hidden 2560 4096 5120 7168]
                                             [--max-rows 512] [--world 1 2 4 8] [--jobs N]
    python -m bench.experiments.ptx_snapshot --compare OLD_DIR NEW_DIR

Snapshot: enumerates every compile an engine can need before CUDA-graph capture, exactly the warmup
job lists (`BoundaryAllReduce.warmup`: the fused boundary's ENGINE_VARIANTS at the default config of
each H, at one rank and at every peer world size of --world (each protocol, inline and staged), and every
coefficients / layer-input-only job the coefficients warmup produces for 1..max_rows rows), for each H and
arch. Each job is compiled in a worker process (spawn) with the in-memory cache
bypassed (the undecorated compile function is called) and the disk cache off
(MHC_BOUNDARY_DISK_CACHE=0, CUTE_DSL_NO_CACHE=1); the worker sets CUTE_DSL_KEEP=ptx,ir and its own
CUTE_DSL_DUMP_DIR before `import cutlass` (and drops every other CUTE_DSL_* variable) and empties that
folder before each job, so the truncated dump file names of two kernels can never overwrite each
other. The tree snapshotted is the one `cute_kernels` imports from: for a worktree of another commit
run it with PYTHONPATH=<worktree> (the tool refuses modules that the editable install would serve from
another checkout). `--order reverse|shuffle` hands the jobs to the workers in another order (two runs
in different orders must compare identical: no per-process state in the PTX). Writes

    DIR/<arch>/<job>.ptx        the normalised PTX (see `normalise`)
    DIR/<arch>/raw/<job>.ptx    the PTX as the DSL wrote it
    DIR/<arch>/host/<job>.mlir  the host side, normalised: the launcher (grid, block, cluster, shared
                                memory, PDL) from the DSL's clean MLIR without its gpu.module (--no-ir: none)
    DIR/<arch>/raw/<job>.mlir   the clean MLIR as the DSL wrote it
    DIR/index.txt               job -> file, sha256 of the normalised PTX (and host IR), the job's H / arch /
                                flags / config
    DIR/index.json              the same, for --compare

Why the host IR: the PTX is the device code only. A launch parameter computed on the host, e.g. the
fused boundary's cluster cap `max_clusters` (from the SM count), never reaches the PTX; it is a
constant of the launcher, which the clean MLIR (CUTE_DSL_KEEP=ir) holds.

Job names come from the job's semantic key (kernel kind, H, variant flags, the coefficients config
fields that the shipped defaults vary), never from object reprs or qualnames, so they are the same
before and after a restructure. Works on both layouts: cute_kernels/boundary/api.py and
cute_kernels/coefficients/api.py (`warmup_jobs`) when they exist, else cute_kernels/boundary_kernel.py
(`warmup_keys`) and cute_kernels/coefficients_kernel.py (`coefficients_warmup_jobs`).

Compare: per job, identical / differs (a unified diff of the normalised PTX, first 40 lines, and the
key fields whose value changed) / host differs (same PTX, the host IR differs: its diff) / missing on
one side, then a summary; exit code 0 only when every job is identical on both sides (the host IR is
compared where both snapshots have it). The raw files are normalised again with this file's
`normalise`, so a baseline taken with an older version of the tool compares fairly.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import inspect
import json
import multiprocessing
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

# Nothing that imports cutlass may be imported at module level: a spawned worker imports this module
# before its initializer sets CUTE_DSL_KEEP / CUTE_DSL_DUMP_DIR, which the DSL reads at `import cutlass`.

FORMAT = "ptx_snapshot v1"
DEFAULT_ARCHS = ("sm_90a", "sm_100a")
DEFAULT_HIDDEN = (2560, 4096, 5120, 7168)
DEFAULT_MAX_ROWS = 512
DEFAULT_WORLDS = (1, 2, 4, 8)  # the fused boundary's world sizes: one rank and protocol.PEER_WORLD_SIZES
DIFF_LINES = 40
# What the workers set (before `import cutlass`); every other CUTE_DSL_* variable is removed so that a
# stray debug / lineinfo / opt setting in the caller's shell cannot change the snapshot.
WORKER_ENV = {"CUTE_DSL_NO_CACHE": "1", "MHC_BOUNDARY_DISK_CACHE": "0"}
# Variables that change what is compiled; recorded in the index header.
RECORDED_ENV = ("MHC_BOUNDARY_SM_COUNT", "CUDA_VISIBLE_DEVICES")

# ---------------------------------------------------------------------------------------------
# Layout adapter: the warmup job lists of the new packages, else of the old modules
# ---------------------------------------------------------------------------------------------

_NEW_MODULES = {
    "boundary": ("cute_kernels.boundary", "cute_kernels.boundary.api"),
    "coefficients": ("cute_kernels.coefficients", "cute_kernels.coefficients.api"),
}


def package_root() -> Path:
    """The folder of the cute_kernels package that is imported (the tree being snapshotted)."""
    import cute_kernels

    roots = [Path(p).resolve() for p in cute_kernels.__path__]
    if len(roots) != 1:
        raise RuntimeError(f"cute_kernels spans several folders: {roots}")
    return roots[0]


def _import_new(kernel: str) -> Any | None:
    """cute_kernels.<kernel>.api when that tree has it (None if not); an error inside it is raised, not hidden.

    Looked up as a file first: an editable install's finder would otherwise serve
    cute_kernels.<kernel>.api from the checkout it points at when the tree on PYTHONPATH lacks it
    (it did: a snapshot of a worktree of an old commit picked up the new boundary package of /work/main).
    """
    import importlib

    folder = package_root() / kernel
    if not ((folder / "api.py").is_file() or (folder / "api" / "__init__.py").is_file()):
        return None
    try:
        module = importlib.import_module(f"cute_kernels.{kernel}.api")
    except ImportError as exc:
        if exc.name in _NEW_MODULES[kernel]:
            return None
        raise
    check_foreign_modules()
    return module


def check_foreign_modules() -> None:
    """Raise if a module of this project was imported from another checkout than the tree's own."""
    root = package_root().parent
    foreign = []
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] not in ("cute_kernels", "boundary"):
            continue
        file = getattr(module, "__file__", None)
        paths = [file] if file else list(getattr(module, "__path__", []))
        if any(root not in Path(p).resolve().parents for p in paths):
            foreign.append(f"{name} ({paths})")
    if foreign:
        raise RuntimeError(f"modules imported from outside {root}: {foreign}; set PYTHONPATH to that tree")


def layout() -> dict[str, str]:
    """Which module provides each kernel's warmup list (for the index header)."""
    out = {}
    for kernel, old in (
        ("boundary", "boundary_kernel.warmup_keys"),
        ("coefficients", "coefficients_kernel.coefficients_warmup_jobs"),
    ):
        new = _import_new(kernel)
        out[kernel] = f"cute_kernels.{kernel}.api.warmup_jobs" if new is not None else f"cute_kernels.{old}"
    return out


def boundary_warmup_jobs(H: int, arch: str) -> list[Any]:
    """The fused boundary's warmup jobs of hidden size H: every ENGINE_VARIANT at the default config, at one rank
    and (where the layout has the peer exchange) at each peer world size, every protocol, inline and staged."""
    api = _import_new("boundary")
    if api is not None:
        try:
            from cute_kernels.allreduce.protocol import PEER_WORLD_SIZES
        except ImportError:
            PEER_WORLD_SIZES = ()
        return [job for world in (1, *PEER_WORLD_SIZES) for job in api.warmup_jobs(H, arch=arch, world_size=world)]
    from cute_kernels import boundary_kernel

    return list(boundary_kernel.warmup_keys(H, arch=arch))


def coefficients_warmup_jobs(H: int, arch: str, max_rows: int) -> list[Any]:
    """The coefficients warmup jobs (projection + Sinkhorn, and the layer-input-only kernels) of H, 1..max_rows rows."""
    api = _import_new("coefficients")
    if api is not None:
        return list(api.warmup_jobs(H, arch=arch, max_rows=max_rows))
    from cute_kernels import coefficients_kernel

    return list(coefficients_kernel.coefficients_warmup_jobs(H, arch=arch, max_rows=max_rows))


# Kernels that ship but that no engine-side warmup list above compiles: DeepSeek-V4's (the own-pre coefficients
# variants in bf16 and every quantized form, hc_head's, and the layer-input kernel's quantized forms), which
# `mhc.warmup_jobs(own_pre=True)` adds for V4Boundaries.warmup; its list repeats the coefficients jobs above, which
# enumerate_jobs keeps once. The fused boundary's only call path (fused_boundary) uses default_config(H, own_pre) and
# a BoundaryVariant, and ENGINE_VARIANTS is the engine's variant space (2 y sources x shared x {residual-only, pre,
# pre+mxfp8, pre+fp8 1x128, pre+fp8 1x128 ue8m0} x aux = 40; MXFP8 and FP8 1x128 at once, which no scheduler call
# asks for, compiles on first use and is not snapshotted); mhc_coefficients uses coefficients_config(H, variant,
# rows) with CoefficientsVariant.of(...), which coefficients_warmup_keys covers for 1..max_rows rows
# (check_dispatch_coverage re-derives it); and mhc_layer_input uses LayerInputConfig() in its 3 valid modes, which
# the coefficients warmup appends. Add an entry (kind, callable(H, arch, max_rows) -> list of WarmupJob) for any
# other.


def v4_warmup_jobs(H: int, arch: str, max_rows: int) -> list[Any]:
    """DeepSeek-V4's compiles at H (none where the layout has no V4 entry)."""
    try:
        from boundary import mhc
        from cute_kernels.coefficients.layer_input import QUANT_FORMS
    except ImportError:
        return []
    if "own_pre" not in inspect.signature(mhc.warmup_jobs).parameters:
        return []
    jobs = list(mhc.warmup_jobs(H, arch, max_rows, own_pre=True, quantized=tuple(QUANT_FORMS)))
    api = _import_new("boundary")
    if api is not None and hasattr(api, "own_pre_variants"):  # the boundary kernels that compute their own pre
        from cute_kernels.allreduce.protocol import PEER_WORLD_SIZES

        variants = api.own_pre_variants()
        jobs += [
            j for w in (1, *PEER_WORLD_SIZES) for j in api.warmup_jobs(H, arch=arch, world_size=w, variants=variants)
        ]
    return jobs


def early_loads_jobs(H: int, arch: str, max_rows: int) -> list[Any]:
    """The engine variants of a BoundaryAllReduce(early_loads=True), at one rank and every peer world size (none where
    the layout has no such flag)."""
    api = _import_new("boundary")
    if api is None or not hasattr(api, "early"):
        return []
    from cute_kernels.allreduce.protocol import PEER_WORLD_SIZES

    variants = api.early(api.ENGINE_VARIANTS, True)
    return [j for w in (1, *PEER_WORLD_SIZES) for j in api.warmup_jobs(H, arch=arch, world_size=w, variants=variants)]


EXTRA_JOBS: tuple[tuple[str, Callable[[int, str, int], list[Any]]], ...] = (
    ("v4", v4_warmup_jobs),
    ("early-loads", early_loads_jobs),
)


def warmup_jobs(H: int, arch: str, max_rows: int) -> list[Any]:
    """Every compile an engine of hidden size H can need on `arch` (the order is the warmup's order)."""
    jobs = boundary_warmup_jobs(H, arch) + coefficients_warmup_jobs(H, arch, max_rows)
    for _, extra in EXTRA_JOBS:
        jobs += extra(H, arch, max_rows)
    check_foreign_modules()
    return jobs


# ---------------------------------------------------------------------------------------------
# Semantic keys and stable job names
# ---------------------------------------------------------------------------------------------

_ALIASES = {"hidden": "H", "hidden_size": "H"}
# The coefficients config fields that the shipped defaults vary (field, name tag, default if the field
# is gone). Fields every default shares (handoff, sinkhorn_unroll, ...) or none uses (trace,
# projection, ...) are left out of the name: a restructure may drop them. They are kept in the index.
COEFFICIENTS_NAME_FIELDS: tuple[tuple[str, str, Any], ...] = (
    ("rows_per_tile", "tile", None),
    ("warps", "w", None),
    ("groups", "g", None),
    ("row_split", "split", 1),
    ("push_vec", "push", False),
    ("min_blocks", "mb", 0),
    ("schedule", "sched", "tile"),
    ("stage_rows", "stage", False),
    ("stage_depth", "depth", 0),
    ("sum_buffers", "sums", 1),
    ("norm_rows", "nr", 0),
)
LAYER_INPUT_NAME_FIELDS: tuple[tuple[str, str, Any], ...] = (("warps", "w", 8), ("norm_rows", "nr", 0))


def _plain(value: Any) -> Any:
    """A JSON-friendly copy of a key value."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return repr(value)


def _tag(value: Any) -> str:
    """A file-name-safe spelling of one key value ('_' separates fields, so it never appears in a value)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    text = str(value).replace("_", "-")
    if not re.fullmatch(r"[A-Za-z0-9+.=-]+", text):
        raise ValueError(f"cannot spell key value {value!r} in a job name")
    return text


def semantic_key(job: Any) -> dict[str, Any]:
    """The job's compile key by meaning: the compile function's arguments bound to their parameter names,
    NamedTuples (a variant) flattened into them, the one dataclass argument (the config) as its fields."""
    fn = inspect.unwrap(job.compile_fn)
    try:
        bound = inspect.signature(fn).bind(*job.args, **dict(job.kwargs))
    except TypeError as exc:
        raise RuntimeError(
            f"warmup job {job.name!r}: its args do not fit {fn.__name__}{inspect.signature(fn)}"
        ) from exc
    params: dict[str, Any] = {}
    config: dict[str, Any] = {}
    config_type = None
    for pname, value in bound.arguments.items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            if config_type is not None:
                raise RuntimeError(f"warmup job {job.name!r} has two config dataclasses")
            config_type = type(value).__name__
            config = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        elif isinstance(value, tuple) and hasattr(value, "projection") and hasattr(value, "layer_input"):
            # a CoefficientsVariant: keyed by the two strings the kernel classes take, as before it existed, and
            # its fields past those only where they are not the default (older snapshots keep their names)
            params["variant"], params["layer_input"] = value.projection, value.layer_input
            if getattr(value, "quant", None) is not None:
                params["quant"] = value.quant
            if not getattr(value, "normed", True):
                params["normed"] = False
        elif isinstance(value, tuple) and hasattr(value, "_asdict"):
            params.update(value._asdict())
        else:
            params[_ALIASES.get(pname, pname)] = value
    return {"params": params, "config_type": config_type, "config": config}


def kernel_kind(key: dict[str, Any]) -> str:
    """boundary / coefficients / layer-input, from which key fields a job has (not from function names)."""
    params, config = key["params"], key["config"]
    if "y_source" in params or "mxfp8" in params:
        return "boundary"
    if "rows_per_tile" in config:
        return "coefficients"
    if "layer_input" in params:
        return "layer-input"
    raise RuntimeError(f"cannot tell the kernel kind of a job with key {params} {key['config_type']} {config}")


def job_name(kind: str, key: dict[str, Any]) -> str:
    """The stable name of a job (without the arch, which is the folder)."""
    p, c = key["params"], key["config"]
    if "H" not in p:
        raise RuntimeError(f"no hidden size among the key fields {sorted(p)}")
    parts = [kind, f"H{p['H']}"]
    if kind == "boundary":
        # The config is a function of H and own_pre (default_config(H, own_pre=)), which the name holds, so it
        # is recorded in the index but kept out of the name; two configs of one variant would collide below.
        parts += [_tag(p["y_source"]), *(f"{f}-{_tag(bool(p[f]))}" for f in ("shared", "pre", "mxfp8", "aux"))]
        if p.get("fp8"):  # the FP8 1x128 variants; the others keep their names, so older snapshots compare
            parts.append(_tag(p["fp8"]))
        if p.get("own_pre"):  # DeepSeek-V4's boundary that computes its own pre
            parts.append("own-pre")
        if p.get("early_loads"):  # the opt-in that loads the first row before the PDL wait
            parts.append("early-loads")
        if p.get("world_size", 1) > 1:  # one-rank names stay as they were, so older snapshots compare
            parts += [f"W{p['world_size']}", _tag(p["protocol"])] + (["staged"] if p.get("staged") else [])
    elif kind == "coefficients":
        parts += [_tag(p["variant"]), f"li-{_tag(p['layer_input'])}"]
        parts += [f"q-{_tag(p['quant'])}"] if p.get("quant") else []
        parts += ["unnormed"] if p.get("normed") is False else []
        parts.append(f"rep-{_tag(p.get('sinkhorn_repeat', 20))}")
        for field, tag, default in COEFFICIENTS_NAME_FIELDS:
            if field not in c and default is None:
                raise RuntimeError(f"coefficients config has no {field!r}: {c}")
            parts.append(f"{tag}-{_tag(c.get(field, default))}")
    else:
        parts += [_tag(p["variant"]), f"li-{_tag(p['layer_input'])}"]
        parts += [f"q-{_tag(p['quant'])}"] if p.get("quant") else []
        parts += ["unnormed"] if p.get("normed") is False else []
        parts += [f"{tag}-{_tag(c.get(field, default))}" for field, tag, default in LAYER_INPUT_NAME_FIELDS]
    return "_".join(parts)


def describe(job: Any, arch: str) -> dict[str, Any]:
    """The index entry of one warmup job (everything but its PTX)."""
    key = semantic_key(job)
    job_arch = key["params"].pop("arch", arch)
    if job_arch != arch:
        raise RuntimeError(f"warmup job {job.name!r} compiles for {job_arch}, asked for {arch}")
    kind = kernel_kind(key)
    name = job_name(kind, key)
    return {
        "key": f"{arch}/{name}",
        "name": name,
        "arch": arch,
        "kind": kind,
        "H": key["params"]["H"],
        "params": {k: _plain(v) for k, v in key["params"].items()},
        "config_type": key["config_type"],
        "config": {k: _plain(v) for k, v in key["config"].items()},
        "label": str(job.name),
    }


def enumerate_jobs(
    archs: Iterable[str], hidden: Iterable[int], max_rows: int, worlds: Iterable[int] = DEFAULT_WORLDS
) -> list[dict[str, Any]]:
    """Index entries of every job (boundary jobs of the world sizes `worlds`), in (arch, H, warmup order); raises on
    two jobs with the same name."""
    entries, seen = [], {}
    worlds = set(worlds)
    for arch in archs:
        for H in hidden:
            for job in warmup_jobs(H, arch, max_rows):
                entry = describe(job, arch)
                if entry["params"].get("world_size", 1) not in worlds:
                    continue
                if entry["key"] in seen:
                    if seen[entry["key"]] == (job.name, entry["params"], entry["config"]):
                        continue  # one compile listed by two warmup lists (the V4 list repeats the coefficients')
                    raise RuntimeError(f"two jobs named {entry['key']}: {seen[entry['key']][0]!r} and {job.name!r}")
                seen[entry["key"]] = (job.name, entry["params"], entry["config"])
                entry["seq"] = len(entries)
                entries.append(entry)
    return entries


def check_dispatch_coverage(hidden: Iterable[int], max_rows: int, entries: list[dict[str, Any]]) -> list[str]:
    """Re-derive every coefficients config the host dispatch picks for 1..max_rows rows (where the layout still
    exposes CoefficientsVariant / coefficients_config) and report any that no warmup job compiles."""
    from cute_kernels import coefficients as ck

    if not all(hasattr(ck, f) for f in ("CoefficientsVariant", "coefficients_config", "compile_coefficients")):
        return [
            "dispatch coverage: not checked (CoefficientsVariant / coefficients_config / compile_coefficients moved)"
        ]
    have = {e["name"] for e in entries}
    notes, checked = [], 0
    for H in hidden:
        for broadcast in (False, True):
            for inline, carried in ((False, False), (True, False), (True, True)):
                variant = ck.CoefficientsVariant.of(broadcast, inline, carried)
                for rows in range(1, max_rows + 1):
                    config = ck.coefficients_config(H, variant, rows, arch="sm_90a")
                    probe = type("Probe", (), {})()
                    probe.name, probe.compile_fn = "dispatch", ck.compile_coefficients
                    probe.args, probe.kwargs = (H, variant, 20, config), (("arch", "sm_90a"),)
                    key = semantic_key(probe)
                    key["params"].pop("arch")
                    name = job_name("coefficients", key)
                    checked += 1
                    if name not in have:
                        notes.append(f"dispatch coverage: NOT WARMED: {name} (rows={rows})")
    notes.append(f"dispatch coverage: {checked} (H, variant, layer input, rows) dispatches checked against the jobs")
    return notes


# ---------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------

_IDENT = re.compile(r"(?<![\w$])[A-Za-z_$][\w$]*")
_DECL = re.compile(
    r"^[ \t]*((?:\.(?:visible|weak|extern)[ \t]+)*)\.(entry|func)[ \t]+(?:\([^)\n]*\)[ \t]*)?([A-Za-z_$][\w$]*)", re.M
)
_PARAM_SUFFIX = re.compile(r"_param_\d+$")
# A symbol the DSL mangled from Python names (module path, class, `object_at_<address>`) that is not
# an .entry / .func: renamed too, so that it cannot hold a module path.
_MANGLED = re.compile(r"object_at_|cute_kernels|cutlass_kernel|__call__")
# Whole-line comments that hold the compiler's build / version, or a file path.
_DROP_COMMENT = re.compile(
    r"^[ \t]*//[ \t]*(?:Generated by NVIDIA|Compiler Build ID|Cuda compilation tools|Based on NVVM)[^\n]*\n?"
    r"|^[ \t]*//[^\n]*(?:/[\w.+-]+){2,}[^\n]*\n?",
    re.M,
)
_FILE = re.compile(r'^([ \t]*\.file[ \t]+\d+[ \t]+)"[^"\n]*"[^\n]*$', re.M)


def normalise(ptx: str) -> tuple[str, dict[str, Any]]:
    """The PTX with its Python-derived names made independent of where the code lives.

    - every .entry symbol defined here becomes kernel0, kernel1, ... and every defined .func func0,
      ... in order of first appearance (the `// .globl` comment included), with its `_param_<n>`
      names following (kernel0_param_3); an `.extern .func` (vprintf, ...) keeps its name;
    - any other identifier mangled from Python names (object_at_, cute_kernels, cutlass_kernel,
      __call__) becomes mangled0, ...;
    - the header comment lines with the compiler build and version (Generated by NVIDIA NVVM
      Compiler, Compiler Build ID, Cuda compilation tools, Based on NVVM) and any comment line that
      holds a file path are dropped; a `.file` directive keeps its number, its path becomes "<file>".
    Everything else is kept byte for byte. Returns the text and what was replaced.
    """
    kinds: dict[str, str] = {}
    for m in _DECL.finditer(ptx):
        if "extern" not in m.group(1):
            kinds.setdefault(m.group(3), "kernel" if m.group(2) == "entry" else "func")
    mapping: dict[str, str] = {}
    counts: Counter[str] = Counter()

    def base_of(tok: str) -> tuple[str, str]:
        if tok in kinds:
            return tok, ""
        stripped = _PARAM_SUFFIX.sub("", tok)
        if stripped != tok and stripped in kinds:
            return stripped, tok[len(stripped) :]
        return tok, ""

    for m in _IDENT.finditer(ptx):
        base, _ = base_of(m.group(0))
        if base in mapping:
            continue
        kind = kinds.get(base) or ("mangled" if _MANGLED.search(base) else None)
        if kind is not None:
            mapping[base] = f"{kind}{counts[kind]}"
            counts[kind] += 1

    def rename(m: re.Match[str]) -> str:
        base, suffix = base_of(m.group(0))
        new = mapping.get(base)
        return m.group(0) if new is None else new + suffix

    text = _IDENT.sub(rename, ptx)
    dropped = [line.rstrip("\n") for line in _DROP_COMMENT.findall(text)]
    text = _DROP_COMMENT.sub("", text)
    files = len(_FILE.findall(text))
    text = _FILE.sub(lambda m: m.group(1) + '"<file>"', text)
    info = {"symbols": {new: old for old, new in mapping.items()}, "dropped_comments": dropped, "file_paths": files}
    return text, info


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


_GPU_MODULE = re.compile(r"^([ \t]*)gpu\.module\b")


def host_ir(mlir: str) -> str:
    """The clean MLIR without its gpu.module block (the device code, which the PTX holds): the type
    aliases and the host function that computes the launch and launches."""
    out, indent = [], None
    for line in mlir.splitlines(keepends=True):
        if indent is None:
            m = _GPU_MODULE.match(line)
            if m is None:
                out.append(line)
            else:
                indent = m.group(1)
        elif line.rstrip("\n") == indent + "}":
            indent = None
    return "".join(out)


def normalise_host(mlir: str) -> str:
    """host_ir, with the mangled symbols renamed as in `normalise`."""
    return normalise(host_ir(mlir))[0]


# ---------------------------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _worker_init(dump_root: str, keep_ir: bool) -> None:
    """Per worker: its own dump folder and the DSL's artifact settings, set before `import cutlass`."""
    if "cutlass" in sys.modules:
        raise RuntimeError("cutlass was imported before the worker set CUTE_DSL_KEEP / CUTE_DSL_DUMP_DIR")
    folder = Path(tempfile.mkdtemp(prefix=f"worker{os.getpid()}-", dir=dump_root))
    for var in [v for v in os.environ if v.startswith("CUTE_DSL_")]:
        del os.environ[var]
    os.environ.update(WORKER_ENV)
    os.environ["CUTE_DSL_KEEP"] = "ptx,ir" if keep_ir else "ptx"
    os.environ["CUTE_DSL_DUMP_DIR"] = str(folder)
    import cutlass  # noqa: F401  (reads the settings above)

    _WORKER["dir"] = folder
    _WORKER["jobs"] = {}


def _find_job(arch: str, H: int, max_rows: int, name: str) -> Any:
    """The WarmupJob of that name, from this worker's own enumeration (no function objects cross processes)."""
    cache = _WORKER["jobs"]
    if (arch, H, max_rows) not in cache:
        cache[arch, H, max_rows] = {describe(job, arch)["name"]: job for job in warmup_jobs(H, arch, max_rows)}
    return cache[arch, H, max_rows][name]


def _worker_run(task: tuple[str, int, int, str]) -> dict[str, Any]:
    """Compile one job with every cache bypassed and return its PTX."""
    arch, H, max_rows, name = task
    folder: Path = _WORKER["dir"]
    try:
        job = _find_job(arch, H, max_rows, name)
        for old in folder.iterdir():
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink()
        fn = inspect.unwrap(job.compile_fn)  # the undecorated compile: no jit_cache memory / disk lookup
        start = time.perf_counter()
        compiled = fn(*job.args, **dict(job.kwargs))
        seconds = time.perf_counter() - start
        dumped = sorted(folder.rglob("*.ptx"))
        if not dumped:
            raise RuntimeError(f"the compile wrote no PTX into {folder}")
        if len(dumped) > 1:
            raise RuntimeError(f"one compile wrote {len(dumped)} PTX files: {[p.name for p in dumped]}")
        hint = getattr(compiled, "__ptx__", None)
        if isinstance(hint, str) and os.path.exists(hint) and Path(hint).resolve() != dumped[0].resolve():
            raise RuntimeError(f"the compile reports its PTX at {hint}, the dump folder holds {dumped[0]}")
        result = {"task": task, "ptx": dumped[0].read_text(), "dump_name": dumped[0].name, "seconds": seconds}
        if "ir" in os.environ["CUTE_DSL_KEEP"].split(","):
            mlir = sorted(folder.rglob("*_clean.mlir"))
            if len(mlir) != 1:
                raise RuntimeError(f"one compile wrote {len(mlir)} clean MLIR files: {[p.name for p in mlir]}")
            result["mlir"] = mlir[0].read_text()
        return result
    except Exception as exc:  # reported per job; the run goes on
        return {"task": task, "error": f"{type(exc).__name__}: {exc}"}


# ---------------------------------------------------------------------------------------------
# Snapshot
# ---------------------------------------------------------------------------------------------


def _git(repo: Path, *args: str) -> str:
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _versions() -> dict[str, str]:
    import cutlass
    import torch

    try:
        import tvm_ffi

        tvm = tvm_ffi.__version__
    except Exception:
        tvm = "unknown"
    return {
        "python": platform.python_version(),
        "cutlass": cutlass.__version__,
        "tvm_ffi": tvm,
        "torch": torch.__version__,
    }


def _index_line(e: dict[str, Any]) -> str:
    params = " ".join(f"{k}={v}" for k, v in e["params"].items() if k != "H")
    config = " ".join(f"{k}={v}" for k, v in e["config"].items())
    head = f"{e['key']}  sha256={e.get('sha256', 'ERROR')}  file={e.get('file', '-')}  raw={e.get('raw', '-')}"
    if "host" in e:
        head += f"\n    host_sha256={e['host_sha256']}  host={e['host']}  raw_mlir={e['raw_mlir']}"
    body = f"H={e['H']} arch={e['arch']} kind={e['kind']} {params} | {e['config_type']}({config})"
    tail = f" | entries={len(e.get('symbols', {}))} | label={e['label']!r}"
    if "error" in e:
        tail += f" | ERROR {e['error']}"
    return f"{head}\n    {body}{tail}"


def snapshot(
    out: Path,
    archs: list[str],
    hidden: list[int],
    max_rows: int,
    workers: int,
    order: str,
    keep_ir: bool,
    worlds: Iterable[int] = DEFAULT_WORLDS,
    only: list[str] | None = None,
) -> int:
    """Compile every job (`only`: those whose name holds one of these), write the PTX files and the index; returns
    the number of failed jobs."""
    started = time.time()
    entries = enumerate_jobs(archs, hidden, max_rows, worlds)
    notes = [] if only else check_dispatch_coverage(hidden, max_rows, entries)
    if only:
        entries = [e for e in entries if any(text in e["name"] for text in only)]
        if not entries:
            raise SystemExit(f"no job's name holds any of {only}")
        for seq, e in enumerate(entries):
            e["seq"] = seq
    for note in notes:
        if "NOT WARMED" in note:
            print(note, file=sys.stderr)
    per = Counter((e["arch"], e["H"], e["kind"]) for e in entries)
    print(f"{len(entries)} jobs ({', '.join(layout().values())}), {workers} workers", file=sys.stderr)

    out.mkdir(parents=True, exist_ok=True)
    for name in ("index.txt", "index.json"):
        (out / name).unlink(missing_ok=True)
    for arch in archs:
        for sub in (out / arch, out / arch / "raw", out / arch / "host"):
            for old in [*sub.glob("*.ptx"), *sub.glob("*.mlir")]:
                old.unlink()
        for sub in (out / arch, out / arch / "raw", *([out / arch / "host"] if keep_ir else [])):
            sub.mkdir(parents=True, exist_ok=True)

    tasks = [(e["arch"], e["H"], max_rows, e["name"]) for e in entries]
    if order == "reverse":
        tasks.reverse()
    elif order == "shuffle":
        random.Random(0).shuffle(tasks)
    by_task = {(e["arch"], e["H"], max_rows, e["name"]): e for e in entries}
    dump_root = tempfile.mkdtemp(prefix="ptx-snapshot-")
    failed = 0
    from tqdm import tqdm

    try:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(workers, initializer=_worker_init, initargs=(dump_root, keep_ir)) as pool:
            bar = tqdm(total=len(tasks), desc="PTX snapshot", unit="kernel", file=sys.stderr)
            for result in pool.imap_unordered(_worker_run, tasks, chunksize=1):
                e = by_task[result["task"]]
                bar.set_postfix_str(e["key"], refresh=False)
                bar.update(1)
                if "error" in result:
                    e["error"] = result["error"]
                    failed += 1
                    tqdm.write(f"FAILED {e['key']}: {result['error']}", file=sys.stderr)
                    continue
                text, info = normalise(result["ptx"])
                e["file"] = f"{e['arch']}/{e['name']}.ptx"
                e["raw"] = f"{e['arch']}/raw/{e['name']}.ptx"
                (out / e["raw"]).write_text(result["ptx"])
                (out / e["file"]).write_text(text)
                e["sha256"] = sha256(text)
                e["raw_sha256"] = sha256(result["ptx"])
                e["symbols"] = info["symbols"]
                e["dropped_comments"] = info["dropped_comments"]
                e["dump_name"] = result["dump_name"]
                e["compile_s"] = round(result["seconds"], 3)
                if "mlir" in result:
                    host = normalise_host(result["mlir"])
                    e["host"] = f"{e['arch']}/host/{e['name']}.mlir"
                    e["raw_mlir"] = f"{e['arch']}/raw/{e['name']}.mlir"
                    (out / e["raw_mlir"]).write_text(result["mlir"])
                    (out / e["host"]).write_text(host)
                    e["host_sha256"] = sha256(host)
            bar.close()
    finally:
        shutil.rmtree(dump_root, ignore_errors=True)
    elapsed = time.time() - started

    repo = package_root().parent
    dirty = _git(repo, "status", "--porcelain", "--", "cute_kernels", "boundary")
    header = {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "elapsed_s": round(elapsed, 1),
        "repo": str(repo),
        "git": _git(repo, "rev-parse", "HEAD") + (" (cute_kernels/ or boundary/ modified)" if dirty else ""),
        "layout": layout(),
        "versions": _versions(),
        "archs": archs,
        "hidden": hidden,
        "max_rows": max_rows,
        "workers": workers,
        "order": order,
        "worker_env": {
            **WORKER_ENV,
            "CUTE_DSL_KEEP": "ptx,ir" if keep_ir else "ptx",
            "CUTE_DSL_DUMP_DIR": "<per worker>",
        },
        "scrubbed_env": sorted(v for v in os.environ if v.startswith("CUTE_DSL_")),
        "recorded_env": {v: os.environ.get(v) for v in RECORDED_ENV},
        "notes": notes,
        "jobs_per_arch_H": {f"{a} H={h} {k}": n for (a, h, k), n in sorted(per.items())},
    }
    (out / "index.json").write_text(json.dumps({"header": header, "jobs": entries}, indent=1) + "\n")
    lines = [f"# {FORMAT}: PTX of every shipped kernel variant (python -m bench.experiments.ptx_snapshot)"]
    lines += [f"# {k}: {json.dumps(v) if not isinstance(v, str) else v}" for k, v in header.items()]
    lines += [
        "# one job per entry: <arch>/<job>  sha256 of the normalised PTX  file  raw file",
        "#     sha256 of the normalised host IR  file  raw clean MLIR (unless --no-ir)",
        "#     the job's H / arch / kind / flags | its config | PTX entry symbols | the warmup's own label",
        "",
    ]
    lines += [_index_line(e) for e in entries]
    (out / "index.txt").write_text("\n".join(lines) + "\n")

    print(f"wrote {len(entries) - failed} PTX files ({failed} failed) to {out} in {elapsed:.1f} s", file=sys.stderr)
    for (arch, H, kind), n in sorted(per.items()):
        print(f"  {arch} H={H} {kind}: {n}", file=sys.stderr)
    return failed


# ---------------------------------------------------------------------------------------------
# Compare
# ---------------------------------------------------------------------------------------------


def _load(folder: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    data = json.loads((folder / "index.json").read_text())
    return data["header"], {e["key"]: e for e in data["jobs"]}


def _normalised(folder: Path, e: dict[str, Any]) -> str | None:
    """The job's PTX normalised by this version of `normalise` (from the raw file when it is there)."""
    if "error" in e:
        return None
    raw = folder / e.get("raw", "")
    if e.get("raw") and raw.is_file():
        return normalise(raw.read_text())[0]
    return (folder / e["file"]).read_text()


def _host(folder: Path, e: dict[str, Any]) -> str | None:
    """The job's host IR normalised by this version of the tool, or None where the snapshot has none."""
    raw = folder / e.get("raw_mlir", "")
    if e.get("raw_mlir") and raw.is_file():
        return normalise_host(raw.read_text())
    if e.get("host") and (folder / e["host"]).is_file():
        return (folder / e["host"]).read_text()
    return None


def _key_changes(a: dict[str, Any], b: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Key fields whose value changed, and fields present on one side only (a pruned config field)."""
    changed, one_side = [], []
    for part in ("params", "config"):
        for k in sorted(set(a[part]) | set(b[part])):
            if k not in a[part] or k not in b[part]:
                side = "OLD" if k in a[part] else "NEW"
                one_side.append(f"{part}.{k}={(a if side == 'OLD' else b)[part][k]} only in {side}")
            elif a[part][k] != b[part][k]:
                changed.append(f"{part}.{k}: {a[part][k]} -> {b[part][k]}")
    return changed, one_side


def _print_diff(old_text: str, new_text: str, old_name: str, new_name: str) -> None:
    diff = difflib.unified_diff(old_text.splitlines(), new_text.splitlines(), old_name, new_name, n=2, lineterm="")
    for i, line in enumerate(diff):
        if i == DIFF_LINES:
            print(f"    ... (diff cut at {DIFF_LINES} lines)")
            break
        print(f"    {line}")


def compare(old: Path, new: Path) -> int:
    """Print per job identical / differs / host differs / missing and a summary; 0 only when every job is identical."""
    old_head, old_jobs = _load(old)
    new_head, new_jobs = _load(new)
    for field in ("archs", "hidden", "max_rows"):
        if old_head.get(field) != new_head.get(field):
            print(f"note: {field} differ: {old_head.get(field)} (OLD) vs {new_head.get(field)} (NEW)")
    for field in ("git", "layout", "versions", "recorded_env"):
        pad = " " * len(field)
        print(f"{field}: OLD {json.dumps(old_head.get(field))}\n{pad}  NEW {json.dumps(new_head.get(field))}")
    keys = list(old_jobs) + [k for k in new_jobs if k not in old_jobs]
    tally: Counter[str] = Counter()
    raw_same = host_compared = 0
    pruned: Counter[str] = Counter()
    for key in keys:
        a, b = old_jobs.get(key), new_jobs.get(key)
        if a is None or b is None:
            status = "missing in OLD" if a is None else "missing in NEW"
            tally[status] += 1
            print(f"{status:15s} {key}")
            continue
        ta, tb = _normalised(old, a), _normalised(new, b)
        if ta is None or tb is None:
            tally["failed compile"] += 1
            print(f"{'failed compile':15s} {key}: {a.get('error') or b.get('error')}")
            continue
        changed, one_side = _key_changes(a, b)
        pruned.update(one_side)
        ha, hb = _host(old, a), _host(new, b)
        host_compared += ha is not None and hb is not None
        if ta != tb:
            status = "differs"
        elif ha is not None and hb is not None and ha != hb:
            status = "host differs"
        else:
            status = "identical"
        tally[status] += 1
        if status == "identical" and a.get("raw_sha256") and a.get("raw_sha256") == b.get("raw_sha256"):
            raw_same += 1
        print(f"{status:15s} {key}")
        for change in changed:
            print(f"    key {change}")
        if status == "differs":
            _print_diff(ta, tb, f"OLD/{a['file']}", f"NEW/{b['file']}")
        elif status == "host differs":
            _print_diff(ha, hb, f"OLD/{a['host']}", f"NEW/{b['host']}")
    for field, n in sorted(pruned.items()):
        print(f"note: key field {field} ({n} jobs)")
    total = sum(tally.values())
    summary = ", ".join(f"{n} {s}" for s, n in sorted(tally.items(), key=lambda kv: kv[0] != "identical"))
    print(
        f"\n{total} jobs: {summary}; host IR compared for {host_compared}; "
        f"raw PTX byte-identical even before normalisation for {raw_same}"
    )
    ok = tally["identical"] == total and total > 0
    print("ALL IDENTICAL" if ok else "NOT IDENTICAL")
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.experiments.ptx_snapshot", description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--out", type=Path, metavar="DIR", help="write a snapshot into DIR")
    mode.add_argument("--compare", nargs=2, type=Path, metavar=("OLD_DIR", "NEW_DIR"), help="compare two snapshots")
    ap.add_argument("--arch", nargs="+", default=list(DEFAULT_ARCHS), choices=DEFAULT_ARCHS)
    ap.add_argument("--hidden", nargs="+", type=int, default=list(DEFAULT_HIDDEN), metavar="H")
    ap.add_argument("--max-rows", type=int, default=DEFAULT_MAX_ROWS)
    ap.add_argument(
        "--world",
        nargs="+",
        type=int,
        default=list(DEFAULT_WORLDS),
        choices=DEFAULT_WORLDS,
        help="the fused boundary's world sizes to snapshot (1: one rank; 2 4 8: the peer kernels)",
    )
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: all cores)")
    ap.add_argument(
        "--order",
        choices=("forward", "reverse", "shuffle"),
        default="forward",
        help="order the jobs are handed to the workers (a check that no per-process state leaks into the PTX)",
    )
    ap.add_argument("--no-ir", action="store_true", help="PTX only: skip the host side (the clean MLIR's launcher)")
    ap.add_argument(
        "--only",
        nargs="+",
        metavar="TEXT",
        help="snapshot only the jobs whose name holds one of these (a partial snapshot: compare it with one taken so)",
    )
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    bad = [h for h in args.hidden if h <= 0 or h % 256]
    if bad or args.max_rows < 1 or args.jobs < 1:
        ap.error(f"H must be positive multiples of 256 (got {bad}), --max-rows and --jobs >= 1")
    failed = snapshot(
        args.out,
        list(dict.fromkeys(args.arch)),
        list(dict.fromkeys(args.hidden)),
        args.max_rows,
        args.jobs,
        args.order,
        not args.no_ir,
        args.world,
        args.only,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
