"""The sandbox's child side: run as `python -I sandbox_boot.py CONFIG_JSON` (standard library
only: it must not import the trainer), it takes away what model-written code must not have,
then runs the code (`main.py` of its working directory) as `__main__`.

In order, each where the kernel allows it (the parent learns which from the first line the boot
writes to its status pipe, `isolation`), with a fallback that holds at least in Python:

1. Resource limits (setrlimit): CPU seconds, address space, file size, open files, no core.
2. Processes: the boot joins a pids cgroup made for this run (cgroup v2 or v1's pids
   controller, when writable), else, not as root, RLIMIT_NPROC; then new PID and network
   namespaces (root): the code runs as PID 1 of its own namespace, so killing it ends every
   process it made (a daemonised grandchild too), and it has no network (not even loopback).
3. Files and TCP: a Landlock ruleset (Linux >= 5.13; TCP from ABI 4): read and execute under
   the Python installation and the system libraries, everything under the working directory,
   nothing else; no TCP bind or connect.
4. Without namespaces or Landlock: audit hooks (PEP 578) refuse, inside Python, opening a
   path outside those roots, sockets, ctypes, and starting processes (fork, exec, subprocess,
   os.system: a new process runs outside the hooks, so processes are allowed only where the
   kernel holds the files and the network and bounds their count), as the fallback ("no
   sockets" where the kernel offers no network namespace).

The environment is the parent's minimal one (no API keys, tokens or home), the working
directory fresh."""

import ctypes
import json
import os
import resource
import sys
import traceback

CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
PR_SET_NO_NEW_PRIVS = 38
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_RULE_PATH_BENEATH, LANDLOCK_RULE_NET_PORT = 1, 2
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_ALL_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1

_libc = ctypes.CDLL(None, use_errno=True)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def set_limits(cfg):
    cpu = max(1, int(cfg["cpu_s"]))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    memory = int(cfg["memory_mb"]) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(cfg["file_bytes"]), int(cfg["file_bytes"])))
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(cfg["open_files"]), int(cfg["open_files"])))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def bound_processes(cfg):
    """'cgroup', 'rlimit' or '' (not bounded by the kernel)."""
    procs = cfg.get("cgroup_procs")
    if procs:
        try:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
            return "cgroup"
        except OSError:
            pass
    if os.getuid() != 0:  # root is never held by RLIMIT_NPROC
        mine = sum(1 for p in os.listdir("/proc") if p.isdigit() and _owner(p) == os.getuid())
        limit = mine + int(cfg["processes"])
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
        return "rlimit"
    return ""


def _owner(pid):
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


def new_namespaces():
    """PID and network namespaces: True when the kernel gave both (root, or CAP_SYS_ADMIN)."""
    return _libc.unshare(CLONE_NEWNET | CLONE_NEWPID) == 0


def run_as_pid_one():
    """Fork the namespace's first process, which goes on; this one waits and passes on its end."""
    child = os.fork()
    if child == 0:
        return
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def landlock(cfg):
    """Restrict files (and TCP from ABI 4) to the allowed roots; the ABI applied, or 0."""
    abi = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, 1)
    if abi < 1:
        return 0
    handled = FS_ALL_BY_ABI.get(abi, FS_ALL_BY_ABI[5])
    attr = _RulesetAttr(handled, (NET_BIND_TCP | NET_CONNECT_TCP) if abi >= 4 else 0)
    size = ctypes.sizeof(attr) if abi >= 4 else ctypes.sizeof(ctypes.c_uint64)
    ruleset = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        return 0
    read = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
    for path, access in [(p, read) for p in cfg["read_roots"]] + [(cfg["workdir"], handled)]:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        if not os.path.isdir(path):
            access &= FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | (1 << 14 if abi >= 3 else 0)
        rule = _PathBeneath(access, fd)
        _libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0)
        os.close(fd)
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            _libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
        os.close(ruleset)
        return 0
    os.close(ruleset)
    return abi


def audit_fallback(cfg, files, network, processes):
    """PEP 578 hooks for what the kernel did not take away (they cannot be removed)."""
    roots = [os.path.realpath(p) for p in cfg["read_roots"]] + [os.path.realpath(cfg["workdir"])]
    workdir = os.path.realpath(cfg["workdir"])
    starts = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
              "os.startfile", "pty.spawn")

    def inside(path):
        real = os.path.realpath(path)
        return any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots)

    def hook(event, args):
        if not files and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            if not inside(path if os.path.isabs(path) else os.path.join(workdir, path)):
                raise PermissionError(f"sandbox: {path} is outside the working directory")
        if not network and event.startswith("socket."):
            raise PermissionError("sandbox: no network")
        if not processes and event.startswith(starts):
            raise PermissionError("sandbox: no new processes")
        if not (files and network and processes) and event.startswith("ctypes."):
            raise PermissionError("sandbox: no ctypes")

    if not (files and network and processes):
        sys.addaudithook(hook)


def main():
    cfg = json.loads(sys.argv[1])
    status = os.fdopen(int(cfg["status_fd"]), "w")
    set_limits(cfg)
    bounded = bound_processes(cfg)
    namespaces = new_namespaces()
    if namespaces:
        run_as_pid_one()
    os.chdir(cfg["workdir"])
    abi = landlock(cfg)
    files, network = bool(abi), namespaces or abi >= 4
    # a new process runs outside this interpreter's hooks: allowed only where the kernel holds
    # its files and network too, and bounds its count
    processes = bool(bounded) and files and network
    isolation = {"processes": ("pid namespace + " if namespaces else "") + bounded if processes else "python",
                 "network": "namespace" if namespaces else ("landlock" if abi >= 4 else "python"),
                 "files": f"landlock abi {abi}" if abi else "python"}
    status.write(json.dumps(isolation) + "\n")
    status.close()
    audit_fallback(cfg, files=files, network=network, processes=processes)
    sys.argv = ["main.py"]
    sys.path[0] = cfg["workdir"]
    try:
        with open("main.py") as f:
            program = compile(f.read(), "main.py", "exec")
    except SyntaxError as exc:  # the model's error alone: no frame of this boot script (its host path)
        traceback.print_exception(type(exc), exc, None)
        sys.exit(1)
    try:
        exec(program, {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as exc:  # the model's traceback, from its own code down
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        sys.exit(1)


if __name__ == "__main__":
    main()
