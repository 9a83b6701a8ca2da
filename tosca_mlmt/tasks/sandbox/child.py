"""The program the sandboxed child runs: load the code, run the test steps, report values.

It is passed to ``python -I -S -c`` as text (see ``run.py``), so it must import only
the standard library and must not import ``tosca_mlmt``. It never decides whether a
test passed: for each ``assert`` it evaluates the operands that depend on the
candidate's code and reports their values, type-tagged; the trusted parent compares
them with the expected values, which never enter this process. Whatever the candidate
does to this process (patch builtins, walk the stack to ``report``, write to the result
pipe) can therefore only change the values it reports, which is its answer anyway.

Arguments: the result pipe's fd, the job fd, the judge fd (-1 when there is none).
"""

import _collections_abc
import _thread
import builtins
import json
import linecache
import os
import resource
import select
import signal
import sys
import traceback

RESERVE_BYTES = 4 * 1024 * 1024
MAX_DEPTH = 64  # nested containers deeper than this are reported as an error
VALUE_LIMIT = 256 * 1024  # bytes of one encoded value
REPR_LIMIT = 200
INT_BITS = 1 << 16  # larger ints are reported as errors; the parent refuses them (values.py)

# Exact references taken before any candidate code runs; the candidate may rebind the
# builtins, and an honest answer must still encode faithfully.
_int, _float, _complex, _str, _bytes, _bytearray = int, float, complex, str, bytes, bytearray
_list, _tuple, _dict, _set, _frozenset, _type, _issubclass = list, tuple, dict, set, frozenset, type, issubclass
_complex_real, _complex_imag = complex.real, complex.imag


