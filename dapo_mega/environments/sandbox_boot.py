"""The sandbox's child side: run as `python -I sandbox_boot.py CONFIG_JSON` (standard library
only: it must not import the trainer), it takes away what model-written code must not have,
then runs the code (`main.py` of its working directory) as `__main__`.

In order, each where the kernel allows it (the parent learns which from the first line the boot
writes to its status pipe, the isolation report), with a fallback that holds at least in Python:

1. Resource limits (setrlimit): CPU seconds, address space, file size, open files, no core.
2. Processes: the boot joins a pids cgroup made for this run (cgroup v2 or v1's pids
   controller, when writable), else, not as root, RLIMIT_NPROC (both count threads: the parent
   starts the numerical libraries with one thread each); then new PID and network namespaces
   (as root directly, otherwise inside a new user namespace where the kernel lets users make
   one): the code runs as PID 1 of its own namespace, so killing it ends every process it made
   (a daemonised grandchild too), it sees and signals no process outside, and it has no network
   (no protocol, not even loopback).
3. Files and TCP: a Landlock ruleset (Linux >= 5.13; TCP from ABI 4): read and execute under
   the Python installation and the system libraries, everything under the working directory,
   nothing else; no TCP bind or connect.
4. What the kernel did not take away, audit hooks (PEP 578) refuse inside Python: without
   Landlock, opening or changing a path outside those roots; without a network namespace,
   sockets (Landlock holds TCP only); unless every kernel layer held, ctypes and starting
   processes (fork, exec, subprocess, os.system: a new process runs outside the hooks). Audit
   hooks are no security boundary (PEP 578 says so): `isolation_level` names what held, and a
   run whose level is below the one required (`isolation` in the config) does not run its code.

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
CLONE_NEWUSER = 0x10000000
PR_SET_NO_NEW_PRIVS = 38
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_RULE_PATH_BENEATH, LANDLOCK_RULE_NET_PORT = 1, 2
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_ALL_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
LEVELS = ("none", "limits", "full")
"""Isolation levels, weakest first (`isolation_level`; docs/multi_turn.md):
none    the kernel bounds CPU time, memory, file size and open files (setrlimit: always);
        files, network and new processes are refused by audit hooks in Python only.
limits  and the kernel bounds the processes and threads (a pids cgroup or RLIMIT_NPROC).
full    and PID + network namespaces and Landlock hold files, every protocol and every
        process the code starts; new processes are allowed, and none outlives the run."""
REFUSED_EXIT = 125
"""The boot's exit status when the run's isolation is below the required level (the code did not run)."""

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
    """'cgroup', 'rlimit' or 'none' (not bounded by the kernel: root without a pids cgroup)."""
    procs = cfg.get("cgroup_procs")
    if procs:
        try:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
            return "cgroup"
        except OSError:
            pass
    uid = os.getuid()
    if uid != 0:  # root is never held by RLIMIT_NPROC
        # RLIMIT_NPROC counts the user's threads, not its processes (a trainer has hundreds)
        mine = sum(_threads(p) for p in os.listdir("/proc") if p.isdigit() and _owner(p) == uid)
        limit = mine + int(cfg["processes"])
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
        return "rlimit"
    return "none"


def _owner(pid):
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


def _threads(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def new_namespaces():
    """New PID and network namespaces: 'pid+net' (root, or CAP_SYS_ADMIN), 'user+pid+net' (inside
    a new user namespace, where the kernel lets an unprivileged user make one), or 'none'."""
    if _libc.unshare(CLONE_NEWNET | CLONE_NEWPID) == 0:
        return "pid+net"
    uid, gid = os.getuid(), os.getgid()
    if _libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID) != 0:
        return "none"
    # the same ids inside: an unmapped id could create no file, and the code stays its user
    for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                       ("/proc/self/gid_map", f"{gid} {gid} 1")):
        with open(path, "w") as f:
            f.write(text)
    return "user+pid+net"


def isolation_level(namespaces, landlock_abi, process_bound):
    """The level (LEVELS) a run had: its namespaces ('none' or which), its Landlock ABI (0:
    none) and what bounds its processes ('cgroup', 'rlimit' or 'none')."""
    if process_bound == "none":
        return "none"
    return "full" if namespaces != "none" and landlock_abi >= 1 else "limits"


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


WRITES = {"os.chmod": 1, "os.chown": 1, "os.link": 2, "os.mkdir": 1, "os.remove": 1, "os.rename": 2, "os.rmdir": 1,
          "os.symlink": 2, "os.truncate": 1, "os.utime": 1, "os.setxattr": 1, "os.removexattr": 1}
"""Audit events that change a path, and how many of their first arguments are paths (each must
lie in the working directory)."""
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def audit_fallback(cfg, files, network, processes):
    """PEP 578 hooks for what the kernel did not take away (they cannot be removed)."""
    roots = [os.path.realpath(p) for p in cfg["read_roots"]] + [os.path.realpath(cfg["workdir"])]
    writable = [os.path.realpath(cfg["workdir"]), "/dev/null"]
    starts = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
              "os.startfile", "pty.spawn")

    def under(path, dirs):
        real = os.path.realpath(os.fsdecode(path))  # a relative path from the current directory, as the call reads it
        return any(real == d or real.startswith(d.rstrip("/") + "/") for d in dirs)

    def is_path(arg):
        return isinstance(arg, (str, bytes, os.PathLike))

    def hook(event, args):
        if not files and event == "open" and args and is_path(args[0]):
            mode, flags = args[1] or "", args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            writes = any(c in str(mode) for c in "wax+") or bool(flags & WRITE_FLAGS)
            if not under(args[0], writable if writes else roots):
                raise PermissionError(f"sandbox: {os.fsdecode(args[0])} is outside the working directory")
        if not files and event in WRITES and not all(under(a, writable) for a in args[:WRITES[event]] if is_path(a)):
            raise PermissionError("sandbox: a path outside the working directory")
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
    if namespaces != "none":
        run_as_pid_one()
    os.chdir(cfg["workdir"])
    abi = landlock(cfg)
    level = isolation_level(namespaces, abi, bounded)
    # Landlock holds TCP only: every other protocol needs the network namespace. A new process
    # runs outside this interpreter's hooks: allowed only where the kernel holds everything.
    files, network, processes = bool(abi), namespaces != "none", level == "full"
    report = {"level": level, "namespaces": namespaces, "landlock_abi": abi, "process_bound": bounded,
              "in_python": [name for name, held in (("files", files), ("network", network),
                                                    ("processes", processes)) if not held]}
    required = cfg.get("isolation", "none")
    refused = LEVELS.index(level) < LEVELS.index(required)
    status.write(json.dumps({**report, "refused": required} if refused else report) + "\n")
    status.close()
    if refused:  # the code does not run below the level the config requires
        sys.exit(REFUSED_EXIT)
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
