"""The compile cache: arch pinning, memory and disk caching keyed on sources and versions."""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import pytest

from cute_kernels import compile as cc

ROOT = Path(__file__).resolve().parents[1]


def test_arch_for_capability() -> None:
    assert cc.arch_for_capability(9, 0) == "sm_90a"
    assert cc.arch_for_capability(10, 0) == "sm_100a"
    for cap in ((8, 0), (8, 9), (12, 0)):
        with pytest.raises(cc.UnsupportedGPUError, match=rf"sm_{cap[0]}{cap[1]}.*backend='reference'"):
            cc.arch_for_capability(*cap)
    with pytest.raises(ValueError, match="arch must be one of"):
        cc.check_arch("sm_80")


def test_jit_cache_compiles_once_then_hits_memory_and_disk(tmp_path, monkeypatch) -> None:
    from tests.tiny_kernel import compile_tiny

    monkeypatch.setenv("MHC_BOUNDARY_CACHE_DIR", str(tmp_path))
    compile_tiny.cache_clear()
    start = cc.STATS.compiles, cc.STATS.disk_hits, cc.STATS.memory_hits
    first = compile_tiny(256, arch="sm_90a")
    assert cc.STATS.compiles == start[0] + 1
    assert compile_tiny(256, arch="sm_90a") is first
    assert cc.STATS.memory_hits == start[2] + 1
    compile_tiny.cache_clear()
    compile_tiny(256, arch="sm_90a")
    assert cc.STATS.disk_hits == start[1] + 1 and cc.STATS.compiles == start[0] + 1
    objects = list(tmp_path.rglob("*.o"))
    assert len(objects) == 1 and cc.source_fingerprint() in str(objects[0])
    compile_tiny(256, arch="sm_100a")  # the arch is part of the key
    assert cc.STATS.compiles == start[0] + 2 and len(list(tmp_path.rglob("*.o"))) == 2


def test_every_spelling_of_one_compile_call_is_one_kernel(monkeypatch) -> None:
    """The key is the call bound to the compile function's signature, defaults filled in: a default left out,
    passed positionally or by name, or an argument passed by name, is the same kernel object (a second object would
    load its module at its first launch, which can stall spinning peers); another value is another kernel."""
    monkeypatch.setenv("MHC_BOUNDARY_DISK_CACHE", "0")
    built = []

    @cc.jit_cache
    def compile_thing(H: int, quant: str | None = None, *, arch: str) -> object:
        built.append((H, quant, arch))
        return object()

    first = compile_thing(256, arch="sm_90a")
    spellings = (
        compile_thing(256, None, arch="sm_90a"),
        compile_thing(256, quant=None, arch="sm_90a"),
        compile_thing(H=256, arch="sm_90a"),
        compile_thing(arch="sm_90a", H=256, quant=None),
    )
    assert all(s is first for s in spellings) and built == [(256, None, "sm_90a")]
    assert compile_thing.ready(256, None, arch="sm_90a") and not compile_thing.ready(256, "mxfp8", arch="sm_90a")
    assert compile_thing(256, "mxfp8", arch="sm_90a") is not first and len(built) == 2
    compile_thing.cache_clear()
    assert compile_thing(256, None, arch="sm_90a") is not first and len(built) == 3


def test_a_launched_mark_never_passes_to_a_new_object() -> None:
    """`launched` is true of the very object marked: the marks hold their objects, so a cache_clear that drops a
    launched kernel never lets a new object take its id, and with it the mark (its module would then load at its
    first launch, while a peer spins)."""
    marked = [object() for _ in range(50)]
    for obj in marked:
        cc.mark_launched(obj)
    ids = {id(obj) for obj in marked}
    del marked, obj
    fresh = [object() for _ in range(2000)]
    assert not any(cc.launched(obj) for obj in fresh)
    assert not ids & {id(obj) for obj in fresh}


def test_a_corrupt_cache_entry_is_rebuilt(tmp_path, monkeypatch) -> None:
    from tests.tiny_kernel import compile_tiny

    monkeypatch.setenv("MHC_BOUNDARY_CACHE_DIR", str(tmp_path))
    compile_tiny.cache_clear()
    compile_tiny(512, arch="sm_90a")
    (obj,) = tmp_path.rglob("*.o")
    obj.write_bytes(b"not an object file")
    compile_tiny.cache_clear()
    before = cc.STATS.compiles
    compile_tiny(512, arch="sm_90a")
    assert cc.STATS.compiles == before + 1 and obj.stat().st_size > 100