def read_fd(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def make_reporter(fd, nonce):
    owner = os.getpid()

    def report(record):
        # A process the code forked without exec continues in this runner; only the
        # original may speak, else its copies' records would read as forgeries.
        if os.getpid() != owner:
            return False
        record["nonce"] = nonce
        try:
            data = (json.dumps(record) + "\n").encode()
            while data:
                data = data[os.write(fd, data):]
            return True
        except (OSError, MemoryError, ValueError):
            return False  # an unreported test counts as failed
    return report


# --- values --------------------------------------------------------------------------


def encode(value, depth=0):
    """A JSON-able, type-tagged copy of ``value`` that the parent can rebuild exactly.

    Types are read with ``type()``, which a ``__class__`` property cannot fake. Subclasses
    of built-in types are encoded through the base type's own slots, so a subclass that
    overrides ``__eq__`` or ``__iter__`` is reported by its real contents; anything else
    becomes an opaque object that equals nothing in the parent.
    """
    if depth > MAX_DEPTH:
        raise ValueError("value is nested too deeply to report")
    t = _type(value)
    if value is None:
        return ["none"]
    if t is bool:
        return ["bool", value]
    if _issubclass(t, _int):
        return ["int", _int.__format__(check_bits(value), "x")]  # hex: no digit limit, exact
    if _issubclass(t, _float):
        return ["float", _float.hex(value)]
    if _issubclass(t, _complex):
        return ["complex", _float.hex(_complex_real.__get__(value)), _float.hex(_complex_imag.__get__(value))]
    if _issubclass(t, _str):
        return ["str", _str.__str__(value)]
    if _issubclass(t, (_bytes, _bytearray)):
        return ["bytes", _bytes.hex(value) if _issubclass(t, _bytes) else _bytearray.hex(value)]
    depth += 1
    if _issubclass(t, _list):
        return ["list", [encode(x, depth) for x in _list.__iter__(value)]]
    if _issubclass(t, _tuple):
        return ["tuple", [encode(x, depth) for x in _tuple.__iter__(value)]]
    if _issubclass(t, _dict):
        return ["dict", [[encode(k, depth), encode(v, depth)] for k, v in _dict.items(value)]]
    if _issubclass(t, _frozenset):
        return ["frozenset", [encode(x, depth) for x in _frozenset.__iter__(value)]]
    if _issubclass(t, _set):
        return ["set", [encode(x, depth) for x in _set.__iter__(value)]]
    # Other mappings and sets (os.environ, dict views) compare by contents in Python too.
    if _issubclass(t, _collections_abc.Mapping):
        return ["dict", [[encode(k, depth), encode(v, depth)] for k, v in _list(value.items())]]
    if _issubclass(t, _collections_abc.Set):
        try:
            return ["frozenset", [encode(x, depth) for x in _frozenset(value)]]
        except TypeError:
            pass  # unhashable members (a dict's items view): an opaque value
    for module, name in (("decimal", "Decimal"), ("fractions", "Fraction")):
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and _issubclass(t, cls):
            if name == "Decimal":
                return ["decimal", cls.__str__(value)]
            return ["fraction", _int.__format__(check_bits(value.numerator), "x"),
                    _int.__format__(check_bits(value.denominator), "x")]
    try:
        text = repr(value)[:REPR_LIMIT]
    except BaseException:
        text = "?"
    try:
        truth = bool(value)
    except BaseException:
        truth = True
    return ["object", getattr(t, "__qualname__", "?")[:100], _str.__str__(text), truth is True]


def check_bits(value):
    if _int.bit_length(value) > INT_BITS:
        raise ValueError("an int of %d bits is too large to report (over %d)" % (_int.bit_length(value), INT_BITS))
    return value


def encode_or_error(value):
    try:
        encoded = encode(value)
        if len(json.dumps(encoded)) > VALUE_LIMIT:
            return ["raised", "ValueError: the value is too large to report (over %d bytes)" % VALUE_LIMIT]
        return encoded
    except BaseException as exc:
        return ["raised", "could not report the value: %s" % describe(exc)]


# --- running snippets ------------------------------------------------------------------


def describe(exc):
    try:
        # Skip this file's frames: the user needs their code's frames only.
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == "<string>":
            tb = tb.tb_next
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        # Valid UTF-8 whatever the message held: chr(0xdcff) becomes the text \\udcff.
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
        return "\n".join(text.rstrip().splitlines()[-12:])[-1500:]
    except BaseException:
        return "MemoryError" if isinstance(exc, MemoryError) else "unprintable " + type(exc).__name__


def rearm(reserve):
    if not reserve:
        try:
            reserve.append(bytearray(RESERVE_BYTES))
        except MemoryError:
            pass


def execute(source, filename, namespace, reserve, mode="exec"):
    """(value, None) or (None, error text); MemoryError first releases the reserve."""
    # Registering the source lets tracebacks quote the failing line.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        return eval(compile(source, filename, mode), namespace), None
    except MemoryError as exc:
        # The memory may still be held (e.g. by a global list); release the reserve so
        # there is room to describe and report the error.
        reserve.clear()
        return None, describe(exc)
    except BaseException as exc:
        return None, describe(exc)


def run_test(i, steps, namespace, reserve):
    """Run one test's steps: statements execute, assert operands are evaluated and kept.

    A failing statement ends the test. A failing operand is reported as raised and the
    rest still run: the parent decides, lazily like Python, whether it was needed.
    """
    values = []
    filename = "<test %d>" % i
    for kind, payload in steps:
        rearm(reserve)
        if kind == "exec":
            _, error = execute(payload, filename, namespace, reserve)
            if error is not None:
                return {"ok": False, "err": error, "values": values}
        else:
            for source in payload:
                value, error = execute(source, filename, namespace, reserve, "eval")
                values.append(["raised", error] if error is not None else encode_or_error(value))
    return {"ok": True, "err": "", "values": values}


def run_judge(fd, count, fd_result, nonce, report):
    """Evaluate the expected sides that are not literals, in a fork, before any candidate
    code exists: the candidate's process never holds them, so it cannot copy them."""
    try:
        pid = os.fork()
    except OSError:
        pid = None
    if pid == 0:
        written = False
        try:
            values = []
            for item in json.loads(read_fd(fd)):
                namespace = {"__builtins__": builtins}
                try:
                    for name in item["modules"]:
                        namespace[name] = __import__(name)
                    values.append(encode_or_error(eval(compile(item["source"], "<expected>", "eval"), namespace)))
                except BaseException as exc:
                    values.append(["raised", describe(exc)])
            written = make_reporter(fd_result, nonce)({"kind": "expected", "values": values})
        finally:
            os._exit(0 if written else 1)
    os.close(fd)
    if pid is None or os.waitpid(pid, 0)[1] != 0:
        # No candidate code exists yet, so this process may still speak for the judge.
        report({"kind": "expected", "values": [["raised", "the process computing it failed"]] * count})


# --- limits ----------------------------------------------------------------------------


def limit_resources(limits):
    pairs = (
        (resource.RLIMIT_AS, limits["memory_bytes"], limits["memory_bytes"]),
        (resource.RLIMIT_CPU, limits["cpu_seconds"], limits["cpu_seconds"] + 1),
        (resource.RLIMIT_FSIZE, limits["file_bytes"], limits["file_bytes"]),
        (resource.RLIMIT_NPROC, limits["max_procs"], limits["max_procs"]),
        (resource.RLIMIT_CORE, 0, 0),
    )
    for which, soft, hard in pairs:
        current_hard = resource.getrlimit(which)[1]
        if current_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, current_hard), min(hard, current_hard)
        resource.setrlimit(which, (soft, hard))
    # A write past RLIMIT_FSIZE should fail with an OSError, not kill the runner.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        # Under memory pressure the kernel should pick the sandbox, not the trainer. Code
        # can lower this back to 0 (not below); the run's memory cgroup is the real bound.
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def watch_trainer(result_fd):
    """Exit once the trainer is gone (the pipe's read end closed). bwrap's --die-with-parent
    misses a trainer that dies while bwrap is still starting; this covers that window,
    and the fallback, which has no such option at all. The code may close the fd: that
    too ends the run."""
    exit_now = os._exit
    poller = select.poll()
    poller.register(result_fd, 0)  # errors only: POLLERR once no reader is left

    def watch():
        while not poller.poll():
            pass
        exit_now(1)

    _thread.start_new_thread(watch, ())


