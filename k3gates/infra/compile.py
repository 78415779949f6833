"""Pythran build cache: content hash -> compiled module, loaded explicitly.

A kernels module is compiled once per *key*: the SHA-256 of its source, the sources of every kernel
module it imports relatively (Pythran inlines them into one extension), the Pythran, NumPy and
Python versions, the compiler, the CPU and the flags. The extension lives in the cache, outside the
source tree, and is loaded by path under a name of its own. Python's import system never sees it,
so a stale `.so` can never shadow the `.py` it came from: change one byte and the key changes.

A failed compile is cached too, under the same key, with the compiler's message. A rebuild with
nothing changed therefore neither recompiles a good module nor retries a broken one.

Cache folder: `$K3GATES_CACHE`, else `$XDG_CACHE_HOME/k3gates`, else `~/.cache/k3gates`.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from . import faults

# -O3 and -march=native let the compiler vectorise the int64 loops; -fopenmp enables
# `#omp parallel for`.
# Pythran's interprocedural type combiner carries a callee's effect on an argument's type back to
# the caller. Our helpers only take int64 scalars and arrays whose type a callee cannot change, so
# it adds nothing, but g++ spent 94% of the compile resolving the type chains it writes (attnres:
# 295 s -> 46 s, moe.kernels_train: 370 s -> 67 s without it). The gates' digests are unchanged.
# Pythran 0.19's default optimisation passes minus ModIndex and RangeBasedSimplify: both run a
# costly range analysis and change nothing here. The C++ that `pythran -E` writes is byte-identical
# for all 21 kernel modules without them, and the front end takes 128 s instead of 165 s in all.
PYTHRAN_PASSES = (
    "InlineBuiltins",
    "PreInliningForwardSubstitution",
    "Inlining",
    "RemoveDeadFunctions",
    "ForwardSubstitution",
    "DeadCodeElimination",
    "ConstantFolding",
    "PartialConstantFolding",
    "SimplifyExcept",
    "IterTransformation",
    "LoopFullUnrolling",
    "transformations.FalsePolymorphism",
    "PatternTransform",
    "Square",
    "CopyTo",
    "FastGExpr",
    "RangeLoopUnfolding",
    "ListToTuple",
    "TupleToShape",
)
PYTHRAN_FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-g0",  # Python's CFLAGS ask for -g: g++ took twice as long building debug info the link strips
    "-w",
    "--config",
    "typing.max_interprocedural_combiner=0",
    "--config",
    "pythran.optimizations="
    + " ".join(f"pythran.{p if '.' in p else 'optimizations.' + p}" for p in PYTHRAN_PASSES),
)
COMPILE_TIMEOUT_S = 1800  # the largest kernel module compiles in minutes, not hours
# Pythran's type inference can make g++ template instantiation explode (a helper taking several
# arrays it mutates once took 24 GiB). A cap turns that into a compile error naming the module
# instead of the kernel's OOM killer taking the whole machine; good modules peak below 2 GiB.
COMPILE_MEMORY_BYTES = 6 << 30
NO_COMPILE_ENV = "K3GATES_NO_COMPILE"  # set in gate subprocesses: a cache miss there is a bug


class CompileError(RuntimeError):
    """A kernels module did not compile; the message names the file and the compiler's reason."""


class StaleModuleError(RuntimeError):
    """A compiled extension sits beside a kernel source, where import would prefer it."""


