"""Runs `spectral-cond` under a wall-clock limit and an address-space limit, measuring the child's
own peak RSS and CPU time (os.wait4), for the hostile-input and data-loss tests."""
import os
import resource
import signal
import subprocess
import tempfile
import time

# The tool's address space when it runs normally is ~300 MB (OpenBLAS reserves its buffers at
# start); 1 GiB leaves room and still stops a runaway allocation long before it hurts.
ADDRESS_SPACE_LIMIT = 1 << 30
ENV = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", LC_ALL="C")

# Under AddressSanitizer (SPECTRAL_COND_SANITIZED=1, set by ctest for the sanitizer build) the
# address-space limit cannot be used: ASan reserves terabytes of shadow memory at start. Its own
# allocator stands in for it: an allocation above the same 1 GiB returns null, so operator new
# throws std::bad_alloc as it would under the limit, and everything else ASan checks still aborts.
SANITIZED = os.environ.get("SPECTRAL_COND_SANITIZED") == "1"
if SANITIZED:
    ENV["ASAN_OPTIONS"] = ":".join(filter(None, [
        os.environ.get("ASAN_OPTIONS", ""), "allocator_may_return_null=1",
        f"max_allocation_size_mb={ADDRESS_SPACE_LIMIT >> 20}"]))


# Under valgrind's memcheck (SPECTRAL_COND_MEMCHECK=1, scripts/memcheck) every run goes through
# valgrind, which reports uninitialised reads and invalid accesses to a log of its own (the
# tool's stderr stays what the tests read); the address-space limit is off (valgrind reserves
# its own), and a run with any report fails its test (Result.memcheck holds the report).
MEMCHECK = os.environ.get("SPECTRAL_COND_MEMCHECK") == "1"


class Result:
    def __init__(self, rc, stdout, stderr, seconds, max_rss_mb, timed_out, cpu_seconds,
                 memcheck=""):
        self.returncode = rc
        self.memcheck = memcheck  # valgrind's report (MEMCHECK), empty when clean
        self.stdout = stdout
        self.stderr = stderr
        self.seconds = seconds
        self.max_rss_mb = max_rss_mb
        self.timed_out = timed_out
        self.cpu_seconds = cpu_seconds  # user + system time of the child itself

    def __repr__(self):
        return (f"rc={self.returncode} {self.seconds:.3f}s wall {self.cpu_seconds:.3f}s cpu "
                f"{self.max_rss_mb:.1f}MB "
                f"timed_out={self.timed_out} stderr={self.stderr[-400:]!r}")


def _limits(address_space):
    def apply():
        if address_space and not SANITIZED and not MEMCHECK:
            resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.setsid()  # its own process group, so that a timeout kills everything it started
    return apply


def run(exe, argv, timeout=5.0, address_space=ADDRESS_SPACE_LIMIT, on_start=None, cwd=None):
    """Runs exe argv; returns Result. `on_start(proc)` is called once the child runs."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile(prefix="sc-memcheck-", suffix=".log") as log:
        cmd = [exe, *argv]
        if MEMCHECK:
            cmd = ["valgrind", "--tool=memcheck", "--error-exitcode=99", "--leak-check=no",
                   "--track-origins=yes", "-q", f"--log-file={log.name}", *cmd]
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                             preexec_fn=_limits(address_space), env=ENV, cwd=cwd)
        if on_start is not None:
            on_start(p)
        timed_out = False
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid != 0:
                break
            if time.monotonic() - t0 > timeout:
                timed_out = True
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                pid, status, ru = os.wait4(p.pid, 0)
                break
            time.sleep(0.002)
        seconds = time.monotonic() - t0
        p.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait again
        out.seek(0)
        err.seek(0)
        report = ""
        if MEMCHECK:
            with open(log.name, encoding="utf-8", errors="replace") as f:
                report = f.read()
            if p.returncode == 99 and not report:
                report = "valgrind exited 99 (errors found)"
        return Result(p.returncode, out.read().decode("utf-8", "replace"),
                      err.read().decode("utf-8", "replace"), seconds, ru.ru_maxrss / 1024.0,
                      timed_out, ru.ru_utime + ru.ru_stime, report)
