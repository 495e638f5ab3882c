"""Opt-in process accounting for the suite's CPU profile (tests/cpu_profiling.py puts this folder on the
PYTHONPATH of pytest's children when SKIPPY_CPU_PROFILE names a folder): every Python process started
under it logs its command line and the test that was running when it started (PYTEST_CURRENT_TEST, which
children inherit), and on a clean exit its own CPU seconds and its reaped children's; every program it
starts that is not Python (llama-server, llama-quantize, a compiler) is logged by its Popen."""

import os

_DIR = os.environ.get("SKIPPY_CPU_PROFILE")


def _log(record: dict) -> None:
    import json
    line = json.dumps(record) + "\n"
    fd = os.open(os.path.join(_DIR, f"procs-{os.getpid()}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _install() -> None:
    import atexit
    import resource
    import subprocess

    with open("/proc/self/cmdline", "rb") as f:
        argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    test = os.environ.get("PYTEST_CURRENT_TEST", "")
    _log({"event": "start", "pid": os.getpid(), "ppid": os.getppid(), "argv": argv[:8], "test": test})

    def at_exit() -> None:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        _log({"event": "exit", "pid": os.getpid(), "argv": argv[:8], "test": test,
              "self_s": own.ru_utime + own.ru_stime, "children_s": kids.ru_utime + kids.ru_stime})

    atexit.register(at_exit)
    original = subprocess.Popen._execute_child

    def execute_child(self, args, executable, *rest, **kw):
        first = args if isinstance(args, (str, bytes)) else (list(args)[0] if args else "")
        name = os.path.basename(str(executable or first))
        if not name.startswith("python") and name not in ("bash", "sh"):
            _log({"event": "exec", "pid": os.getpid(), "program": name,
                  "test": os.environ.get("PYTEST_CURRENT_TEST", "")})
        return original(self, args, executable, *rest, **kw)

    subprocess.Popen._execute_child = execute_child


if _DIR and os.path.isdir(_DIR):
    _install()