def cache_root() -> Path:
    if os.environ.get("K3GATES_CACHE"):
        return Path(os.environ["K3GATES_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "k3gates"


def source_path(modname: str) -> Path:
    """The `.py` file of a dotted module name, found without importing the module itself.

    sys.path first; then the import system, which also knows packages installed in editable
    mode through a path hook (no sys.path entry), imported from any working directory."""
    rel = Path(*modname.split(".")).with_suffix(".py")
    for entry in sys.path:
        candidate = Path(entry or ".") / rel
        if candidate.is_file():
            return candidate.resolve()
    try:
        spec = importlib.util.find_spec(modname)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin and spec.origin.endswith(".py"):
        return Path(spec.origin).resolve()
    raise CompileError(f"{modname}: no source file {rel} on sys.path")


def _relative_imports(modname: str, path: Path) -> tuple[str, ...]:
    """Kernel modules imported with `from ..x.kernels import f` (Pythran compiles those in)."""
    st = path.stat()
    return _relative_imports_of(modname, path, st.st_mtime_ns, st.st_size)


# Parsed once per file version: a build asks for every gate's dependencies several times, and
# memoised on disk by the source's hash: parsing the 21 kernel modules took 0.16 s, about a sixth
# of a no-change rebuild, and every gate process asked again.
@functools.lru_cache(maxsize=512)
def _relative_imports_of(modname: str, path: Path, mtime_ns: int, size: int) -> tuple[str, ...]:
    text = path.read_bytes()
    memo = memo_path("imports", modname.encode() + b"\0" + text)
    try:
        return tuple(json.loads(memo.read_text()))
    except (OSError, ValueError):
        pass
    try:
        tree = ast.parse(text, filename=str(path))
    except SyntaxError as e:
        raise CompileError(f"{path}:{e.lineno}: syntax error: {e.msg}") from e
    package = modname.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            # Pythran finds a relative import from the folder of the module it compiles, not of
            # the file that says it, and knows an imported module by its spelling: `.kernels`
            # in mxfp/kernels_qat.py, compiled into moe/kernels_train.py, would be moe's kernels.
            # One spelling, the same from every folder, binds the same file everywhere.
            if node.level != 2 or not node.module or node.module.count(".") != 1:
                spelled = "." * node.level + (node.module or "")
                raise CompileError(
                    f"{path}:{node.lineno}: `from {spelled} import ...`: a kernel module imports "
                    "another only as `from ..<package>.<module> import ...` (Pythran resolves "
                    "relative imports from the compiled module's folder)"
                )
            base = package[: len(package) - (node.level - 1)]
            found.append(".".join(base + ([node.module] if node.module else [])))
    write_memo(memo, found)
    return tuple(found)


def memo_path(kind: str, material: bytes) -> Path:
    """Where a fact derived from `material` (a source's bytes, a compiler's identity) is kept:
    read with json, written with write_memo."""
    return cache_root() / "memo" / f"{kind}-{hashlib.sha256(material).hexdigest()[:32]}.json"


def write_memo(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)  # a concurrent reader sees the old memo or the new one, never half


def dependencies(modname: str) -> dict[str, Path]:
    """The module and, transitively, every kernel module it imports: {modname: path}."""
    seen: dict[str, Path] = {}
    stack = [modname]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen[name] = source_path(name)
        stack.extend(_relative_imports(name, seen[name]))
    return dict(sorted(seen.items()))


# clang++ first: g++ 12 spends 82% of a kernel compile instantiating Pythran's templates, at any
# -O level, and clang++ 14 compiles our modules in half its time. Its code is as fast or faster
# (kda, mla, moe, k3mu: bench/), except in the modules below, which keep g++: each one's bench
# runs slower from clang++ (README, "Compile time").
CLANG = ("clang++", "clang")
GCC = ("g++", "gcc")
GXX_MODULES = {
    "k3gates.fx.kernels": "bench_fx: exp, rsqrt, sin/cos and SiTU-GLU 3-8% slower",
    "k3gates.gemm.kernels": "bench_gemm: the int16 GEMM 0.6x (clang 14 forms no vpdpwssd)",
    "k3gates.muon.kernels": "bench_muon: NS5 0.4x (its int16 GEMM)",
    "k3gates.mxfp.kernels": "bench_mxfp: MXFP4 quantise and pack 0.6x",
    "k3gates.attnres.kernels": "bench_attnres: RMS keys 0.93x",
}
_OPENMP_PROBE = "#include <omp.h>\nint main() { return omp_get_max_threads() < 1; }\n"


def compilers(modname: str) -> tuple[str, str]:
    """(CXX, CC) that compile `modname`: $CXX (with $CC) when set, as every build tool honours;
    else g++ for GXX_MODULES and clang++ for the rest, when it builds OpenMP code (clang needs
    libomp-dev); else g++."""
    if os.environ.get("CXX"):
        return os.environ["CXX"], os.environ.get("CC", "cc")
    if modname not in GXX_MODULES and _compiler_facts(CLANG[0])["openmp"]:
        return CLANG
    return GCC


@functools.lru_cache(maxsize=8)
def _compiler_facts(cxx: str) -> dict:
    """`cxx`'s version line, and whether it compiles and links an OpenMP program.

    Memoised on disk per compiler binary (its path, mtime and size): the probe takes 100-180 ms,
    which every build and every gate process paid. Only a compiler that passed is memoised, so
    installing libomp-dev later is seen by the next build."""
    exe = shutil.which(cxx)
    if exe is None:
        return {"version": f"{cxx} (not found)", "openmp": False}
    real = os.path.realpath(exe)
    st = os.stat(real)
    memo = memo_path("compiler", f"{cxx}\0{real}\0{st.st_mtime_ns}\0{st.st_size}".encode())
    try:
        return json.loads(memo.read_text())
    except (OSError, ValueError):
        pass
    facts = {"version": _version(cxx), "openmp": _builds_openmp(cxx)}
    if facts["openmp"]:
        write_memo(memo, facts)
    return facts


def _builds_openmp(cxx: str) -> bool:
    with tempfile.TemporaryDirectory(prefix="k3-omp-") as scratch:
        cmd = [cxx, "-fopenmp", "-x", "c++", "-", "-o", os.path.join(scratch, "probe")]
        try:
            proc = subprocess.run(
                cmd, input=_OPENMP_PROBE, capture_output=True, text=True, timeout=60
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
    return proc.returncode == 0


def _version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else cxx
    except (OSError, subprocess.TimeoutExpired):
        return f"{cxx} (not found)"


@functools.lru_cache(maxsize=1)
def toolchain() -> dict[str, str]:
    """Everything outside the sources that changes the compiled code."""
    import numpy
    import pythran

    # "" stands for every module outside GXX_MODULES
    used = dict.fromkeys(compilers(m)[0] for m in ("", *GXX_MODULES))
    compiler = "; ".join(_compiler_facts(cxx)["version"] for cxx in used)
    return {
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "pythran": pythran.__version__,
        "compiler": compiler,
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "flags": " ".join(PYTHRAN_FLAGS),
    }


VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                "avx_vnni", "amx_int8")  # fmt: skip


def cpu_vector_extensions() -> str:
    """The CPU's integer-relevant vector extensions, as /proc/cpuinfo names them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return " ".join(f for f in VECTOR_FLAGS if f in have)
    except OSError:
        pass
    return "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


_key_memo: dict[str, tuple[tuple, str]] = {}


def _stat_signature(paths: list[Path]) -> tuple:
    return tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in paths)


def module_key(modname: str) -> str:
    """The cache key of `modname`, memoised on the files' stat (hot library calls)."""
    memo = _key_memo.get(modname)
    if memo is not None:
        paths = [Path(p) for p, _, _ in memo[0]]
        try:
            if _stat_signature(paths) == memo[0]:
                return memo[1]
        except OSError:
            pass
    deps = dependencies(modname)
    h = hashlib.sha256()
    h.update(json.dumps(toolchain(), sort_keys=True).encode())
    for name, path in deps.items():
        h.update(f"\0{name}\0".encode())
        h.update(path.read_bytes())
    key = h.hexdigest()[:24]
    _key_memo[modname] = (_stat_signature(list(deps.values())), key)
    return key


def _ext_name(modname: str) -> str:
    # Pythran names PyInit_<stem> after the output file, so the stem must be a valid identifier.
    return "k3c_" + modname.replace(".", "_")


@dataclass
class Compiled:
    """The outcome of `ensure()` for one module."""

    modname: str
    key: str
    path: Path | None  # the extension, or None when the compile failed
    error: str | None
    seconds: float
    reused: bool  # True when the cache already held this key (good or failed)


def _entry(modname: str, key: str) -> Path:
    return cache_root() / "pythran" / f"{_ext_name(modname)}-{key}"


def _read_entry(modname: str, key: str) -> Compiled | None:
    entry = _entry(modname, key)
    so = entry / (_ext_name(modname) + ".so")
    meta_file = entry / "meta.json"
    if not meta_file.is_file():
        return None
    meta = json.loads(meta_file.read_text())
    if meta.get("error") is None and not so.is_file():
        return None
    return Compiled(
        modname,
        key,
        None if meta.get("error") else so,
        meta.get("error"),
        meta.get("seconds", 0.0),
        reused=True,
    )


def check_not_shadowed(modname: str) -> None:
    """Refuse a compiled extension beside the source: `import` would silently prefer it."""
    src = source_path(modname)
    for sibling in src.parent.glob(src.stem + ".*"):
        if sibling.suffix in {".so", ".pyd"}:
            raise StaleModuleError(
                f"{sibling}: a compiled extension beside {src.name} would shadow the source "
                "when imported; delete it (compiled kernels live in the cache, not the tree)"
            )


def ensure(modname: str) -> Compiled:
    """Compile `modname` unless the cache holds its current key; never raises for a bad kernel."""
    start = time.perf_counter()
    try:
        check_not_shadowed(modname)
        key = module_key(modname)
    except (CompileError, StaleModuleError) as e:
        return Compiled(modname, "", None, str(e), time.perf_counter() - start, reused=False)
    cached = _read_entry(modname, key)
    if cached is not None:
        return cached
    if os.environ.get(NO_COMPILE_ENV):
        raise CompileError(f"{modname}: not compiled for key {key} (the build compiles first)")
    error = _run_pythran(modname, key)
    return Compiled(
        modname,
        key,
        None if error else _read_entry(modname, key).path,
        error,
        time.perf_counter() - start,
        reused=False,
    )


def _run_pythran(modname: str, key: str) -> str | None:
    """Compile into a scratch folder, then rename it into place; returns the error or None."""
    src = source_path(modname)
    final = _entry(modname, key)
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    so = scratch / (_ext_name(modname) + ".so")
    cmd = [
        sys.executable,
        "-c",
        "import sys; from pythran.run import run; sys.exit(run())",
        str(src),
        "-o",
        str(so),
        *PYTHRAN_FLAGS,
    ]
    cxx, cc = compilers(modname)
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
            cwd=scratch,
            env={**os.environ, "CXX": cxx, "CC": cc},
            preexec_fn=_limit_memory,
        )
        ok = proc.returncode == 0 and so.is_file()
        error = None if ok else _compiler_message(src, proc.stdout + proc.stderr)
    except subprocess.TimeoutExpired:
        error = f"{src}: pythran did not finish within {COMPILE_TIMEOUT_S} s"
    meta = {
        "modname": modname,
        "key": key,
        "error": error,
        "toolchain": toolchain(),
        "seconds": round(time.perf_counter() - start, 3),
        "sources": {n: str(p) for n, p in dependencies(modname).items()},
    }
    (scratch / "meta.json").write_text(json.dumps(meta, indent=1))
    for leftover in scratch.iterdir():
        if leftover.name not in {so.name, "meta.json"}:
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    try:
        os.rename(scratch, final)
    except OSError:  # another process published the same key first; theirs is as good
        shutil.rmtree(scratch, ignore_errors=True)
    return error


def _limit_memory() -> None:
    """In the compiler's process, before exec: cap its address space (and its children's)."""
    resource.setrlimit(resource.RLIMIT_AS, (COMPILE_MEMORY_BYTES, COMPILE_MEMORY_BYTES))


def _compiler_message(src: Path, output: str) -> str:
    if "memory exhausted" in output or "Cannot allocate memory" in output:
        gib = COMPILE_MEMORY_BYTES >> 30
        return (
            f"{src}: pythran failed: the C++ compiler ran out of its {gib} GiB memory cap "
            "(Pythran's type inference exploded; a helper that takes several arrays it mutates "
            "is the usual cause: inline it, or pass scalars)"
        )
    lines = [ln for ln in output.strip().splitlines() if ln.strip()]
    if any(ln.startswith("Traceback") for ln in lines):
        headline = lines[-1]  # Pythran itself crashed: the exception is the last line
    else:
        errors = [ln for ln in lines if "error" in ln.lower() and "CRITICAL" not in ln]
        headline = errors[0] if errors else (lines[-1] if lines else "no message")
    tail = "\n".join(lines[-25:])
    return f"{src}: pythran failed: {headline.strip()}\n{tail}"


def load_extension(compiled: Compiled) -> ModuleType:
    if compiled.path is None:
        raise CompileError(compiled.error or f"{compiled.modname}: not compiled")
    spec = importlib.util.spec_from_file_location(_ext_name(compiled.modname), compiled.path)
    if spec is None or spec.loader is None:
        raise CompileError(f"{compiled.path}: not a loadable extension")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_loaded: dict[tuple[str, str], ModuleType] = {}


def load(modname: str) -> faults.GuardedModule:
    """The compiled extension for the *current* source of `modname`, compiling if needed.

    The key is recomputed on every call, so an edited kernel is never served from an old build.
    Every function of it refuses a non-integer output, and corrupts its outputs when a fault run
    asks it to (faults.py).
    """
    try:
        cache_key = (modname, module_key(modname))
    except CompileError:
        cache_key = (modname, "")
    if cache_key not in _loaded:
        _loaded[cache_key] = faults.guard(load_extension(ensure(modname)), modname)
    return _loaded[cache_key]


def loaded_modules() -> set[str]:
    """The kernel modules this process has loaded."""
    return {modname for modname, _ in _loaded}


def interpreted(modname: str) -> ModuleType:
    """The same kernels run by CPython (the reference for compiled == interpreted)."""
    check_not_shadowed(modname)
    return importlib.import_module(modname)