def flush_std():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass


def main():
    result_fd, job_fd, judge_fd = (int(a) for a in sys.argv[1:4])
    job = json.loads(read_fd(job_fd))
    report = make_reporter(result_fd, job["nonce"])
    watch_trainer(result_fd)
    limit_resources(job["limits"])
    if judge_fd >= 0:
        run_judge(judge_fd, job["n_judge"], result_fd, job["nonce"], report)
    if job["guard_source"]:
        # Without an isolation tool the only barrier is in-process (see guards.py).
        guards = {"__name__": "guards"}
        exec(compile(job["guard_source"], "<guards>", "exec"), guards)
        guards["install"](os.path.realpath(os.getcwd()))
    # Not "__main__": solutions often end with a main block that reads input or prints demos.
    # A real module, so that pickle (multiprocessing) and dataclasses can find its names.
    module = type(sys)("solution")
    sys.modules["solution"] = module
    namespace = module.__dict__
    namespace["__builtins__"] = builtins
    reserve = [bytearray(RESERVE_BYTES)]
    _, load_error = execute(job["code"], "<solution>", namespace, reserve)
    if load_error is None and job["setup"]:
        _, load_error = execute(job["setup"], "<setup>", namespace, reserve)
    report({"kind": "load", "ok": load_error is None, "err": load_error or ""})
    if load_error is None:
        for i, steps in enumerate(job["tests"]):
            record = run_test(i, steps, namespace, reserve)
            record.update(kind="test", i=i)
            report(record)
    flush_std()
    report({"kind": "done"})
    os._exit(0)  # skip interpreter teardown, which runs more user code (__del__, atexit)


if __name__ == "__main__":
    main()