def test_warmup_runs_every_job_and_logs_its_phases(capsys, caplog) -> None:
    seen = []
    jobs = [
        cc.WarmupJob(f"job{i}", lambda i, arch: seen.append((i, arch)), (i,), (("arch", "sm_90a"),)) for i in range(3)
    ]
    with caplog.at_level(logging.INFO, logger="boundary"):
        assert cc.warmup(jobs, progress=True, desc="test") == 3
    assert seen == [(0, "sm_90a"), (1, "sm_90a"), (2, "sm_90a")]
    assert "test" in capsys.readouterr().err
    # Where the time went: the compiles (here none is a jit_cache one) and the loads, for a slow start-up's reader.
    assert re.fullmatch(r"test: 3 jobs, 0 compiled here, while loading; loaded: \d+\.\d s", caplog.messages[-1])


def _run_script(tmp_path: Path, name: str, body: str) -> str:
    """Run `body` as a script of its own (a fresh interpreter, the cache under tmp_path); its stdout."""
    import subprocess
    import sys

    script = tmp_path / name
    script.write_text(body)
    env = dict(os.environ, MHC_BOUNDARY_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_a_compile_that_fails_in_a_worker_is_reported_with_its_log(tmp_path) -> None:
    """A job that raises in its compile process fails the warmup with that process's last lines; the other jobs are
    still compiled by the other worker."""
    stdout = _run_script(
        tmp_path,
        "failing.py",
        "import cute_kernels.compile as cc\n"
        "from tests.tiny_kernel import compile_tiny\n"
        "jobs = [cc.WarmupJob(f'tiny {n}', compile_tiny, (n,), (('arch', 'sm_90a'),)) for n in (384, 640, 896)]\n"
        "jobs.insert(1, cc.WarmupJob('bad arch', compile_tiny, (512,), (('arch', 'sm_80'),)))\n"
        "try:\n"
        "    cc.warmup(jobs, workers=2, progress=False)\n"
        "except RuntimeError as exc:\n"
        "    print('raised:', str(exc).splitlines()[0], flush=True)\n"
        "    print('log names the arch:', 'sm_80' in str(exc), flush=True)\n",
    )
    assert "raised: 1 of 2 compile processes failed" in stdout, stdout
    assert "log names the arch: True" in stdout, stdout
    assert len(list((tmp_path / "cache").rglob("*.o"))) == 3


# No main guard: the compile workers are fresh interpreters, not multiprocessing children that would re-run it.
GROUP_SCRIPT = (
    "import os, sys, time\n"
    "import cute_kernels.compile as cc\n"
    "from tests.tiny_kernel import compile_tiny\n"
    "print('script body ran', flush=True)\n"
    "start = sys.argv[1]\n"
    "while not os.path.exists(start):\n"  # every process waits here, then all warm up at the same moment
    "    time.sleep(0.01)\n"
    "jobs = [cc.WarmupJob(f'tiny {n}', compile_tiny, (n,), (('arch', 'sm_90a'),)) for n in (384, 640, 896, 1152)]\n"
    "cc.warmup(jobs, workers=int(os.environ.get('WORKERS', '2')), progress=False)\n"
    "kernels = [job.run() for job in jobs]\n"
    "print('kernels:', sum(hasattr(k, '__call__') for k in kernels), 'compiled here:', cc.STATS.compiles,\n"
    "      'compile processes:', cc.STATS.compile_processes)\n"
)


def _start_group(tmp_path: Path, count: int, **env: str) -> tuple[list, Path, Path]:
    """`count` processes of GROUP_SCRIPT on one cache folder, each waiting for the start file; (procs, start, log)."""
    import subprocess
    import sys

    script, start, log = tmp_path / "group.py", tmp_path / "start", tmp_path / "compiles.log"
    script.write_text(GROUP_SCRIPT)
    env = dict(os.environ, MHC_BOUNDARY_CACHE_DIR=str(tmp_path / "cache"), TINY_COMPILE_LOG=str(log), **env)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(start)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(count)
    ]
    return procs, start, log


def _compiles(log: Path) -> dict[str, list[str]]:
    """The compile log's lines by kind ("start" / "done"), each as its width and pids."""
    lines: dict[str, list[str]] = {"start": [], "done": []}
    for line in log.read_text().splitlines() if log.exists() else ():
        kind, rest = line.split(" ", 1)
        lines[kind].append(rest)
    return lines


def test_a_group_warming_up_together_compiles_each_kernel_once(tmp_path) -> None:
    """Two processes start warmup(workers=2) on the same cold cache at the same moment: one of them compiles each
    kernel once, in two compile processes (the jobs handed out as each finishes one; neither group process compiles
    itself, and each group script, which has no main guard, runs once), and the other waits for its objects and
    loads them (the cores are used once, not twice), and every process gets every kernel. The control: a third
    process with the disk cache off compiles all four again, so the log does count compiles."""
    import subprocess
    import sys

    procs, start, log = _start_group(tmp_path, 2)
    start.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, err.decode()[-3000:]
        lines = out.decode().splitlines()
        assert lines[0] == "script body ran" and lines.count("script body ran") == 1, lines
        assert lines[-1].startswith("kernels: 4 compiled here: 0 "), lines
    assert len(list((tmp_path / "cache").rglob("*.o"))) == 4
    started = sorted(int(out.decode().split()[-1]) for out, _ in outs)
    assert started == [0, 2], started  # compile processes per group process
    done = sorted(int(rest.split()[0]) for rest in _compiles(log)["done"])
    assert done == [384, 640, 896, 1152], done  # once each, not once per process
    env = dict(os.environ, MHC_BOUNDARY_DISK_CACHE="0", TINY_COMPILE_LOG=str(log))
    control = subprocess.run([sys.executable, str(tmp_path / "group.py"), str(start)], cwd=ROOT, env=env, timeout=300)
    assert control.returncode == 0
    assert len(_compiles(log)["done"]) == 8


def test_a_process_killed_while_it_compiles_blocks_the_others_only_while_it_lives(tmp_path) -> None:
    """The process that compiles for the group is stopped in the middle of a compile: the other waits (the negative
    control: a live holder does block it). Once it is killed, the other takes over, finishes, and gets every
    kernel."""
    import signal

    procs, start, log = _start_group(tmp_path, 2, TINY_COMPILE_SLEEP="2", WORKERS="1")  # compiles in the process
    start.touch()
    deadline = time.monotonic() + 120
    while not _compiles(log)["start"]:
        assert time.monotonic() < deadline, "no compile started"
        time.sleep(0.05)
    _, compiler, _ = _compiles(log)["start"][0].split()
    victim = next(p for p in procs if p.pid == int(compiler))  # the group's compiling process
    os.kill(victim.pid, signal.SIGSTOP)
    time.sleep(4)  # two compiles' worth: with the holder alive, the other may not have finished
    others = [p for p in procs if p is not victim]
    assert all(p.poll() is None for p in others), "a process finished while the compiling one held the lock"
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=30)
    for proc in others:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()[-3000:]
        assert out.decode().splitlines()[-1].startswith("kernels: 4"), out.decode()
    assert sorted({int(rest.split()[0]) for rest in _compiles(log)["done"]}) == [384, 640, 896, 1152]


def test_a_kernel_loaded_on_one_gpu_is_loaded_again_on_another() -> None:
    """CUDA loads a module per device (context): a warm-up of cuda:1 after cuda:0 must load there too, and a first
    launch on cuda:1 is not one that cuda:0's load already made (the guard simulated ranks need)."""
    fn = object()
    loads: list = []
    job = cc.WarmupJob("k", lambda: fn, (), load=lambda f, device: loads.append(device))
    for device in ("cuda:0", "cuda:1", "cuda:1"):
        cc._load_onto(job, device)
    assert loads == ["cuda:0", "cuda:1"]
    assert cc.launched(fn, "cuda:0") and cc.launched(fn, "cuda:1") and not cc.launched(fn, "cuda:2")


def test_the_cache_key_names_the_hosts_machine_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache folder shared by x86_64 and aarch64 hosts ($MHC_BOUNDARY_CACHE_DIR on shared storage) must not offer
    one machine's objects to the other."""
    import platform

    keys = {}
    for machine in ("x86_64", "aarch64"):
        monkeypatch.setattr(platform, "machine", lambda m=machine: m)
        cc.source_fingerprint.cache_clear()
        keys[machine] = cc.source_fingerprint()
    cc.source_fingerprint.cache_clear()
    assert keys["x86_64"] != keys["aarch64"]
